"""The load planner: how a batch of loads moves from one source rank, and which of them landed.

One planner serves every transport (:meth:`Planner.read`), after it checked a batch's params
against the peer (:meth:`Planner.check`). A lone whole load (every layer, no groups, nothing
held here) goes to the session's ``start_whole`` first, which moves it with nothing planned
where it can. Else, for each
:class:`~kvxfer.transfer.Route` a peer's session names for the source rank, it plans the batch
into ops calls once (:func:`kvxfer.batching.plan_batch`, in the units the route allows), hands
them to the session as a :class:`~kvxfer.transfer.Transfer` and waits for its completion. A
stream the exporter refused for some loads is asked again without them (each refusal drops at
least one: bounded). Then the transport's record decides: after a one-sided read (``ipc``,
``nixl`` direct) the source's block epochs against the lease grant's snapshot
(:func:`stale_loads`: a block released before or during the copy fails its load, never
delivered); after a stream (``pg``, ``nixl`` staged) the exporter's status. A load lands only
by that record, in every route.
"""

from __future__ import annotations

import numpy as np

from . import idops
from .batching import BatchPlan, Item, plan_batch, wire_bytes
from .engine_types import LoadItem, disjoint_blocks, loaded_twice, time_left
from .grouped import group_items
from .groups.state_group import StateLanding
from .metrics import now
from .peer import Peer
from .plan import Read
from .rank import Rank, Runtime
from .transfer import Outcome, Route, Transfer

__all__ = ["Planner", "stale_loads"]


