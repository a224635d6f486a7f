"""Native CPU backend: ``csrc/cpu/kvx_cpu.cpp`` through ctypes, multi-threaded, GIL released.

The default for CPU tensors when the library loads (``backend=None``; ``backend="cpu"`` forces
it). Each call is one foreign call: the library splits the transfer into token segments that
stay inside one block on both sides, copies each (layer, K/V, segment) with as few ``memcpy``
calls as the two layouts allow (one per block when both sides are contiguous, one per head row
otherwise) and spreads the work over a small thread pool. ctypes drops the GIL for the call, so
other Python threads (the engine's, the model runner's) keep running while bytes move.

Where the library comes from, first match wins:

1. ``kvxfer/_prebuilt/libkvx_cpu-<hash>.so``, built by ``setup.py`` when a C++ compiler was
   found at install time (also in an editable install, where it lands in the source tree);
2. the cache directory (``$KVXFER_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvxfer``, else
   ``~/.cache/kvxfer``), where it is compiled on first use when missing (one WARNING line);
3. otherwise the backend is unavailable: one WARNING says why, and CPU tensors go to the torch
   reference backend.

``<hash>`` covers the source and compile flags, so a stale library is never loaded.

Threads: ``KVXFER_CPU_THREADS`` (default ``min(4, CPUs this process may use)``), or
:func:`set_num_threads`. Transfers under ~256 KiB per thread use fewer threads. When two Python
threads copy at once, the second runs its copy on its own thread instead of waiting for the pool.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from array import array
from pathlib import Path

import numpy as np
import torch

from . import cpu_build
from .base import PagedSide

__all__ = [
    "copy",
    "gather",
    "get_num_threads",
    "is_available",
    "library_path",
    "load_error",
    "scatter",
    "set_num_threads",
    "source_dir",
    "unavailable_reason",
]

_LOG = logging.getLogger(__name__)
_ENV_THREADS = "KVXFER_CPU_THREADS"
_NUM_ARGS = 8 + 2 * 12  # kvx_cpu_move: 8 header fields + 2 sides of 12 (see the source)
_FLAG_STREAM = 1
EXTRA_FLAGS = 0  # OR-ed into every call's flags: loop-order overrides for profiling/sweep_cpu.py
# Non-temporal (streaming) stores from this many bytes per call. They skip the read-for-
# ownership of every destination line: 2/3 of a plain copy's memory traffic, and they won at
# every size profiling/sweep_cpu.py swept from 4 MB up, warm or cold
# (profiling/results/2026-11-23-cpu-datapath/README.md). A copy below 256 KiB is short and
# whoever reads the destination next (Gloo sending a wire) would find it in cache: small copies
# keep plain stores.
STREAM_MIN_BYTES = 256 << 10
# Fewer bytes than this per thread and waking one costs more than it saves: smaller transfers use
# fewer threads (128, 256 and 512 KiB were within the noise of each other at 0.5-2 MB; the second
# thread's gain with the other core free or busy:
# profiling/results/2026-11-23-cpu-datapath/README.md). Chunks are shared by the pool, so a
# worker the OS runs late costs little (kvx_cpu.cpp).
MIN_BYTES_PER_THREAD = 256 << 10
_ZERO = array("q", [0])  # the block table of a dense wire: one block, id 0
_ZERO_ADDR = _ZERO.buffer_info()[0]

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_lib_path: Path | None = None
_error: str | None = None
_tried = False


def _default_threads() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus))


def _threads_from_env() -> int:
    raw = os.environ.get(_ENV_THREADS)
    if raw is None or raw.strip() == "":
        return _default_threads()
    try:
        n = int(raw)
        if n < 1:
            raise ValueError
    except ValueError:
        default = _default_threads()
        _LOG.warning("%s=%r is not a positive integer; using %d threads", _ENV_THREADS, raw, default)
        return default
    return min(n, 64)


_num_threads = _threads_from_env()


def set_num_threads(n: int) -> None:
    """Threads one copy may use (1 to 64), the caller's included."""
    global _num_threads
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 64:
        raise ValueError(f"n: must be an int in [1, 64], got {n!r}")
    _num_threads = n


