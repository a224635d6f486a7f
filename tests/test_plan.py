import itertools

import pytest
import torch

from kvxfer import KVCacheSpec, Layout, Read, plan_reads
from kvxfer.plan import token_block_index, token_slots


def spec(h=8, **kw):
    return KVCacheSpec(num_layers=2, num_kv_heads=h, head_dim=16, block_size=16, dtype=torch.bfloat16, **kw)


def test_equal_tp_is_identity():
    p = plan_reads(spec(), 2, spec(layout=Layout.HND), 2)
    assert p.reads(0) == [Read(0, 0, 0, 4)] and p.reads(1) == [Read(1, 0, 0, 4)]
    assert [p.expected_notifications(s) for s in range(2)] == [1, 1]


def test_fan_in_and_fan_out():
    p = plan_reads(spec(), 2, spec(), 1)
    assert p.reads(0) == [Read(0, 0, 0, 4), Read(1, 0, 4, 4)]
    assert [p.expected_notifications(s) for s in range(2)] == [1, 1]
    p = plan_reads(spec(), 2, spec(), 4)
    assert p.reads(1) == [Read(0, 2, 0, 2)] and p.reads(2) == [Read(1, 0, 0, 2)]
    assert [p.expected_notifications(s) for s in range(2)] == [2, 2]


def test_non_integer_ratio():
    p = plan_reads(spec(6), 2, spec(6), 3)
    assert p.reads(1) == [Read(0, 2, 0, 1), Read(1, 0, 1, 1)]
    assert [p.expected_notifications(s) for s in range(2)] == [2, 2]
    p = plan_reads(spec(6), 3, spec(6), 2)
    assert p.reads(0) == [Read(0, 0, 0, 2), Read(1, 0, 2, 1)]
    assert p.reads(1) == [Read(1, 1, 0, 1), Read(2, 0, 1, 2)]
    assert [p.expected_notifications(s) for s in range(3)] == [1, 2, 1]


def test_replicated_source_heads_are_notified_but_not_read():
    p = plan_reads(spec(2), 4, spec(2), 1)
    assert p.reads(0) == [Read(0, 0, 0, 1), Read(2, 0, 1, 1)]
    assert p.notify_targets(0) == [0, 1, 2, 3]
    assert [p.expected_notifications(s) for s in range(4)] == [1, 1, 1, 1]
    assert p.readers_of(1) == []


def test_replicated_both_sides_spreads_over_replicas():
    p = plan_reads(spec(2), 4, spec(2), 4)
    assert [p.reads(d)[0].src_rank for d in range(4)] == [0, 1, 2, 3]


def test_mla_reads_one_rank_spread_and_notifies_all():
    mla = KVCacheSpec(2, 1, 576, 16, torch.bfloat16, use_mla=True)
    p = plan_reads(mla, 4, mla, 2)
    assert p.reads(0) == [Read(0, 0, 0, 1)] and p.reads(1) == [Read(1, 0, 0, 1)]
    assert p.notify_targets(0) == [0, 2] and p.notify_targets(1) == [1, 3]
    assert [p.expected_notifications(s) for s in range(4)] == [1, 1, 1, 1]
    p = plan_reads(mla, 1, mla, 4)
    assert all(p.reads(d) == [Read(0, 0, 0, 1)] for d in range(4))
    assert p.expected_notifications(0) == 4


@pytest.mark.parametrize("h", [1, 2, 4, 6, 8, 12])
def test_every_head_exactly_once_from_a_holder(h):
    sizes = [t for t in (1, 2, 3, 4, 6, 8, 12, 16) if (t <= h and h % t == 0) or (t > h and t % h == 0)]
    for src_tp, dst_tp in itertools.product(sizes, sizes):
        s = spec(h)
        p = plan_reads(s, src_tp, s, dst_tp)
        notified = [0] * src_tp
        for d in range(dst_tp):
            got = []
            for r in p.reads(d):
                src_heads = s.heads_of_rank(r.src_rank, src_tp)
                for i in range(r.num_heads):
                    got.append(src_heads[r.src_head_start + i])
                    assert r.dst_head_start + i == len(got) - 1
            assert got == list(s.heads_of_rank(d, dst_tp)), (src_tp, dst_tp, d)
            assert {r.src_rank for r in p.reads(d)} <= set(p.notify_targets(d))
            for t in p.notify_targets(d):
                notified[t] += 1
        assert notified == [p.expected_notifications(r) for r in range(src_tp)]
        assert min(notified) >= 1, (src_tp, dst_tp)


def test_incompatible_or_unplannable():
    with pytest.raises(ValueError, match="head_dim"):
        plan_reads(spec(), 1, KVCacheSpec(2, 8, 32, 16, torch.bfloat16), 1)
    with pytest.raises(ValueError, match="num_kv_heads"):
        plan_reads(spec(8), 1, spec(4), 1)
    with pytest.raises(ValueError, match="tp_size"):
        plan_reads(spec(), 3, spec(), 1)
    with pytest.raises(ValueError, match="dst_rank"):
        plan_reads(spec(), 1, spec(), 2).reads(2)


def test_token_mapping_partial_last_block():
    idx, off = token_block_index(37, 16)
    assert idx.tolist() == [0] * 16 + [1] * 16 + [2] * 5
    assert off[15].item() == 15 and off[16].item() == 0 and off[-1].item() == 4
    slots = token_slots(torch.tensor([5, 9, 2]), 16, 37)
    assert slots[0].item() == 80 and slots[16].item() == 144 and slots[-1].item() == 36
    assert token_slots(torch.tensor([7]), 1, 1).tolist() == [7]


def test_plan_is_cached():
    assert plan_reads(spec(), 2, spec(), 4) is plan_reads(spec(), 2, spec(), 4)