class Planner:
    """Plans and checks the loads of one loader rank (see the module doc)."""

    def __init__(self, rank: Rank, rt: Runtime) -> None:
        self.rank = rank
        self.rt = rt

    def check(
        self, peer: Peer, items: list[LoadItem]
    ) -> tuple[list[LoadItem], list[str], list[str], list[bytes], list[tuple[LoadItem, str]]]:
        """The loads whose params fit ``peer`` (their ids as many as the exporter's block size
        needs and in its range, no params twice; an engine with groups: each load given its
        planner items, one per group), with their remote request ids, tokens and content
        digests (what a lease request carries); and ``(load, why)`` of the others."""
        good: list[LoadItem] = []
        rids: list[str] = []
        toks: list[str] = []
        digests: list[bytes] = []
        bad: list[tuple[LoadItem, str]] = []
        seen: set[str] = set()
        num_blocks = peer.num_blocks
        gs = self.rank.groups
        for it in items:
            p = it.params
            need = peer.spec.num_blocks_for(p.num_tokens) if gs is None else it.src_ids.size
            why = "" if gs is None else self._group_items(peer, it)
            if why:
                bad.append((it, why))
            elif it.src_ids.size != need:
                bad.append((it, f"params.block_ids: has {it.src_ids.size} ids, num_tokens needs {need}"))
            elif idops.max_id(it.src_ids) >= num_blocks:  # read as unsigned: bounds both ends
                bad.append((it, f"params.block_ids: out of the exporter's range [0, {num_blocks})"))
            elif p.request_id in seen:
                bad.append((it, loaded_twice(p.request_id)))
            else:
                seen.add(p.request_id)
                good.append(it)
                rids.append(p.request_id)
                toks.append(p.token)
                digests.append(p.digest())
        return good, rids, toks, digests, bad

    def _group_items(self, peer: Peer, it: LoadItem) -> str:
        """Give a load of an engine with KV cache groups its planner items, one per group
        (:func:`kvxfer.grouped.group_items`, with the exporter's block size); why not, or ""."""
        p = it.params
        got = group_items(
            self.rank.groups, it.request_id, it.src_ids, p.groups, p.num_tokens, it.group_dst,
            peer.spec.block_size, self.rank.spec.block_size, peer.state_routes,
        )  # fmt: skip
        if type(got) is str:
            return got
        it.groups = got
        return ""

    def plan(self, route: Route, src_block_size: int, loads: list[LoadItem], distinct: bool) -> BatchPlan:
        """The ops calls of ``loads`` along ``route`` (source blocks of ``src_block_size``
        tokens); ``distinct``: no local block is written by two of them
        (:func:`kvxfer.engine_types.disjoint_blocks`)."""
        bs = self.rank.spec.block_size
        return plan_batch(loads, src_block_size, route.src_units, bs, route.dst_units, distinct=distinct)

    def read(
        self,
        peer: Peer,
        s: int,
        loads: list[LoadItem],
        granted: dict[str, bytes],
        deadline: float,
        layers: list[int] | None = None,
    ) -> tuple[int, set[str], dict[str, str]]:
        """Move the plan's reads of source rank ``s`` (``layers``, default all) for ``loads``
        through ``peer``'s session (``granted``: local id -> the grant's epochs, native int64
        bytes), recorded in the metrics (one batch: its span, wire bytes and ops calls). Returns
        (wire bytes moved, the local ids that landed by the transport's record in every route,
        local id -> why for the loads that did not); errors raise, with nothing recorded."""
        t0 = now()
        rank = self.rank
        session = peer.session
        if session is None:
            raise RuntimeError(f"{peer.transport}: no session with {peer.engine_id} (forgotten meanwhile)")
        if len(loads) == 1 and layers is None and rank.groups is None and not loads[0].first:
            got = session.start_whole(s, loads[0], deadline)
            if got is not None:  # one whole load the session moves with nothing to plan
                return self._whole(got, s, loads, granted, deadline, t0)
        sbs = peer.spec.block_size
        distinct = len(loads) == 1 or disjoint_blocks(loads, rank.spec.block_size)
        bad: dict[str, str] = {}
        landed: set[str] | None = None
        moved = saved = calls = 0
        for route in session.routes(s, peer.reads_by_rank[s]):
            todo = [it for it in loads if it.request_id not in bad] if bad else loads
            while todo:
                out, plans, extra = self._start(peer, route, s, sbs, todo, distinct, layers, deadline)
                moved += extra
                if out.refused:
                    before = len(bad)
                    bad.update(out.refused)
                    if len(bad) == before:  # a refusal that names none of them: no progress
                        why = f"exporter rank {s} refused the send request: {out.refused}"
                        bad.update(dict.fromkeys([it.request_id for it in todo], why))
                    todo = [it for it in todo if it.request_id not in bad]
                    continue  # each refusal drops at least one load: bounded
                calls += out.calls
                if out.calls or out.landed:  # else nothing moved (a pair that could not be made)
                    for bp, lay in plans:
                        for r in route.reads:
                            m, sk = wire_bytes(rank.spec, bp, r.num_heads, lay)
                            moved, saved = moved + m, saved + sk
                if out.failed:
                    bad.update(out.failed)
                if out.epochs is not None:
                    stale = stale_loads(out.epochs, todo, granted, s)
                    if stale:
                        bad.update(stale)
                landed = set(out.landed) if landed is None else landed & out.landed
                break
            else:
                landed = set()  # every load of this route was refused
        self.rt.metrics.record_batch(t0, now(), moved, calls, saved)
        if landed is None:
            return moved, set(), bad
        return moved, landed - bad.keys() if bad else landed, bad

    def _whole(
        self, got: tuple, s: int, loads: list[LoadItem], granted: dict[str, bytes], deadline: float, t0: float
    ) -> tuple[int, set[str], dict[str, str]]:
        """:meth:`read`'s record of a load :meth:`~kvxfer.transfer.Session.start_whole` started
        (``got``: its completion and wire bytes): the same checks of the outcome as a planned
        transfer's."""
        done, moved = got
        out = done.wait(deadline)
        bad = {**out.failed, **out.refused}  # refused: none moves unplanned, but none lands either
        if out.epochs is not None:
            bad.update(stale_loads(out.epochs, loads, granted, s))
        self.rt.metrics.record_batch(t0, now(), moved, out.calls)
        return moved, out.landed - bad.keys() if bad else out.landed, bad

    def _start(
        self,
        peer: Peer,
        route: Route,
        s: int,
        sbs: int,
        todo: list[LoadItem],
        distinct: bool,
        layers: list[int] | None,
        deadline: float,
    ) -> tuple[Outcome, list[tuple[BatchPlan, list[int] | None]]]:
        """Move ``todo`` along ``route`` and wait: one transfer, or for an engine with KV cache
        groups (:mod:`kvxfer.grouped`) one per group (its layers, its items), their outcomes
        merged: a load landed only if it landed in every group, failed or refused if it was in
        any; the epochs are the last group's (read after every earlier copy). A state group
        that re-shards (``peer.state_routes``) is one unit-wise copy of the session's
        (``move_state``) instead of a planned transfer. Returns the outcome, each transfer's
        (plan, layers) and the bytes of the unit-wise copies."""
        session = peer.session
        if self.rank.groups is None:
            bp = self.plan(route, sbs, todo, distinct)
            out = session.start(Transfer(s, route.reads, bp, todo, layers, deadline)).wait(deadline)
            return out, [(bp, layers)], 0
        plans = []
        landed: set[str] | None = None
        failed: dict[str, str] = {}
        refused: dict[str, str] = {}
        epochs = None
        calls = extra = 0
        want = None if layers is None else set(layers)
        for g, grp in enumerate(self.rank.groups.groups):
            lay = list(grp.layers) if want is None else [x for x in grp.layers if x in want]
            if not lay:
                continue
            items = [it.groups[g] for it in todo]
            state = peer.state_routes.get(g)
            if state is not None:
                if s not in state.runs:
                    continue  # this source rank holds none of this rank's units
                if hasattr(session, "move_state"):  # ipc: straight from the mapped pages
                    out = session.move_state(s, grp, state, items, todo, lay, deadline).wait(deadline)
                    extra += state.nbytes(len(lay), len(items), s)
                else:
                    out, nbytes = self._staged_state(peer, s, grp, state, items, todo, lay, deadline)
                    extra += nbytes
            else:
                bp = self.plan(route, sbs, items, distinct)
                blocks = np.concatenate([it.src for it in items])
                out = session.start(Transfer(s, route.reads, bp, todo, lay, deadline, None, blocks)).wait(
                    deadline
                )
                plans.append((bp, lay))
            landed = set(out.landed) if landed is None else landed & out.landed
            failed.update(out.failed)
            refused.update(out.refused)
            calls += out.calls
            if out.epochs is not None:
                epochs = out.epochs
            if refused:
                break  # planned again without the refused loads
        return Outcome(landed or set(), failed, refused, epochs, calls), plans, extra

    def _staged_state(self, peer: Peer, s: int, grp, state, items, todo, lay: list[int], deadline: float):
        """A re-sharded state group over a staged transport: source rank ``s``'s whole state
        pages of ``items`` streamed into a :class:`~kvxfer.groups.state_group.StateLanding` laid
        out as that rank's, then this rank's units copied out of it into its own pages
        (:func:`~kvxfer.groups.state_ops.copy_state`) for the loads the stream's status says
        landed. Returns the outcome and the bytes streamed."""
        rank = self.rank
        pspec, n = peer.spec, len(items)
        pbs, heads = pspec.block_size, pspec.heads_per_rank(peer.tp_size)
        landing = StateLanding(pspec, peer.tp_size, grp.layers, n, rank.device)
        whole = [
            Item(it.request_id, it.src, np.array([j], dtype=np.int64), pbs) for j, it in enumerate(items)
        ]
        bp = plan_batch(whole, pbs, [pbs], pbs, [pbs], distinct=True)
        read = Read(s, 0, 0, heads)
        out = peer.session.start(Transfer(s, [read], bp, todo, lay, deadline, landing)).wait(deadline)
        got = [j for j, it in enumerate(items) if it.request_id in out.landed]
        if got:
            state.copy(
                s, landing.pages(), got, rank.caches, grp.layers, [int(items[j].dst[0]) for j in got], lay
            )
            self.rt.order.wait_done(time_left(deadline))  # CUDA: the copies ran
        return out, pspec.bytes_per_token(heads, len(lay)) * pbs * n


