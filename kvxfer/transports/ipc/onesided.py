"""One-sided ``ipc`` reads: a mode of the ipc session in which a load is launched in the
caller's thread, with no message before the copy and none on the critical path after it.

When a loader rank's ipc session with a peer has mapped every source rank
(:mod:`kvxfer.transports.ipc.session`), ``load()`` looks up the request in each source rank's
lease-slot table (:mod:`kvxfer.transports.ipc.slots`; :meth:`Target.read
<kvxfer.transports.ipc.target.Target.read>`, one native call over every source rank): a live
slot bound to the params (a hash of their token, content digest and request id: only the
export's own params find it), whose ready flag is set (the exporter's compute wrote the blocks),
not a layer-wise export, leased for at least ``min(timeout, LEASE_LEFT_S)`` more, on an exporter
that is open and beat recently. If every source rank has one, the loader snapshots the blocks'
epochs between two reads of the slot's generation, and the copy is issued on the load stream
right there
(:func:`kvxfer.transports.ipc.copies.copy_loads`; CUDA: an event from the session's pool is
recorded after it). Anything else returns False, and the load takes the messaged path (lease
grant, then the copy in the worker thread), which names every refusal. The one refusal this
path makes itself is the messaged path's own check of a batch: params another load already
reads (launched or held here and not reported yet, or queued for the loader's next batch) fail
as "loaded twice in one batch". Every word it reads from the table is untrusted (``slots``): a
bad one is no slot. Inside a batch (:meth:`OneSided.hold`, ``TransferEngine.batched_loads()``)
the copy waits for the batch's end, where the held loads of each peer are planned together by
the load planner (:meth:`kvxfer.planner.Planner.plan`) and launched with one event.

``poll()`` (:meth:`OneSided.complete`) queries the events itself. A load whose copy completed is
checked as the messaged path checks it (:meth:`Target.land
<kvxfer.transports.ipc.target.Target.land>`, with its done marks one native call): the slot
still at the same generation and the blocks' epochs unchanged (released meanwhile: the load
fails, its bytes never reported), and the exporter still beating. A landed load is reported
finished and a done mark goes into the slot of every exporter rank the plan has this rank
notify (the exporter frees the blocks at its next ``poll()`` or side-channel tick). When every
such mark was written and its ring entry taken by the native compare-and-swap
(:mod:`kvxfer.transports.ipc.slots`: no mark is lost), the marks free the blocks and the
acknowledged notification is deferred: a later ``poll()`` sends it between ``MARK_GRACE_S`` and
twice that after, at most one message per exporter in each ``MARK_GRACE_S`` for every such load
due by then (``close()``: at once). It then counts nothing, unless a stranger overwrote a mark in
the table (which no table word lets the loader see): it is the record only the loader writes.
Otherwise (a rank past the marks, a rank without a mapped table, a slot not found, the Python
fallback's stores) the notification is queued at once, and a failed load is always notified.

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
from typing import TYPE_CHECKING, Protocol

from ... import tracing
from ...completion import native_load_book
from ...engine_types import LoadItem, describe_error, loaded_twice
from ...grouped import group_items
from ...metrics import now
from ...ordering import event_done
from ...tracing import items_tag, trace
from .copies import HeldLoad, copy_loads, moved
from .lane import NativeLane
from .session import IpcSession
from .target import STALE_S, Target, make_target, stale_ns

if TYPE_CHECKING:  # pragma: no cover
    from ...batching import BatchPlan
    from ...peer import Peer
    from ...rank import Rank, Runtime
    from ...transfer import Route

__all__ = ["CPU_COPY_MAX_BYTES", "LEASE_LEFT_S", "ORDERED_CPU", "STALE_S", "OneSided", "OneSidedLink"]

_LOG = logging.getLogger(__name__)

# The slot protocol relies on stores and loads staying in program order between processes
# (kvxfer.transports.ipc.slots): x86-64 (TSO) keeps them; elsewhere loads take the messaged path.
ORDERED_CPU = platform.machine().lower() in ("x86_64", "amd64")
# On CPU caches the copy runs in the caller's thread (there is nothing to launch): a larger one
# would hold load() for more than about a millisecond, so it goes to the worker thread instead.
CPU_COPY_MAX_BYTES = 16 << 20
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

    queued_keys: set  # the params keys (engine id, request id) waiting for its next batch

    def plan(self, route: Route, src_block_size: int, loads: list, distinct: bool) -> BatchPlan: ...

    def notify(self, peer: Peer, done: list, failed: list) -> None: ...

    def notify_ids(self, peer: Peer, done: list, failed: list) -> None: ...


class Flight:
    """One one-sided load in flight: the load, the params' key (engine id, request id), its
    target, what its lookup read per source rank in the target's order (``(slot, generation,
    snapshot)``: the slot, its generation and the blocks' epochs snapshotted while it stayed at
    that generation), the binding, when it started, the event after its copy (CUDA), its wire
    bytes and ops calls, and whether its deadline passed unfinished."""

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
        self.native = 0  # loads looked up and recorded by the native lane (load_native)
        self.deferred = 0  # landed loads whose marks freed them, notified after the grace
        # (due, peer, params request id, token) of the landed loads whose marks were all
        # written, oldest first, until their notification goes (_notify_marked)
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
        # The native lane (load_native) over the rank's LoadBook, once start() made it (native_book)
        self.lane: NativeLane | None = None
        self._queued_keys = link.queued_keys

    def native_book(self, timeout_s: float):
        """The rank's load tracker as the control module's ``LoadBook``
        (:func:`kvxfer.completion.native_load_book`, sharing this mode's in-flight keys), or
        None without the module (the Python tracker and path). The native lane reads through
        it where the CPU keeps the slot protocol's store order."""
        book = native_load_book(self._active, stale_ns())
        if book is not None and ORDERED_CPU:
            need_ns = int(min(timeout_s, LEASE_LEFT_S) * 1e9)
            self.lane = NativeLane(book, self.rank, self.rt, self.link, need_ns, self._marked.append)
        return book

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
        if t is None:
            t = session.onesided = make_target(self.rank, peer)
            if self.lane is not None and t is not None:  # the native lane's loads read through it
                self.lane.attach(peer, t)
        return t

    def load_native(self, request_id: str, params: dict, block_ids, timeout_s: float) -> bool:
        """:meth:`try_load` in the native lane (:mod:`kvxfer.transports.ipc.lane`): a whole load
        (no tokens held here) of an engine without groups, outside test hooks, from a peer whose
        target has its lane; the params and local ids checked, every source rank's slot read
        and the load recorded in one call, then the copy through the target's prepared copies
        (in a batch, :meth:`hold`: at its end, with the batch's other loads of that peer).
        False: nothing was written, and the engine's Python path takes the load (naming what
        is wrong)."""
        lane = self.lane
        if lane is None:
            return False
        hooks = self.rt.hooks
        if hooks and ("before_ipc_copy" in hooks or "after_ipc_copy" in hooks):
            return False
        cap = CPU_COPY_MAX_BYTES // self._cpu_bpt if self._cpu_bpt else -1
        now_ns = time.monotonic_ns()
        deadline = now_ns * 1e-9 + timeout_s
        try:
            got = lane.book.begin(
                request_id, params, block_ids, self._queued_keys, now_ns, now_ns + lane.need_ns, now(), deadline, cap
            )  # fmt: skip
        except Exception as e:  # begin wrote nothing: the Python path takes the load, naming what is wrong
            _LOG.warning(
                "kvxfer one-sided reads: the native lookup of %r failed (%s: %s); the Python path takes it",
                request_id, type(e).__name__, e,
            )  # fmt: skip
            return False
        if got is None:
            return False
        src, dst, num_tokens, lane_tuple = got
        t = lane_tuple[0]
        held = getattr(self._local, "held", None) if self._batches else None
        if held is not None:  # launched with the batch's other loads of this peer when it closes
            if self._cpu_bpt:
                size = num_tokens * self._cpu_bpt
                if held[1] + size > CPU_COPY_MAX_BYTES:  # the caller copies on CPU: bounded per launch
                    self._launch_held()
                    held = self._local.held
                held[1] += size
            prid, token = params["request_id"], params["token"]
            held[2].append(HeldLoad(t, request_id, src, dst, num_tokens, deadline, prid, token))
        elif not lane.copy(request_id, params, t, src, dst, num_tokens):
            return False
        self.loads += 1
        self.native += 1
        return True

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
        try:
            got = t.read(p, ids, now_ns, need_ns, gs is None)
        except Exception as e:  # the lookup writes nothing: the messaged path loads it, or names why not
            _LOG.warning(
                "kvxfer one-sided reads: the lookup of %r failed (%s: %s); it takes the messaged path",
                item.request_id, type(e).__name__, e,
            )  # fmt: skip
            return self._no(f"lookup failed: {type(e).__name__}")
        if type(got) is str:
            return self._no(got)  # the messaged path loads it (and names a bad params' problem)
        b, reads = got
        key = (p.engine_id, p.request_id)
        if key in self._active or key in self._queued_keys:
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

    def _launch(self, t: Target, group: list[Flight], lanes: list[HeldLoad] | tuple = ()) -> bool:
        """Issue the copies of ``group`` (flights of target ``t``) and of the native lane's held
        ``lanes`` of it on the load stream, planned together, one event after them (CUDA; a
        second for ``lanes`` when both are there: each side reports, and recycles, its own);
        False when the session closed since their lookup (nothing written)."""
        session, rt = t.session, self.rt
        items = [f.item for f in group]
        items += lanes
        with session.lock:
            if session.closed:  # the peer was forgotten since the lookup: its mapping may be gone
                return False
            hook = rt.hooks.get("before_ipc_copy")
            if hook:
                hook()
            rank = self.rank
            if rt.order.cuda or tracing.enabled():
                with trace("copy", items_tag, items), rt.order.on_stream():
                    calls, direct = copy_loads(t, rank, self.link.plan, items)
            else:  # CPU caches, no NVTX: no range to open, no stream to enter (two contexts per load)
                calls, direct = copy_loads(t, rank, self.link.plan, items)
            ev = session.done_event() if rt.order.cuda else None
            ev_lanes = session.done_event() if rt.order.cuda and group and lanes else ev
        if lanes:  # the native lane's first (a batch's calls counted once)
            self.lane.launched(lanes, ev_lanes, 0 if group else calls)
        if direct:
            self.direct += len(items)
        per_token = t.per_token
        for k, f in enumerate(group):
            f.event, f.calls = ev, calls if k == 0 else 0
            it = f.item
            f.moved = (it.num_tokens - it.first) * per_token if it.groups is None else moved(t, rank, it)
        return True

    # -------------------------------------------------------------------------- batch
    def hold(self) -> None:
        """Open a batch on this thread: one-sided loads are looked up and snapshotted as they
        come, and launched together at :meth:`release` (one ops call per read and source rank
        for all of them, one event) instead of one launch each. Nests."""
        depth = getattr(self._local, "depth", 0)
        if not depth:
            self._local.held = [[], 0, []]  # flights, CPU bytes, the native lane's loads
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
        """Launch the loads held so far (the Python path's flights and the native lane's): per
        peer one launch (:meth:`_launch`); a load whose launch failed, or whose peer was
        forgotten since its lookup, is reported failed. Should anything escape (a failure's
        report raising, an interrupt), the peers not launched yet fail their loads first: none
        is left held."""
        held = self._local.held
        self._local.held = [[], 0, []]
        by_target: dict[int, tuple[Target, list[Flight], list[HeldLoad]]] = {}
        for f in held[0]:
            by_target.setdefault(id(f.target), (f.target, [], []))[1].append(f)
        for h in held[2]:
            by_target.setdefault(id(h.target), (h.target, [], []))[2].append(h)
        left = list(by_target.values())
        try:
            while left:
                self._launch_target(*left[-1])
                left.pop()
        finally:
            for t, group, lanes in left:  # only when something escaped
                self._fail_target(t, group, lanes, "one-sided ipc copy: the batch's launch was interrupted")

    def _launch_target(self, t: Target, group: list[Flight], lanes: list[HeldLoad]) -> None:
        """:meth:`_launch` of one peer's held loads; a failed launch fails them."""
        try:
            if not self._launch(t, group, lanes):
                raise RuntimeError("the exporter's mapping was dropped before the launch")
        except Exception as e:  # the copy may have written part of the blocks: fail the loads
            self._fail_target(t, group, lanes, f"one-sided ipc copy: {describe_error(e)}")
            return
        if group:
            with self.lock:
                self.flights.extend(group)

    def _fail_target(self, t: Target, group: list[Flight], lanes: list[HeldLoad], why: str) -> None:
        """One peer's held loads failed to launch: each reported failed for ``why``."""
        for f in group:
            self._report(f, why)
        if lanes:
            self.lane.fail(t, lanes, why)

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
        lane = self.lane
        if lane is not None and lane.book.in_flight():
            lane.complete(MARK_GRACE_S)
        if not self.flights:
            return
        with self.lock:
            flights, self.flights = self.flights, []
        still = []
        notes: dict[int, tuple[Peer, list, list]] = {}
        now_ns = time.monotonic_ns()
        recycled: set[int] = set()  # a batch's loads share one event: back to the pool once
        asked: dict[int, bool] = {}  # once per event: a batch's loads are reported together
        for f in flights:
            ev = f.event
            done = True if ev is None else asked.get(id(ev))
            if done is None:
                done = asked[id(ev)] = event_done(ev)
            if not done:
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
        """The check after a completed copy and, when it landed, the done marks
        (:meth:`Target.land <kvxfer.transports.ipc.target.Target.land>`): ``("", marked)`` or
        ``(why not, False)``."""
        rank = self.rank
        hook = self.rt.hooks.get("after_ipc_copy")
        return f.target.land(f.item.src_ids, f.reads, f.binding, rank.tp_rank, rank.tp_size, now_ns, hook)

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
                p = item.params
                with self.lock:
                    self._marked.append((time.monotonic() + MARK_GRACE_S, peer, p.request_id, p.token))
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
                _, peer, prid, token = marked.popleft()
                note = notes.get(id(peer))
                if note is None:
                    note = notes[id(peer)] = (peer, [])
                note[1].append((prid, token))
        for peer, loads in notes.values():
            self.deferred += len(loads)
            self.link.notify_ids(peer, loads, [])

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
        if self.lane is not None:
            evs += self.lane.events_of(request_ids)
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
            "native": self.native,
            "deferred": self.deferred,
            "in_flight": len(self.flights) + (self.lane.in_flight() if self.lane is not None else 0),
            "fallbacks": dict(self.fallbacks),
        }