def get_num_threads() -> int:
    """Threads one copy may use (``KVXFER_CPU_THREADS`` or :func:`set_num_threads`)."""
    return _num_threads


# --------------------------------------------------------------------------- finding the library
def source_dir() -> Path:
    """The ``csrc`` directory: shipped in the package (``kvxfer/csrc``) or the source checkout's."""
    return cpu_build.source_dir(cpu_build.CPU_LIBRARY)


_prebuilt_dir = cpu_build.prebuilt_dir  # module attributes: a test points them elsewhere
_cache_dir = cpu_build.cache_dir


def _open(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))  # CDLL (not PyDLL): every call releases the GIL
    lib.kvx_cpu_abi_version.restype = ctypes.c_int
    lib.kvx_cpu_abi_version.argtypes = []
    abi = lib.kvx_cpu_abi_version()
    if abi != cpu_build.ABI_VERSION:
        raise OSError(f"{path}: ABI version {abi}, this kvxfer needs {cpu_build.ABI_VERSION}")
    lib.kvx_cpu_move.restype = ctypes.c_int
    lib.kvx_cpu_move.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return lib


def _find_or_build() -> Path:
    csrc = source_dir()
    name = cpu_build.library_name(csrc)
    prebuilt = _prebuilt_dir() / name
    if prebuilt.is_file():
        return prebuilt
    cache = _cache_dir()
    if (cache / name).is_file():
        return cache / name
    # A warning, so that it shows without any logging set up: the first op waits for it.
    _LOG.warning(
        "kvxfer CPU backend: no prebuilt %s (installed without a C++ compiler, or sources changed "
        "since); compiling it once into %s (a few seconds)",
        name,
        cache,
    )
    return cpu_build.build(cache, csrc)


def _load() -> ctypes.CDLL | None:
    global _lib, _lib_path, _error, _tried
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        try:
            path = _find_or_build()
            _lib = _open(path)
            _lib_path = path
            _LOG.info("kvxfer CPU backend: loaded %s (%d threads)", path, _num_threads)
        except Exception as exc:
            _error = f"{type(exc).__name__}: {exc}"
            _LOG.warning(
                "kvxfer CPU backend unavailable, CPU tensors use the torch reference backend "
                "(several times slower): %s",
                _error,
            )
        _tried = True
    return _lib


def unavailable_reason(device: torch.device) -> str:
    """Why :func:`is_available` says False for ``device`` ("" when it does not)."""
    try:
        if torch.device(device).type != "cpu":
            return "the native CPU backend runs CPU tensors only"
    except (RuntimeError, TypeError) as e:
        return f"not a device: {e}"
    return "" if _load() is not None else f"the native library did not load: {_error}"


def library_path() -> Path | None:
    """Path of the loaded library (None when not loaded, or not tried yet)."""
    return _lib_path


def load_error() -> str | None:
    """Why the library did not load (None when it did, or was not tried yet)."""
    return _error


def is_available(device: torch.device) -> bool:
    """True for CPU devices once the library loads (never raises)."""
    try:
        if torch.device(device).type != "cpu":
            return False
    except (RuntimeError, TypeError):
        return False
    return _load() is not None


# --------------------------------------------------------------------------- calls
def _paged(side: PagedSide) -> tuple[list[int], tuple[array, np.ndarray], int]:
    """The 12 side fields of a paged cache, the tables they point into (keep them alive), and
    the bytes of a row. All but the block ids' address are kept in the side's memo (the
    engine's sides share their registered cache's template memo: no per-call layer table, and
    no torch call per op: each costs a few us with a cold cache)."""
    layers, static, row = side.kept("cpu", _static_fields)
    ids = side.block_ids  # C-contiguous int64 (ops)
    fields = static.copy()
    fields[3] = ids.ctypes.data
    return fields, (layers, ids), row


