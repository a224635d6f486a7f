"""Host side of the Triton backend: choose word width and tiles, build the small tables, launch.

One call is one launch of :func:`~kvxfer.kernels.rows.move_rows_kernel`, whatever the number of
layers and blocks. The host never waits for the device: block ids go to the device with a
non-blocking copy and the per-layer pointer tables are cached, so nothing here synchronises.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
from collections import OrderedDict

import numpy as np
import torch
import triton
import triton.language as tl

from ..backends import meta_ring
from ..backends.base import PagedSide, ids_tensor
from .rows import move_rows_kernel

__all__ = ["INTERPRETED", "Plan", "budget_grid", "move", "plan_move"]

_LOG = logging.getLogger(__name__)

# Kernels decorated while TRITON_INTERPRET=1 run in Triton's CPU interpreter on CPU tensors.
INTERPRETED: bool = not isinstance(move_rows_kernel, triton.runtime.jit.JITFunction)

# word bytes -> (torch dtype, triton dtype) of the integers rows move as
_WORDS = {
    8: (torch.int64, tl.int64),
    4: (torch.int32, tl.int32),
    2: (torch.int16, tl.int16),
    1: (torch.uint8, tl.uint8),
}

# Tile shape. Interpreter: a program's cost is per Triton op, not per element (16- and 512-token
# tiles cost alike per program), so one tile spans up to 1024 tokens of a row group.
# GPU: BLOCK_T*BLOCK_W words per program (8 KiB), 8 warps: the best of the tiles and warps
# profiling/sweep_triton_tiles.py tried, by about a point over 16 KiB / 4 warps
# (profiling/results/2026-11-26-H200/README.md, "Triton tile sweep": run6, run8).
# $KVXFER_TRITON_TILE_BYTES and $KVXFER_TRITON_NUM_WARPS override them for the sweep.
_INTERP_MAX_BLOCK_T = 1024
_GPU_MIN_BLOCK_T = 16


def _env_pow2(name: str, default: int, lo: int, hi: int) -> int:
    """``$name`` as a power of two in ``[lo, hi]`` (``default`` when unset); anything else raises
    naming the variable."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"${name}={raw!r}: not an integer") from None
    if not lo <= value <= hi or value & (value - 1):
        raise ValueError(f"${name}={value}: must be a power of two in [{lo}, {hi}]")
    _LOG.info("kvxfer Triton kernels: $%s=%d (default %d)", name, value, default)
    return value


DEFAULT_TILE_BYTES = 8192
DEFAULT_NUM_WARPS = 8
_GPU_TILE_BYTES = _env_pow2("KVXFER_TRITON_TILE_BYTES", DEFAULT_TILE_BYTES, 1024, 1 << 18)
_GPU_NUM_WARPS = _env_pow2("KVXFER_TRITON_NUM_WARPS", DEFAULT_NUM_WARPS, 1, 32)
# Warps of a program under an SM budget (a grid capped at max_sms persistent programs): one
# program per SM then, so it gets more warps than the uncapped one to keep as many loads in
# flight per SM. An unmeasured default: profiling/bench_interference.py sweeps the budgets, and
# $KVXFER_TRITON_BUDGET_WARPS overrides this for that sweep.
DEFAULT_BUDGET_NUM_WARPS = 16
_GPU_BUDGET_NUM_WARPS = _env_pow2("KVXFER_TRITON_BUDGET_WARPS", DEFAULT_BUDGET_NUM_WARPS, 1, 32)

_TABLES: OrderedDict[tuple, torch.Tensor] = OrderedDict()
_MAX_TABLES = 256


