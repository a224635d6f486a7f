"""CUDA C++ backend: the kernels of ``csrc/`` launched through CuPy on torch's current stream.

One kernel launch per call, whatever the number of layers and blocks: the launch arguments are
the transfer's sizes, byte strides and two device tables per paged side (layer base addresses,
block ids) that travel in one small host-to-device copy from pinned memory (no host sync).

Kernels come from the fatbin that ``setup.py`` builds with nvcc (``kvxfer/_prebuilt/``, sm_80,
sm_90a, PTX for newer GPUs). When it is missing or does not load on this GPU/driver, the same
``csrc/`` sources are compiled once per device with NVRTC (CuPy caches the result on disk).

Launch planning (:func:`plan_gather`, :func:`plan_scatter`, :func:`plan_copy`) is plain Python
and device-independent, so the tests run the same plans through a g++ build of the kernels.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from .base import PagedSide
from .device_context import bound_device

__all__ = [
    "Launch",
    "budget_launch",
    "copy",
    "copy_width",
    "gather",
    "is_available",
    "loaded_from",
    "plan_copy",
    "plan_gather",
    "plan_scatter",
    "scatter",
    "source_dir",
    "unavailable_reason",
    "warmup",
]

WIDTHS = (16, 8, 4, 2, 1)  # copy units in bytes, widest first; each has its own entry point
THREADS = 256  # threads per block (8 warps); each warp moves one item at a time
# Fallback blocks of THREADS per SM when the occupancy query fails (the widest entries' registers
# leave room for 4 on sm_80). Normally the driver's occupancy query sizes the grid
# (_blocks_per_sm): a fixed count left a partial wave (profiling/results/2026-11-26-H200/README.md).
BLOCKS_PER_SM = 4
ITEM_BYTES = 8192  # bytes per item (head, layer, K/V, chunk of tokens) when items are plentiful
# Threads per block under an SM budget (a grid of max_sms blocks, one per SM): as many as the
# blocks a full wave keeps on one SM would have (blocks_per_sm x THREADS), up to the hardware's
# 1024 and what the kernel's registers allow (the driver's max threads per block). An
# unmeasured default against 256-thread blocks: profiling/bench_interference.py sweeps the budgets.
MAX_BUDGET_THREADS = 1024
_U32 = 1 << 32
_FATBIN = "kvxfer_kernels.fatbin"
_LOG = logging.getLogger(__name__)
_loaded_from: dict[int, str] = {}  # device index -> "fatbin:<path>" or "nvrtc"


@dataclass(frozen=True)
class Launch:
    """One kernel launch: entry point, 1-D grid, block size and its 64-bit arguments.

    ``meta`` holds the tables the pointer arguments point into (per paged side: layer bases,
    then block ids; int64). With ``rel`` empty, ``args`` hold their addresses (a host table,
    for the g++ build's tests). Otherwise ``meta`` is the host table of a CUDA launch and the
    args at indices ``rel`` are byte offsets into it: :func:`enqueue_staged` puts the table on
    the device (:mod:`kvxfer.backends.meta_ring`) and adds its device address.
    """

    name: str
    grid: int
    block: int
    args: tuple[int, ...]
    meta: torch.Tensor
    rel: tuple[int, ...] = ()


def copy_width(*values: int) -> int:
    """Widest copy unit (16/8/4/2/1 bytes) dividing every address, stride and row size given."""
    g = math.gcd(*values)
    for w in WIDTHS:
        if g % w == 0:
            return w
    raise AssertionError("unreachable: 1 divides everything")


class _Fields(NamedTuple):
    """What a launch needs of one paged side besides its block ids."""

    layers: np.ndarray  # int64 per-layer base addresses, head_start folded in
    strides: tuple[int, int, int, int]  # bytes: kv, block, token, head
    gcd: int  # of every layer address and stride (the copy width's share of this side)


def _paged_fields(side: PagedSide) -> _Fields:
    """Per-layer base addresses (head_start folded in), byte strides (kv, block, token, head)
    and their gcd, kept in the side's memo (the engine's sides: one per registered cache, head
    slice and layer set): made per call, with the block table joined by torch, they were most
    of a 32-layer copy's plan (profiling/results/2026-11-23-cpu-hostcost/README.md)."""
    return side.kept("cuda", _make_fields)


def _make_fields(side: PagedSide) -> _Fields:
    es = side.element_size
    strides = (side.stride_kv * es, side.stride_block * es, side.stride_token * es, side.stride_head * es)
    head_off = side.head_start * strides[3]
    layers = [p + head_off for p in side.layer_ptrs()]
    return _Fields(np.array(layers, dtype=np.int64), strides, math.gcd(*layers, *strides))


