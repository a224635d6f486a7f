"""Cross-memory attach: an exporter's plain CPU caches read by a loader on the same host.

CPU caches that are not in shared memory (vLLM's CPU worker allocates its KV cache with plain
``torch.zeros``) cannot be mapped, but Linux lets a process read another's memory with
``process_vm_readv`` when it may ptrace it (same user; Yama's ``ptrace_scope`` 0, or the
exporter allowing it). That is as much access as a shared-memory mapping gives, with the kernel
as the judge. This module is the ``"cma"`` mapper of the ``ipc`` transport
(:mod:`kvxfer.transports.ipc.mappers`):

* exporter: :func:`describe` publishes its pid, each layer's address, the caches' shape, strides
  and dtype, and a probe: the address and value of 16 random bytes of its own;
* loader: :func:`attach` opens a pidfd on that pid, reads the probe through
  ``process_vm_readv`` and checks the value (so the pid is the exporter's, not another process
  of this PID namespace), then returns *mirrors*: per layer, an anonymous mapping of the
  layer's extent (``MAP_NORESERVE``: untouched pages cost nothing) viewed with the exporter's
  shape and strides. :meth:`Remote.fetch` copies the blocks a transfer reads from the exporter
  into the same offsets of the mirrors (one ``process_vm_readv`` per 1024 ranges), after which
  the engine's copies run from the mirrors as from a mapping; :meth:`Remote.drop` gives the
  pages back (``MADV_DONTNEED``). A fetch succeeds only if the exporter's pidfd still shows it
  alive afterwards: a pid reused by another process cannot be read from unnoticed.

The lease epochs and the lease-slot table stay in shared memory (:mod:`kvxfer.transports.ipc.shm`),
so the grant, the epoch check after the copy and the one-sided mode work as with a mapping.
``KVXFER_IPC_CMA=0`` turns it off (an exporter then offers ``ipc`` only for caches in shm).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import select
import sys
import threading
from typing import NamedTuple

import numpy as np
import torch

from ...spec import dtype_from_name, dtype_name
from . import shm

__all__ = ["Direct", "Remote", "attach", "attach_array", "available", "describe", "detach", "probe"]

IOV_MAX = 1024  # ranges per process_vm_readv call (Linux's UIO_MAXIOV)
MAX_LAYERS = 4096  # an exporter's description is checked before any mirror is made
MAX_EXTENT = 1 << 40  # bytes of one layer's mirror (address space, reserved lazily)
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux's value; Python 3.11 lacks the name
_PROBE_BYTES = 16

_lock = threading.Lock()
_probe: dict = {}  # this process's probe: {"buf": ctypes buffer, "addr": int, "hex": str}
_libc: dict = {}


def _readv():
    """libc's ``process_vm_readv`` (ctypes), or None where there is none."""
    if "fn" not in _libc:
        fn = None
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                fn = libc.process_vm_readv
                fn.restype = ctypes.c_ssize_t
                fn.argtypes = [
                    ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong,
                ]  # fmt: skip
            except (OSError, AttributeError):
                fn = None
        _libc["fn"] = fn
    return _libc["fn"]


def available() -> str:
    """Why cross-memory attach cannot be offered or used here ("" when it can)."""
    if os.environ.get("KVXFER_IPC_CMA", "1").strip().lower() in ("0", "false", "off", "no"):
        return "cross-memory attach turned off (KVXFER_IPC_CMA=0)"
    if not sys.platform.startswith("linux"):
        return "cross-memory attach needs Linux"
    if not hasattr(os, "pidfd_open"):
        return "cross-memory attach needs os.pidfd_open (Linux 5.3)"
    if _readv() is None:
        return "cross-memory attach: libc has no process_vm_readv"
    return ""


def _own_probe() -> dict:
    with _lock:
        if not _probe:
            value = os.urandom(_PROBE_BYTES)
            buf = ctypes.create_string_buffer(value, _PROBE_BYTES)
            _probe.update(buf=buf, addr=ctypes.addressof(buf), hex=value.hex())
        return _probe