def stale_loads(ep: np.ndarray, loads, granted: dict[str, bytes], s: int) -> dict[str, str]:
    """The check after a one-sided read: loads whose source blocks' epochs in ``ep`` (read after
    the copy) moved since the grant's snapshot (``granted``: local id -> the grant's epochs,
    native int64 bytes) -> why (source rank ``s``).

    An exporter bumps a block's epoch when no live export holds it any more (released,
    aborted, lease ended, engine closed), and epochs only grow: a block released before or
    during the read shows a moved epoch, and its load is failed, never delivered (one check
    after the copy also catches a release between the grant and the copy)."""
    if len(loads) == 1:  # one load: one compare, no lists
        it = loads[0]
        g = granted[it.request_id]
        if len(g) == 8 * it.src_ids.size and idops.unchanged(ep, it.src_ids, g):
            return {}
    why = f"exporter rank {s}: blocks released before or during the copy (lease ended); not delivered"
    out: dict[str, str] = {}
    ids_list, snaps, checked = [], [], []
    for it in loads:
        ids = it.src_ids
        g = granted[it.request_id]
        if len(g) != 8 * ids.size:  # the exporter grants only params naming its export's ids
            out[it.request_id] = f"exporter rank {s}: the grant covers other blocks than the params'"
            continue
        ids_list.append(ids)
        snaps.append(g)
        checked.append(it.request_id)
    for i in idops.moved(ep, ids_list, snaps) if checked else ():
        out[checked[i]] = why
    return out
