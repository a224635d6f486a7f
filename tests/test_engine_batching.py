"""Packing several requests into one ops call is exact: compare with per-request copies."""

import math
import random

import numpy as np
import pytest
import torch

from kvxfer import KVCacheSpec, ops
from kvxfer.batching import Item, pack_calls, plan_batch, shared_prefixes
from kvxfer.views import cache_views, unit_view

from .engine_payload import payload, poison


def units_of(block_ids, block_size: int, num_tokens: int, unit: int) -> np.ndarray:
    """Unit ids of a request's tokens: token slots when ``unit == 1``, else its blocks."""
    ids = np.asarray(block_ids, dtype=np.int64)
    if unit == 1:
        return (ids[:, None] * block_size + np.arange(block_size)).reshape(-1)[:num_tokens]
    return ids[: -(-num_tokens // block_size)]


def dedupe_prefixes(items, src_unit: int, dst_unit: int) -> None:
    """Skips as plan_batch sets them: shared prefixes rounded down to whole units of both sides."""
    align = math.lcm(src_unit, dst_unit)
    for it, shared in zip(items, shared_prefixes(items, src_unit, dst_unit)):
        it.skip = shared // align * align


@pytest.mark.parametrize(
    ("src", "dst", "max_calls_one"),
    [
        (KVCacheSpec(2, 2, 8, 16, torch.float16), KVCacheSpec(2, 2, 8, 8, torch.float16), True),
        (
            KVCacheSpec(2, 2, 8, 16, torch.float16),
            KVCacheSpec(2, 2, 8, 12, torch.float16, layout="HND"),
            False,
        ),
        (
            KVCacheSpec(2, 2, 8, 16, torch.float16, layout="HND"),
            KVCacheSpec(2, 2, 8, 16, torch.float16),
            False,
        ),
        (
            KVCacheSpec(2, 1, 24, 16, torch.bfloat16, use_mla=True),
            KVCacheSpec(2, 1, 24, 5, torch.bfloat16, use_mla=True),
            True,
        ),
    ],
)
def test_batched_copy_matches_per_request(src, dst, max_calls_one):
    rng = random.Random(0)
    src_c = [torch.empty(src.cache_shape(64, 1), dtype=src.dtype) for _ in range(2)]
    want = [torch.empty(dst.cache_shape(96, 1), dtype=dst.dtype) for _ in range(2)]
    got = [torch.empty(dst.cache_shape(96, 1), dtype=dst.dtype) for _ in range(2)]
    poison(want)
    poison(got)
    for c in src_c:
        c.view(torch.uint8).copy_(
            torch.randint(0, 256, (*c.shape[:0], c.numel() * c.element_size()), dtype=torch.uint8).view(
                c.view(torch.uint8).shape
            )
        )
    sfree, dfree = list(range(64)), list(range(96))
    rng.shuffle(sfree)
    rng.shuffle(dfree)
    reqs = []
    for n in [16, 48, 7, 33, 24, 1, 12]:
        s_ids = torch.tensor([sfree.pop() for _ in range(src.num_blocks_for(n))])
        d_ids = torch.tensor([dfree.pop() for _ in range(dst.num_blocks_for(n))])
        reqs.append((n, s_ids, d_ids))
        ops.copy_blocks(src_c, src, s_ids, want, dst, d_ids, n)
    sv, sspec, su = unit_view(src_c, src)
    dv, dspec, du = unit_view(got, dst)
    items = [
        Item(f"r{i}", units_of(s, src.block_size, n, su), units_of(d, dst.block_size, n, du), n)
        for i, (n, s, d) in enumerate(reqs)
    ]
    chunks = pack_calls(items, su, du)
    for ch in chunks:
        ops.copy_blocks(sv, sspec, ch.src, dv, dspec, ch.dst, ch.num_tokens)
    assert sorted(r for ch in chunks for r in ch.request_ids) == sorted(it.request_id for it in items)
    if max_calls_one:
        assert len(chunks) == 1
    for g, w in zip(got, want):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))