def _chunk(num_rows: int, num_tokens: int, row_bytes: int, num_warps: int) -> int:
    """Tokens per item: about ITEM_BYTES, smaller while there are fewer items than warps."""
    chunk = max(1, ITEM_BYTES // row_bytes)
    while chunk > 1 and num_rows * -(-num_tokens // chunk) < num_warps:
        chunk //= 2
    return min(chunk, num_tokens)


def _plan(
    op: str,
    src: PagedSide | None,
    dst: PagedSide | None,
    wire_ptr: int | None,
    max_blocks: int,
    meta_device: torch.device | str | None,
    threads: int = THREADS,
) -> Launch:
    if threads < 32 or threads % 32 or threads > MAX_BUDGET_THREADS or max_blocks < 1:
        raise ValueError(f"launch of {max_blocks} blocks x {threads} threads: not a valid grid")
    side = src if src is not None else dst
    assert side is not None
    num_heads, num_layers, num_kv, num_tokens, _ = side.wire_view_shape()
    row_bytes = side.row_bytes
    if num_tokens >= 1 << 31 or row_bytes >= 1 << 24:
        raise ValueError(f"num_tokens {num_tokens} / row of {row_bytes} bytes: too large for one launch")
    paged = [s for s in (src, dst) if s is not None]
    # per side: table offsets, strides, block size, slot block
    fields: list[tuple[int, int, tuple[int, int, int, int], int, int]] = []
    addresses: list[int] = [row_bytes] if wire_ptr is None else [row_bytes, wire_ptr]
    per_side = [(_paged_fields(s), s.block_ids) for s in paged]
    # one host table, filled in place: per side its layer bases, then its block ids
    meta_np = np.empty(sum(f.layers.size + ids.size for f, ids in per_side), dtype=np.int64)
    offset = 0
    for s, (f, ids) in zip(paged, per_side):
        addresses.append(f.gcd)
        n_layers = f.layers.size
        meta_np[offset : offset + n_layers] = f.layers
        meta_np[offset + n_layers : offset + n_layers + ids.size] = ids
        fields.append((offset, offset + n_layers, f.strides, s.block_size, s.slot_block))
        offset += n_layers + ids.size
    width = copy_width(*addresses)
    meta = torch.from_numpy(meta_np)
    # A CUDA launch's table goes to the device when it is queued (enqueue_staged): its pointer
    # arguments are offsets into the table until then.
    staged = meta_device is not None and torch.device(meta_device).type == "cuda"
    base = 0 if staged else meta.data_ptr()

    max_warps = max_blocks * threads // 32
    num_rows = num_heads * num_layers * num_kv
    chunk = _chunk(num_rows, num_tokens, row_bytes, max_warps)
    num_items = num_rows * -(-num_tokens // chunk)
    grid = max(1, min(max_blocks, -(-num_items * 32 // threads)))
    if num_items + grid * threads >= _U32 or chunk * (row_bytes // width) + 32 * 4 >= _U32:
        raise ValueError(f"transfer of {num_items} items: too large for one launch; split it")

    args: list[int] = [num_heads, num_layers, num_kv, num_tokens, row_bytes, chunk]
    rel: list[int] = []  # where the table's addresses go

    def add_paged(lo: int, ids: int, strides: tuple[int, int, int, int], bs: int, slot_block: int) -> None:
        rel.extend((len(args), len(args) + 1))
        args.extend((base + 8 * lo, base + 8 * ids, *strides, bs, slot_block))

    if op == "scatter":
        args.append(wire_ptr)
    for f in fields:
        add_paged(*f)
    if op == "gather":
        args.append(wire_ptr)
    return Launch(f"kvx_{op}_w{width}", grid, threads, tuple(args), meta, tuple(rel) if staged else ())


def plan_gather(
    src: PagedSide, wire_ptr: int, max_blocks: int, meta_device=None, threads: int = THREADS
) -> Launch:
    """Launch that gathers ``src`` into the dense wire at address ``wire_ptr``: at most
    ``max_blocks`` blocks of ``threads`` threads (:func:`budget_launch`)."""
    return _plan("gather", src, None, wire_ptr, max_blocks, meta_device, threads)


def plan_scatter(
    wire_ptr: int, dst: PagedSide, max_blocks: int, meta_device=None, threads: int = THREADS
) -> Launch:
    """Launch that scatters the dense wire at address ``wire_ptr`` into ``dst``."""
    return _plan("scatter", None, dst, wire_ptr, max_blocks, meta_device, threads)


def plan_copy(
    src: PagedSide, dst: PagedSide, max_blocks: int, meta_device=None, threads: int = THREADS
) -> Launch:
    """Launch that copies ``src`` rows straight into ``dst`` rows (same H, L, KV, T, row size)."""
    return _plan("copy", src, dst, None, max_blocks, meta_device, threads)


def budget_launch(num_sms: int, blocks_per_sm: int, max_threads: int, max_sms: int | None) -> tuple[int, int]:
    """(max blocks, threads per block) of a launch on a device of ``num_sms`` SMs that keeps
    ``blocks_per_sm`` blocks of :data:`THREADS` per SM, whose kernels allow ``max_threads``
    threads per block, under an SM budget of ``max_sms`` (None: no budget).

    Without a budget (or one of every SM): one full wave of ``THREADS``-thread blocks. With one:
    ``max_sms`` blocks, each as wide as what a full wave keeps on one SM (at most 1024 threads,
    and what the registers allow): the block scheduler puts a block on one SM, so at most
    ``max_sms`` SMs hold transfer work at any time.
    """
    if max_sms is None or max_sms >= num_sms:
        return num_sms * blocks_per_sm, THREADS
    threads = min(MAX_BUDGET_THREADS, max_threads, THREADS * blocks_per_sm) // 32 * 32
    return max_sms, max(threads, 32)


# --------------------------------------------------------------------------- sources and loading
def source_dir() -> Path:
    """Directory holding the kernel sources (installed package or source checkout)."""
    here = Path(__file__).resolve().parent.parent  # kvxfer/
    for cand in (here / "csrc", here.parent / "csrc"):
        if (cand / "kvx_kernels.cu").is_file():
            return cand
    raise FileNotFoundError("kvxfer CUDA sources (csrc/kvx_kernels.cu) not found")


def inline_source(path: Path, _seen: set[Path] | None = None) -> str:
    """``path`` with its quoted ``#include``s inlined (once each): one self-contained unit."""
    seen = set() if _seen is None else _seen
    out = []
    for line in path.read_text().splitlines():
        m = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
        if m:
            inc = (path.parent / m.group(1)).resolve()
            if inc not in seen:
                seen.add(inc)
                out.append(inline_source(inc, seen))
        elif not re.match(r"\s*#\s*pragma\s+once", line):
            out.append(line)
    return "\n".join(out)


def _entry_names() -> list[str]:
    return [f"kvx_{op}_w{w}" for op in ("gather", "scatter", "copy") for w in WIDTHS]


def _prebuilt() -> Path | None:
    path = Path(__file__).resolve().parent.parent / "_prebuilt" / _FATBIN
    return path if path.is_file() else None


@functools.cache
def _kernels(device_index: int) -> dict:
    """Entry name -> cupy RawKernel on this device (prebuilt fatbin, else NVRTC)."""
    import cupy

    with cupy.cuda.Device(device_index):
        fatbin = _prebuilt()
        if os.environ.get("KVXFER_CUDA_FORCE_NVRTC"):
            _LOG.info("kvxfer CUDA kernels: KVXFER_CUDA_FORCE_NVRTC set, compiling with NVRTC")
        elif fatbin is None:
            _LOG.info(
                "kvxfer CUDA kernels: no prebuilt fatbin (installed without nvcc), compiling with NVRTC"
            )
        else:
            try:
                module = cupy.RawModule(path=str(fatbin))
                kernels = {n: module.get_function(n) for n in _entry_names()}
                _loaded_from[device_index] = f"fatbin:{fatbin}"
                return kernels
            except Exception as exc:  # no SASS/PTX this driver accepts: compile from source below
                _LOG.warning(
                    "kvxfer CUDA kernels: prebuilt %s did not load on device %d (%s: %s); "
                    "compiling with NVRTC instead",
                    fatbin,
                    device_index,
                    type(exc).__name__,
                    exc,
                )
        code = inline_source(source_dir() / "kvx_kernels.cu")
        module = cupy.RawModule(code=code, options=("-std=c++17",), backend="nvrtc")
        kernels = {n: module.get_function(n) for n in _entry_names()}
        _loaded_from[device_index] = "nvrtc"
        return kernels


def loaded_from(device_index: int = 0) -> str | None:
    """Where the kernels on ``device_index`` came from: ``"fatbin:<path>"``, ``"nvrtc"``, or None
    when they have not been loaded there yet."""
    return _loaded_from.get(device_index)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


_unavailable: dict[str, str] = {}  # device type -> why the kernels are not usable there


def is_available(device: torch.device) -> bool:
    """True when ``device`` is a CUDA device and the kernels load on it (never raises; the
    reason they do not is kept for :func:`unavailable_reason`)."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        _unavailable[str(device)] = f"not a device: {exc}"
        return False
    if device.type != "cuda":
        _unavailable[device.type] = f"the CUDA C++ kernels run on CUDA tensors, not {device.type}"
        return False
    if not torch.cuda.is_available():
        _unavailable[device.type] = "no CUDA device is visible"
        return False
    try:
        _kernels(_index(device))
        return True
    except Exception as exc:
        why = f"{type(exc).__name__}: {exc}"
        _unavailable[device.type] = why
        _LOG.warning("kvxfer CUDA kernels unavailable on %s (%s)", device, why)
        return False


def warmup(side: PagedSide, wire: torch.Tensor, copy: bool = True) -> None:
    """Load the kernels on ``side``'s device (fatbin, else an NVRTC compile) before the first
    transfer needs them."""
    _kernels(_index(side.device))


def unavailable_reason(device: torch.device) -> str:
    """Why :func:`is_available` said False for ``device`` ("" if it did not)."""
    return _unavailable.get(torch.device(device).type, "")


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _device_address(t: torch.Tensor, device: torch.device) -> int:
    """Address of ``t`` that kernels on ``device`` can use: its own for CUDA memory, the mapped one
    for pinned host memory, asked for with ``device``'s context bound on this thread
    (:mod:`kvxfer.backends.device_context`: the staged exporter's side-channel thread may have
    made no CUDA call yet, and then got device pointer 0)."""
    if t.device.type == "cuda":
        return t.data_ptr()
    import cupy

    rt = cupy.cuda.runtime
    index = _index(device)
    with bound_device(index, rt):
        attrs = rt.pointerGetAttributes(t.data_ptr())
    host = getattr(rt, "memoryTypeHost", 1)
    if attrs.type != host or not attrs.devicePointer:
        raise ValueError(
            f"wire: host memory at {t.data_ptr():#x} is not pinned and mapped for cuda:{index} "
            f"(memory type {attrs.type}, device pointer {attrs.devicePointer:#x}); a kernel "
            "cannot write it"
        )
    return int(attrs.devicePointer)


@functools.lru_cache(maxsize=64)
def _cupy_stream(ptr: int, device_index: int):
    """CuPy handle of the CUDA stream ``ptr`` (torch's stream; CuPy neither owns nor syncs it)."""
    import cupy

    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:  # CuPy >= 14: the CUDA stream protocol

        class _Handle:
            def __cuda_stream__(self) -> tuple[int, int]:
                return (0, ptr)

        return from_external(_Handle())
    return cupy.cuda.ExternalStream(ptr, device_index)


def with_table(plan: Launch, base: int) -> tuple[int, ...]:
    """``plan.args`` with the address ``base`` of its table added at ``plan.rel``."""
    if not plan.rel:
        return plan.args
    args = list(plan.args)
    for i in plan.rel:
        args[i] += base
    return tuple(args)


def enqueue_staged(plan: Launch, ring, enqueue, allocate) -> None:
    """Queue ``plan``: its table to the device through ``ring`` (a
    :class:`~kvxfer.backends.meta_ring.MetaRing` of the launch's device and stream, or None), or,
    when there is none or it refuses, through ``allocate(meta) -> (keep alive, device address)``;
    then ``enqueue(args)`` with the table's address in them, under the ring's lock (the ring
    reuses a segment only after the kernels that read it, which needs them queued in order)."""
    if not plan.rel:
        enqueue(plan.args)
        return
    if ring is not None:
        with ring.lock:
            off = ring.stage(plan.meta.numpy())
            if off is not None:
                enqueue(with_table(plan, ring.device_ptr + off))
                return
    keep, base = allocate(plan.meta)
    enqueue(with_table(plan, base))
    del keep  # the caching allocator keeps it valid for the work queued on this stream


def _allocate_table(device: torch.device):
    def allocate(meta: torch.Tensor) -> tuple[torch.Tensor, int]:
        # Pinned (caching host allocator) so the copy is asynchronous; the allocator records the
        # copy's event before the pinned block is reused.
        dev = meta.pin_memory().to(device, non_blocking=True)
        return dev, dev.data_ptr()

    return allocate


def _launch(plan: Launch, device: torch.device) -> None:
    from . import meta_ring

    index = _index(device)
    kernel = _kernels(index)[plan.name]
    torch_stream = torch.cuda.current_stream(device)
    raw_stream = torch_stream.cuda_stream
    stream = _cupy_stream(raw_stream, index)

    def enqueue(args: tuple[int, ...]) -> None:
        if _LOG.isEnabledFor(logging.DEBUG):  # what a fault report needs: kernel, stream, addresses
            _LOG.debug(
                "launch %s on cuda:%d stream %#x grid %d x %d args %s (thread %s)",
                plan.name,
                index,
                raw_stream,
                plan.grid,
                plan.block,
                [hex(a) if a > 0xFFFFFFFF else a for a in args],
                threading.current_thread().name,
            )
        kernel((plan.grid,), (plan.block,), tuple(np.int64(a) for a in args))

    with bound_device(index), stream:  # a fresh thread may have no context bound (device_context)
        if not plan.rel:
            enqueue(plan.args)
            return
        dev = torch.device("cuda", index)
        enqueue_staged(plan, meta_ring.ring_for(dev, torch_stream), enqueue, _allocate_table(dev))


@functools.cache
def _blocks_per_sm(device_index: int) -> int:
    """Blocks of ``THREADS`` each SM keeps resident for the widest entry points (the most
    registers: the narrower widths fit as many or more), asked of the driver's occupancy
    calculator; ``BLOCKS_PER_SM`` with a warning when the query fails."""
    import cupy

    try:
        kernels = _kernels(device_index)
        with bound_device(device_index):
            fit = min(
                cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
                    kernels[f"kvx_{op}_w{WIDTHS[0]}"].kernel.ptr, THREADS, 0
                )
                for op in ("gather", "scatter", "copy")
            )
        if fit < 1:
            raise RuntimeError(f"it says no block of {THREADS} threads fits an SM")
    except Exception as exc:
        _LOG.warning(
            "kvxfer CUDA kernels: occupancy query on device %d failed (%s: %s); sizing the grid "
            "for %d blocks per SM",
            device_index,
            type(exc).__name__,
            exc,
            BLOCKS_PER_SM,
        )
        return BLOCKS_PER_SM
    _LOG.debug("kvxfer CUDA kernels: %d blocks of %d threads per SM on device %d", fit, THREADS, device_index)
    return fit


@functools.cache
def _max_threads(device_index: int) -> int:
    """Threads per block the widest entry points allow (registers), asked of the driver through
    CuPy; :data:`THREADS` with a warning when the query fails (a budgeted grid then runs
    256-thread blocks)."""
    try:
        kernels = _kernels(device_index)
        with bound_device(device_index):
            most = min(
                int(kernels[f"kvx_{op}_w{WIDTHS[0]}"].max_threads_per_block)
                for op in ("gather", "scatter", "copy")
            )
        if most < THREADS:
            raise RuntimeError(f"it allows {most} threads per block, fewer than {THREADS}")
        return most
    except Exception as exc:
        _LOG.warning(
            "kvxfer CUDA kernels: max threads per block on device %d unknown (%s: %s); blocks under "
            "an SM budget get %d threads",
            device_index,
            type(exc).__name__,
            exc,
            THREADS,
        )
        return THREADS


def _max_blocks(device: torch.device) -> int:
    """A persistent grid of one full wave: every SM holds as many blocks as fit at once."""
    index = _index(device)
    return _num_sms(index) * _blocks_per_sm(index)


def _grid(device: torch.device, max_sms: int | None) -> tuple[int, int]:
    """(max blocks, threads) for a launch on ``device`` under ``max_sms`` (:func:`budget_launch`)."""
    index = _index(device)
    if max_sms is None:
        return _num_sms(index) * _blocks_per_sm(index), THREADS
    return budget_launch(_num_sms(index), _blocks_per_sm(index), _max_threads(index), max_sms)


def gather(src: PagedSide, wire: torch.Tensor) -> None:
    """``wire`` [H, L, KV, T, D] (CUDA, or pinned host) <- the rows of ``src`` (at most
    ``src.max_sms`` blocks when set)."""
    dev = src.device
    blocks, threads = _grid(dev, src.max_sms)
    _launch(plan_gather(src, _device_address(wire, dev), blocks, dev, threads), dev)


def scatter(wire: torch.Tensor, dst: PagedSide) -> None:
    """The rows of ``dst`` <- ``wire`` [H, L, KV, T, D] (CUDA, or pinned host)."""
    dev = dst.device
    blocks, threads = _grid(dev, dst.max_sms)
    _launch(plan_scatter(_device_address(wire, dev), dst, blocks, dev, threads), dev)


def copy(src: PagedSide, dst: PagedSide) -> None:
    """The rows of ``dst`` <- the rows of ``src`` (one device)."""
    dev = dst.device
    blocks, threads = _grid(dev, dst.max_sms)
    _launch(plan_copy(src, dst, blocks, dev, threads), dev)