def _extent(shape, stride, element_size: int) -> int:
    """Bytes from a tensor's first element to one past its last (positive strides)."""
    return (sum((n - 1) * s for n, s in zip(shape, stride)) + 1) * element_size


def describe(caches: list[torch.Tensor]) -> dict | None:
    """What a loader needs to read ``caches`` (CPU, one shape, strides and dtype) from this
    process; None when cross-memory attach is not available or the caches do not fit it."""
    if available() or not caches:
        return None
    first = caches[0]
    if first.device.type != "cpu" or any(
        c.device.type != "cpu"
        or c.shape != first.shape
        or c.stride() != first.stride()
        or c.dtype != first.dtype
        for c in caches
    ):
        return None
    if any(s <= 0 for s in first.stride()) or first.dim() < 3:
        return None
    probe = _own_probe()
    return {
        "pid": os.getpid(),
        "addrs": [c.data_ptr() for c in caches],
        "shape": list(first.shape),
        "stride": list(first.stride()),
        "dtype": dtype_name(first.dtype),
        "probe_addr": probe["addr"],
        "probe": probe["hex"],
    }


class Remote:
    """An exporter's caches as this process reads them (see the module doc): ``caches`` are the
    mirrors (the exporter's shape and strides), :meth:`fetch` fills the blocks a copy reads,
    :meth:`drop` empties them again, :meth:`close` releases everything."""

    def __init__(self, desc: dict) -> None:
        why = available()
        if why:
            raise OSError(why)
        self.pid = int(desc["pid"])
        self.dtype = dtype_from_name(desc["dtype"])
        es = torch.empty((), dtype=self.dtype).element_size()
        shape, stride = tuple(int(x) for x in desc["shape"]), tuple(int(x) for x in desc["stride"])
        if (
            len(shape) != len(stride)
            or len(shape) < 3
            or any(s <= 0 for s in stride)
            or any(n <= 0 for n in shape)
        ):
            raise ValueError(f"cma: a cache shape {shape} with strides {stride} cannot be read")
        if not 0 < len(desc["addrs"]) <= MAX_LAYERS:
            raise ValueError(f"cma: {len(desc['addrs'])} layers (1 to {MAX_LAYERS})")
        self.addrs = np.asarray([int(a) for a in desc["addrs"]], dtype=np.uint64)
        self.extent = _extent(shape, stride, es)
        if self.extent > MAX_EXTENT:  # mirrors are address space only, still bounded
            raise ValueError(f"cma: a layer of {self.extent} bytes (at most {MAX_EXTENT})")
        # block dim: 0 for MLA ([nb, bs, d]), else 1 ([2, nb, ...]); the dims after it are one block
        mla = len(shape) == 3
        self._bdim = 0 if mla else 1
        self._kv_offsets = (
            np.zeros(1, dtype=np.int64) if mla else np.arange(shape[0], dtype=np.int64) * (stride[0] * es)
        )
        self._block_stride = stride[self._bdim] * es
        self._span = _extent(shape[self._bdim + 1 :], stride[self._bdim + 1 :], es)
        self.shape, self.stride, self.element_size = shape, stride, es
        self.num_blocks = shape[self._bdim]
        self._fd = os.pidfd_open(self.pid)
        self._maps: list[mmap.mmap] = []
        try:
            why = _probe_through(self._fd, self.pid, int(desc["probe_addr"]), str(desc["probe"]))
            if why:
                raise OSError(why)
            self.caches = []
            for _ in range(len(self.addrs)):
                m = mmap.mmap(-1, self.extent, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
                self._maps.append(m)
                raw = torch.frombuffer(m, dtype=torch.uint8)
                self.caches.append(raw.view(self.dtype).as_strided(shape, stride))
            self._bases = np.asarray([c.data_ptr() for c in self.caches], dtype=np.uint64)
        except BaseException:
            self.close()
            raise
        self.num_fetches = 0
        self.bytes_fetched = 0

    # ------------------------------------------------------------------ reading
    def _alive(self) -> bool:
        return not _exited(self._fd)

    def _read_all(self, local: np.ndarray, remote: np.ndarray) -> int:
        """:meth:`_readv` of every range, then the checks that make it a read of the exporter:
        every byte read and the exporter still alive after it (``OSError`` otherwise); counted.
        Returns the bytes."""
        want = int(remote[:, 1].sum())
        got = self._readv(local, remote)
        if got != want:
            raise OSError(f"cma: read {got} of {want} bytes from pid {self.pid} (its memory changed?)")
        if not self._alive():
            raise OSError(f"cma: the exporter (pid {self.pid}) exited during the read")
        self.num_fetches += 1
        self.bytes_fetched += want
        return want

    def _readv(self, local: np.ndarray, remote: np.ndarray) -> int:
        """``process_vm_readv`` of ``[n, 2]`` uint64 (address, length) arrays, IOV_MAX at a time;
        returns the bytes read, ``OSError`` naming the errno when a call fails."""
        fn = _readv()
        got = 0
        for i in range(0, len(local), IOV_MAX):
            lo, re = local[i : i + IOV_MAX], remote[i : i + IOV_MAX]
            n = fn(self.pid, lo.ctypes.data, len(lo), re.ctypes.data, len(re), 0)
            if n < 0:
                err = ctypes.get_errno()
                raise OSError(err, f"cma: process_vm_readv from pid {self.pid}: {os.strerror(err)}")
            got += n
        return got

    def fetch(self, block_ids: np.ndarray, layers=None) -> None:
        """Copy blocks ``block_ids`` (int64, in range; repeats allowed) of ``layers`` (default
        all) from the exporter into the mirrors; ``OSError`` when a read falls short or the
        exporter exited meanwhile (what the mirrors hold is then not to be used)."""
        ids = np.unique(np.asarray(block_ids, dtype=np.int64))
        if ids.size == 0:
            return
        if ids[0] < 0 or ids[-1] >= self.num_blocks:
            raise ValueError(f"cma: block ids out of [0, {self.num_blocks})")
        rel = (self._kv_offsets[:, None] + ids[None, :] * self._block_stride).reshape(-1)
        rel = _merge(rel, self._span)
        lay = np.arange(len(self.addrs)) if layers is None else np.asarray(layers, dtype=np.int64)
        starts, lens = rel
        n = len(starts)
        local = np.empty((len(lay) * n, 2), dtype=np.uint64)
        remote = np.empty((len(lay) * n, 2), dtype=np.uint64)
        off = starts.astype(np.uint64)
        local[:, 0] = (self._bases[lay][:, None] + off[None, :]).reshape(-1)
        remote[:, 0] = (self.addrs[lay][:, None] + off[None, :]).reshape(-1)
        local[:, 1] = remote[:, 1] = np.tile(lens.astype(np.uint64), len(lay))
        self._read_all(local, remote)

    def direct(self, caches: list[torch.Tensor], token_dim: int) -> Direct | None:
        """Reads straight into ``caches`` (this rank's, one per exporter layer) where they are
        laid out as the exporter's within a block (same dtype, same shape and strides after the
        block dim, the same K/V dim): no mirror, one copy instead of two, and no page faults
        of pages emptied by :meth:`drop`. ``token_dim``: the dim of a block's tokens (its rows).
        None when they are not laid out alike."""
        es, bd = self.element_size, self._bdim
        if len(caches) != len(self.addrs) or not 0 < token_dim - bd < len(self.shape) - bd:
            return None
        for c in caches:
            if (
                c.device.type != "cpu"
                or c.dtype != self.dtype
                or c.dim() != len(self.shape)
                or tuple(c.shape[bd + 1 :]) != self.shape[bd + 1 :]
                or tuple(c.stride()[bd + 1 :]) != self.stride[bd + 1 :]
                or tuple(c.shape[:bd]) != self.shape[:bd]
                or any(x <= 0 for x in c.stride())
                or c.stride() != caches[0].stride()
            ):
                return None
        first = caches[0]
        kv = (
            np.zeros(1, dtype=np.int64)
            if bd == 0
            else np.arange(first.shape[0], dtype=np.int64) * (first.stride(0) * es)
        )
        # a block's first r rows: per index of the dims between the block dim and the token dim,
        # one range of r rows (the rows themselves packed: one row's extent is its stride)
        row = self.stride[token_dim] * es
        if _extent(self.shape[token_dim + 1 :], self.stride[token_dim + 1 :], es) != row:
            return None
        outer = [np.zeros(1, dtype=np.int64)]
        for d in range(bd + 1, token_dim):
            outer.append(np.arange(self.shape[d], dtype=np.int64) * (self.stride[d] * es))
        offs = np.zeros(1, dtype=np.int64)
        for o in outer:
            offs = (offs[:, None] + o[None, :]).reshape(-1)
        bases = np.asarray([c.data_ptr() for c in caches], dtype=np.uint64)
        return Direct(self, bases, kv, first.stride(bd) * es, offs, row, self.shape[token_dim])

    def read_direct(
        self, d: Direct, layers: np.ndarray, src: np.ndarray, dst: np.ndarray, last_rows: int
    ) -> int:
        """Blocks ``src[i]`` of the exporter's ``layers`` into blocks ``dst[i]`` of ``d``'s
        caches (int64 ids in range, checked by the caller), the last pair's first
        ``last_rows`` rows only (the rest of that block stays as it was); returns the bytes.
        ``OSError`` as :meth:`fetch`."""
        return self.read_direct_many(d, [(layers, src, dst, last_rows)])

    def read_direct_many(self, d: Direct, parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, int]]) -> int:
        """:meth:`read_direct` of every ``(layers, src, dst, last_rows)`` part in one batch of
        ``process_vm_readv`` calls (a request's groups, a step's loads); returns the bytes."""
        locs, rems, lens = [], [], []
        for layers, src, dst, last_rows in parts:
            if src.size:
                self._direct_ranges(d, layers.astype(np.int64), src, dst, last_rows, locs, rems, lens)
        if not lens:
            return 0
        n = np.concatenate(lens).astype(np.uint64)
        local = np.empty((n.size, 2), dtype=np.uint64)
        remote = np.empty((n.size, 2), dtype=np.uint64)
        local[:, 0] = np.concatenate(locs).astype(np.uint64)
        remote[:, 0] = np.concatenate(rems).astype(np.uint64)
        local[:, 1] = remote[:, 1] = n
        return self._read_all(local, remote)

    def _direct_ranges(
        self, d: Direct, lay, src, dst, last_rows: int, locs: list, rems: list, lens: list
    ) -> None:
        """Append one part's ranges: a [layer, kv, pair] grid of whole blocks, then the last
        block's row ranges when it is partial."""
        full = src.size if last_rows >= d.rows else src.size - 1
        dbase = d.bases[lay].astype(np.int64)[:, None, None] + d.kv[None, :, None]
        sbase = self.addrs[lay].astype(np.int64)[:, None, None] + self._kv_offsets[None, :, None]
        if full:
            loc = dbase + (dst[:full] * d.block_stride)[None, None, :]
            locs.append(loc.reshape(-1))
            rems.append((sbase + (src[:full] * self._block_stride)[None, None, :]).reshape(-1))
            lens.append(np.full(loc.size, self._span, dtype=np.int64))
        if full < src.size:
            loc = dbase + int(dst[-1]) * d.block_stride + d.row_offsets[None, None, :]
            locs.append(loc.reshape(-1))
            rems.append(
                (sbase + int(src[-1]) * self._block_stride + d.row_offsets[None, None, :]).reshape(-1)
            )
            lens.append(np.full(loc.size, last_rows * d.row_bytes, dtype=np.int64))

    def drop(self) -> None:
        """Give back the mirrors' pages (what they held is not needed once the copies ran)."""
        for m in self._maps:
            m.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        self.caches = []
        for m in self._maps:
            with contextlib.suppress(BufferError):  # a view of it is still alive: unmapped when it goes
                m.close()
        self._maps = []
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class Direct(NamedTuple):
    """How :meth:`Remote.read_direct` addresses this rank's caches: each layer's address, the
    K/V offsets and block stride in bytes, a block's row ranges (their offsets, the bytes of a
    row, rows per block)."""

    remote: Remote
    bases: np.ndarray
    kv: np.ndarray
    block_stride: int
    row_offsets: np.ndarray
    row_bytes: int
    rows: int


