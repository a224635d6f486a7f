"""One-sided ``ipc`` reads: a mode of the ipc session in which a load is launched in the
caller's thread, with no message before the copy and none on the critical path after it.

When a loader rank's ipc session with a peer has mapped every source rank
(:mod:`kvxfer.transports.ipc.session`), ``load()`` looks up the request in each source rank's
lease-slot table (:mod:`kvxfer.transports.ipc.slots`): a live slot bound to the params (a hash
of their token, content digest and request id: only the export's own params find it), whose
ready flag is set (the exporter's compute wrote the blocks), not a layer-wise export, leased for
at least ``min(timeout, LEASE_LEFT_S)`` more, on an exporter that is open and beat recently. If every source
rank has one, the loader snapshots the blocks' epochs between two reads of the slot's
generation, and the session issues the copy on the load stream right there
(:meth:`~kvxfer.transports.ipc.session.IpcSession.copy`; CUDA: an event from the session's pool
is recorded after it). Anything else returns False, and the load takes the messaged path (lease
grant, then the copy in the worker thread), which names every refusal. The one refusal this
path makes itself is the messaged path's own check of a batch: params another load already
reads (launched or held here and not reported yet, or queued for the loader's next batch) fail
as "loaded twice in one batch". Every word it reads from the table is untrusted (``slots``): a
bad one is no slot. Inside a batch (:meth:`OneSided.hold`, ``TransferEngine.batched_loads()``)
the copy waits for the batch's end, where the held loads of each peer are planned together by
the load planner (:meth:`kvxfer.planner.Planner.plan`) and launched with one event.

``poll()`` (:meth:`OneSided.complete`) queries the events itself. A load whose copy completed is
checked as the messaged path checks it: the slot still at the same generation and the blocks'
epochs unchanged (released meanwhile: the load fails, its bytes never reported), and the
exporter still beating. A landed load is reported finished and a done mark goes into the slot
of every exporter rank the plan has this rank notify (the exporter frees the blocks at its next
``poll()`` or side-channel tick). When every such mark was written and its ring entry taken by
the native compare-and-swap (:mod:`kvxfer.transports.ipc.slots`: no mark is lost), the marks
free the blocks and the acknowledged notification is deferred: a later ``poll()`` sends it
between ``MARK_GRACE_S`` and twice that after, at most one message per exporter in each
``MARK_GRACE_S`` for every such load due by then (``close()``: at once). It then counts
nothing, unless a stranger overwrote a mark in the table (which no table word lets the loader
see): it is the record only the loader writes. Otherwise
(a rank past the marks, a rank without a mapped table, a slot not found, the Python fallback's
stores) the notification is queued at once, and a failed load is always notified.

The guarantees are those of the messaged path (DESIGN, "Completion"): the snapshot is taken while
the export is live, the check after the copy catches a release, the GPU work completes before a
load is reported or the exporter frees, the ready flag is the exporter's ready gate, and the
exporter counts each loader rank once whether it marks done or notifies.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import platform
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np

from ... import idops, ops, tracing
from ...engine_types import LoadItem, describe_error, disjoint_blocks, loaded_twice
from ...grouped import group_items
from ...metrics import now
from ...ordering import event_done
from ...tracing import items_tag, trace
from ...transfer import Route, Transfer
from . import slots
from .cma import Direct
from .direct import direct_fits, direct_target, read_direct
from .session import IpcMap, IpcSession, fetched
from .slots import SlotView

if TYPE_CHECKING:  # pragma: no cover
    from ...batching import BatchPlan
    from ...peer import Peer
    from ...plan import Read
    from ...rank import Rank, Runtime

__all__ = ["CPU_COPY_MAX_BYTES", "LEASE_LEFT_S", "ORDERED_CPU", "STALE_S", "OneSided", "OneSidedLink"]

_LOG = logging.getLogger(__name__)

# The slot protocol relies on stores and loads staying in program order between processes
# (kvxfer.transports.ipc.slots): x86-64 (TSO) keeps them; elsewhere loads take the messaged path.
ORDERED_CPU = platform.machine().lower() in ("x86_64", "amd64")
# On CPU caches the copy runs in the caller's thread (there is nothing to launch): a larger one
# would hold load() for more than about a millisecond, so it goes to the worker thread instead.
CPU_COPY_MAX_BYTES = 16 << 20
STALE_S = 2.0  # an exporter that has not beat for this long is not read one-sided (it beats every 20 ms)
_STALE_NS = int(STALE_S * 1e9)
# The lease a one-sided read needs left: a copy takes milliseconds, so 5 s is a margin of three
# orders of magnitude, and a lease that still ends during the copy is caught by the check after it
# (the load fails, no wrong byte is reported). Asking for the whole load timeout instead refused
# every served load under the connector's defaults (lease 30 s = timeout 30 s: "lease too short").
LEASE_LEFT_S = 5.0
# A landed load whose done marks were all written is notified at least this long after (at most
# twice it), in one message per exporter for every such load due by then, at most one message
# per exporter in each such period (a steady stream of loads is not one message each). The
# marks free the blocks at the exporter's next poll() or side-channel tick (20 ms); the
# notification is the record a stranger cannot overwrite in the table (nor make this loader
# believe the blocks freed), so it still goes.
MARK_GRACE_S = 0.1


class OneSidedLink(Protocol):
    """What the one-sided mode uses of the loader (:class:`kvxfer.loader.Loader`): the peers it
    handshook, whether params wait in its next batch, the load planner, the notifications."""

    peer: Callable[[str], Peer | None]  # the peer kept for an engine id, or None

    queued: Callable[[tuple[str, str]], bool]  # whether params (engine id, request id) wait

    def plan(self, route: Route, src_block_size: int, loads: list, distinct: bool) -> BatchPlan: ...

    def notify(self, peer: Peer, done: list, failed: list) -> None: ...


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
        # groups, no mirrors, every prepared copy taking the checked ids as they are): _copy
        # runs them itself. None: the general path.
        plain = direct is None and not grouped and not self.remote and all(src.bounded for src in sources)
        self.plain = tuple(c for src in sources for c, _ in src.whole) if plain else None


class Flight:
    """One one-sided load in flight: the load, the params' key (engine id, request id), its
    target, what its lookup read per source rank in the target's order (``(slot, generation,
    snapshot)``: the slot, its generation and the blocks' epochs snapshotted while it stayed at
    that generation),
    the binding, when it started, the event after its copy (CUDA), its wire bytes and ops calls,
    and whether its deadline passed unfinished."""

    __slots__ = ("binding", "calls", "event", "item", "key", "late", "moved", "reads", "t0", "target")

    def __init__(
        self, item: LoadItem, key: tuple, target: Target, reads: tuple, binding: tuple, t0: float
    ) -> None:
        self.item = item
        self.key = key
        self.target = target
        self.reads = reads
        self.binding = binding
        self.t0 = t0
        self.event = None
        self.moved = 0
        self.calls = 0
        self.late = False


class OneSided:
    """The one-sided mode of one loader rank (see the module doc).

    Args:
        rank, rt: the rank's configuration and runtime.
        link: the rank's loader (:class:`OneSidedLink`).

    ``loads``: loads read one-sided so far; ``direct``: of them, read by cross-memory attach
    straight into this rank's caches (no mirror); ``deferred``: landed ones whose done marks
    freed them and whose notification went ``MARK_GRACE_S`` or more later, with the other loads
    due by then; ``fallbacks``: why a load took the messaged path, counted by reason (all in
    ``stats()["onesided"]``)."""

    def __init__(self, rank: Rank, rt: Runtime, link: OneSidedLink) -> None:
        self.rank = rank
        self.rt = rt
        self.link = link
        self._peer = link.peer  # a dict lookup (kvxfer.peer.Peers.get): no frame per load
        self._queued = link.queued  # a set's test, likewise
        if not ORDERED_CPU:
            _LOG.warning(
                "kvxfer engine %s rank %d: one-sided reads off on %s (the lease-slot protocol needs "
                "x86-64's store order); ipc loads take the messaged path",
                rank.engine_id, rank.tp_rank, platform.machine(),
            )  # fmt: skip
        self.flights: list[Flight] = []
        self.loads = 0
        self.fallbacks: dict[str, int] = {}
        self.direct = 0  # loads read by cross-memory attach straight into this rank's caches
        self.deferred = 0  # landed loads whose marks freed them, notified after the grace
        # (due, peer, load) of the landed loads whose marks were all written, oldest first,
        # until their notification goes (_notify_marked)
        self._marked: collections.deque = collections.deque()
        # not before then: at most one deferred notification per peer every MARK_GRACE_S (each
        # load's goes between MARK_GRACE_S and twice that after its marks)
        self._next_notify = 0.0
        # (engine id, request id) of the params of every load launched or held here and not
        # reported yet: a second load of them is refused as the messaged path refuses a repeat
        self._active: set[tuple[str, str]] = set()
        # CPU caches: bytes per token this rank copies (load() copies them itself: bounded)
        spec = rank.spec
        self._cpu_bpt = (
            0 if rank.device.type == "cuda" else spec.bytes_per_token(spec.heads_per_rank(rank.tp_size))
        )
        self.lock = threading.Lock()  # flights: appended by load(), taken by poll()
        self._local = threading.local()  # per thread: the loads held by an open batch (hold())
        self._batches = 0  # threads with a batch open (none: load() skips the thread-local lookup)

    # ------------------------------------------------------------------------- launch
    def _no(self, why: str) -> bool:
        n = self.fallbacks.get(why, 0)
        self.fallbacks[why] = n + 1
        if not n:  # the messaged path still loads it: said once per reason, counted in stats()
            _LOG.info(
                "kvxfer one-sided reads: a load took the messaged path: %s (logged once per reason; "
                "stats()['onesided']['fallbacks'] counts them)",
                why,
            )
        return False

    def _target(self, peer: Peer) -> Target | None:
        """What a one-sided read of ``peer`` needs, made once per session (None while a source
        rank is not mapped yet, or its table is of another start of that rank)."""
        session = peer.session
        if type(session) is not IpcSession or session.closed:
            return None
        t = session.onesided
        if t is not None:
            return t
        views = session.slot_views
        rank = self.rank
        dst = rank.views.whole
        sources = []
        for s in peer.src_ranks:
            v, m = views[s], session.mapped(s)
            if v is None or m is None or not v.of(peer.replies[s].incarnation):
                return None
            reads = peer.reads_by_rank[s]
            src = m.views.whole
            whole = [
                (
                    ops.PreparedCopy(src.caches, dst.caches, r.src_head_start, r.dst_head_start, r.num_heads),
                    rank.spec.bytes_per_token(num_heads=r.num_heads),
                )
                for r in reads
            ]
            src_bound = peer.num_blocks * (peer.spec.block_size // src.unit)
            dst_bound = rank.num_blocks * (rank.spec.block_size // dst.unit)
            route = Route(reads, m.views.units, rank.units)
            bounded = all(c.takes(src.unit, src_bound, dst.unit, dst_bound) for c, _ in whole)
            sources.append(Source(s, v, m, reads, route, whole, src_bound, dst_bound, bounded))
        ranks = [src.rank for src in sources]
        marks = [
            (views[s], ranks.index(s) if s in ranks else -1)
            for s in peer.notify_to
            if s < len(views) and views[s] is not None
        ]
        t = session.onesided = Target(
            peer,
            session,
            sources,
            marks,
            direct_target(rank, peer, [(src.mapping, src.reads) for src in sources]),
            rank.groups is not None,
        )
        return t

    def try_load(self, item: LoadItem, timeout_s: float) -> bool:
        """Launch ``item`` one-sided if it can be (see the module doc); False: queue it for the
        messaged path (nothing was written)."""
        if not ORDERED_CPU:
            return self._no("weakly ordered CPU")
        p = item.params
        peer = self._peer(p.engine_id)
        if peer is None or not peer.serves(p):
            return self._no("not handshaken")
        session = peer.session
        t = session.onesided if type(session) is IpcSession and not session.closed else None
        if t is None:  # made once per session
            if peer.transport != "ipc":
                return self._no(f"transport {peer.transport}")
            t = self._target(peer)
            if t is None:
                return self._no("not mapped")
        if self._cpu_bpt and (p.num_tokens - item.first) * self._cpu_bpt > CPU_COPY_MAX_BYTES:
            return self._no("CPU copy too large for the caller")
        ids = item.src_ids
        gs = self.rank.groups
        if gs is not None:  # one item per group, as the messaged path plans them
            got = group_items(
                gs, item.request_id, ids, p.groups, p.num_tokens, item.group_dst,
                peer.spec.block_size, self.rank.spec.block_size, peer.state_routes,
            )  # fmt: skip
            if type(got) is str:
                return self._no("bad params")
            item.groups = got
        now_ns = time.monotonic_ns()
        need_ns = now_ns + int(min(timeout_s, LEASE_LEFT_S) * 1e9)
        ctl = t.ctl
        if ctl is not None and gs is None:  # the checks, the binding and every read in one call
            got = ctl.onesided_read(
                t.tables, t.epochs, ids, p.num_tokens, peer.spec.block_size, peer.num_blocks,
                p.token, p.digest(), p.request_id, now_ns, _STALE_NS, need_ns,
            )  # fmt: skip
            if type(got) is int:
                return self._no(self._refused(t, got))
            b0, b1, reads = got
            b = (b0, b1)
        else:
            got = self._read(t, p, ids, now_ns, need_ns, gs is None)
            if type(got) is str:
                return self._no(got)
            b, reads = got
        key = (p.engine_id, p.request_id)
        if key in self._active or self._queued(key):
            # The same params already in this batch (read here, or queued for the messaged path,
            # whose batch check refuses a repeat the same way); a load that would not be read
            # here anyway was handed to the messaged path above, which checks its own batch.
            if self.rt.loads.fail(item.request_id, loaded_twice(p.request_id)):
                self.rt.metrics.add("failures")
            return True
        f = Flight(item, key, t, reads, b, now())
        item.deadline = now_ns * 1e-9 + timeout_s  # time.monotonic's clock
        held = getattr(self._local, "held", None) if self._batches else None
        if held is not None:  # launched with the batch's other loads when it closes
            if self._cpu_bpt:
                size = (p.num_tokens - item.first) * self._cpu_bpt
                if held[1] + size > CPU_COPY_MAX_BYTES:  # the caller copies on CPU: bounded per launch
                    self._launch_held()
                    held = self._local.held
                held[1] += size
            held[0].append(f)
            self._active.add(key)
            self.loads += 1
            return True
        self.loads += 1
        try:
            if not self._launch(t, [f]):
                self.loads -= 1
                return self._no("not mapped")
        except Exception as e:  # the copy may have written part of the blocks: fail the load
            self._report(f, f"one-sided ipc copy: {describe_error(e)}")
            return True
        self._active.add(key)
        with self.lock:
            self.flights.append(f)
        return True

    @staticmethod
    def _read(
        t: Target, p, ids: np.ndarray, now_ns: int, need_ns: int, counted: bool
    ) -> tuple[tuple, tuple] | str:
        """What the native ``onesided_read`` does, a step per call: the ids' count (``counted``:
        a load of one group; the groups' counts were checked by their items) and bound, the
        binding, each source rank's slot read; ``((b0, b1), reads)`` or why not."""
        peer = t.peer
        if counted and ids.size != peer.spec.num_blocks_for(p.num_tokens):
            return "bad params"  # the messaged path names the problem
        if idops.max_id(ids) >= peer.num_blocks:
            return "bad params"
        try:
            b0, b1 = t.bind(p.token, p.digest(), p.request_id)
        except ValueError:
            return "bad params"  # a token not ASCII: the messaged path refuses it
        reads = []
        for src in t.sources:
            got = src.view.read(b0, b1, now_ns, _STALE_NS, need_ns, src.mapping.epochs_np, ids)
            if type(got) is str:
                return got
            reads.append(got)
        return (b0, b1), tuple(reads)

    @staticmethod
    def _refused(t: Target, code: int) -> str:
        """Why ``onesided_read`` refused (its code | source index << 4), as the views say it."""
        why = slots.READ_REFUSALS[code & 15]
        if why is slots.BAD_WORD:
            t.sources[code >> 4].view.bad("a slot's generation out of range")
        return why

    def _launch(self, t: Target, group: list[Flight]) -> bool:
        """Issue the copies of ``group`` (flights of target ``t``) on the load stream, one event
        after them (CUDA); False when the session closed since their lookup (nothing written)."""
        session, rt = t.session, self.rt
        items = [group[0].item] if len(group) == 1 else [f.item for f in group]
        with session.lock:
            if session.closed:  # the peer was forgotten since the lookup: its mapping may be gone
                return False
            hook = rt.hooks.get("before_ipc_copy")
            if hook:
                hook()
            if rt.order.cuda or tracing.enabled():
                with trace("copy", items_tag, items), rt.order.on_stream():
                    calls = self._copy(t, items)
            else:  # CPU caches, no NVTX: no range to open, no stream to enter (two contexts per load)
                calls = self._copy(t, items)
            ev = session.done_event() if rt.order.cuda else None
        per_token = t.per_token
        for k, f in enumerate(group):
            f.event, f.calls = ev, calls if k == 0 else 0  # a batch's calls counted once
            it = f.item
            f.moved = (it.num_tokens - it.first) * per_token if it.groups is None else self._moved(t, it)
        return True

    def _copy(self, t: Target, items: list[LoadItem]) -> int:
        """The copies of ``items`` (under the session's lock, on the load stream); returns the
        ops calls. Cross-memory attach straight into this rank's caches when the loads move
        whole blocks, else per group, else (the source ranks' blocks read into their mirrors
        first, when they are remote) a lone whole load through the prepared copies, and
        anything else planned as the messaged path plans a batch."""
        plain = t.plain
        if plain is not None and len(items) == 1 and not items[0].first:  # _copy_whole, fewer hops
            it = items[0]
            for copy in plain:
                copy.run_bounded(it.src, it.dst, it.num_tokens)  # >= 1: a load moves a token
            return len(plain)
        rank = self.rank
        if t.direct is not None and direct_fits(rank, items):
            self.direct += len(items)
            return read_direct(t.direct, rank, items)
        if rank.groups is not None:  # fetched per group (its blocks, its layers)
            return self._copy_groups(t, items)
        if not t.remote:
            return self._copy_mapped(t, items)
        with contextlib.ExitStack() as fetch:  # cross-memory attach: the blocks read into the mirrors
            for src in t.sources:
                if src.mapping.remote is not None:
                    fetch.enter_context(fetched(src.mapping, items))
            return self._copy_mapped(t, items)

    def _copy_mapped(self, t: Target, items: list[LoadItem]) -> int:
        """:meth:`_copy` of loads whose source blocks are mapped here (or read into mirrors)."""
        if len(items) == 1 and not items[0].first:
            return _copy_whole(t, items[0])
        rank, session = self.rank, t.session
        distinct = len(items) == 1 or disjoint_blocks(items, rank.spec.block_size)
        sbs = t.peer.spec.block_size
        calls = 0
        for src in t.sources:
            bp = self.link.plan(src.route, sbs, items, distinct)
            xfer = Transfer(src.rank, src.reads, bp, items, None, items[0].deadline)
            calls += session.copy(src.mapping, xfer)
        return calls

    def _copy_groups(self, t: Target, items: list[LoadItem]) -> int:
        """The copies of loads of an engine with KV cache groups (under the session's lock): per
        source rank and group (cross-memory attach: its blocks of its layers fetched first), the
        group's items planned over its layers as the messaged path plans them, a re-sharded
        state group's units copied (:meth:`IpcSession.copy_units`); returns the ops calls."""
        session, gs = t.session, self.rank.groups
        routes = t.peer.state_routes
        distinct = len(items) == 1 or disjoint_blocks(items, self.rank.spec.block_size)
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
                    bp = self.link.plan(src.route, sbs, sub, distinct)
                    xfer = Transfer(src.rank, src.reads, bp, items, layers, items[0].deadline)
                    calls += session.copy(src.mapping, xfer)
        return calls

    def _moved(self, t: Target, item: LoadItem) -> int:
        """Wire bytes of a load: its tokens over every read, or per group over its layers."""
        if item.groups is None:
            return (item.num_tokens - item.first) * t.per_token
        per_layer = t.per_token // max(1, self.rank.spec.num_layers)
        out = 0
        for g, (grp, sub) in enumerate(zip(self.rank.groups.groups, item.groups)):
            state = t.peer.state_routes.get(g)
            if state is not None:
                out += sum(state.nbytes(len(grp.layers), 1, src.rank) for src in t.sources)
            else:
                out += (sub.num_tokens - sub.first) * per_layer * len(grp.layers)
        return out

    # -------------------------------------------------------------------------- batch
    def hold(self) -> None:
        """Open a batch on this thread: one-sided loads are looked up and snapshotted as they
        come, and launched together at :meth:`release` (one ops call per read and source rank
        for all of them, one event) instead of one launch each. Nests."""
        depth = getattr(self._local, "depth", 0)
        if not depth:
            self._local.held = [[], 0]  # flights, CPU bytes
            with self.lock:
                self._batches += 1
        self._local.depth = depth + 1

    def release(self) -> None:
        """Close the batch :meth:`hold` opened; the outermost close launches what it held."""
        self._local.depth -= 1
        if not self._local.depth:
            try:
                self._launch_held()
            finally:
                self._local.held = None
                with self.lock:
                    self._batches -= 1

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """:meth:`hold` for the block, :meth:`release` at its end (even when it raises)."""
        self.hold()
        try:
            yield
        finally:
            self.release()

    def _launch_held(self) -> None:
        """Launch the loads held so far: per peer one launch (:meth:`_launch`); a load whose
        launch failed, or whose peer was forgotten since its lookup, is reported failed."""
        held = self._local.held
        flights, self._local.held = held[0], [[], 0]
        by_target: dict[int, list[Flight]] = {}
        for f in flights:
            by_target.setdefault(id(f.target), []).append(f)
        for group in by_target.values():
            try:
                if not self._launch(group[0].target, group):
                    raise RuntimeError("the exporter's mapping was dropped before the launch")
            except Exception as e:  # the copy may have written part of the blocks: fail the loads
                for f in group:
                    self._report(f, f"one-sided ipc copy: {describe_error(e)}")
                continue
            with self.lock:
                self.flights.extend(group)

    # ----------------------------------------------------------------------- complete
    def complete(self) -> None:
        """Check and report every one-sided load whose copy completed (``poll()`` calls it); one
        notification per peer for all of them. First, the marked loads whose grace ended, when
        the last such notification went ``MARK_GRACE_S`` ago or more (:meth:`_notify_marked`)."""
        marked = self._marked
        if marked:
            now_s = time.monotonic()
            if marked[0][0] <= now_s and now_s >= self._next_notify:
                self._notify_marked(False)
        if not self.flights:
            return
        with self.lock:
            flights, self.flights = self.flights, []
        still = []
        notes: dict[int, tuple[Peer, list, list]] = {}
        now_ns = time.monotonic_ns()
        recycled: set[int] = set()  # a batch's loads share one event: back to the pool once
        for f in flights:
            ev = f.event
            if ev is not None and not event_done(ev):
                if time.monotonic() > f.item.deadline and not f.late:
                    # the copy is still running: hold the report until it completed
                    f.late = True
                    _LOG.warning(
                        "kvxfer loader %s rank %d: one-sided copy of %s not complete by its "
                        "deadline; reported once it completed",
                        self.rank.engine_id, self.rank.tp_rank, f.item.request_id,
                    )  # fmt: skip
                still.append(f)
                continue
            why, marked = self._land(f, now_ns)
            self._report(f, why, notes, marked)
            if ev is not None and id(ev) not in recycled:
                recycled.add(id(ev))
                f.target.session.recycle(ev)
        for peer, done, failed in notes.values():
            self.link.notify(peer, done, failed)
        if still:
            with self.lock:
                self.flights[:0] = still

    def _land(self, f: Flight, now_ns: int) -> tuple[str, bool]:
        """The check after a completed copy, and when it landed, the done marks: ``("", marked)``
        (``marked``: every exporter rank it notifies counts a mark) or ``(why not, False)``. One
        native call (``onesided_land``) when the module is in use, else a step per rank."""
        t, rank = f.target, self.rank
        hook = self.rt.hooks.get("after_ipc_copy")
        ctl = t.ctl
        if ctl is not None and not hook:
            b0, b1 = f.binding
            got = ctl.onesided_land(
                t.tables, t.epochs, f.item.src_ids, f.reads, t.mark_tables, b0, b1,
                rank.tp_rank, rank.tp_size, now_ns, _STALE_NS,
            )  # fmt: skip
            if not got:
                return "", t.marks_all
            code = got & 15
            if code == 3:  # landed; a rank not marked (it is notified now)
                view = t.marks[0][0]
                if got & 16:
                    view.bad("a slot's generation out of range")
                if got & 32:
                    view.bad("a done count out of range")
                return "", False
            return self._failed(t.sources[got >> 4], code, now_ns), False
        ids = f.item.src_ids
        for src, (slot, gen, snap) in zip(t.sources, f.reads):
            if hook:
                hook(src.mapping.epochs)
                now_ns = time.monotonic_ns()
            got = src.view.check(slot, gen, src.mapping.epochs_np, ids, snap, now_ns, _STALE_NS)
            if got:
                return self._failed(src, got, now_ns), False
        marked, reads = t.marks_all, f.reads
        for view, k in t.marks:
            i, g = (reads[k][0], reads[k][1]) if k >= 0 else view.find(*f.binding)
            if i < 0 or not view.mark_done(i, g, rank.tp_rank, rank.tp_size):
                marked = False
        return "", marked

    @staticmethod
    def _failed(src: Source, got: int, now_ns: int) -> str:
        """Why a load whose copy completed did not land: source rank ``src``'s check said 1
        (released) or 2 (the exporter stopped)."""
        # released first: an exporter that closed released every export before it shut, so
        # that is what happened to the blocks (the messaged path says the same)
        if got == 1:
            return (
                f"exporter rank {src.rank}: blocks released before or during the copy (lease ended); "
                "not delivered"
            )
        # nothing released, but the exporter stopped beating (killed, hung) or closed
        why = src.view.alive(_STALE_NS, now_ns) or (  # read again: alive by now
            "closed or no heartbeat when checked after the copy, alive when read again "
            "(a word of its lease-slot table was overwritten meanwhile?)"
        )
        return f"exporter rank {src.rank}: {why}"

    def _report(self, f: Flight, why: str, notes: dict | None = None, marked: bool = False) -> None:
        """Report ``f`` once: landed (``why`` empty; ``marked``: every exporter rank it notifies
        counts its done mark, :meth:`_land`) or failed for ``why``; its notification goes into
        ``notes`` (peer -> loads), or now, or (``marked``) after the grace."""
        rt, item, peer = self.rt, f.item, f.target.peer
        self._active.discard(f.key)
        t = now()
        if why:
            rt.metrics.record_load(f.t0, t, 0, f.calls, None)
            if rt.loads.fail(item.request_id, why):
                rt.metrics.add("failures")
        else:
            rt.metrics.record_load(f.t0, t, f.moved, f.calls, rt.loads.finish_one(item.request_id, t))
            if marked:  # every exporter rank it notifies counts the mark: notified later,
                # with the other loads of the window (:meth:`_notify_marked`)
                with self.lock:
                    self._marked.append((time.monotonic() + MARK_GRACE_S, peer, item))
                return
        if notes is None:
            self.link.notify(peer, [] if why else [item], [item] if why else [])
            return
        note = notes.get(id(peer))
        if note is None:
            note = notes[id(peer)] = (peer, [], [])
        note[2 if why else 1].append(item)

    def _notify_marked(self, every: bool) -> None:
        """Notify the landed loads marked at least ``MARK_GRACE_S`` ago (``every``: all of them),
        one message per peer: their exporters freed them from the marks already (the
        notification then counts nothing), or did not count a mark (a stranger overwrote it in
        the table) and free them now."""
        now_s = time.monotonic()
        self._next_notify = now_s + MARK_GRACE_S
        notes: dict[int, tuple[Peer, list]] = {}
        with self.lock:
            marked = self._marked
            while marked and (every or marked[0][0] <= now_s):
                _, peer, item = marked.popleft()
                note = notes.get(id(peer))
                if note is None:
                    note = notes[id(peer)] = (peer, [])
                note[1].append(item)
        for peer, items in notes.values():
            self.deferred += len(items)
            self.link.notify(peer, items, [])

    def flush(self) -> None:
        """The engine is closing: the marked loads still in their grace are notified now (while
        the notifier still sends)."""
        if self._marked:
            self._notify_marked(True)

    # --------------------------------------------------------------------------- wait
    def wait_some(self, request_ids: set[str], deadline: float) -> None:
        """Block until a one-sided copy of ``request_ids`` completed, or ``deadline``, or a short
        pause when none of them is in flight here (the messaged path reports through poll)."""
        evs = [f.event for f in self.flights if f.event is not None and f.item.request_id in request_ids]
        if not evs:
            time.sleep(min(2e-4, max(0.0, deadline - time.monotonic())))
            return
        spin_until = time.monotonic() + 2e-4  # a copy about to end: query, yielding the GIL only
        while time.monotonic() < deadline:
            if any(event_done(e) for e in evs):
                return
            time.sleep(0 if time.monotonic() < spin_until else 2e-5)

    def stats(self) -> dict:
        return {
            "loads": self.loads,
            "direct": self.direct,
            "deferred": self.deferred,
            "in_flight": len(self.flights),
            "fallbacks": dict(self.fallbacks),
        }


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
