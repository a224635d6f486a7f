"""A peer as the one-sided mode reads it (:class:`Target`, made once per ipc session by
:func:`make_target`): its source ranks' lease-slot tables, mappings and prepared copies, and the
two table steps of a one-sided load over all of them: :meth:`Target.read` (the params' ids
checked, the binding, each source rank's slot found and its blocks' epochs snapshotted) and
:meth:`Target.land` (after the copy: each source rank's slot and epochs checked, then the done
marks). Each step is one native call (``onesided_read`` / ``onesided_land`` of
``csrc/ctl/onesided_reads.h``) when every table view takes the native module, else a step per
view (:mod:`kvxfer.transports.ipc.slots`). The protocol and what each word read from a table may
be are in ``slots``'s docstring; :mod:`kvxfer.transports.ipc.onesided` says when a load reads
one-sided.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from ... import idops, ops
from ...transfer import Route
from . import slots
from .cma import Direct
from .direct import direct_target
from .session import IpcMap, IpcSession, whole_copies
from .slots import SlotView

if TYPE_CHECKING:  # pragma: no cover
    from ...params import KVTransferParams
    from ...peer import Peer
    from ...plan import Read
    from ...rank import Rank

__all__ = ["STALE_S", "Source", "Target", "make_target", "stale_ns"]

STALE_S = 2.0  # an exporter that has not beat for this long is not read one-sided (it beats every 20 ms)
_STALE_NS = int(STALE_S * 1e9)


def stale_ns() -> int:
    """:data:`STALE_S` in ns, as this module's checks use it now (what a ``LoadBook`` made now
    checks against)."""
    return _STALE_NS


class Source(NamedTuple):
    """One source rank as the one-sided mode reads it: its rank, lease-slot table, mapping, the
    plan's reads of it and their route; and for a whole load (no tokens held here) per read a
    :class:`~kvxfer.ops.PreparedCopy` between the whole-block views with its wire bytes per
    token, and both sides' id bounds."""

    rank: int
    view: SlotView
    mapping: IpcMap
    reads: list[Read]
    route: Route
    whole: list[tuple[ops.PreparedCopy, int]]
    src_bound: int
    dst_bound: int
    bounded: bool  # every prepared copy takes ids within these bounds as they are (run_bounded)


