"""The ``ipc`` transport's session with one peer: the exporter ranks' caches and epochs mapped in
this process (shared memory on CPU, CUDA IPC on a GPU), their lease-slot tables, and the
copies straight out of them.

A transfer (:class:`~kvxfer.transfer.Transfer`) is one fused ``copy_blocks`` per ops call of its
plan and head slice, from the mapped caches into this rank's, on the current stream (CUDA:
queued, not waited for); a lone whole load (:meth:`IpcSession.start_whole`) one whole-block copy
per head slice with nothing planned. A completion's outcome carries the exporter's epochs read
after the copy, which the planner checks against the grant (:func:`kvxfer.planner.stale_loads`).
The same copies serve the one-sided mode (:mod:`kvxfer.transports.ipc.onesided`), which reads the
lease slots instead of asking for a grant. A source rank is mapped on its first transfer.

Closing the session (its peer was forgotten) unmaps everything, unless a one-sided copy may
still read a mapping: then the mappings stay until those copies completed
(:meth:`IpcSession.idle`; the transport unmaps it later, :mod:`kvxfer.transports.ipc.transport`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from ... import ops
from ...engine_types import time_left
from ...groups.state_group import page_view
from ...ordering import event_done
from ...prepared import prepared_copy
from ...tracing import items_tag, trace
from ...transfer import Outcome, Route, Transfer
from ...views import CacheViews
from . import offer
from .cma import Remote
from .mappers import mapper
from .slots import SlotView

if TYPE_CHECKING:  # pragma: no cover
    from ...engine_types import LoadItem
    from ...peer import Peer
    from ...rank import Rank, Runtime

__all__ = ["IpcCompletion", "IpcMap", "IpcSession", "fetched", "map_rank", "whole_copies"]

_POOL_MAX = 64  # completion events kept for reuse
_BUSY_PRUNE = 16  # events kept before the completed ones are dropped
_INT64 = np.dtype(np.int64)
_COPIES_MAX = 256  # call shapes whose prepared copies are kept (offset views come and go)


def _fits(ids: np.ndarray, need: int) -> bool:
    """Whether ``ids`` is what a bounded copy reads in place: C-contiguous int64, at least
    ``need`` of them."""
    return ids.dtype is _INT64 and ids.flags.c_contiguous and ids.size >= need


class IpcMap(NamedTuple):
    """An exporter rank's caches and epoch array, mapped in this process."""

    views: CacheViews  # the exporter's caches, registered in each unit
    epochs: torch.Tensor  # int64 [num_blocks], the exporter's, shared
    epochs_np: np.ndarray  # a numpy view of it (made once, not per read)
    handles: list  # for offer.detach
    remote: Remote | None = None  # "cma": the caches are mirrors, filled before each copy


def map_rank(peer: Peer, s: int, device: torch.device) -> IpcMap:
    """Map source rank ``s`` of ``peer`` (its handshake's ``ipc`` entry) in this process."""
    caches, ep, handles = offer.attach(peer.replies[s].ipc, device)
    try:
        views = CacheViews(caches, peer.spec)
        # the ids a grant or a slot opens are checked against the handshake's block count:
        # what the exporter maps must hold that many (a read past it would be out of bounds)
        if ep.numel() != peer.num_blocks or views.num_blocks < peer.num_blocks:
            raise ValueError(
                f"ipc: exporter rank {s} maps {ep.numel()} block epochs and caches of "
                f"{views.num_blocks} blocks, its handshake says {peer.num_blocks} blocks"
            )
    except BaseException:
        offer.detach(handles)
        raise
    remote = handles[0][1] if isinstance(handles[0][1], Remote) else None
    return IpcMap(views, ep, ep.numpy(), handles, remote)