def _merge(starts: np.ndarray, span: int) -> tuple[np.ndarray, np.ndarray]:
    """Byte ranges ``[start, start + span)`` merged where they touch or overlap: (starts, lengths)."""
    s = np.sort(starts)
    ends = s + span
    # a range opens a new run unless it starts at or before the running end of the runs before
    run_end = np.maximum.accumulate(ends)
    new = np.empty(len(s), dtype=bool)
    new[0] = True
    new[1:] = s[1:] > run_end[:-1]
    idx = np.flatnonzero(new)
    out_starts = s[idx]
    last = np.append(idx[1:], len(s)) - 1
    out_ends = run_end[last]
    return out_starts, out_ends - out_starts


def probe(desc: dict) -> str:
    """Why this process cannot read the caches ``desc`` describes ("" when it can): the probe
    read through a pidfd, nothing mapped, nothing kept open."""
    why = available()
    if why:
        return why
    try:
        pid, addr, want = int(desc["pid"]), int(desc["probe_addr"]), str(desc["probe"])
        fd = os.pidfd_open(pid)
    except (KeyError, TypeError, ValueError, OSError) as e:
        return f"cross-memory attach: the exporter's process cannot be opened ({e})"
    try:
        return _probe_through(fd, pid, addr, want)
    finally:
        os.close(fd)


