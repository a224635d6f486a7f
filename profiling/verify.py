"""Independent byte-exact oracle for the benchmarks' verification pass.

The oracle uses only plain torch indexing on each layer's cache (a per-layer loop is fine
here: this is the checker, not a hot path), so it also checks kvxfer's own torch reference
backend rather than comparing it with itself.

Every cache is viewed as ``[KV, num_blocks, block_size, heads, dim]`` (HND is permuted to it,
MLA gets unit KV and head axes); the rows of a request are
``view[:, block_ids[t // bs], t % bs, head_start:head_start + num_heads]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

POISON = 0xA5  # byte pattern of memory a transfer must not touch


def _nhd(cache: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "MLA":
        return cache.unsqueeze(0).unsqueeze(3)
    if layout == "HND":
        return cache.permute(0, 1, 3, 2, 4)
    return cache


def token_index(block_ids: torch.Tensor, block_size: int, num_tokens: int, device) -> tuple:
    """(block id, offset in block) of each token, as int64 tensors on ``device``."""
    t = torch.arange(num_tokens, dtype=torch.int64)
    blk = block_ids.to(torch.int64)[t // block_size]
    return blk.to(device), (t % block_size).to(device)


def rows_of(cache, layout, blk, off, head_start, num_heads) -> torch.Tensor:
    """The request's rows of one layer, ``[num_heads, KV, T, dim]`` (a copy)."""
    rows = _nhd(cache, layout)[:, blk, off, head_start : head_start + num_heads]  # [KV, T, H, D]
    return rows.permute(2, 0, 1, 3)


def write_rows(cache, layout, blk, off, head_start, value) -> None:
    """Write ``value`` ``[H, KV, T, dim]`` into the request's rows of one layer."""
    view = _nhd(cache, layout)
    view[:, blk, off, head_start : head_start + value.shape[0]] = value.permute(1, 2, 0, 3)


def _diff(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ne = a.contiguous().view(torch.uint8) != b.contiguous().view(torch.uint8)
    return ne.sum(), ne.any(-1).sum()


def as_wire5(wire: torch.Tensor, layout: str) -> torch.Tensor:
    """The wire as ``[H, L, KV, T, D]`` (MLA ``[L, T, D]`` gets unit H and KV axes)."""
    return wire.unsqueeze(0).unsqueeze(2) if layout == "MLA" else wire


def check_wire(wire, caches, layout, block_ids, block_size, num_tokens, head_start) -> dict:
    """Compare a wire tensor with the rows it should hold; ``wrong_bytes`` and ``wrong_rows``."""
    dev = caches[0].device
    w = as_wire5(wire, layout).to(dev)
    blk, off = token_index(block_ids, block_size, num_tokens, dev)
    wb = wr = torch.zeros((), dtype=torch.int64, device=dev)
    for layer, cache in enumerate(caches):
        b, r = _diff(w[:, layer], rows_of(cache, layout, blk, off, head_start, w.shape[0]))
        wb, wr = wb + b, wr + r
    return {"wrong_bytes": int(wb), "wrong_rows": int(wr)}


def check_copy(
    src_caches,
    src_layout,
    src_ids,
    dst_caches,
    dst_layout,
    dst_ids,
    block_size_src,
    block_size_dst,
    num_tokens,
    src_head_start,
    dst_head_start,
    num_heads,
) -> dict:
    """Compare the destination rows of a fused copy with the source rows."""
    dev = src_caches[0].device
    sb, so = token_index(src_ids, block_size_src, num_tokens, dev)
    db, do = token_index(dst_ids, block_size_dst, num_tokens, dev)
    wb = wr = torch.zeros((), dtype=torch.int64, device=dev)
    for s, d in zip(src_caches, dst_caches):
        b, r = _diff(
            rows_of(d, dst_layout, db, do, dst_head_start, num_heads),
            rows_of(s, src_layout, sb, so, src_head_start, num_heads),
        )
        wb, wr = wb + b, wr + r
    return {"wrong_bytes": int(wb), "wrong_rows": int(wr)}


def poison(tensors: Sequence[torch.Tensor]) -> None:
    """Fill every tensor's bytes with :data:`POISON`."""
    for t in tensors:
        t.view(torch.uint8).fill_(POISON)


def clobbered_bytes(caches, layout, block_ids, block_size, num_tokens, head_start, num_heads) -> int:
    """Bytes outside the request's rows that are no longer :data:`POISON`.

    Re-poisons the request's rows first, so ``caches`` are all poison afterwards if nothing
    else was written (this mutates ``caches``; run it after the rows were checked).
    """
    return clobbered_bytes_of(caches, layout, [(block_ids, num_tokens)], block_size, head_start, num_heads)


def clobbered_bytes_of(caches, layout, requests, block_size, head_start, num_heads) -> int:
    """:func:`clobbered_bytes` for several requests (``(block_ids, num_tokens)`` each) that
    share ``caches``: bytes outside all of their rows that are no longer :data:`POISON`."""
    dev = caches[0].device
    for block_ids, num_tokens in requests:
        blk, off = token_index(block_ids, block_size, num_tokens, dev)
        for cache in caches:
            rows = rows_of(cache, layout, blk, off, head_start, num_heads)
            rows.view(torch.uint8).fill_(POISON)
            write_rows(cache, layout, blk, off, head_start, rows)
    total = torch.zeros((), dtype=torch.int64, device=dev)
    for cache in caches:
        total += (cache.view(torch.uint8) != POISON).sum()
    return int(total)


def fill_random(tensors: Sequence[torch.Tensor], seed: int) -> None:
    """Fill every tensor with seeded random bytes (any dtype: done on a uint8 view)."""
    gen = torch.Generator(device=tensors[0].device).manual_seed(seed)
    for t in tensors:
        t.view(torch.uint8).random_(0, 256, generator=gen)


def corrupt(
    kind, op, layout, wire, dst_caches, dst_ids, block_size, num_tokens, dst_head_start, num_blocks
) -> bool:
    """Deliberately break a result so the verification pass can be shown to catch it.

    ``kind == "result"``: flip one byte of the moved data (the wire's last byte for a gather,
    the last row written in the destination cache otherwise). ``kind == "untouched"``: flip one
    byte a scatter/copy must leave alone (the tail of a partial last block, else a block the
    request does not use). Returns whether anything was corrupted.
    """
    if kind == "result" and op == "gather":
        wire.view(-1).view(torch.uint8)[-1:].bitwise_xor_(0xFF)
        return True
    if op == "gather":
        return False  # a gather writes the whole wire: there is nothing it must leave alone
    view = _nhd(dst_caches[-1], layout)
    last_block = int(dst_ids[(num_tokens - 1) // block_size])
    if kind == "result":
        row = view[0, last_block, (num_tokens - 1) % block_size, dst_head_start]
    elif num_tokens % block_size:
        row = view[0, last_block, block_size - 1, dst_head_start]
    else:
        used = set(dst_ids[: -(-num_tokens // block_size)].tolist())
        free = next(b for b in range(num_blocks) if b not in used)
        row = view[0, free, 0, dst_head_start]
    row.view(torch.uint8)[:1].bitwise_xor_(0xFF)
    return True