def test_dedupe_skips_shared_prefix_in_whole_units():
    a = Item("a", torch.arange(40), torch.arange(100, 140), 40)
    b = Item(
        "b",
        torch.cat([torch.arange(35), torch.arange(200, 210)]),
        torch.cat([torch.arange(100, 135), torch.arange(300, 310)]),
        45,
    )
    c = Item("c", torch.arange(50, 60), torch.arange(400, 410), 10)
    dedupe_prefixes([a, b, c], 1, 1)
    assert (a.skip, b.skip, c.skip) == (0, 35, 0)
    a2 = Item("a", torch.tensor([1, 2, 3]), torch.tensor([5, 6, 7]), 40)
    b2 = Item("b", torch.tensor([1, 2, 9]), torch.tensor([5, 6, 8]), 40)
    dedupe_prefixes([a2, b2], 16, 16)
    assert b2.skip == 32
    # different destination blocks: nothing is shared on the wire
    a3 = Item("a", torch.tensor([1, 2]), torch.tensor([5, 6]), 32)
    b3 = Item("b", torch.tensor([1, 2]), torch.tensor([7, 6]), 32)
    dedupe_prefixes([a3, b3], 16, 16)
    assert b3.skip == 0


def test_payload_encodes_origin():
    spec = KVCacheSpec(2, 2, 8, 4, torch.float16)
    w = payload(spec, 1, 5, range(2))
    flat = w.view(torch.int16).reshape(-1)
    assert torch.unique(flat).numel() > 0.99 * flat.numel()


def _cases():
    nhd16 = KVCacheSpec(2, 2, 8, 16, torch.float16)
    return [
        (nhd16, KVCacheSpec(2, 2, 8, 8, torch.float16)),
        (nhd16, KVCacheSpec(2, 2, 8, 12, torch.float16, layout="HND")),
        (KVCacheSpec(2, 2, 8, 16, torch.float16, layout="HND"), nhd16),
        (
            KVCacheSpec(2, 1, 24, 16, torch.bfloat16, use_mla=True),
            KVCacheSpec(2, 1, 24, 5, torch.bfloat16, use_mla=True),
        ),
    ]


