"""Packing several requests into one ops call is exact: compare with per-request copies."""

import random

import pytest
import torch

from kvxfer import KVCacheSpec, ops
from kvxfer.transports import Item, build_chunks, dedupe_prefixes, unit_view, units_of

from .engine_procs import payload, poison


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
    chunks = build_chunks(items, su, du)
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
