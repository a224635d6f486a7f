"""plan_state_reads (kvxfer.groups.state_plan): every destination unit of every section read
exactly once, from a source rank that holds it, at the right local offsets; replicas spread;
every source rank notified; mismatched models refused."""

from __future__ import annotations

import pytest
import torch

from kvxfer.groups import StatePlan, StateSpec, UnitRun, plan_state_reads


def gdn(tp, **kw):
    return StateSpec.gdn(num_layers=2, num_k_heads=12, num_v_heads=24, head_k_dim=4, head_v_dim=3, conv_kernel=4,
                         conv_dtype=torch.bfloat16, tp_size=tp, **kw)  # fmt: skip


def mamba2(tp, n_groups=1, **kw):
    return StateSpec.mamba2(num_layers=2, num_heads=12, head_dim=2, n_groups=n_groups, d_state=3, conv_kernel=4,
                            conv_dtype=torch.float32, tp_size=tp, **kw)  # fmt: skip


PAIRS = [(1, 1), (1, 2), (2, 1), (1, 4), (4, 1), (2, 3), (3, 2), (2, 4), (4, 2), (3, 4), (12, 1), (1, 12)]


def _check_cover(plan: StatePlan, src: StateSpec, dst: StateSpec) -> None:
    """Each destination rank gets each of its global units once, from a holder, in place."""
    for d in range(dst.tp_size):
        got: list[dict[int, int]] = [{} for _ in range(dst.num_sections)]
        for read in plan.reads(d):
            assert len(read.runs) == dst.num_sections
            for i, run in enumerate(read.runs):
                held = src.units_of_rank(i, read.src_rank)
                for k in range(run.num_units):
                    unit = held[run.src_start + k]
                    assert run.dst_start + k not in got[i], (d, i, run)
                    got[i][run.dst_start + k] = unit
        for i in range(dst.num_sections):
            assert got[i] == dict(enumerate(dst.units_of_rank(i, d))), (d, i)


@pytest.mark.parametrize("tps", PAIRS, ids=[f"{a}to{b}" for a, b in PAIRS])
@pytest.mark.parametrize("make", [gdn, mamba2], ids=["gdn", "mamba2_replicated"])
def test_every_unit_read_once_from_a_holder(make, tps):
    src, dst = make(tps[0]), make(tps[1], conv_layout="DS")
    plan = plan_state_reads(src, dst)
    _check_cover(plan, src, dst)
    assert plan.src_tp, plan.dst_tp == tps
    for s in range(src.tp_size):  # every source rank hears from the destination once per reader
        assert (
            plan.expected_notifications(s)
            == sum(s in plan.notify_targets(d) for d in range(dst.tp_size))
            >= 1
        )


def test_two_to_three_splits_the_middle_rank():
    plan = plan_state_reads(gdn(2), gdn(3))
    assert [r.src_rank for r in plan.reads(1)] == [0, 1]
    a, b = plan.reads(1)
    # q/k: 4 key heads per D rank, D rank 1 holds keys 4..7: 2 from P rank 0 (local 4, 5), 2 from P 1 (0, 1)
    assert a.runs[0] == UnitRun(4, 0, 2) and b.runs[0] == UnitRun(0, 2, 2)
    assert a.runs[3] == UnitRun(8, 0, 4) and b.runs[3] == UnitRun(0, 4, 4)  # SSM: value heads 8..15
    assert plan.readers_of(0) == [0, 1] and plan.readers_of(1) == [1, 2]
    assert a.num_units == 2 + 2 + 4 + 4


def test_replicated_groups_spread_over_replicas():
    """n_groups=1: P TP 4 holds the group 4 times; D TP 1 reads it once (from rank 0), D TP 2's
    ranks read x and the SSM from two P ranks each and the group from one of those."""
    plan = plan_state_reads(mamba2(4), mamba2(1))
    groups = [(r.src_rank, r.runs[1].num_units) for r in plan.reads(0)]
    assert groups == [(0, 1), (1, 0), (2, 0), (3, 0)]
    plan = plan_state_reads(mamba2(4), mamba2(2))
    assert [(r.src_rank, r.runs[1]) for r in plan.reads(1)] == [(2, UnitRun(0, 0, 0)), (3, UnitRun(0, 0, 1))]
    assert [r.src_rank for r in plan.reads(0)] == [0, 1]  # no read of a rank for its group alone
    # D TP 4 from P TP 1: every D rank reads the one group from P's only rank
    plan = plan_state_reads(mamba2(1), mamba2(4))
    assert all(plan.reads(d)[0].runs[1] == UnitRun(0, 0, 1) for d in range(4))
    assert plan.expected_notifications(0) == 4


def test_every_source_rank_is_read_and_notified():
    """x/v heads and the SSM are sharded, never replicated, so every source rank is read by
    someone, and is notified by exactly its readers (P TP 12 into D TP 1: all 12)."""
    plan = plan_state_reads(mamba2(12), mamba2(1))
    assert plan.notify_targets(0) == list(range(12))
    assert all(plan.expected_notifications(s) == 1 and plan.readers_of(s) == [0] for s in range(12))


def test_refusals():
    with pytest.raises(ValueError, match="incompatible peer: kind differs"):
        plan_state_reads(gdn(1), mamba2(1))
    with pytest.raises(ValueError, match="incompatible peer: state_len differs"):
        plan_state_reads(gdn(1), gdn(1, num_speculative_tokens=1))
    with pytest.raises(ValueError, match="must be StateSpecs"):
        plan_state_reads(gdn(1), "x")
    plan = plan_state_reads(gdn(2), gdn(1))
    for call, match in [
        (lambda: plan.reads(1), r"dst_rank: must be in \[0, 1\)"),
        (lambda: plan.expected_notifications(2), r"src_rank: must be in \[0, 2\)"),
        (lambda: plan.readers_of(-1), "src_rank"),
        (lambda: plan.notify_targets(True), "dst_rank"),
    ]:
        with pytest.raises(ValueError, match=match):
            call()


def test_plans_are_cached():
    assert plan_state_reads(gdn(2), gdn(3)) is plan_state_reads(gdn(2), gdn(3))
