"""The CUDA driver's batched copy (``cuMemcpyBatchAsync``) through ctypes: the call that moves
the runs :mod:`kvxfer.backends.dma` plans, without an SM and without CuPy.

* :class:`BatchCopier`: one call per batch of runs, through the driver's symbol or a test's fake
  built from the same prototype (:data:`PROTOTYPES`);
* :func:`copier`: the copier for a device type, looked up once (a driver without the call: None
  and why, logged once as a warning); :func:`install_copier` puts a fake in its place;
* :func:`run`: enqueue runs on torch's current stream, or report that the driver refused them
  (DMA then stays off for that device type and the caller runs its kernel).

**The call**: ``cuMemcpyBatchAsync`` (CUDA 12.8+). The CUDA 13 driver API names the current
form ``cuMemcpyBatchAsync_v2`` (dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, stream);
the CUDA 12.8 form, still exported under the plain name, takes a ``size_t *failIdx`` before the
stream (``cuda.h`` of CUDA 13.0). One attribute covers every run: the source is read in stream
order, and the copies prefer to overlap compute. The stream must not be the legacy default
stream: on it the batch runs on a side stream ordered after and before it by events.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import NamedTuple

import numpy as np
import torch

__all__ = [
    "ARGTYPES",
    "MIN_DRIVER",
    "PROTOTYPES",
    "SYMBOLS",
    "BatchCopier",
    "CUmemLocation",
    "CUmemcpyAttributes",
    "DmaError",
    "Runs",
    "copier",
    "install_copier",
    "looked_up",
    "run",
    "serves_cpu",
]


class Runs(NamedTuple):
    """The memory copies of one transfer: ``count`` runs, ``dsts[i] <- srcs[i]`` of ``sizes[i]``
    bytes (uint64 arrays, C-contiguous, what the driver call takes), ``nbytes`` in all; ``unit``
    the bytes of one block's run before adjacent ones were coalesced."""

    dsts: np.ndarray
    srcs: np.ndarray
    sizes: np.ndarray
    nbytes: int
    unit: int

    @property
    def count(self) -> int:
        return int(self.sizes.size)


_LOG = logging.getLogger(__name__)