def _static_fields(side: PagedSide) -> tuple[array, list[int], int]:
    """The layer table, the side fields that do not depend on the block ids, the row bytes."""
    es = side.element_size
    layers = array("q", side.layer_ptrs())
    # bytes from a layer's base its rows can reach (every block, token and K/V of the heads up
    # to the last one moved; strides are non-negative): for the overlap check of a copy. With
    # token slots, num_blocks counts slots (slot_block per block) and block_size is 1.
    sb = side.slot_block
    extent = (
        (side.num_kv - 1) * side.stride_kv
        + (-(-side.num_blocks // sb) - 1) * side.stride_block
        + (side.block_size * sb - 1) * side.stride_token
        + (side.head_start + side.num_heads - 1) * side.stride_head
    ) * es + side.row_bytes
    return (
        layers,
        [
            layers.buffer_info()[0],
            0,
            0,
            0,  # the block ids' address: per call
            side.block_size,
            side.stride_kv * es,
            side.stride_block * es,
            side.stride_token * es,
            side.stride_head * es,
            side.head_start * side.stride_head * es,
            extent,
            sb,
        ],
        side.row_bytes,
    )


def _dense(wire: torch.Tensor, side: PagedSide) -> list[int]:
    """The 12 side fields of a contiguous wire [H, L, KV, T, D]: one block of T tokens."""
    _, num_layers, num_kv, num_tokens, _ = side.wire_view_shape()
    row = side.row_bytes
    return [
        0,
        wire.data_ptr(),
        num_kv * num_tokens * row,
        _ZERO_ADDR,
        max(num_tokens, 1),
        num_tokens * row,
        0,
        row,
        num_layers * num_kv * num_tokens * row,
        0,
        wire.numel() * wire.element_size(),
        1,
    ]


def _move(side: PagedSide, src: list[int], dst: list[int], row: int) -> None:
    lib = _lib if _lib is not None else _load()
    if lib is None:
        raise RuntimeError(f"kvxfer CPU backend unavailable: {_error}")
    h, num_layers, num_kv, num_tokens, _ = side.wire_view_shape()
    nbytes = h * num_layers * num_kv * num_tokens * row
    flags = (_FLAG_STREAM if nbytes >= STREAM_MIN_BYTES else 0) | EXTRA_FLAGS
    args = (ctypes.c_int64 * _NUM_ARGS)(
        h, num_layers, num_kv, num_tokens, row, _num_threads, flags, MIN_BYTES_PER_THREAD, *src, *dst
    )
    rc = lib.kvx_cpu_move(args, _NUM_ARGS)
    if rc != 0:
        raise RuntimeError(f"kvxfer CPU backend: kvx_cpu_move returned {rc}")


def gather(src: PagedSide, wire: torch.Tensor) -> None:
    """``wire`` [H, L, KV, T, D] (contiguous, CPU) <- the rows of ``src``."""
    fields, _keep, row = _paged(src)
    _move(src, fields, _dense(wire, src), row)


def scatter(wire: torch.Tensor, dst: PagedSide) -> None:
    """The rows of ``dst`` <- ``wire`` [H, L, KV, T, D] (contiguous, CPU)."""
    fields, _keep, row = _paged(dst)
    _move(dst, _dense(wire, dst), fields, row)


def copy(src: PagedSide, dst: PagedSide) -> None:
    """The rows of ``dst`` <- the rows of ``src`` (both in host memory).

    When the two sides' layers may share memory (a copy inside one cache, or between views of
    one allocation) the library moves the rows through a temporary wire, so every row is read
    before any is written, as in the torch reference.
    """
    s_fields, _keep_s, row = _paged(src)
    d_fields, _keep_d, _ = _paged(dst)
    _move(src, s_fields, d_fields, row)
