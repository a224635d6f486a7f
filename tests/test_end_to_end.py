"""P ranks -> plan -> gather/scatter (and fused copy) -> D ranks equals what D would compute itself."""

import pytest
import torch

from kvxfer import KVCacheSpec, Layout, plan_reads
from kvxfer.ops import copy_blocks, gather_blocks, scatter_blocks
from tests.kvdata import as_bytes, empty_cache, first_difference, rank_cache, truth_bytes

TP_PAIRS = [(1, 1), (2, 1), (1, 2), (4, 1), (1, 4), (2, 3), (3, 2)]
HEADS = 12  # divisible by 1, 2, 3, 4


def _blocks(num_needed: int, num_blocks: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(num_blocks, generator=g)[:num_needed].tolist()


def _move(p_spec, tp_p, d_spec, tp_d, num_tokens, fused, seed=0):
    truth = truth_bytes(p_spec, num_tokens, seed)
    p_nb, d_nb = p_spec.num_blocks_for(num_tokens) + 3, d_spec.num_blocks_for(num_tokens) + 3
    p_ids = _blocks(p_spec.num_blocks_for(num_tokens), p_nb, seed + 1)
    d_ids = _blocks(d_spec.num_blocks_for(num_tokens), d_nb, seed + 2)
    p_caches = [rank_cache(p_spec, truth, r, tp_p, p_ids, p_nb) for r in range(tp_p)]
    plan = plan_reads(p_spec, tp_p, d_spec, tp_d)
    for d in range(tp_d):
        d_caches = empty_cache(d_spec, d_nb, d_spec.heads_per_rank(tp_d))
        for read in plan.reads(d):
            src = p_caches[read.src_rank]
            if fused:
                copy_blocks(
                    src,
                    p_spec,
                    p_ids,
                    d_caches,
                    d_spec,
                    d_ids,
                    num_tokens,
                    src_head_start=read.src_head_start,
                    dst_head_start=read.dst_head_start,
                    num_heads=read.num_heads,
                )
            else:
                wire = gather_blocks(
                    src, p_spec, p_ids, num_tokens, head_start=read.src_head_start, num_heads=read.num_heads
                )
                scatter_blocks(wire, d_caches, d_spec, d_ids, num_tokens, head_start=read.dst_head_start)
        want = rank_cache(d_spec, truth, d, tp_d, d_ids, d_nb)
        got_b, want_b = as_bytes(d_caches), as_bytes(want)
        assert torch.equal(got_b, want_b), f"D rank {d}: {first_difference(got_b, want_b)}"
    # Every P rank is notified, and the counts match what D ranks send.
    sent = [0] * tp_p
    for d in range(tp_d):
        for s in plan.notify_targets(d):
            sent[s] += 1
    assert sent == [plan.expected_notifications(s) for s in range(tp_p)] and min(sent) >= 1


@pytest.mark.parametrize("tp_p,tp_d", TP_PAIRS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("fused", [False, True], ids=["gather_scatter", "copy"])
def test_tp_layout_block_matrix(tp_p, tp_d, dtype, fused):
    p_spec = KVCacheSpec(3, HEADS, 24, 16, dtype, Layout.NHD)
    d_spec = KVCacheSpec(3, HEADS, 24, 32, dtype, Layout.HND)
    _move(p_spec, tp_p, d_spec, tp_d, num_tokens=77, fused=fused)
    # and the other direction of layout / block size
    _move(d_spec, tp_p, p_spec, tp_d, num_tokens=50, fused=fused, seed=7)


@pytest.mark.parametrize("tp_p,tp_d", [(4, 1), (1, 4), (4, 4), (4, 2), (2, 4), (8, 4)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e5m2])
def test_replicated_heads(tp_p, tp_d, dtype):
    p_spec = KVCacheSpec(2, 2, 16, 8, dtype, Layout.HND)
    d_spec = KVCacheSpec(2, 2, 16, 16, dtype, Layout.NHD)
    _move(p_spec, tp_p, d_spec, tp_d, num_tokens=33, fused=False)


@pytest.mark.parametrize("tp_p,tp_d", [(1, 1), (2, 1), (1, 2), (4, 2), (2, 3)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("fused", [False, True], ids=["gather_scatter", "copy"])
def test_mla(tp_p, tp_d, dtype, fused):
    p_spec = KVCacheSpec(3, 1, 72, 16, dtype, use_mla=True)
    d_spec = KVCacheSpec(3, 1, 72, 64, dtype, use_mla=True)
    _move(p_spec, tp_p, d_spec, tp_d, num_tokens=100, fused=fused)