class CUmemLocation(ctypes.Structure):
    """``CUmemLocation`` (cuda.h): a location type (``CUmemLocationType``, an enum) and an id."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class CUmemcpyAttributes(ctypes.Structure):
    """``CUmemcpyAttributes`` (cuda.h, CUDA 12.8+): source access order, location hints of both
    operands (used only for managed or pageable memory), flags."""

    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),  # CUmemcpySrcAccessOrder
        ("srcLocHint", CUmemLocation),
        ("dstLocHint", CUmemLocation),
        ("flags", ctypes.c_uint),
    ]


CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_LOCATION_TYPE_HOST = 2

_P64 = ctypes.POINTER(ctypes.c_uint64)  # CUdeviceptr * (CUdeviceptr: unsigned long long)
_PSZ = ctypes.POINTER(ctypes.c_size_t)
_PATTR = ctypes.POINTER(CUmemcpyAttributes)
# The two forms of the call (cuda.h of CUDA 13.0): 2 = cuMemcpyBatchAsync_v2 (CUDA 13), 1 = the
# CUDA 12.8 cuMemcpyBatchAsync with ``size_t *failIdx`` before the stream. CUresult is an int
# enum, CUstream a pointer. tests/test_dma_driver.py checks both against the toolkit's cuda.h.
ARGTYPES = {
    2: (_P64, _P64, _PSZ, ctypes.c_size_t, _PATTR, _PSZ, ctypes.c_size_t, ctypes.c_void_p),
    1: (_P64, _P64, _PSZ, ctypes.c_size_t, _PATTR, _PSZ, ctypes.c_size_t, _PSZ, ctypes.c_void_p),
}
SYMBOLS = {2: "cuMemcpyBatchAsync_v2", 1: "cuMemcpyBatchAsync"}
PROTOTYPES = {abi: ctypes.CFUNCTYPE(ctypes.c_int, *args) for abi, args in ARGTYPES.items()}
MIN_DRIVER = 12080  # cuDriverGetVersion of CUDA 12.8


class DmaError(RuntimeError):
    """The batched copy returned an error (nothing to trust of what it enqueued)."""


class BatchCopier:
    """One ``cuMemcpyBatchAsync`` per call, through ``fn`` (an instance of ``PROTOTYPES[abi]``:
    the driver's symbol, or a test's fake built from the same prototype). ``serves``: the device
    types whose tensors it copies (``("cuda",)``; a fake on CPU memory: ``("cpu",)``).
    ``bind(device_index)``: a context manager making the device's context current (None: none
    needed). ``error_name(rc)``: the name of a CUresult."""

    def __init__(
        self, fn, abi: int, name: str, serves: tuple[str, ...] = ("cuda",), bind=None, error_name=None
    ):
        if abi not in PROTOTYPES or not isinstance(fn, PROTOTYPES[abi]):
            raise TypeError(f"fn: must be an instance of PROTOTYPES[{abi}]")
        self.fn, self.abi, self.name, self.serves = fn, abi, name, serves
        self._bind, self._error_name = bind, error_name

    def copy(
        self,
        runs: Runs,
        stream: int,
        src_loc: tuple[int, int],
        dst_loc: tuple[int, int],
        device_index: int | None,
    ) -> None:
        """Enqueue ``runs`` on ``stream`` (a CUstream handle, not the legacy default stream).
        ``src_loc``/``dst_loc``: (CUmemLocationType, id) hints. Raises :class:`DmaError`."""
        attr = CUmemcpyAttributes(
            CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            CUmemLocation(*src_loc),
            CUmemLocation(*dst_loc),
            CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE,
        )
        idx = (ctypes.c_size_t * 1)(0)
        args = [
            runs.dsts.ctypes.data_as(_P64),
            runs.srcs.ctypes.data_as(_P64),
            runs.sizes.ctypes.data_as(_PSZ),
            runs.count,
            ctypes.pointer(attr),
            idx,
            1,
        ]
        fail = ctypes.c_size_t(2**64 - 1)  # the 12.8 form's index of a failing copy
        if self.abi == 1:
            args.append(ctypes.pointer(fail))
        args.append(ctypes.c_void_p(stream or None))
        if self._bind is not None and device_index is not None:
            with self._bind(device_index):
                rc = self.fn(*args)
        else:
            rc = self.fn(*args)
        if rc != 0:
            name = self._error_name(rc) if self._error_name else str(rc)
            where = f" at run {fail.value}" if self.abi == 1 and fail.value < runs.count else ""
            raise DmaError(f"{self.name} returned {name}{where} ({runs.count} runs, {runs.nbytes} B)")


class _Driver:
    """libcuda through ctypes: the batched copy and the primary-context binding it needs."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(version)) != 0:
            raise OSError("cuDriverGetVersion failed")
        self.version = version.value
        if self.version < MIN_DRIVER:
            v = self.version
            raise OSError(
                f"the driver supports CUDA {v // 1000}.{v % 1000 // 10}; cuMemcpyBatchAsync needs 12.8"
            )
        for abi in (2, 1):
            if hasattr(lib, SYMBOLS[abi]):
                self.abi, self.fn = abi, PROTOTYPES[abi]((SYMBOLS[abi], lib))
                break
        else:
            raise OSError("the driver exports no cuMemcpyBatchAsync")
        if lib.cuInit(0) != 0:
            raise OSError("cuInit failed")
        self.lib = lib
        self._ctx: dict[int, ctypes.c_void_p] = {}
        self._lock = threading.Lock()

    def error_name(self, rc: int) -> str:
        s = ctypes.c_char_p()
        if self.lib.cuGetErrorName(ctypes.c_int(rc), ctypes.byref(s)) == 0 and s.value:
            return s.value.decode()
        return f"CUresult {rc}"

    def _primary(self, index: int) -> ctypes.c_void_p:
        with self._lock:
            ctx = self._ctx.get(index)
            if ctx is None:  # retained once for the process: torch holds it as long anyway
                dev, ctx = ctypes.c_int(0), ctypes.c_void_p()
                if self.lib.cuDeviceGet(ctypes.byref(dev), index) != 0:
                    raise DmaError(f"cuDeviceGet({index}) failed")
                if self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) != 0:
                    raise DmaError(f"cuDevicePrimaryCtxRetain({index}) failed")
                self._ctx[index] = ctx
            return ctx

    def bind(self, index: int):
        """Context manager: device ``index``'s primary context current on this thread (a fresh
        engine thread may have none bound: ``kvxfer/backends/device_context.py``), the
        thread's previous context restored after."""
        driver = self

        class _Bound:
            def __enter__(self):
                self.prev = ctypes.c_void_p()
                driver.lib.cuCtxGetCurrent(ctypes.byref(self.prev))
                want = driver._primary(index)
                self.swap = self.prev.value != want.value
                if self.swap and driver.lib.cuCtxSetCurrent(want) != 0:
                    raise DmaError(f"cuCtxSetCurrent for device {index} failed")

            def __exit__(self, *exc):
                if self.swap:
                    driver.lib.cuCtxSetCurrent(self.prev)

        return _Bound()