class Target:
    """A peer as the one-sided mode reads it, made once per session (when every source rank is
    mapped): its :class:`Source` s, where a landed load marks done (per exporter rank this rank
    notifies: its slot table and the index of its source, or -1 when it is only notified) and
    whether every rank it notifies has a table, the binding function, and the wire bytes of one
    token over every read."""

    __slots__ = (
        "bind",
        "ctl",
        "direct",
        "epochs",
        "lane",
        "mark_tables",
        "marks",
        "marks_all",
        "peer",
        "per_token",
        "plain",
        "remote",
        "session",
        "sources",
        "tables",
    )

    def __init__(
        self,
        peer: Peer,
        session: IpcSession,
        sources: list[Source],
        marks: list,
        direct: Direct | None = None,
        grouped: bool = False,
    ) -> None:
        self.peer = peer
        self.session = session
        self.sources = sources
        self.marks = marks
        self.marks_all = len(marks) == len(peer.notify_to)  # a table of every rank it notifies
        self.bind = slots.binder()  # slots.binding, native when the module is in use
        # The native module's reads and marks over every source rank in one call each
        # (csrc/ctl/onesided_reads.h) when every view takes native steps; None: per view.
        views = [src.view for src in sources] + [view for view, _ in marks]
        self.ctl = views[0].ctl if all(v.ctl is not None for v in views) else None
        self.tables = tuple(src.view.t for src in sources)
        self.epochs = tuple(src.mapping.epochs_np for src in sources)
        self.mark_tables = tuple((view.t, k) for view, k in marks)
        self.per_token = sum(pt for src in sources for _, pt in src.whole)
        self.direct = direct  # cross-memory attach straight into this rank's caches (.direct)
        self.remote = any(src.mapping.remote is not None for src in sources)  # read into mirrors
        # A lone whole load's copies when nothing else applies (no cross-memory attach, no
        # groups, no mirrors, every prepared copy taking the checked ids as they are): the copy
        # runs them itself (kvxfer.transports.ipc.copies). None: the general path.
        plain = direct is None and not grouped and not self.remote and all(src.bounded for src in sources)
        self.plain = tuple(c for src in sources for c, _ in src.whole) if plain else None
        # What the native lane reads a load through (LoadBook.begin, csrc/ctl/load_lane.h), set
        # by the one-sided mode when it may (``OneSided._target``); None: the Python path.
        self.lane: tuple | None = None

    # --------------------------------------------------------------------------- read
    def read(
        self, p: KVTransferParams, ids: np.ndarray, now_ns: int, need_ns: int, counted: bool
    ) -> tuple[tuple[int, int], tuple] | str:
        """The lookup of a load of params ``p`` (their ids ``ids``, int64): the ids' count
        (``counted``: a load of one group; the groups' counts were checked by their items) and
        bound, the binding, each source rank's slot read while the exporter beat within
        ``STALE_S`` of ``now_ns`` and leased past ``need_ns``; ``((b0, b1), reads)`` (per source
        rank ``(slot, generation, snapshot)``) or why not (the messaged path then loads it,
        naming a bad params' problem)."""
        ctl, peer = self.ctl, self.peer
        if ctl is not None and counted:  # the checks, the binding and every read in one call
            got = ctl.onesided_read(
                self.tables, self.epochs, ids, p.num_tokens, peer.spec.block_size, peer.num_blocks,
                p.token, p.digest(), p.request_id, now_ns, _STALE_NS, need_ns,
            )  # fmt: skip
            if type(got) is int:
                return self._refused(got)
            return (got[0], got[1]), got[2]
        if counted and ids.size != peer.spec.num_blocks_for(p.num_tokens):
            return "bad params"
        if idops.max_id(ids) >= peer.num_blocks:
            return "bad params"
        try:
            b0, b1 = self.bind(p.token, p.digest(), p.request_id)
        except ValueError:
            return "bad params"  # a token not ASCII
        reads = []
        for src in self.sources:
            got = src.view.read(b0, b1, now_ns, _STALE_NS, need_ns, src.mapping.epochs_np, ids)
            if type(got) is str:
                return got
            reads.append(got)
        return (b0, b1), tuple(reads)

    def _refused(self, code: int) -> str:
        """Why ``onesided_read`` refused (its code | source index << 4), as the views say it."""
        why = slots.READ_REFUSALS[code & 15]
        if why is slots.BAD_WORD:
            self.sources[code >> 4].view.bad("a slot's generation out of range")
        return why

    # --------------------------------------------------------------------------- land
    def land(
        self,
        ids: np.ndarray,
        reads: tuple,
        binding: tuple[int, int],
        loader_rank: int,
        loader_tp: int,
        now_ns: int,
        hook: Callable | None = None,
    ) -> tuple[str, bool]:
        """The check after a completed copy of what :meth:`read` returned (``reads`` of the ids
        ``ids`` under ``binding``), and when it landed, the done marks of loader rank
        ``loader_rank`` of a ``loader_tp``-rank engine: ``("", marked)`` (``marked``: every
        exporter rank it notifies counts a mark) or ``(why not, False)``. ``hook``: a test's,
        called with each source rank's epochs before its check (a step per view then)."""
        ctl = self.ctl
        if ctl is not None and not hook:
            got = ctl.onesided_land(
                self.tables, self.epochs, ids, reads, self.mark_tables, *binding,
                loader_rank, loader_tp, now_ns, _STALE_NS,
            )  # fmt: skip
            return self.outcome(got, now_ns)
        for src, (slot, gen, snap) in zip(self.sources, reads):
            if hook:
                hook(src.mapping.epochs)
                now_ns = time.monotonic_ns()
            got = src.view.check(slot, gen, src.mapping.epochs_np, ids, snap, now_ns, _STALE_NS)
            if got:
                return _failed(src, got, now_ns), False
        marked = self.marks_all
        for view, k in self.marks:
            i, g = (reads[k][0], reads[k][1]) if k >= 0 else view.find(*binding)
            if i < 0 or not view.mark_done(i, g, loader_rank, loader_tp):
                marked = False
        return "", marked

    def outcome(self, got: int, now_ns: int) -> tuple[str, bool]:
        """What ``onesided_land``'s answer ``got`` (checked at ``now_ns``) means, as :meth:`land`
        returns it: ``("", marked)`` or ``(why not, False)``; a word out of range is logged
        once per view."""
        if not got:
            return "", self.marks_all
        code = got & 15
        if code == 3:  # landed; a rank not marked (it is notified now)
            view = self.marks[got >> 6][0]  # the first whose table had a word out of range
            if got & 16:
                view.bad("a slot's generation out of range")
            if got & 32:
                view.bad("a done count out of range")
            return "", False
        return _failed(self.sources[got >> 4], code, now_ns), False


def _failed(src: Source, got: int, now_ns: int) -> str:
    """Why a load whose copy completed did not land: source rank ``src``'s check said 1
    (released) or 2 (the exporter stopped)."""
    # released first: an exporter that closed released every export before it shut, so that is
    # what happened to the blocks (the messaged path says the same)
    if got == 1:
        return f"exporter rank {src.rank}: blocks released before or during the copy (lease ended); not delivered"
    # nothing released, but the exporter stopped beating (killed, hung) or closed
    why = src.view.alive(_STALE_NS, now_ns) or (  # read again: alive by now
        "closed or no heartbeat when checked after the copy, alive when read again "
        "(a word of its lease-slot table was overwritten meanwhile?)"
    )
    return f"exporter rank {src.rank}: {why}"


def make_target(rank: Rank, peer: Peer) -> Target | None:
    """What a one-sided read of ``peer`` needs, made once per session by this loader rank (None
    while a source rank is not mapped yet, or its table is of another start of that rank)."""
    session = peer.session
    views = session.slot_views
    sources = []
    for s in peer.src_ranks:
        v, m = views[s], session.mapped(s)
        if v is None or m is None or not v.of(peer.replies[s].incarnation):
            return None
        reads = peer.reads_by_rank[s]
        whole, src_bound, dst_bound, bounded = whole_copies(rank, peer, m, reads)
        route = Route(reads, m.views.units, rank.units)
        sources.append(Source(s, v, m, reads, route, whole, src_bound, dst_bound, bounded))
    ranks = [src.rank for src in sources]
    marks = [
        (views[s], ranks.index(s) if s in ranks else -1)
        for s in peer.notify_to
        if s < len(views) and views[s] is not None
    ]
    return Target(
        peer,
        session,
        sources,
        marks,
        direct_target(rank, peer, [(src.mapping, src.reads) for src in sources]),
        rank.groups is not None,
    )