def whole_copies(rank: Rank, peer: Peer, m: IpcMap, reads: list) -> tuple[list, int, int, bool]:
    """Per read of ``reads`` (a source rank's, mapped as ``m``) a prepared copy between the
    whole-block views of both sides with its wire bytes per token; how many ids address each
    side's blocks; and whether every copy takes ids below those bounds as they are
    (:meth:`~kvxfer.prepared.PreparedCopy.takes`: then :meth:`~kvxfer.prepared.PreparedCopy.run_bounded`
    runs them with no check of its own)."""
    src, dst = m.views.whole, rank.views.whole
    copies = [
        (
            ops.PreparedCopy(src.caches, dst.caches, r.src_head_start, r.dst_head_start, r.num_heads),
            rank.spec.bytes_per_token(num_heads=r.num_heads),
        )
        for r in reads
    ]
    src_bound = peer.num_blocks * (peer.spec.block_size // src.unit)
    dst_bound = rank.num_blocks * (rank.spec.block_size // dst.unit)
    bounded = all(c.takes(src.unit, src_bound, dst.unit, dst_bound) for c, _ in copies)
    return copies, src_bound, dst_bound, bounded


@contextlib.contextmanager
def fetched(m: IpcMap, loads, layers=None, blocks: np.ndarray | None = None) -> Iterator[None]:
    """Around the copies of ``loads`` from mapping ``m``: for cross-memory attach, their source
    blocks (``blocks``, default every id of the loads) of ``layers`` read into the mirrors first
    and the mirrors emptied after (the copies run on the CPU, synchronously); nothing for a real
    mapping."""
    remote = m.remote
    if remote is None:
        yield
        return
    if blocks is not None:
        ids = blocks
    else:
        ids = loads[0].src_ids if len(loads) == 1 else np.concatenate([it.src_ids for it in loads])
    remote.fetch(ids, layers)
    try:
        yield
    finally:
        remote.drop()


class IpcSession:
    """The ``ipc`` session with ``peer`` (see the module doc). ``slot_views``: each exporter
    rank's lease-slot table as mapped at the handshake (None where not: that rank is read
    through grants only); ``lock``: held while a mapping is used or dropped from two threads
    (the one-sided mode runs in the caller's); ``closed``: the peer was forgotten; ``linger``:
    takes the session when it closed while copies may still read a mapping (the transport
    unmaps it once they completed)."""

    def __init__(
        self,
        rank: Rank,
        rt: Runtime,
        peer: Peer,
        slot_views: list[SlotView | None],
        slot_handles: list,
        linger: Callable[[IpcSession], None],
    ) -> None:
        self.rank = rank
        self.rt = rt
        self.peer = peer
        self.slot_views = slot_views
        self._slot_handles = slot_handles
        self.lock = threading.RLock()
        self.closed = False
        self._maps: dict[int, IpcMap] = {}
        self._busy: list = []  # events of one-sided copies that may still read a mapping
        self._pool: list = []  # completion events to reuse
        self._copies: dict[tuple, tuple] = {}  # prepared copies of each call shape (_prepared)
        self._routes: dict[int, tuple] = {}  # source rank -> (reads, mapping, its routes): routes()
        # source rank -> (mapping, its copies or None, wire bytes per token, both block sizes)
        self._whole: dict[int, tuple] = {}
        self.onesided = None  # the one-sided mode's view of this peer (kvxfer.transports.ipc.onesided)
        self._linger = linger  # called when closed while copies may still read a mapping

    # ------------------------------------------------------------------ mappings
    def mapping(self, s: int) -> IpcMap:
        """Source rank ``s`` mapped (on first use); ``RuntimeError`` once the session closed."""
        m = self._maps.get(s)
        if m is None:
            with self.lock:
                if self.closed:
                    raise RuntimeError(f"ipc: the session with {self.peer.engine_id} was closed")
                m = self._maps.get(s)
                if m is None:
                    m = self._maps[s] = map_rank(self.peer, s, self.rank.device)
        return m

    def mapped(self, s: int) -> IpcMap | None:
        """Source rank ``s`` as mapped so far (None if not yet)."""
        return self._maps.get(s)

    # ------------------------------------------------------------------ transfers
    def routes(self, source: int, reads: list) -> list[Route]:
        """One route for all of ``reads``: the units the mapped caches and this rank's offer
        (made once per source rank and reads; the caller does not change the list)."""
        got = self._routes.get(source)
        if got is not None and got[0] is reads and got[1] is self._maps.get(source):
            return got[2]
        m = self.mapping(source)
        routes = [Route(reads, m.views.units, self.rank.units)]
        self._routes[source] = (reads, m, routes)
        return routes

    def start(self, transfer: Transfer) -> IpcCompletion:
        """Issue ``transfer``'s copies (see the module doc); its completion waits for the load
        stream and reads the exporter's epochs after the copy."""
        m = self.mapping(transfer.source)
        hook = self.rt.hooks.get("before_ipc_copy")
        if hook:
            hook()
        with self.lock, trace("copy", items_tag, transfer.loads):
            if self.closed:
                raise RuntimeError(f"ipc: the session with {self.peer.engine_id} was closed")
            if m.remote is None:  # a real mapping: nothing to fetch
                calls = self.copy(m, transfer)
            else:
                with fetched(m, transfer.loads, transfer.layers, transfer.blocks):
                    calls = self.copy(m, transfer)
        return IpcCompletion(self, m, transfer.loads, calls)

    def start_whole(self, source: int, load: LoadItem, deadline: float) -> tuple[IpcCompletion, int] | None:
        """Issue every layer of one whole ``load`` (nothing held here) from source rank
        ``source``: one call per read of the plan, each a prepared copy between the whole-block
        views of both sides taking the load's ids as they are (checked already: the source's
        count and range by the planner, the destination's at ``load()``), so there is nothing to
        plan. Returns its completion (as :meth:`start`'s) and the wire bytes, or None, with
        nothing issued, where a copy would not take the ids as they are or the mapping is a
        mirror (cross-memory attach): the planner then plans it (:meth:`start`)."""
        m = self.mapping(source)
        w = self._whole.get(source)
        if w is None or w[0] is not m:
            copies, _, _, bounded = whole_copies(self.rank, self.peer, m, self.peer.reads_by_rank[source])
            # an engine with groups writes each group's own blocks (planned per group): never whole
            ok = bounded and m.remote is None and self.rank.groups is None
            use = tuple(c for c, _ in copies) if ok else None
            w = (m, use, sum(b for _, b in copies), self.peer.spec.block_size, self.rank.spec.block_size)
            with self.lock:
                if not self.closed:  # unmap() may have emptied the cache meanwhile: not kept then
                    self._whole[source] = w
        _, copies, per_token, sbs, dbs = w
        src, dst, n = load.src_ids, load.dst, load.num_tokens
        if copies is None or not n:
            return None
        ns, nd = -(-n // sbs), -(-n // dbs)  # exactly the ids run_bounded reads on each side
        if not (src.size == ns and dst.size == nd and _fits(src, ns) and _fits(dst, nd)):
            return None
        hook = self.rt.hooks.get("before_ipc_copy")
        if hook:
            hook()
        with self.lock, trace("copy", load.request_id):
            if self.closed:
                raise RuntimeError(f"ipc: the session with {self.peer.engine_id} was closed")
            for pc in copies:
                pc.run_bounded(src, dst, n)
        return IpcCompletion(self, m, [load], len(copies)), per_token * n

    def move_state(
        self, s: int, group, route, items, loads, layers: list[int], deadline: float
    ) -> IpcCompletion:
        """Copy a state group's units this rank needs from source rank ``s`` (``route``: a
        :class:`~kvxfer.groups.state_group.StateRoute`; ``items``: each load's state block on
        both sides) straight out of the mapped pages into this rank's, re-sharded and converted
        (:func:`kvxfer.groups.state_ops.copy_state`) over ``layers`` (engine layer indices of
        ``group``); the completion as for :meth:`start`."""
        m = self.mapping(s)
        with self.lock, trace("copy", items_tag, loads):
            if self.closed:
                raise RuntimeError(f"ipc: the session with {self.peer.engine_id} was closed")
            with fetched(m, loads, layers, np.array([it.src[0] for it in items], dtype=np.int64)):
                self.copy_units(m, s, group, route, items, layers)
        return IpcCompletion(self, m, loads, 1)

    def copy_units(self, m: IpcMap, s: int, group, route, items, layers: list[int]) -> None:
        """The copy of :meth:`move_state` from mapping ``m`` (call under :attr:`lock`, the
        source blocks fetched)."""
        src_caches = m.views.views[0].caches
        route.copy(
            s, [page_view(src_caches[x]) for x in group.layers], [int(it.src[0]) for it in items],
            self.rank.caches, group.layers, [int(it.dst[0]) for it in items], layers,
        )  # fmt: skip

    def copy(self, m: IpcMap, transfer: Transfer) -> int:
        """The ops calls of ``transfer`` from mapping ``m`` into this rank's caches, on the
        current stream (call under :attr:`lock`); returns how many. The ids were checked
        already (source: against the exporter's block count, on the grant or the slot lookup;
        destination: range and repeats, at ``load()``): each call runs its prepared copy
        (:meth:`_prepared`) with no check of its own, but for repeats among the destination
        ids of a call that carries several loads whose blocks are not disjoint (the plan's
        ``distinct``)."""
        bp = transfer.plan
        distinct = bp.distinct
        for c in bp.calls:
            su, du = bp.units(c)
            bounded, copies = self._prepared(m, transfer, su, du, c.src_offset, c.dst_offset)
            n, src, dst = c.num_tokens, c.src, c.dst
            if not n:
                continue
            unique = distinct or len(c.request_ids) == 1
            ns, nd = -(-n // su), -(-n // du)
            if bounded and unique and _fits(src, ns) and _fits(dst, nd):
                if src.size != ns:
                    src = src[:ns]
                if dst.size != nd:
                    dst = dst[:nd]
                for pc in copies:
                    pc.run_bounded(src, dst, n)
            else:  # off a unit boundary, or ids repeated across the call's loads: checked there
                src = ops.CheckedIds(src, self._bound(su, True), False)
                dst = ops.CheckedIds(dst, self._bound(du, False), unique)
                for pc in copies:
                    pc.run(src, dst, n)
        return len(bp.calls) * len(transfer.reads)

    def _bound(self, unit: int, src: bool) -> int:
        """How many ids of ``unit`` a checked grant (``src``) or load addresses."""
        if src:
            return self.peer.num_blocks * (self.peer.spec.block_size // unit)
        return self.rank.num_blocks * (self.rank.spec.block_size // unit)

    def _prepared(self, m: IpcMap, transfer: Transfer, su: int, du: int, so: int, do: int) -> tuple:
        """The prepared copies (:class:`~kvxfer.prepared.PreparedCopy`, one per head slice of
        ``transfer.reads``) of a call in units ``su``/``du`` at token offsets ``so``/``do`` of
        ``transfer``'s layers from mapping ``m``, made once per call shape, and whether the ids
        a checked grant and load give (below the bounds of :meth:`_bound`) are the copies' own
        (:meth:`~kvxfer.prepared.PreparedCopy.takes`, and no offset)."""
        layers = transfer.layers
        key = (transfer.source, su, du, so, do, None if layers is None else tuple(layers))
        got = self._copies.get(key)
        if got is not None and got[2] is transfer.reads and got[3] is m:
            return got[0], got[1]
        sv, dv = m.views.at(su, so), self.rank.views.at(du, do)
        copies = tuple(
            prepared_copy(sv.caches, dv.caches, r.src_head_start, r.dst_head_start, r.num_heads, layers)
            for r in transfer.reads
        )
        sb, db = self._bound(su, True), self._bound(du, False)
        bounded = not so and not do and all(pc.takes(su, sb, du, db) for pc in copies)
        if len(self._copies) >= _COPIES_MAX:
            self._copies.clear()
        self._copies[key] = (bounded, copies, transfer.reads, m)
        return bounded, copies

    # ------------------------------------------------------------------ events
    def done_event(self):
        """An event (pooled) recorded on the load stream after the copies just queued, kept
        among this session's busy events (its mappings outlive a close until they completed)."""
        ev = self._pool.pop() if self._pool else torch.cuda.Event()
        ev.record(self.rt.order.stream("load"))
        busy = self._busy
        if len(busy) >= _BUSY_PRUNE:
            busy[:] = [e for e in busy if not event_done(e)]
        busy.append(ev)
        return ev

    def recycle(self, ev) -> None:
        """``ev`` (completed) may be recorded again."""
        if len(self._pool) < _POOL_MAX:
            self._pool.append(ev)

    def idle(self) -> bool:
        """Whether no copy that may still read a mapping is running."""
        self._busy[:] = [e for e in self._busy if not event_done(e)]
        return not self._busy

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """The peer was forgotten: no transfer starts any more; the mappings are dropped now,
        or by :meth:`unmap` once the one-sided copies still reading them completed."""
        with self.lock:
            self.closed = True
            if self.onesided is not None:  # no native lane reads this peer through it any more
                self.onesided.lane = None
            if self.idle():
                self.unmap()
            else:
                self._linger(self)

    def unmap(self) -> None:
        """Drop every mapping and lease-slot table of this session."""
        with self.lock:
            maps, self._maps = self._maps, {}
            self._copies = {}  # they hold the mapped caches
            self._routes = {}
            self._whole = {}
            for m in maps.values():
                offer.detach(m.handles)
            handles, self._slot_handles = self._slot_handles, []
            for h in handles:
                mapper("shm").detach(h)

    def holds_mappings(self) -> bool:
        return bool(self._maps or self._slot_handles)


class IpcCompletion:
    """A messaged ``ipc`` transfer in flight: it completed once the load stream ran past it."""

    __slots__ = ("_calls", "_loads", "_map", "_session")

    def __init__(self, session: IpcSession, m: IpcMap, loads: list, calls: int) -> None:
        self._session, self._map, self._loads, self._calls = session, m, loads, calls

    def done(self) -> bool:
        order = self._session.rt.order
        return not order.cuda or order.stream("load").query()

    def wait(self, deadline: float) -> Outcome:
        rt = self._session.rt
        rt.order.wait_done(time_left(deadline))  # CUDA: the copy ran before the epochs are re-read
        hook = rt.hooks.get("after_ipc_copy")
        if hook:
            hook(self._map.epochs)
        landed = {it.request_id for it in self._loads}
        return Outcome(landed, {}, {}, self._map.epochs_np, self._calls)
