"""The copies of one-sided loads (:mod:`kvxfer.transports.ipc.onesided`), made in the caller's
thread under the session's lock once the loads were looked up (:meth:`Target.read
<kvxfer.transports.ipc.target.Target.read>`): the ways a :class:`~kvxfer.transports.ipc.target.Target`
moves a batch of loads into this rank's caches, and their wire bytes.

In order of preference: a lone whole load through the target's prepared copies (the ids
``load()`` checked, taken as they are); cross-memory attach straight into this rank's caches
when the loads move whole blocks; per KV cache group; else (the source ranks' blocks read into
their mirrors first, when they are remote) through the prepared copies, or planned by the load
planner as the messaged path plans a batch (``plan``: :meth:`kvxfer.planner.Planner.plan`).
The native lane's loads held for a batch (:class:`HeldLoad`) are such loads too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ... import ops
from ...engine_types import LoadItem, disjoint_blocks
from ...transfer import Transfer
from .direct import direct_fits, read_direct
from .session import fetched
from .target import Target

if TYPE_CHECKING:  # pragma: no cover
    from ...rank import Rank

__all__ = ["HeldLoad", "copy_loads", "moved"]


class HeldLoad:
    """A load of the native lane (``LoadBook.begin``) held for its batch's launch, as the batch
    planner's item (:class:`kvxfer.batching.Item`: ``src``, ``dst``, ``num_tokens``, ``skip``,
    ``first``): its target, request id, the ids ``begin`` checked (source, destination: int64
    arrays of exactly the blocks of ``num_tokens``), its deadline, and the params' request id
    and token (its notification, should the launch fail)."""

    __slots__ = ("deadline", "dst", "num_tokens", "prid", "request_id", "src", "target", "token")

    first = 0  # a whole load
    skip = 0

    def __init__(
        self, target: Target, request_id: str, src: np.ndarray, dst: np.ndarray, num_tokens: int,
        deadline: float, prid: str, token: str,
    ) -> None:  # fmt: skip
        self.target, self.request_id, self.src, self.dst = target, request_id, src, dst
        self.num_tokens, self.deadline, self.prid, self.token = num_tokens, deadline, prid, token

    @property
    def block_ids(self) -> np.ndarray:
        return self.dst


def copy_loads(t: Target, rank: Rank, plan: Callable, items: list[LoadItem]) -> tuple[int, bool]:
    """The copies of ``items`` from ``t``'s source ranks into loader rank ``rank``'s caches (under
    the session's lock, on the load stream): ``(ops calls, whether by cross-memory attach
    straight into the caches)``."""
    plain = t.plain
    if plain is not None and len(items) == 1 and not items[0].first:  # _copy_whole, fewer hops
        it = items[0]
        for copy in plain:
            copy.run_bounded(it.src, it.dst, it.num_tokens)  # >= 1: a load moves a token
        return len(plain), False
    if t.direct is not None and direct_fits(rank, items):
        return read_direct(t.direct, rank, items), True
    if rank.groups is not None:  # fetched per group (its blocks, its layers)
        return _copy_groups(t, rank, plan, items), False
    if not t.remote:
        return _copy_mapped(t, rank, plan, items), False
    with contextlib.ExitStack() as fetch:  # cross-memory attach: the blocks read into the mirrors
        for src in t.sources:
            if src.mapping.remote is not None:
                fetch.enter_context(fetched(src.mapping, items))
        return _copy_mapped(t, rank, plan, items), False


def _copy_mapped(t: Target, rank: Rank, plan: Callable, items: list[LoadItem]) -> int:
    """:func:`copy_loads` of loads whose source blocks are mapped here (or read into mirrors)."""
    if len(items) == 1 and not items[0].first:
        return _copy_whole(t, items[0])
    session = t.session
    distinct = len(items) == 1 or disjoint_blocks(items, rank.spec.block_size)
    sbs = t.peer.spec.block_size
    calls = 0
    for src in t.sources:
        bp = plan(src.route, sbs, items, distinct)
        xfer = Transfer(src.rank, src.reads, bp, items, None, items[0].deadline)
        calls += session.copy(src.mapping, xfer)
    return calls


def _copy_groups(t: Target, rank: Rank, plan: Callable, items: list[LoadItem]) -> int:
    """The copies of loads of an engine with KV cache groups: per source rank and group
    (cross-memory attach: its blocks of its layers fetched first), the group's items planned
    over its layers as the messaged path plans them, a re-sharded state group's units copied
    (:meth:`IpcSession.copy_units <kvxfer.transports.ipc.session.IpcSession.copy_units>`);
    returns the ops calls."""
    session, gs = t.session, rank.groups
    routes = t.peer.state_routes
    distinct = len(items) == 1 or disjoint_blocks(items, rank.spec.block_size)
    sbs = t.peer.spec.block_size
    calls = 0
    for src in t.sources:
        for g, grp in enumerate(gs.groups):
            sub = [it.groups[g] for it in items]
            layers = list(grp.layers)
            state = routes.get(g)
            if state is not None and src.rank not in state.runs:
                continue
            with fetched(src.mapping, items, layers, np.concatenate([it.src for it in sub])):
                if state is not None:
                    session.copy_units(src.mapping, src.rank, grp, state, sub, layers)
                    calls += 1
                    continue
                bp = plan(src.route, sbs, sub, distinct)
                xfer = Transfer(src.rank, src.reads, bp, items, layers, items[0].deadline)
                calls += session.copy(src.mapping, xfer)
    return calls


def _copy_whole(t: Target, item: LoadItem) -> int:
    """The copies of a whole load (every block, no tokens held here) through each source's
    prepared copies; returns the ops calls. Its ids were checked at ``load()``: exactly the
    blocks its tokens fill on each side, in range, the destination's without repeats."""
    n = item.num_tokens
    calls = 0
    for src in t.sources:
        if src.bounded:
            for copy, _ in src.whole:
                copy.run_bounded(item.src, item.dst, n)  # n >= 1: a load moves at least one token
        else:
            src_ids = ops.CheckedIds(item.src, src.src_bound, False)
            dst_ids = ops.CheckedIds(item.dst, src.dst_bound, True)
            for copy, _ in src.whole:
                copy.run(src_ids, dst_ids, n)
        calls += len(src.whole)
    return calls


def moved(t: Target, rank: Rank, item: LoadItem) -> int:
    """Wire bytes of a load: its tokens over every read, or per group over its layers."""
    if item.groups is None:
        return (item.num_tokens - item.first) * t.per_token
    per_layer = t.per_token // max(1, rank.spec.num_layers)
    out = 0
    for g, (grp, sub) in enumerate(zip(rank.groups.groups, item.groups)):
        state = t.peer.state_routes.get(g)
        if state is not None:
            out += sum(state.nbytes(len(grp.layers), 1, src.rank) for src in t.sources)
        else:
            out += (sub.num_tokens - sub.first) * per_layer * len(grp.layers)
    return out
