"""Partial loads at the ops level: plan_batch moves tokens [first, n) only, exactly, whatever
the block sizes and layouts of the two sides (offset calls where first is inside a block)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvxfer import KVCacheSpec, Layout, ops
from kvxfer.batching import Item, plan_batch
from kvxfer.views import cache_views, view_at

from .cache_oracle import bytes_equal, expected_dst, make_cache, poisoned

SHAPES = [
    # (src layout, src bs, dst layout, dst bs)
    ("NHD", 16, "NHD", 16),
    ("HND", 32, "NHD", 16),  # first inside a source block
    ("HND", 16, "HND", 48),
    ("NHD", 12, "HND", 8),
    ("HND", 20, "HND", 12),
    ("MLA", 16, "MLA", 24),
]


def _spec(layout: str, bs: int, dtype=torch.bfloat16) -> KVCacheSpec:
    if layout == "MLA":
        return KVCacheSpec(3, 1, 40, bs, dtype, use_mla=True)
    return KVCacheSpec(3, 4, 24, bs, dtype, Layout(layout))


def run_plan(bp, src_views, dst_views, src_spec, dst_spec, h0=0, nh=None, layers=None):
    by_src = {v.unit: v for v in src_views}
    by_dst = {v.unit: v for v in dst_views}
    memo_s, memo_d = {}, {}
    for c in bp.calls:
        su, du = bp.units(c)
        sv = view_at(by_src, su, c.src_offset, memo_s)
        dv = view_at(by_dst, du, c.dst_offset, memo_d)
        ops.copy_blocks(
            sv.caches, sv.spec, c.src, dv.caches, dv.spec, c.dst, c.num_tokens, h0, h0, nh, layers
        )


@pytest.mark.parametrize("shape", SHAPES, ids=["-".join(map(str, s)) for s in SHAPES])
@pytest.mark.parametrize("seed", range(4))
def test_partial_load_moves_exactly_the_missing_tokens(shape, seed):
    sl, sbs, dl, dbs = shape
    src_spec, dst_spec = _spec(sl, sbs), _spec(dl, dbs)
    heads = src_spec.num_kv_heads
    rng = random.Random(seed)
    n = rng.randint(dbs + 1, 6 * max(sbs, dbs))
    k = rng.choice([0, dbs, (n - 1) // dbs * dbs, rng.randrange(0, n, dbs)])  # 0, one block, all but one
    nsb, ndb = src_spec.num_blocks_for(n) + 2, dst_spec.num_blocks_for(n) + 2
    g = torch.Generator().manual_seed(seed)
    sids = torch.randperm(nsb, generator=g)[: src_spec.num_blocks_for(n)]
    dids = torch.randperm(ndb, generator=g)[: dst_spec.num_blocks_for(n)]
    src = make_cache(src_spec, nsb, heads, 0)
    dst = poisoned(dst_spec, ndb, heads)
    want = expected_dst(src, src_spec, sids, dst, dst_spec, dids, n, 0, 0, heads, start=k)
    sv, dv = cache_views(src, src_spec), cache_views(dst, dst_spec)
    it = Item("r", sids.numpy(), dids.numpy(), n, first=k)
    bp = plan_batch([it], sbs, [v.unit for v in sv], dbs, [v.unit for v in dv])
    assert sum(c.num_tokens for c in bp.calls) == n - k
    assert len(bp.calls) <= 1 + np.lcm(sbs, dbs) // np.gcd(sbs, dbs)
    run_plan(bp, sv, dv, src_spec, dst_spec)
    assert bytes_equal(dst, want), (
        shape,
        n,
        k,
        [(c.num_tokens, c.src_offset, c.dst_offset) for c in bp.calls],
    )


def test_partial_loads_share_calls_with_whole_ones():
    """A batch mixing whole and partial loads (and n>1 siblings) stays exact."""
    src_spec, dst_spec = _spec("NHD", 16), _spec("HND", 8)
    src = make_cache(src_spec, 40, 4, 1)
    dst = poisoned(dst_spec, 80, 4)
    want = [c.clone() for c in dst]
    items = []
    layout = [(50, 0), (37, 8), (64, 56), (9, 0)]
    s_next, d_next = 0, 0
    for i, (n, k) in enumerate(layout):
        s_ids = torch.arange(s_next, s_next + src_spec.num_blocks_for(n))
        d_ids = torch.arange(d_next, d_next + dst_spec.num_blocks_for(n))
        s_next, d_next = s_next + len(s_ids), d_next + len(d_ids)
        want = expected_dst(src, src_spec, s_ids, want, dst_spec, d_ids, n, 0, 0, 4, start=k)
        items.append(Item(f"r{i}", s_ids.numpy(), d_ids.numpy(), n, first=k))
    sv, dv = cache_views(src, src_spec), cache_views(dst, dst_spec)
    bp = plan_batch(items, 16, [v.unit for v in sv], 8, [v.unit for v in dv])
    run_plan(bp, sv, dv, src_spec, dst_spec)
    assert bytes_equal(dst, want)
