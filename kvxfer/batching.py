"""Batching arithmetic of every transport: the choice of units per batch (the units each side's
caches can be addressed in: :class:`kvxfer.views.CacheViews`) and the packing of several
requests into as few ops calls as exactness allows (:func:`plan_batch`, :func:`pack_calls`). Requests travel as block lists; per-token slot arrays
are built (one numpy op each) only when requests with partial last blocks share a call."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .spec import KVCacheSpec

__all__ = [
    "BatchPlan",
    "Call",
    "Item",
    "pack_calls",
    "plan_batch",
    "shared_prefixes",
    "wire_bytes",
]


_OFFSETS: dict[int, np.ndarray] = {}


def _slots(blocks: np.ndarray, block_size: int, start: int, stop: int) -> np.ndarray:
    """Token slots (``block * block_size + offset``) of tokens ``[start, stop)``: one numpy op."""
    off = _OFFSETS.get(block_size)
    if off is None:
        off = _OFFSETS[block_size] = np.arange(block_size, dtype=np.int64)
    b0 = start // block_size
    rows = blocks[b0 : -(-stop // block_size), None] * block_size + off
    return rows.reshape(-1)[start - b0 * block_size : stop - b0 * block_size]


def _extend_slots(out: list[int], blocks: np.ndarray, block_size: int, start: int, stop: int) -> None:
    """Append the token slots of tokens ``[start, stop)`` (fewer than ``lcm`` of the two sides'
    block sizes: a head or a tail, one block or a few) to ``out`` as Python ints. A batch's
    tails, one array at the end: cheaper than a :func:`_slots` per tail or a fixed chain of
    numpy ops over all of them (a tail is one block or a few)."""
    b0 = start // block_size
    for k, b in enumerate(blocks[b0 : -(-stop // block_size)].tolist()):
        first = (b0 + k) * block_size  # the block's first token
        base = b * block_size - first
        out.extend(range(base + max(start, first), base + min(stop, first + block_size)))


def _np(ids) -> np.ndarray:
    if type(ids) is np.ndarray:  # what the engine passes (an isinstance on torch.Tensor costs more)
        return ids
    return ids.numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)


@dataclass
class Item:
    """One request as seen by one (batch, source rank): unit ids on both sides (int arrays)."""

    request_id: str
    src: np.ndarray  # int64 source unit ids, ceil(num_tokens / src_unit)
    dst: np.ndarray  # int64 destination unit ids, ceil(num_tokens / dst_unit)
    num_tokens: int
    skip: int = 0  # leading tokens carried by an earlier sibling in this batch (n>1)
    first: int = 0  # leading tokens the loader already holds (a partial load): move [first, n)


@dataclass
class Call:
    """One ops call: concatenated unit ids of the requests it carries. ``src_offset`` /
    ``dst_offset`` (token offset inside the first unit; only in the short calls that start a
    partial load off a block boundary) address the side through an offset view
    (:meth:`kvxfer.views.CacheViews.at`).
    ``src_unit`` / ``dst_unit``: the call's own units where they differ from its plan's (the
    token-slot call of a plan with ``split_tails``); 0 means the plan's
    (:meth:`BatchPlan.units`)."""

    request_ids: list[str]
    src: np.ndarray
    dst: np.ndarray
    num_tokens: int
    src_offset: int = 0
    dst_offset: int = 0
    src_unit: int = 0
    dst_unit: int = 0


def _common_units(a, b) -> int:
    a, b = _np(a), _np(b)
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def shared_prefixes(items: list[Item], src_unit: int, dst_unit: int) -> list[int]:
    """Leading tokens of each request that an earlier request of the batch already carries.

    Two requests share a prefix when their leading source *and* destination units are equal
    (n>1 children whose loader gives them the same prefix blocks, as prefix caching does): the
    tokens in their common leading units on both sides are the same cache rows.
    """
    out = [0] * len(items)
    if len(items) < 2:
        return out
    leaders: dict[tuple[int, int], Item] = {}
    for k, it in enumerate(items):
        if it.num_tokens == 0:
            continue
        key = (int(it.src[0]), int(it.dst[0]))
        lead = leaders.get(key)
        if lead is None:
            leaders[key] = it
            continue
        out[k] = min(
            _common_units(lead.src, it.src) * src_unit,
            _common_units(lead.dst, it.dst) * dst_unit,
            lead.num_tokens,
            it.num_tokens,
        )
    return out


def pack_calls(items: list[Item], src_unit: int, dst_unit: int) -> list[Call]:
    """Pack requests into as few ops calls as exactness allows.

    A request can follow another in one call only if the tokens before it fill whole units on
    both sides (a multiple of ``lcm(src_unit, dst_unit)``): then token ``t`` of the call lies
    in unit ``t // unit`` of the concatenated unit lists on either side. Requests whose tokens
    fill whole units go first, so a call closes only after a request with a partial last unit:
    ``max(1, number of those)`` calls (one with unit 1). Requests' skipped prefixes
    (``skip``, from :func:`shared_prefixes`) are left out.
    """
    align = math.lcm(src_unit, dst_unit)
    live = [it for it in items if it.num_tokens > it.skip]
    live.sort(key=lambda it: (it.num_tokens - it.skip) % align != 0)  # stable
    calls: list[Call] = []
    ids: list[str] = []
    srcs: list[np.ndarray] = []
    dsts: list[np.ndarray] = []
    total = 0

    def close() -> None:
        nonlocal ids, srcs, dsts, total
        if total:
            cat = len(srcs) > 1
            src = np.concatenate(srcs) if cat else srcs[0]
            dst = np.concatenate(dsts) if cat else dsts[0]
            calls.append(Call(ids, src, dst, total))
        ids, srcs, dsts, total = [], [], [], 0

    for it in live:
        ids.append(it.request_id)
        srcs.append(_np(it.src)[it.skip // src_unit : -(-it.num_tokens // src_unit)])
        dsts.append(_np(it.dst)[it.skip // dst_unit : -(-it.num_tokens // dst_unit)])
        total += it.num_tokens - it.skip
        if total % align:
            close()
    close()
    return calls


@dataclass
class BatchPlan:
    """How one (batch, source rank) moves: the unit of each side and the ops calls."""

    src_unit: int
    dst_unit: int
    calls: list[Call]
    skipped_tokens: int  # tokens not moved because an n>1 sibling carries them
    distinct: bool = False  # no destination unit is named twice across the calls (plan_batch's ``distinct``)

    def units(self, c: Call) -> tuple[int, int]:
        """The (source, destination) units call ``c`` addresses its sides in."""
        return c.src_unit or self.src_unit, c.dst_unit or self.dst_unit


def _head_calls(it: Item, end: int, src_bs: int, su: int, dst_bs: int, du: int) -> list[Call]:
    """Calls moving tokens ``[it.first, end)`` of a partial load whose start is not on a
    boundary of both sides' units: one per stretch that stays inside one block of each
    block-unit side (a unit-1 side takes token slots), each addressed with offsets. At most
    ``lcm(units) / gcd(block sizes)`` short calls, only at the start of a partial load."""
    out = []
    src, dst = _np(it.src), _np(it.dst)
    t = it.first
    while t < end:
        e = end
        if su != 1:
            e = min(e, (t // src_bs + 1) * src_bs)
        if du != 1:
            e = min(e, (t // dst_bs + 1) * dst_bs)
        s_ids = _slots(src, src_bs, t, e) if su == 1 and src_bs != 1 else src[t // su : t // su + 1]
        d_ids = _slots(dst, dst_bs, t, e) if du == 1 and dst_bs != 1 else dst[t // du : t // du + 1]
        so = 0 if su == 1 else t % src_bs
        do = 0 if du == 1 else t % dst_bs
        out.append(Call([it.request_id], s_ids, d_ids, e - t, so, do))
        t = e
    return out


def _split_plan(
    items: list[Item], shared: list[int], src_block_size: int, dst_block_size: int, slots: bool
) -> BatchPlan | None:
    """A batch in block units, what is not whole blocks as token slots: one call over every
    request's whole ``lcm`` stretches of blocks (the last request that ends inside a block goes
    last in it, to its end), and one call of token slots on both sides (:attr:`Call.src_unit`
    1) for the rest: the tails of the other requests that end inside a block, and the heads of
    requests whose moved tokens start off a boundary of both sides' blocks (a partial load's
    ``first``, or an n>1 sibling's ``shared`` prefix, skipped exactly). None when that rest is
    not empty and ``slots`` is false (a side without a token-slot view).

    The scoring of :func:`plan_batch` would move a batch with several requests ending inside a
    block in one call of token slots: ~3K ids per request and side, most of a ragged batch's
    host cost to build (profiling/results/2026-11-23-cpu-hostcost/README.md, sixth pass), and a
    kernel moving single token rows
    where it can move 16-token blocks (``profiling/bench_batching.py``)."""
    sbs, dbs = src_block_size, dst_block_size
    align = math.lcm(sbs, dbs)
    spans = []  # (item, first token moved, first token on a boundary of both sides' blocks)
    skipped = 0
    last = None  # the span of the last request ending inside a block with whole blocks to move
    for it, sh in zip(items, shared):
        n = it.num_tokens
        start = min(n, max(it.first, sh))
        skipped += max(0, start - it.first)
        if start < n:
            a = min(n, -(-start // align) * align)
            spans.append((it, start, a))
            if n % align and a < n:
                last = spans[-1]
    rids: list[str] = []
    srcs: list[np.ndarray] = []
    dsts: list[np.ndarray] = []
    total = 0
    slot_rids: list[str] = []
    slot_src: list[int] = []
    slot_dst: list[int] = []
    for span in spans:  # one pass: whole blocks, heads and tails as slots
        it, start, a = span
        n = it.num_tokens
        if not start and not n % align:  # every block of it (the common case): its own arrays
            rids.append(it.request_id)
            srcs.append(_np(it.src))
            dsts.append(_np(it.dst))
            total += n
            continue
        e = n if span is last else max(a, n - n % align)  # the blocks moved are tokens [a, e)
        src, dst = _np(it.src), _np(it.dst)
        if start < a or e < n:
            if not slots:
                return None
            slot_rids.append(it.request_id)
            for lo, hi in ((start, a), (e, n)):
                if lo < hi:
                    _extend_slots(slot_src, src, sbs, lo, hi)
                    _extend_slots(slot_dst, dst, dbs, lo, hi)
        if a < e and span is not last:
            rids.append(it.request_id)
            srcs.append(src[a // sbs : e // sbs])
            dsts.append(dst[a // dbs : e // dbs])
            total += e - a
    if last is not None:  # after the others: its last block is partial
        it, _, a = last
        n = it.num_tokens
        rids.append(it.request_id)
        srcs.append(_np(it.src)[a // sbs : -(-n // sbs)])
        dsts.append(_np(it.dst)[a // dbs : -(-n // dbs)])
        total += n - a
    calls = []
    if total:
        cat = len(srcs) > 1
        src_ids = np.concatenate(srcs) if cat else srcs[0]
        calls.append(Call(rids, src_ids, np.concatenate(dsts) if cat else dsts[0], total))
    if slot_rids:
        src_ids = np.array(slot_src, dtype=np.int64)
        dst_ids = np.array(slot_dst, dtype=np.int64)
        calls.append(Call(slot_rids, src_ids, dst_ids, src_ids.size, src_unit=1, dst_unit=1))
    return BatchPlan(sbs, dbs, calls, skipped)


def _whole_plan(items: list[Item], src_block_size: int, dst_block_size: int) -> BatchPlan | None:
    """The plan of a batch that moves every block of each request, whole (no partial load, no
    request ending inside a block of either side, no shared prefix: the caller knows them
    distinct): one call over the concatenated block lists, in order. None for any other batch.
    What :func:`_split_plan` builds for such a batch, without its per-request spans."""
    align = math.lcm(src_block_size, dst_block_size)
    total = 0
    srcs, dsts = [], []
    nd = np.ndarray
    for it in items:
        n, src, dst = it.num_tokens, it.src, it.dst
        if it.first or n % align or type(src) is not nd or type(dst) is not nd:
            return None
        srcs.append(src)
        dsts.append(dst)
        total += n
    call = Call([it.request_id for it in items], np.concatenate(srcs), np.concatenate(dsts), total)
    return BatchPlan(src_block_size, dst_block_size, [call] if total else [], 0, True)


def plan_batch(
    items: list[Item],
    src_block_size: int,
    src_units: Sequence[int],
    dst_block_size: int,
    dst_units: Sequence[int],
    split_tails: bool = True,
    distinct: bool = False,
) -> BatchPlan:
    """Choose units for both sides and pack a batch into ops calls.

    ``items`` hold *block* ids on both sides (for the whole request; ``first`` leading tokens
    of a partial load are not moved). Every pair of allowed units (each side: its block size,
    and 1 when its cache has a token-slot view) is scored by (ops calls, tokens moved, ids
    passed) and the best is built: a lone request, or requests whose lengths fill whole blocks,
    go as block lists (256 ids for 4K tokens, no per-token array), requests with partial last
    blocks that would need one call each share one call through token slots. A partial load
    whose first token is not on a unit boundary of both sides starts with a few short offset
    calls (:func:`_head_calls`). Only per-request Python here; each request's unit ids are one
    numpy op.

    ``split_tails`` (default), when both sides have token-slot views: every request's whole
    blocks in one block call, and only what does not fill whole blocks (tails of requests
    that end inside a block, heads of partial loads and n>1 siblings that start inside one) as
    token slots, in a second call whose units differ from the plan's (:func:`_split_plan`;
    callers address each call in :meth:`BatchPlan.units`). False: the scoring above, which
    moves such a batch as slots in one call, the plan before protocol 3
    (``profiling/bench_batching.py`` compares the two).

    ``distinct``: the caller knows that no two items name the same destination block among
    the tokens they move (the loader checks its loads' blocks once per batch): then no n>1
    sibling shares a prefix with another, :func:`shared_prefixes` is skipped, and the plan
    says so (:attr:`BatchPlan.distinct`: its calls repeat no destination unit).
    """
    if len(items) == 1 and not items[0].first:  # one call whatever the units: the coarsest
        it = items[0]
        su, du = src_units[0], dst_units[0]
        src = (
            _np(it.src)
            if su != 1 or src_block_size == 1
            else _slots(_np(it.src), src_block_size, 0, it.num_tokens)
        )
        dst = (
            _np(it.dst)
            if du != 1 or dst_block_size == 1
            else _slots(_np(it.dst), dst_block_size, 0, it.num_tokens)
        )
        calls = [Call([it.request_id], src, dst, it.num_tokens)] if it.num_tokens else []
        return BatchPlan(su, du, calls, 0, True)
    one = len(items) < 2 or distinct
    if one and src_units[0] == src_block_size and dst_units[0] == dst_block_size:
        plan = _whole_plan(items, src_block_size, dst_block_size)
        if plan is not None:
            return plan
    shared = [0] * len(items) if one else shared_prefixes(items, src_block_size, dst_block_size)
    if src_units[0] == src_block_size and dst_units[0] == dst_block_size:
        slots = split_tails and 1 in src_units and 1 in dst_units
        plan = _split_plan(items, shared, src_block_size, dst_block_size, slots)
        if plan is not None:
            plan.distinct = one
            return plan
    best = None
    for su in src_units:
        for du in dst_units:
            align = math.lcm(su, du)
            moved = ragged = ids = heads = 0
            for it, sh in zip(items, shared):
                n = it.num_tokens
                start = max(it.first, sh // align * align)
                heads += start % align != 0
                m = n - start
                if m > 0:
                    moved += m
                    ragged += m % align != 0
                    ids += m // su + m // du
            key = (max(1, ragged) + heads if moved else 0, moved, ids)
            if best is None or key < best[0]:
                best = (key, su, du)
    assert best is not None, "plan_batch: no units to choose from"
    _, su, du = best
    align = math.lcm(su, du)
    unit_items = []
    head_calls: list[Call] = []
    skipped = 0
    for it, sh in zip(items, shared):
        n = it.num_tokens
        start = max(it.first, sh // align * align)
        skipped += start - it.first
        skip = start
        if start % align:  # a partial load starting inside a unit: short offset calls first
            skip = min(n, -(-start // align) * align)
            head_calls += _head_calls(
                Item(it.request_id, it.src, it.dst, n, 0, start), skip, src_block_size, su, dst_block_size, du
            )
        src, dst = _np(it.src), _np(it.dst)
        if su == 1 and src_block_size != 1:
            src = _slots(src, src_block_size, skip, n)
        else:
            src = src[skip // su :]
        if du == 1 and dst_block_size != 1:
            dst = _slots(dst, dst_block_size, skip, n)
        else:
            dst = dst[skip // du :]
        # ids now start at token ``skip``: a request with nothing skipped from here on
        unit_items.append(Item(it.request_id, src, dst, n - skip))
    calls = head_calls + pack_calls(unit_items, su, du)
    return BatchPlan(su, du, calls, skipped, one)


@functools.lru_cache(maxsize=1024)
def _bytes_per_token(spec: KVCacheSpec, num_heads: int) -> int:
    return spec.bytes_per_token(num_heads=num_heads)


def wire_bytes(
    spec: KVCacheSpec, bp: BatchPlan, num_heads: int, layers: list[int] | None = None
) -> tuple[int, int]:
    """(wire bytes ``bp`` moves for ``num_heads`` heads of ``spec``'s ``layers``, default all;
    wire bytes its n>1 prefixes saved)."""
    bpt = _bytes_per_token(spec, num_heads)
    if layers is not None:
        bpt = bpt * len(layers) // spec.num_layers
    tokens = 0
    for c in bp.calls:  # a loop: a generator is a frame more, per read
        tokens += c.num_tokens
    return tokens * bpt, bp.skipped_tokens * bpt
