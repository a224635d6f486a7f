"""The one Triton kernel behind gather, scatter and copy: move head rows between two sides.

A *side* is either a paged cache or the wire tensor. Every (head, layer, kv, token) row of
``R`` words moves from its address on the source side to its address on the destination side.
Data is moved as integer *words* (int8/16/32/64, the widest the alignment allows), never as
values, so every dtype (fp8 included) moves bit-exactly.

Paged side: ``table`` is an int64 tensor of per-layer base addresses (``data_ptr()`` values,
cast to pointers in the kernel) and ``ids`` the request's block ids on the device; the row of
(layer ``l``, kv, token ``t``, head ``h``) starts at word
``table[l] + kv*s_kv + ids[t // bs]*s_blk + (t % bs)*s_tok + (head_start + h)*s_head``; with
``sb > 1`` (then ``bs == 1``) the ids are token slots: slot ``i = ids[t]`` is block ``i // sb``,
offset ``i % sb`` (one formula for both: block ``ids[t // bs] // sb``, offset
``t % bs + ids[t // bs] % sb``; Triton specialises an ``sb`` of 1, so block ids pay nothing).
Wire side: ``table`` is the contiguous ``[H, L, KV, T, R]`` wire itself (device or pinned host
memory, read/written through its device address), row ``((h*L + l)*KV + kv)*T + t``.

Grid (1-D): one program per (h, l, kv, tile of ``BLOCK_T`` tokens), tokens fastest, so one
launch covers every layer and block of a call. A program moves a ``[BLOCK_T, BLOCK_W]`` tile.
Under an SM budget (``PERSISTENT``) the grid is capped at the budget and each program strides
over the tiles ``pid, pid + grid, ...``; the uncapped variant keeps one tile per program (the
code measured for the tile and warp defaults, ``kvxfer/kernels/launch.py``).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _row_starts(
    table,
    ids,
    t,
    tmask,
    g,
    layer,
    kv,
    h,
    T,
    head_start,
    bs,
    sb,
    s_kv,
    s_blk,
    s_tok,
    s_head,
    PAGED: tl.constexpr,
    WORD: tl.constexpr,
    R: tl.constexpr,
    VEC: tl.constexpr,
):
    """(base pointer, word offset of each token's row ``[BLOCK_T]``) for one side."""
    if PAGED:
        base = tl.load(table + layer).to(tl.pointer_type(WORD))
        i = tl.load(ids + t // bs, mask=tmask, other=0)
        blk = (i // sb).to(tl.int64)
        tok = (t % bs + i % sb).to(tl.int64)
        off = kv * s_kv + (head_start + h) * s_head + blk * s_blk + tok * s_tok
    else:
        base = table
        off = (g * T + t) * R
    return base, tl.multiple_of(off, VEC)


# Per-request integers are not specialised (Triton would compile a variant for each value that
# is 1 or a multiple of 16): a server compiles once per cache shape family, not per request.
DO_NOT_SPECIALIZE = ("T", "num_t_tiles", "num_tiles", "src_head_start", "dst_head_start")


@triton.jit
def _move_tile(
    pid,
    src,
    src_ids,
    dst,
    dst_ids,
    T,
    L,
    KV,
    num_t_tiles,
    src_head_start,
    src_bs,
    src_sb,
    src_s_kv,
    src_s_blk,
    src_s_tok,
    src_s_head,
    dst_head_start,
    dst_bs,
    dst_sb,
    dst_s_kv,
    dst_s_blk,
    dst_s_tok,
    dst_s_head,
    SRC_PAGED: tl.constexpr,
    DST_PAGED: tl.constexpr,
    WORD: tl.constexpr,
    R: tl.constexpr,
    VEC: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """Copy the rows of tile ``pid`` (int64): one (head, layer, kv, token tile)."""
    tile = pid % num_t_tiles
    g = pid // num_t_tiles  # (h*L + layer)*KV + kv: the wire's row group
    kv = g % KV
    layer = (g // KV) % L
    h = g // (KV * L)
    # token indices stay int32 (T < 2**31) so t // bs and t % bs are 32-bit divisions; every
    # address product below is int64
    t = (tile * BLOCK_T).to(tl.int32) + tl.arange(0, BLOCK_T)
    tmask = t < T
    col = tl.arange(0, BLOCK_W)
    mask = tmask[:, None] & (col < R)[None, :]
    s_base, s_off = _row_starts(
        src, src_ids, t, tmask, g, layer, kv, h, T, src_head_start, src_bs, src_sb,
        src_s_kv, src_s_blk, src_s_tok, src_s_head, SRC_PAGED, WORD, R, VEC,
    )  # fmt: skip
    d_base, d_off = _row_starts(
        dst, dst_ids, t, tmask, g, layer, kv, h, T, dst_head_start, dst_bs, dst_sb,
        dst_s_kv, dst_s_blk, dst_s_tok, dst_s_head, DST_PAGED, WORD, R, VEC,
    )  # fmt: skip
    s_ptr = tl.multiple_of(s_base + s_off[:, None] + col[None, :], [1, ALIGN])
    d_ptr = tl.multiple_of(d_base + d_off[:, None] + col[None, :], [1, ALIGN])
    tl.store(d_ptr, tl.load(s_ptr, mask=mask), mask=mask)


@triton.jit(do_not_specialize=DO_NOT_SPECIALIZE)
def move_rows_kernel(
    src,
    src_ids,
    dst,
    dst_ids,
    T,
    L,
    KV,
    num_t_tiles,
    num_tiles,
    src_head_start,
    src_bs,
    src_sb,
    src_s_kv,
    src_s_blk,
    src_s_tok,
    src_s_head,
    dst_head_start,
    dst_bs,
    dst_sb,
    dst_s_kv,
    dst_s_blk,
    dst_s_tok,
    dst_s_head,
    SRC_PAGED: tl.constexpr,
    DST_PAGED: tl.constexpr,
    WORD: tl.constexpr,
    R: tl.constexpr,
    VEC: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr,
    PERSISTENT: tl.constexpr,
):
    """Copy the rows of one (head, layer, kv, token tile) from ``src`` to ``dst``; with
    ``PERSISTENT``, of tiles ``pid, pid + grid, ...`` below ``num_tiles`` (= H*L*KV*num_t_tiles).

    ``R`` words per row, moved as ``WORD`` integers; every row start is a multiple of ``VEC``
    words and of ``ALIGN`` bytes (checked on the host), which lets the compiler emit
    ``ALIGN``-byte vector loads and stores.
    """
    pid = tl.program_id(0).to(tl.int64)
    if PERSISTENT:
        step = tl.num_programs(0)
        # a while loop over int64 tile ids, not a tl.range: Triton 3.6's interpreter cannot take
        # a run-time loop bound (it converts a one-element array to int, which NumPy 2.4
        # refuses), and range(pid, ...) would make the ids Python ints there
        tile = pid
        while tile < num_tiles:
            _move_tile(
                tile, src, src_ids, dst, dst_ids, T, L, KV, num_t_tiles,
                src_head_start, src_bs, src_sb, src_s_kv, src_s_blk, src_s_tok, src_s_head,
                dst_head_start, dst_bs, dst_sb, dst_s_kv, dst_s_blk, dst_s_tok, dst_s_head,
                SRC_PAGED, DST_PAGED, WORD, R, VEC, ALIGN, BLOCK_T, BLOCK_W,
            )  # fmt: skip
            tile += step
    else:
        _move_tile(
            pid, src, src_ids, dst, dst_ids, T, L, KV, num_t_tiles,
            src_head_start, src_bs, src_sb, src_s_kv, src_s_blk, src_s_tok, src_s_head,
            dst_head_start, dst_bs, dst_sb, dst_s_kv, dst_s_blk, dst_s_tok, dst_s_head,
            SRC_PAGED, DST_PAGED, WORD, R, VEC, ALIGN, BLOCK_T, BLOCK_W,
        )  # fmt: skip
