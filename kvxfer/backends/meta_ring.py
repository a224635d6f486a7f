"""Launch tables to the GPU through a persistent pinned ring: no allocation per launch.

Every CUDA launch of the kernels reads a small int64 table from device memory: per paged side
its layer base addresses and block ids (:mod:`kvxfer.backends.cuda`), or the block ids alone
(the Triton kernels, :mod:`kernels.launch`). Made per call with ``pin_memory()`` and ``.to()``,
that is two allocations and two torch calls per launch. Here each (device, stream) gets one
ring: ``nbytes`` of pinned host memory and as much device memory, made once. A launch writes its
table into the next free stretch of the host ring (a numpy copy), queues one host-to-device copy
of it on the launch's stream, and passes the device address; nothing is allocated.

Reuse is safe by two rules:

* The ring is cut into ``SEGMENTS`` segments and a table never straddles two. When the head
  leaves a segment, an event is recorded on the stream; the head enters a segment again only
  once the event recorded when it last left completed. That event follows every copy out of the
  segment's host memory and, because the caller holds :attr:`MetaRing.lock` from
  :meth:`MetaRing.stage` until its kernel is queued, every kernel that reads its device memory.
* When that event has not completed yet (more launches in flight than the ring holds, or a
  table larger than a segment), :meth:`MetaRing.stage` returns None and the caller takes the
  allocating path for that launch (counted in ``fallbacks``, logged once): never a wait. A
  driver call that fails retires the ring (logged, ``broken`` says why): its launches allocate.

The driver calls go through a :class:`Driver` (CUDA through torch and CuPy:
:class:`CudaDriver`), so the ring's logic is tested on CPU against a stream that runs its
copies late (``tests/test_meta_ring.py``). ``KVXFER_META_RING=0`` turns the ring off (every
launch allocates, as before it existed).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Protocol

import numpy as np

__all__ = [
    "ALIGN",
    "DEFAULT_BYTES",
    "ENV",
    "SEGMENTS",
    "CudaDriver",
    "Driver",
    "MetaRing",
    "enabled",
    "ring_for",
]

_LOG = logging.getLogger(__name__)

ENV = "KVXFER_META_RING"
SEGMENTS = 4
ALIGN = 256  # bytes: each table starts on its own 256-byte line (the kernels read 16-byte words)
# 1 MiB segments: a 32-layer, 4K-token copy's table (two sides of 32 + 256 ids) is 4.6 KiB, so
# ~900 such launches can be in flight before one falls back; a table up to 1 MiB (~130 K ids per
# launch) fits.
DEFAULT_BYTES = 4 << 20
RING_BYTES = DEFAULT_BYTES  # what ring_for gives a new ring (a test makes it small to make it wrap)
MAX_RINGS = 16  # (device, stream) pairs with a ring; launches on more streams allocate


class Driver(Protocol):
    """What the ring needs of the GPU (:class:`CudaDriver`; a test's fake on CPU)."""

    def alloc(self, nbytes: int) -> tuple[np.ndarray, int, Any, int]:
        """(pinned host bytes as a uint8 array, its address, the device buffer, its address)."""

    def copy_to_device(self, dst: int, src: int, nbytes: int) -> None:
        """Queue a copy of ``nbytes`` from host address ``src`` to device address ``dst`` on the
        ring's stream."""

    def new_event(self) -> Any: ...

    def record(self, event: Any) -> None:
        """Record ``event`` on the ring's stream (after everything queued on it so far)."""

    def done(self, event: Any) -> bool:
        """Whether the work before ``event``'s last record has completed (never waits)."""


class MetaRing:
    """The ring of one (device, stream): see the module doc.

    Args:
        driver: the GPU calls, bound to the ring's device and stream.
        nbytes: host and device bytes (a multiple of ``SEGMENTS * ALIGN``).

    ``staged``: tables staged so far; ``fallbacks``: tables refused (the caller allocated).
    """

    def __init__(self, driver: Driver, nbytes: int = DEFAULT_BYTES) -> None:
        if nbytes < SEGMENTS * ALIGN or nbytes % (SEGMENTS * ALIGN):
            raise ValueError(f"nbytes: must be a positive multiple of {SEGMENTS * ALIGN}, got {nbytes}")
        self.driver = driver
        self.host, self.host_ptr, self.device, self.device_ptr = driver.alloc(nbytes)
        self.nbytes = nbytes
        self.segment_bytes = nbytes // SEGMENTS
        self._left: list[Any] = [
            None
        ] * SEGMENTS  # per segment: the event recorded when the head last left it
        self._seg = 0
        self._off = 0  # next free byte in the current segment
        self.staged = 0
        self.fallbacks = 0
        self._logged = False
        self.broken = ""  # why a driver call failed (then every table is refused)
        self.lock = threading.Lock()  # held from stage() until the kernel that reads the table is queued

    def stage(self, table: np.ndarray) -> int | None:
        """Copy ``table`` (a C-contiguous numpy array) to the device on the ring's stream; its
        byte offset in the ring (the device address is ``device_ptr`` plus it), or None when
        the ring cannot take it now (the caller allocates). Call under :attr:`lock`, and hold it
        until the launch that reads the table is queued."""
        if self.broken:
            self.fallbacks += 1
            return None
        try:
            return self._stage(table)
        except Exception as e:  # a driver call failed: this ring is not used again
            self.broken = f"{type(e).__name__}: {e}"
            _LOG.warning(
                "kvxfer launch tables: the ring's driver call failed (%s); its launches allocate "
                "their tables from now on",
                self.broken,
            )
            self.fallbacks += 1
            return None

    def _stage(self, table: np.ndarray) -> int | None:
        n = table.nbytes
        need = -(-n // ALIGN) * ALIGN
        if need > self.segment_bytes or not n:
            return self._refuse(f"a table of {n} bytes (segments hold {self.segment_bytes})")
        if self._off + need > self.segment_bytes:
            nxt = (self._seg + 1) % SEGMENTS
            ev = self._left[nxt]
            if ev is not None and not self.driver.done(ev):
                return self._refuse("every segment still in use by queued copies and kernels")
            cur = self._left[self._seg]
            if cur is None:
                cur = self._left[self._seg] = self.driver.new_event()
            self.driver.record(cur)  # after every copy out of this segment and kernel that read it
            self._seg, self._off = nxt, 0
        start = self._seg * self.segment_bytes + self._off
        self.host[start : start + n] = table.reshape(-1).view(np.uint8)
        self.driver.copy_to_device(self.device_ptr + start, self.host_ptr + start, n)
        self._off += need
        self.staged += 1
        return start

    def _refuse(self, why: str) -> None:
        self.fallbacks += 1
        if not self._logged:
            self._logged = True
            _LOG.warning(
                "kvxfer launch tables: %s; this launch allocates its table (pinned copy, "
                "device tensor) instead of using the %d-byte ring (logged once per ring)",
                why,
                self.nbytes,
            )
        return None

    def stats(self) -> dict:
        return {
            "staged": self.staged,
            "fallbacks": self.fallbacks,
            "bytes": self.nbytes,
            "broken": self.broken,
        }


class CudaDriver:
    """:class:`Driver` of one CUDA device and stream: pinned host and device memory from
    torch (made once per ring), the copy through CuPy's runtime on the raw stream (without
    CuPy, torch's ``copy_`` of the two slices: a dispatcher call more), events from torch
    (recorded only when a segment is left)."""

    def __init__(self, device, stream) -> None:
        self.device = device
        self.stream = stream  # a torch.cuda.Stream
        self.stream_ptr = stream.cuda_stream
        try:
            import cupy

            rt = cupy.cuda.runtime
            self._memcpy = rt.memcpyAsync
            self._h2d = getattr(rt, "memcpyHostToDevice", 1)
        except (ImportError, AttributeError) as e:
            _LOG.warning(
                "kvxfer launch tables: copies through torch, a dispatcher call more per launch (CuPy's runtime: %s)",
                e,
            )
            self._memcpy = None

    def alloc(self, nbytes: int) -> tuple[np.ndarray, int, Any, int]:
        import torch

        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._host, self._dev = host, dev  # the numpy view does not own the pinned block
        return host.numpy(), host.data_ptr(), dev, dev.data_ptr()

    def copy_to_device(self, dst: int, src: int, nbytes: int) -> None:
        if self._memcpy is not None:
            self._memcpy(dst, src, nbytes, self._h2d, self.stream_ptr)
            return
        import torch

        d, h = dst - self._dev.data_ptr(), src - self._host.data_ptr()
        with torch.cuda.stream(self.stream):
            self._dev[d : d + nbytes].copy_(self._host[h : h + nbytes], non_blocking=True)

    def new_event(self) -> Any:
        import torch

        return torch.cuda.Event()

    def record(self, event: Any) -> None:
        event.record(self.stream)

    def done(self, event: Any) -> bool:
        return event.query()


_rings: dict[tuple[int, int], MetaRing | None] = {}
_rings_lock = threading.Lock()


def enabled() -> bool:
    """Whether launches use the rings (``KVXFER_META_RING``, default on)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def ring_for(device, stream) -> MetaRing | None:
    """The ring of CUDA ``device`` and torch ``stream`` (made on first use), or None: rings
    off, more streams than ``MAX_RINGS``, or the ring could not be made (logged once)."""
    key = (device.index, stream.cuda_stream)
    ring = _rings.get(key, False)
    if ring is not False:
        return ring
    with _rings_lock:
        ring = _rings.get(key, False)
        if ring is not False:
            return ring
        ring = None
        if not enabled():
            pass
        elif len(_rings) >= MAX_RINGS:
            _LOG.warning(
                "kvxfer launch tables: %d streams already have a ring; launches on stream %#x of "
                "cuda:%s allocate their tables",
                MAX_RINGS,
                key[1],
                key[0],
            )
        else:
            try:
                ring = MetaRing(CudaDriver(device, stream), RING_BYTES)
            except Exception as e:
                _LOG.warning(
                    "kvxfer launch tables: no ring for cuda:%s stream %#x (%s: %s); its launches "
                    "allocate their tables",
                    key[0],
                    key[1],
                    type(e).__name__,
                    e,
                )
        _rings[key] = ring
        return ring