_lock = threading.Lock()
_copiers: dict[str, BatchCopier | None] = {}
_why: dict[str, str] = {}
_installed: BatchCopier | None = None


def install_copier(c: BatchCopier | None) -> None:
    """Use ``c`` for the device types it serves (tests: a fake driver); None: back to the real
    driver, looked up again on next use."""
    global _installed, _serves_cpu
    with _lock:
        _installed = c
        _serves_cpu = c is not None and "cpu" in c.serves
        _copiers.clear()
        _why.clear()


def serves_cpu() -> bool:
    """Whether an installed copier moves CPU tensors (a test's fake): ops then consider the DMA
    path on CPU tensors too; never in production."""
    return _serves_cpu


_serves_cpu = False


def copier(device: torch.device) -> tuple[BatchCopier | None, str]:
    """The batched copy for tensors on ``device`` and "" (looked up once per device type), or
    None and why not (logged once as a warning)."""
    kind = device.type
    got = _copiers.get(kind, False)
    if got is not False:
        return got, _why.get(kind, "")
    with _lock:
        if kind in _copiers:
            return _copiers[kind], _why.get(kind, "")
        c, why = None, ""
        if _installed is not None and kind in _installed.serves:
            c = _installed
        elif kind != "cuda":
            why = f"the copy engines move CUDA memory, not {kind} tensors"
        else:
            try:
                d = _Driver()
                c = BatchCopier(d.fn, d.abi, SYMBOLS[d.abi], ("cuda",), d.bind, d.error_name)
                _LOG.info("kvxfer DMA path: %s (driver CUDA %d)", SYMBOLS[d.abi], d.version)
            except (OSError, AttributeError, DmaError) as e:
                why = f"{type(e).__name__}: {e}"
                _LOG.warning("kvxfer DMA path unavailable, transfers use the kernels: %s", why)
        _copiers[kind], _why[kind] = c, why
        return c, why


def looked_up() -> list[tuple[str, str | None, str]]:
    """The device types looked up so far, sorted: (type, the call's name or None, why not)."""
    return [(kind, None if c is None else c.name, _why.get(kind, "")) for kind, c in sorted(_copiers.items())]


def _disable(device: torch.device, why: str) -> None:
    with _lock:
        _copiers[device.type], _why[device.type] = None, why


_side_streams: dict[int, torch.cuda.Stream] = {}


def _location(t_device: torch.device, host: bool) -> tuple[int, int]:
    if host:
        return (CU_MEM_LOCATION_TYPE_HOST, 0)
    return (CU_MEM_LOCATION_TYPE_DEVICE, t_device.index or 0)


def run(runs: Runs, device: torch.device, src_host: bool = False, dst_host: bool = False) -> bool:
    """Enqueue ``runs`` on torch's current stream of ``device``; True when done, False (after
    one warning; DMA then stays off for this device type) when the driver refused them, so the
    caller runs its kernel instead: the same bytes again, in stream order after whatever the
    refused call may have enqueued."""
    c, _ = copier(device)
    if c is None:
        return False
    try:
        if device.type != "cuda":  # a test's fake on CPU memory
            c.copy(runs, 0, _location(device, True), _location(device, True), None)
            return True
        index = device.index if device.index is not None else torch.cuda.current_device()
        src_loc, dst_loc = _location(device, src_host), _location(device, dst_host)
        cur = torch.cuda.current_stream(device)
        if cur.cuda_stream != 0:
            c.copy(runs, cur.cuda_stream, src_loc, dst_loc, index)
            return True
        # the legacy default stream is refused by the call: a side stream ordered after the work
        # queued so far and before whatever follows
        side = _side_streams.get(index)
        if side is None:
            side = _side_streams[index] = torch.cuda.Stream(device)
        side.wait_stream(cur)
        c.copy(runs, side.cuda_stream, src_loc, dst_loc, index)
        cur.wait_stream(side)
        return True
    except DmaError as e:
        why = str(e)
        _LOG.warning("kvxfer DMA path: %s; this and later transfers use the kernels", why)
        _disable(device, why)
        return False