def _exited(fd: int) -> bool:
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(0))  # a pidfd turns readable when its process exited


def _probe_through(fd: int, pid: int, addr: int, want: str) -> str:
    """Read the probe of ``pid`` (whose pidfd is ``fd``) and compare; why not usable, or ""."""
    buf = ctypes.create_string_buffer(_PROBE_BYTES)
    local = np.array([[ctypes.addressof(buf), _PROBE_BYTES]], dtype=np.uint64)
    remote = np.array([[addr, _PROBE_BYTES]], dtype=np.uint64)
    n = _readv()(pid, local.ctypes.data, 1, remote.ctypes.data, 1, 0)
    if n < 0:
        err = ctypes.get_errno()
        return f"cross-memory attach not permitted here ({os.strerror(err)}: ptrace_scope, or a sandbox)"
    if n != _PROBE_BYTES or buf.raw.hex() != want or _exited(fd):
        return f"cross-memory attach: pid {pid} is not the exporter that described these caches"
    return ""


def attach(desc: dict) -> tuple[list[torch.Tensor], Remote]:
    """Loader: the exporter's caches as mirrors, and the :class:`Remote` that fills them (raises
    ``OSError`` when they cannot be read from here, naming why)."""
    r = Remote(desc)
    return r.caches, r


def attach_array(name: str, n: int):
    """The lease epochs stay in shared memory (:func:`kvxfer.transports.ipc.shm.attach_array`)."""
    return shm.attach_array(name, n)


def detach(handle) -> None:
    """Release what :func:`attach` or :func:`attach_array` returned."""
    if isinstance(handle, Remote):
        handle.close()
    else:
        shm.detach(handle)