@pytest.mark.parametrize(("src", "dst"), _cases())
@pytest.mark.parametrize("lens", [[48], [37], [48, 96, 240], [16, 48, 7, 33, 24, 1, 12], [96, 48, 37]])
@pytest.mark.parametrize("sibling", [True, False], ids=["sibling", "no-sibling"])
@pytest.mark.parametrize("split_tails", [False, True], ids=["one-unit", "split-tails"])
def test_plan_batch_matches_per_request_copies(src, dst, lens, sibling, split_tails):
    """What the engine runs: block lists in, units chosen per batch, n>1 siblings deduped; the
    result equals per-request copies byte for byte, and blocks no request names stay poisoned.
    Without a sibling, batches whose requests fill whole blocks but one take plan_batch's
    one-call shortcut; with ``split_tails`` (the ipc read) also batches with several requests
    ending inside a block, whose tails then go in a second call of token slots."""
    rng = random.Random(len(lens))
    src_c = [torch.empty(src.cache_shape(96, 1), dtype=src.dtype) for _ in range(2)]
    for c in src_c:
        c.view(torch.uint8).copy_(torch.randint(0, 256, c.view(torch.uint8).shape, dtype=torch.uint8))
    want = [torch.empty(dst.cache_shape(160, 1), dtype=dst.dtype) for _ in range(2)]
    got = [torch.empty(dst.cache_shape(160, 1), dtype=dst.dtype) for _ in range(2)]
    poison(want)
    poison(got)
    sfree, dfree = list(range(96)), list(range(160))
    rng.shuffle(sfree)
    rng.shuffle(dfree)
    items = []
    for i, n in enumerate(lens):
        s_ids = np.array([sfree.pop() for _ in range(src.num_blocks_for(n))])
        d_ids = np.array([dfree.pop() for _ in range(dst.num_blocks_for(n))])
        items.append(Item(f"r{i}", s_ids, d_ids, n))
    if (
        sibling and len(lens) > 1
    ):  # an n>1 sibling of r1: its first 2 source and 1 destination blocks are r1's
        n1 = lens[1]
        s_ids = np.concatenate([items[1].src[:2], [sfree.pop() for _ in range(src.num_blocks_for(n1) - 2)]])
        d_ids = np.concatenate([items[1].dst[:1], [dfree.pop() for _ in range(dst.num_blocks_for(n1) - 1)]])
        items.append(Item("sib", s_ids.astype(np.int64), d_ids.astype(np.int64), n1))
    for it in items:
        ops.copy_blocks(src_c, src, it.src, want, dst, it.dst, it.num_tokens)
    sviews, dviews = cache_views(src_c, src), cache_views(got, dst)
    bp = plan_batch(
        items, src.block_size, [v.unit for v in sviews], dst.block_size, [v.unit for v in dviews], split_tails
    )
    for ch in bp.calls:
        su, du = bp.units(ch)
        sv = next(v for v in sviews if v.unit == su)
        dv = next(v for v in dviews if v.unit == du)
        ops.copy_blocks(sv.caches, sv.spec, ch.src, dv.caches, dv.spec, ch.dst, ch.num_tokens)
    for g, w in zip(got, want):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))
    moved = sum(c.num_tokens for c in bp.calls)
    assert moved + bp.skipped_tokens == sum(it.num_tokens for it in items)
    align = math.lcm(src.block_size, dst.block_size)
    num_ragged = sum(n % align != 0 for n in lens)
    slots_both = len(sviews) == 2 and len(dviews) == 2
    split = split_tails and slots_both
    if sibling and len(lens) > 1:  # the shared prefix: exactly with split tails, else whole units
        shared = min(2 * src.block_size, dst.block_size)
        lcm_units = math.lcm(bp.src_unit, bp.dst_unit)
        assert bp.skipped_tokens >= (shared if split else shared // lcm_units * lcm_units)
    # Unit choice: one request moves as block lists (no per-token array) in one call.
    if len(lens) == 1:
        assert (bp.src_unit, bp.dst_unit) == (src.block_size, dst.block_size)
        assert len(bp.calls) == 1 and bp.calls[0].src.size == src.num_blocks_for(lens[0])
    # Calls: max(1, requests with a partial last unit); one call when both sides have token
    # slots; with split tails a block call and at most one call of token slots after it (what
    # does not fill whole blocks: tails, a sibling's head past its shared prefix).
    if slots_both and not split_tails:
        assert len(bp.calls) == 1
    if split:
        assert (bp.src_unit, bp.dst_unit) == (src.block_size, dst.block_size)
        assert [bp.units(c) for c in bp.calls] in (
            [(src.block_size, dst.block_size)],
            [(src.block_size, dst.block_size), (1, 1)],
        )
        assert all(c.num_tokens == c.src.size == c.dst.size for c in bp.calls[1:])
    if not sibling and (num_ragged <= 1 or (split_tails and slots_both)):  # block lists
        assert (bp.src_unit, bp.dst_unit) == (src.block_size, dst.block_size)
        assert bp.units(bp.calls[0]) == (src.block_size, dst.block_size)
        if num_ragged <= 1:  # one block call
            assert len(bp.calls) == 1 and bp.calls[0].src.size == sum(src.num_blocks_for(n) for n in lens)
        else:  # whole blocks of all, one request whole, the others' tails as token slots
            assert len(bp.calls) == 2 and bp.units(bp.calls[1]) == (1, 1)
            ragged = [n for n in lens if n % align]  # the last stays whole in the block call
            assert bp.calls[1].num_tokens == sum(n % align for n in ragged[:-1])
            assert bp.calls[1].num_tokens == bp.calls[1].src.size == bp.calls[1].dst.size
            assert bp.calls[0].num_tokens == sum(lens) - bp.calls[1].num_tokens


def test_plan_batch_one_call_per_ragged_request_with_block_units_only():
    # Block units (16) on both sides, no token slots (the nixl direct READ's plans): a request
    # that ends inside a block cannot share a call with one after it.
    lens = [32, 20, 64, 5, 16]  # two requests end inside a block
    items = [
        Item(f"r{i}", np.arange(i * 8, i * 8 + -(-n // 16)), np.arange(i * 8, i * 8 + -(-n // 16)), n)
        for i, n in enumerate(lens)
    ]
    bp = plan_batch(items, 16, [16], 16, [16])
    assert len(bp.calls) == 2
    assert sorted(r for c in bp.calls for r in c.request_ids) == sorted(it.request_id for it in items)


@pytest.mark.parametrize(("src", "dst"), _cases())
def test_plan_batch_whole_block_requests_go_as_block_lists(src, dst):
    align = math.lcm(src.block_size, dst.block_size)
    lens = [align, 3 * align, 2 * align]
    items, s0, d0 = [], 0, 0
    for i, n in enumerate(lens):
        ns, nd = src.num_blocks_for(n), dst.num_blocks_for(n)
        items.append(Item(f"r{i}", np.arange(s0, s0 + ns), np.arange(d0, d0 + nd), n))
        s0, d0 = s0 + ns, d0 + nd
    bp = plan_batch(items, src.block_size, [src.block_size, 1], dst.block_size, [dst.block_size, 1])
    assert (bp.src_unit, bp.dst_unit) == (src.block_size, dst.block_size)
    assert len(bp.calls) == 1 and bp.calls[0].src.tolist() == list(range(s0))
    assert bp.calls[0].dst.tolist() == list(range(d0))


@pytest.mark.parametrize(("src", "dst"), _cases())
@pytest.mark.parametrize("lens", [[48], [37], [48, 96, 240], [16, 48, 7, 33, 24, 1, 12], [96, 48, 37]])
@pytest.mark.parametrize("first", [0, 16], ids=["whole", "partial-load"])
def test_plan_batch_distinct_is_the_same_plan(src, dst, lens, first):
    """``distinct`` (the loader's promise that no two loads write one block) skips the
    shared-prefix search and takes a one-pass plan for whole-block batches: the calls are
    exactly those of the general plan, which the test above checks byte for byte."""
    rng = random.Random(7 * len(lens) + first)
    sfree, dfree = list(range(200)), list(range(300))
    rng.shuffle(sfree)
    rng.shuffle(dfree)
    items = []
    for i, n in enumerate(lens):
        s_ids = np.array([sfree.pop() for _ in range(src.num_blocks_for(n))], dtype=np.int64)
        d_ids = np.array([dfree.pop() for _ in range(dst.num_blocks_for(n))], dtype=np.int64)
        k = first if first < n and first % dst.block_size == 0 else 0
        items.append(Item(f"r{i}", s_ids, d_ids, n, first=k))
    sv, dv = [src.block_size, 1], [dst.block_size, 1]
    if src.layout == "HND" or dst.layout == "HND":
        sv, dv = [src.block_size], [dst.block_size]
    general = plan_batch(items, src.block_size, sv, dst.block_size, dv)
    fast = plan_batch(items, src.block_size, sv, dst.block_size, dv, distinct=True)
    assert fast.distinct and (fast.src_unit, fast.dst_unit) == (general.src_unit, general.dst_unit)
    assert fast.skipped_tokens == general.skipped_tokens
    assert len(fast.calls) == len(general.calls)
    for a, b in zip(fast.calls, general.calls):
        assert a.request_ids == b.request_ids and a.num_tokens == b.num_tokens
        assert (a.src_offset, a.dst_offset, fast.units(a)) == (b.src_offset, b.dst_offset, general.units(b))
        assert np.array_equal(a.src, b.src) and np.array_equal(a.dst, b.dst)
    assert general.distinct == (len(items) == 1)  # without the promise: only a lone request
