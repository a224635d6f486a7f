"""Transfer plans for state groups: which source rank's unit slices each destination rank reads.

The analogue of :func:`kvxfer.plan.plan_reads` for a :class:`~kvxfer.groups.state.StateSpec`.
Every section (conv part, SSM state) is sharded on its own (GDN's q/k follow the key heads, v
and the SSM the value heads; Mamba2's B and C may be replicated), so a read names one
:class:`~kvxfer.groups.state.UnitRun` per section: from one source rank a destination rank
reads at most one contiguous run of each section (the intersection of two rank ranges, or one
replicated unit), possibly empty. A unit that several source ranks hold (replicated) is read
from one of them: one the destination rank reads anyway for its other sections when there is
one, else the destination ranks spread over the replicas as for attention heads.

Notifications follow :func:`kvxfer.plan.plan_reads`: a destination notifies every source rank
it read, and a source rank nobody reads is notified by destination ``src_rank % dst_tp``, so
every source rank learns when it may free a request's state.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

from ..plan import RankPlan
from .state import StateSpec, UnitRun

__all__ = ["StatePlan", "StateRead", "plan_state_reads"]


class StateRead(NamedTuple):
    """What one destination rank reads from source rank ``src_rank``: one :class:`UnitRun` per
    section of the spec (conv parts in order, then the SSM state), ``num_units`` 0 where it
    reads nothing of that section. Pass ``runs`` to the state ops as they are."""

    src_rank: int
    runs: tuple[UnitRun, ...]

    @property
    def num_units(self) -> int:
        """Units read over every section."""
        return sum(r.num_units for r in self.runs)


@dataclass(frozen=True)
class StatePlan(RankPlan):
    """Who reads which units of a state group from whom (see the module doc); its reads are
    ordered by source rank."""

    src_tp: int
    dst_tp: int
    _reads: tuple[tuple[StateRead, ...], ...]
    _notify: tuple[tuple[int, ...], ...]
    _expected: tuple[int, ...]


def plan_state_reads(src_spec: StateSpec, dst_spec: StateSpec) -> StatePlan:
    """Plan moving a state group from a ``src_spec.tp_size``-rank engine to a
    ``dst_spec.tp_size``-rank one. Raises ``ValueError`` if the specs describe different models
    (kind, layers, conv parts, state length, SSM heads or head shape); TP size, conv layout, SSM
    order, page size and dtypes may differ. Cached: the same arguments again are a lookup."""
    if not isinstance(src_spec, StateSpec) or not isinstance(dst_spec, StateSpec):
        raise ValueError("plan_state_reads: src_spec and dst_spec must be StateSpecs")
    mismatch = src_spec.model_mismatch(dst_spec)
    if mismatch:
        raise ValueError(f"incompatible peer: {mismatch}")
    return _plan_cached(src_spec, dst_spec)


@functools.lru_cache(maxsize=256)
def _plan_cached(src_spec: StateSpec, dst_spec: StateSpec) -> StatePlan:
    src_tp, dst_tp = src_spec.tp_size, dst_spec.tp_size
    num_sections = src_spec.num_sections
    # per destination rank: source rank -> one [src_start, dst_start, n] per section
    per_dst: list[dict[int, list[list[int]]]] = [{} for _ in range(dst_tp)]
    holders = []  # per section: the source ranks holding each global unit
    for i, sec in enumerate(src_spec.sections):
        units_held: list[list[int]] = [[] for _ in range(sec.num_units)]
        for s in range(src_tp):
            for u in src_spec.units_of_rank(i, s):
                units_held[u].append(s)
        holders.append(units_held)
    for d in range(dst_tp):
        # the source ranks d reads anyway (units with one holder); a replicated unit is read
        # from one of those when it can, else the replicas are spread over destination ranks
        needed = {
            h[0]
            for i in range(num_sections)
            for u in dst_spec.units_of_rank(i, d)
            if len(h := holders[i][u]) == 1
        }
        for i, sec in enumerate(src_spec.sections):
            for local, u in enumerate(dst_spec.units_of_rank(i, d)):
                cands = [s for s in holders[i][u] if s in needed] or holders[i][u]
                s = cands[d % len(cands)]
                src_local = u - src_spec.units_of_rank(i, s).start
                runs = per_dst[d].setdefault(s, [[0, 0, 0] for _ in range(num_sections)])
                run = runs[i]
                if run[2] == 0:
                    run[0], run[1], run[2] = src_local, local, 1
                elif run[0] + run[2] == src_local and run[1] + run[2] == local:
                    run[2] += 1
                else:  # pragma: no cover - two rank ranges intersect in one interval
                    raise AssertionError(f"section {sec.name}: a second run from source rank {s}")
    all_reads = tuple(
        tuple(StateRead(s, tuple(UnitRun(*r) for r in runs)) for s, runs in sorted(reads.items()))
        for reads in per_dst
    )
    read_by: list[set[int]] = [set() for _ in range(src_tp)]
    for d, reads in enumerate(all_reads):
        for r in reads:
            read_by[r.src_rank].add(d)
    notify: list[set[int]] = [{r.src_rank for r in reads} for reads in all_reads]
    for s in range(src_tp):
        if not read_by[s]:  # nobody reads this rank, yet it holds the request's state
            notify[s % dst_tp].add(s)
    expected = tuple(sum(s in n for n in notify) for s in range(src_tp))
    return StatePlan(
        src_tp=src_tp,
        dst_tp=dst_tp,
        _reads=all_reads,
        _notify=tuple(tuple(sorted(n)) for n in notify),
        _expected=expected,
    )