def _pow2_divisor(values: list[int], limit: int) -> int:
    """Largest power of two ``<= limit`` dividing every value."""
    g = math.gcd(*values) if values else 0
    unit = limit
    while unit > 1 and g % unit:
        unit //= 2
    return unit


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class Plan:
    """Word width, vector width and tile of one move (all checked to divide the data layout).

    Args:
        row_bytes: bytes per head row.
        byte_values: every byte stride and base address the rows are reached through.
        num_tokens: tokens per row group (the wire's ``T``).
        interpreted: tiles for Triton's CPU interpreter rather than a GPU.
    """

    __slots__ = ("align", "block_t", "block_w", "num_warps", "row_words", "vec", "word_bytes")

    def __init__(self, row_bytes: int, byte_values: list[int], num_tokens: int, interpreted: bool) -> None:
        values = [row_bytes, *byte_values]
        self.word_bytes = _pow2_divisor(values, 8)
        self.align = _pow2_divisor(values, 16)
        self.vec = self.align // self.word_bytes
        self.row_words = row_bytes // self.word_bytes
        self.block_w = _next_pow2(self.row_words)
        if interpreted:
            self.block_t = min(_next_pow2(num_tokens), _INTERP_MAX_BLOCK_T)
        else:
            # Token tiles come in a few buckets (at most 16, 32, ... up to the full tile), not one
            # per power of two of the request size: few compiled variants per cache shape.
            per_tile = max(1, _GPU_TILE_BYTES // (self.block_w * self.word_bytes))
            self.block_t = min(max(_GPU_MIN_BLOCK_T, _next_pow2(num_tokens)), _next_pow2(per_tile))
        self.num_warps = _GPU_NUM_WARPS
        assert self.align % self.word_bytes == 0 and self.row_words * self.word_bytes == row_bytes
        assert self.row_words % self.vec == 0 and self.block_w >= self.row_words

    def constexprs(self, src_paged: bool, dst_paged: bool) -> dict:
        """The kernel's compile-time arguments for this plan."""
        return dict(
            SRC_PAGED=src_paged,
            DST_PAGED=dst_paged,
            WORD=_WORDS[self.word_bytes][1],
            R=self.row_words,
            VEC=self.vec,
            ALIGN=self.align,
            BLOCK_T=self.block_t,
            BLOCK_W=self.block_w,
        )


@functools.lru_cache(maxsize=1024)
def _cached_plan(row_bytes: int, byte_gcd: int, tokens_pow2: int, interpreted: bool) -> Plan:
    # A plan depends on the byte values only through their gcd and on num_tokens only through
    # its next power of two.
    return Plan(row_bytes, [byte_gcd], tokens_pow2, interpreted)


class _Side:
    """A paged side or a wire, with what the launch needs computed once."""

    __slots__ = ("byte_values", "paged", "ptrs", "side", "wire")

    def __init__(self, x: PagedSide | torch.Tensor) -> None:
        self.paged = isinstance(x, PagedSide)
        if self.paged:
            self.side, self.wire = x, None
            self.ptrs, self.byte_values = x.kept("triton", _side_values)  # per template (base.py)
        else:
            self.side, self.wire = None, x
            self.ptrs = (x.data_ptr(),)
            self.byte_values = list(self.ptrs)

    def args(self, word_bytes: int, ring=None) -> tuple[tuple, tuple]:
        """((table or wire, ids or wire), (head_start, block_size, slot_block, 4 strides in words)).
        ``ring``: the launch's :class:`~kvxfer.backends.meta_ring.MetaRing` (CUDA; its lock
        held until the kernel is queued), through which the ids reach the device."""
        if not self.paged:
            words = self.wire.reshape(-1).view(torch.uint8).view(_WORDS[word_bytes][0])
            return (words, words), (0, 1, 1, 0, 0, 0, 0)
        side = self.side
        small = side.num_blocks <= 2**31
        ids = None
        if ring is not None:  # one copy from the persistent pinned ring, nothing allocated
            host = side.block_ids.astype(np.int32) if small else side.block_ids
            off = ring.stage(host)
            if off is not None:
                ids = ring.device[off : off + host.nbytes].view(torch.int32 if small else torch.int64)
        if ids is None:
            ids = ids_tensor(side).to(torch.int32 if small else torch.int64)
            if side.device.type == "cuda":
                # Through pinned memory (torch's caching host allocator keeps the block until the
                # copy is done): from pageable memory the driver may wait for the stream before
                # the copy, the host waiting out the work queued ahead
                # (profiling/results/2026-11-26-H200/).
                ids = ids.pin_memory()
            ids = ids.to(side.device, non_blocking=True)
        w = side.element_size
        strides = (side.stride_kv, side.stride_block, side.stride_token, side.stride_head)
        words = tuple(s * w // word_bytes for s in strides)
        return (_table(side.device, self.ptrs), ids), (
            side.head_start,
            side.block_size,
            side.slot_block,
            *words,
        )


def _side_values(x: PagedSide) -> tuple[tuple[int, ...], list[int]]:
    """A paged side's layer addresses, and every byte stride and address its rows use."""
    ptrs = tuple(c.data_ptr() for c in x.caches)
    es = x.element_size
    strides = (x.stride_kv, x.stride_block, x.stride_token, x.stride_head)
    return ptrs, [s * es for s in strides if s] + list(ptrs)


def _table(dev: torch.device, ptrs: tuple[int, ...]) -> torch.Tensor:
    """Device int64 tensor of per-layer base addresses (cached per device and stream)."""
    stream = torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else 0
    key = (dev.type, dev.index, stream, ptrs)
    table = _TABLES.get(key)
    if table is None:
        table = torch.tensor(ptrs, dtype=torch.int64).to(dev, non_blocking=True)
        _TABLES[key] = table
        if len(_TABLES) > _MAX_TABLES:
            _TABLES.popitem(last=False)
    else:
        _TABLES.move_to_end(key)
    return table


def plan_move(src: PagedSide | torch.Tensor, dst: PagedSide | torch.Tensor, shape: PagedSide) -> Plan:
    """The :class:`Plan` for moving ``shape``'s rows from ``src`` to ``dst`` (sides or wires)."""
    return _plan(_Side(src), _Side(dst), shape)


def _plan(src: _Side, dst: _Side, shape: PagedSide) -> Plan:
    g = math.gcd(shape.row_bytes, *src.byte_values, *dst.byte_values)
    return _cached_plan(shape.row_bytes, g, _next_pow2(shape.num_tokens), INTERPRETED)


def budget_grid(num_tiles: int, max_sms: int | None) -> tuple[int, bool]:
    """(programs, persistent) of a launch over ``num_tiles`` tiles under an SM budget of
    ``max_sms`` (None: no budget). One program per tile while that fits the budget; otherwise
    ``max_sms`` persistent programs striding over the tiles: each program is one CTA, so at most
    ``max_sms`` SMs hold transfer work at any time."""
    if max_sms is None or num_tiles <= max_sms:
        return num_tiles, False
    return max_sms, True


def move(
    src: PagedSide | torch.Tensor, dst: PagedSide | torch.Tensor, shape: PagedSide, warmup: bool = False
) -> None:
    """One launch moving every row of ``shape`` (heads, layers, kv, tokens) from ``src`` to ``dst``.

    ``src``/``dst`` are each a :class:`PagedSide` or a contiguous wire tensor ``[H, L, KV, T, D]``;
    ``shape`` is the paged side that gives H, L, KV, T and D, and the SM budget
    (``shape.max_sms``: at most that many programs, see :func:`budget_grid`). ``warmup=True``
    compiles the kernel this call would launch and launches nothing (GPU only).
    """
    dev = shape.device
    if dev.type == "cpu" and not INTERPRETED:
        raise RuntimeError("kvxfer.kernels: CPU tensors need TRITON_INTERPRET=1 set before triton loads")
    if dev.type == "cuda" and INTERPRETED:
        raise RuntimeError("kvxfer.kernels: TRITON_INTERPRET=1 is set, so CUDA tensors cannot be used")
    s, d = _Side(src), _Side(dst)
    plan = _plan(s, d, shape)
    if dev.type != "cuda":
        _launch(s, d, shape, plan, dev, None, warmup)
        return
    with torch.cuda.device(dev):
        ring = None
        if not warmup and (s.paged or d.paged):
            ring = meta_ring.ring_for(
                torch.device("cuda", torch.cuda.current_device()), torch.cuda.current_stream()
            )
        with ring.lock if ring is not None else contextlib.nullcontext():  # until the kernel is queued
            _launch(s, d, shape, plan, dev, ring, warmup)


def _launch(s: _Side, d: _Side, shape: PagedSide, plan: Plan, dev: torch.device, ring, warmup: bool) -> None:
    s_ptrs, s_args = s.args(plan.word_bytes, ring)
    d_ptrs, d_args = d.args(plan.word_bytes, ring)
    num_t_tiles = -(-shape.num_tokens // plan.block_t)
    num_tiles = shape.num_heads * shape.num_layers * shape.num_kv * num_t_tiles
    assert num_tiles < 2**31, "grid too large for one launch"
    programs, persistent = budget_grid(num_tiles, shape.max_sms)
    grid = (programs,)
    args = (
        s_ptrs[0], s_ptrs[1], d_ptrs[0], d_ptrs[1],
        shape.num_tokens, shape.num_layers, shape.num_kv, num_t_tiles, num_tiles,
        *s_args, *d_args,
    )  # fmt: skip
    kwargs = plan.constexprs(s.paged, d.paged)
    kwargs["PERSISTENT"] = persistent
    num_warps = _GPU_BUDGET_NUM_WARPS if persistent else plan.num_warps
    if dev.type == "cuda":  # the device is current (move)
        if warmup:
            move_rows_kernel.warmup(*args, grid=grid, **kwargs, num_warps=num_warps)
        else:
            move_rows_kernel[grid](*args, **kwargs, num_warps=num_warps)
    elif not warmup:
        move_rows_kernel[grid](*args, **kwargs)
