"""One-sided ``ipc`` reads: a load launched in the caller's thread, with no message before the
copy and none on the critical path after it.

When a loader rank has already mapped the exporter ranks of a remote engine (an earlier load
handshook and mapped them, :mod:`kvxfer.transports.ipc.transport`), ``load()`` looks up the
request in each source rank's lease-slot table (:mod:`kvxfer.transports.ipc.slots`): a live
slot bound to the params (a hash of their token, content digest and request id: only the
export's own params find it), whose ready flag is set (the exporter's compute wrote the blocks),
not a layer-wise export, leased for longer than the load's timeout, on an exporter that is open
and beat recently. If every source rank has one, the loader snapshots the blocks' epochs
between two reads of the slot's generation, and issues the copy on its load stream right there
(:func:`kvxfer.transports.ipc.read.launch`; CUDA: an event from a pool is recorded after it).
Anything else returns False, and the load takes the messaged path (lease grant, then the copy
in the worker thread), which names every refusal. The one refusal this path makes itself is
the messaged path's own check of a batch: params another load already reads (launched or held
here and not reported yet, or queued for the loader's next batch) fail as "loaded twice in one
batch". Every word it reads from the table is untrusted (``slots``): a bad one is no slot.
Inside a batch (:meth:`OneSided.hold`, ``TransferEngine.batched_loads()``) the copy waits for
the batch's end, where the held loads of each remote are launched together through the
messaged path's batch planner (:func:`kvxfer.transports.ipc.read.launch`), with one event.

``poll()`` (:meth:`OneSided.complete`) queries the events itself. A load whose copy completed is
checked as the messaged path checks it: the slot still at the same generation and the blocks'
epochs unchanged (released meanwhile: the load fails, its bytes never reported), and the
exporter still beating. A landed load is reported finished, a done mark goes into the slot of
every exporter rank the plan has this rank notify (the exporter frees the blocks at its next
``poll()``), and the acknowledged notification is still queued, for a mark that was missed.

The guarantees are those of the messaged path (DESIGN, "Completion"): the snapshot is taken while
the export is live, the check after the copy catches a release, the GPU work completes before a
load is reported or the exporter frees, the ready flag is the exporter's ready gate, and the
exporter counts each loader rank once whether it marks done or notifies.
"""

from __future__ import annotations

import logging
import platform
import threading
import time
from typing import TYPE_CHECKING

from ... import idops, ops
from ...engine_types import LoadItem, Remote, describe_error, loaded_twice
from ...metrics import now
from ...ordering import event_done
from ...tracing import items_tag, trace
from . import slots
from .read import launch

if TYPE_CHECKING:  # pragma: no cover
    from ...rank import Rank, Runtime
    from ..base import LoaderLink
    from .transport import IpcTransport

__all__ = ["CPU_COPY_MAX_BYTES", "ORDERED_CPU", "STALE_S", "OneSided"]

_LOG = logging.getLogger(__name__)

# The slot protocol relies on stores and loads staying in program order between processes
# (kvxfer.transports.ipc.slots): x86-64 (TSO) keeps them; elsewhere loads take the messaged path.
ORDERED_CPU = platform.machine().lower() in ("x86_64", "amd64")
# On CPU caches the copy runs in the caller's thread (there is nothing to launch): a larger one
# would hold load() for more than ~1 ms (~20 GB/s here), so it goes to the worker thread instead.
CPU_COPY_MAX_BYTES = 16 << 20
STALE_S = 2.0  # an exporter that has not beat for this long is not read one-sided (it beats every 20 ms)
_STALE_NS = int(STALE_S * 1e9)
_POOL_MAX = 64  # completion events kept for reuse


def _copy_whole(whole: tuple, item: LoadItem) -> tuple[int, int]:
    """Issue the copies of a whole load (:meth:`OneSided._whole`'s arguments): (wire bytes, calls)."""
    src_bound, dst_bound, copies = whole
    n = item.num_tokens
    src_ids = ops.CheckedIds(item.src, src_bound, False)
    dst_ids = ops.CheckedIds(item.dst, dst_bound, True)
    moved = 0
    for copy, per_token in copies:
        copy(src_ids, dst_ids, n)
        moved += n * per_token
    return moved, len(copies)


class _Target:
    """A mapped remote as the one-sided path reads it: per source rank (rank, its slot view, its
    mapping, the plan's reads of it), and where a landed load marks done; ``epoch``: the ipc
    transport's count of forgotten remotes when it was made (a change means a mapping may be
    gone)."""

    __slots__ = ("bind", "epoch", "marks", "rem", "sources")

    def __init__(self, rem: Remote, epoch: int, sources: list, marks: list) -> None:
        self.rem = rem
        self.epoch = epoch
        self.sources = sources
        self.marks = marks  # per exporter rank this rank notifies: (its slot view, index in sources or -1)
        self.bind = slots.binder()  # slots.binding, native when the module is in use


class _Flight:
    """One one-sided load in flight: the load, its target (remote), per source rank (rank, its
    slot view, slot, generation, mapping, the epochs' snapshot, reads), and the event after its
    copy."""

    __slots__ = ("b", "calls", "checks", "event", "item", "key", "late", "moved", "t0", "target")

    def __init__(
        self, item: LoadItem, target: _Target, checks: list, b: tuple[int, int], t0: float, key: tuple
    ) -> None:
        self.item = item
        self.key = key  # (engine id, request id) of the params
        self.target = target
        self.checks = checks
        self.b = b
        self.t0 = t0
        self.event = None
        self.moved = 0
        self.calls = 0
        self.late = False


class OneSided:
    """The one-sided path of one loader rank (see the module doc).

    Args:
        rank: the rank's shared state.
        loader: the rank's loader (:class:`~kvxfer.transports.LoaderLink`: its handshaken
            remotes, its notifications).
        ipc: the rank's :class:`~kvxfer.transports.ipc.transport.IpcTransport` (its mappings).

    ``loads``: loads read one-sided so far; ``fallbacks``: why a load took the messaged path,
    counted by reason (both in ``stats()["onesided"]``)."""

    def __init__(self, rank: Rank, rt: Runtime, loader: LoaderLink, ipc: IpcTransport) -> None:
        self.rank = rank
        self.rt = rt
        self.loader = loader
        self.ipc = ipc
        if not ORDERED_CPU:
            _LOG.warning(
                "kvxfer engine %s rank %d: one-sided reads off on %s (the lease-slot protocol needs "
                "x86-64's store order); ipc loads take the messaged path",
                rank.engine_id, rank.tp_rank, platform.machine(),
            )  # fmt: skip
        self.flights: list[_Flight] = []
        self.loads = 0
        self.fallbacks: dict[str, int] = {}
        self._pool: list = []
        self._targets: dict[str, _Target] = {}
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
        self.fallbacks[why] = self.fallbacks.get(why, 0) + 1
        return False

    def _target(self, rem: Remote) -> _Target | None:
        """What a one-sided read of ``rem`` needs per source rank, made once per mapping of it
        (None while a source rank is not mapped yet)."""
        t = self._targets.get(rem.engine_id)
        ipc = self.ipc
        if t is not None and t.rem is rem and t.epoch == ipc.epoch:
            return t
        views = ipc.slot_views(rem)
        if views is None:
            return None
        sources = []
        for s in rem.src_ranks:
            v, m = views[s], ipc.mapped(rem, s)
            if v is None or m is None or not v.of(rem.replies[s].incarnation):
                return None  # not mapped yet, or a table of another start of that rank
            sources.append((s, v, m, rem.reads_by_rank[s], self._whole(rem, m, rem.reads_by_rank[s])))
        ranks = [src[0] for src in sources]
        marks = [
            (views[s], ranks.index(s) if s in ranks else -1)
            for s in rem.notify_to
            if s < len(views) and views[s] is not None
        ]
        t = self._targets[rem.engine_id] = _Target(rem, ipc.epoch, sources, marks)
        return t

    def _whole(self, rem: Remote, m, reads: list) -> tuple:
        """What the copy of a whole load (no tokens held here) from mapping ``m`` needs besides
        its ids: both sides' id bounds, and per read an :class:`~kvxfer.ops.PreparedCopy` between
        the whole-block views and its wire bytes per token. Made once per target."""
        rank = self.rank
        sv, dv = m.views.whole, rank.views.whole
        su, du = sv.unit, dv.unit
        copies = [
            (
                ops.PreparedCopy(sv.caches, dv.caches, r.src_head_start, r.dst_head_start, r.num_heads),
                rank.spec.bytes_per_token(num_heads=r.num_heads),
            )
            for r in reads
        ]
        src_bound = rem.num_blocks * (rem.spec.block_size // su)
        dst_bound = rank.num_blocks * (rank.spec.block_size // du)
        return src_bound, dst_bound, copies

    def try_load(self, item: LoadItem, timeout_s: float) -> bool:
        """Launch ``item`` one-sided if it can be (see the module doc); False: queue it for the
        messaged path (nothing was written)."""
        rt = self.rt
        if not ORDERED_CPU:
            return self._no("weakly ordered CPU")
        p = item.params
        rem = self.loader.remotes.get(p.engine_id)
        if rem is None or not rem.serves(p):
            return self._no("not handshaken")
        if rem.transport != "ipc":
            return self._no(f"transport {rem.transport}")
        t = self._target(rem)
        if t is None:
            return self._no("not mapped")
        if self._cpu_bpt and (p.num_tokens - item.first) * self._cpu_bpt > CPU_COPY_MAX_BYTES:
            return self._no("CPU copy too large for the caller")
        ids = item.src_ids
        if ids.size != rem.spec.num_blocks_for(p.num_tokens) or idops.max_id(ids) >= rem.num_blocks:
            return self._no("bad params")  # the messaged path names the problem
        key = (p.engine_id, p.request_id)
        if key in self._active or key in self.loader.incoming_keys:
            # The same params already in this batch (read here, or queued for the messaged path,
            # whose batch check refuses a repeat the same way); a load that would not be read
            # here anyway was handed to the messaged path above, which checks its own batch.
            if self.rt.loads.fail(item.request_id, loaded_twice(p.request_id)):
                self.rt.metrics.add("failures")
            return True
        try:
            b0, b1 = b = t.bind(p.token, p.digest(), p.request_id)
        except ValueError:
            return self._no("bad params")  # a token not ASCII: the messaged path refuses it
        now_ns = time.monotonic_ns()
        need_ns = now_ns + int(timeout_s * 1e9)
        checks = []
        for s, v, m, reads, whole in t.sources:
            got = v.read(b0, b1, now_ns, _STALE_NS, need_ns, m.epochs_np, ids)
            if type(got) is str:
                return self._no(got)
            checks.append((s, v, got[0], got[1], m, got[2], reads, whole))
        f = _Flight(item, t, checks, b, now(), key)
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
            self._active.add(f.key)
            self.loads += 1
            return True
        rank, ipc = self.rank, self.ipc
        try:
            with ipc.lock, trace("copy", items_tag, [item]):
                if t.epoch != ipc.epoch:  # a remote was forgotten meanwhile: its mapping may be gone
                    return self._no("not mapped")
                hook = rt.hooks.get("before_ipc_copy")
                if hook:
                    hook()
                with rt.order.on_stream():
                    for c in checks:
                        if item.first:  # a partial load: planned as the messaged path plans it
                            mv, _, n = launch(rank, c[4], rem, c[6], [item])
                        else:
                            mv, n = _copy_whole(c[7], item)
                        f.moved, f.calls = f.moved + mv, f.calls + n
                    if rt.order.cuda:
                        f.event = self._done_event(rem)
        except Exception as e:  # the copy may have written part of the blocks: fail the load
            self.loads += 1
            self._report(f, f"one-sided ipc copy: {describe_error(e)}")
            return True
        self.loads += 1
        self._active.add(f.key)
        with self.lock:
            self.flights.append(f)
        return True

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

    def _launch_held(self) -> None:
        """Launch the loads held so far: per remote one launch of the plan's reads per source
        rank (:func:`kvxfer.transports.ipc.read.launch`, the messaged path's batch planner), one
        event for all; a load whose launch failed is reported failed."""
        held = self._local.held
        flights, self._local.held = held[0], [[], 0]
        by_target: dict[int, list[_Flight]] = {}
        for f in flights:
            by_target.setdefault(id(f.target), []).append(f)
        for group in by_target.values():
            self._launch_group(group)

    def _launch_group(self, group: list[_Flight]) -> None:
        rt = self.rt
        t = group[0].target
        rem, rank, ipc = t.rem, self.rank, self.ipc
        items = [f.item for f in group]
        try:
            with ipc.lock, trace("copy", items_tag, items):
                if t.epoch != ipc.epoch:  # a remote was forgotten since the loads were looked up
                    raise RuntimeError("the exporter's mapping was dropped before the launch")
                hook = rt.hooks.get("before_ipc_copy")
                if hook:
                    hook()
                calls = 0
                with rt.order.on_stream():
                    for c in group[0].checks:
                        calls += launch(rank, c[4], rem, c[6], items)[2]
                    ev = self._done_event(rem) if rt.order.cuda else None
        except Exception as e:  # the copy may have written part of the blocks: fail the loads
            for f in group:
                self._report(f, f"one-sided ipc copy: {describe_error(e)}")
            return
        # wire bytes per token of every read of every source rank (_whole keeps them per read)
        per_token = sum(pt for c in group[0].checks for _, pt in c[7][2])
        for k, f in enumerate(group):
            f.event, f.calls = ev, calls if k == 0 else 0  # the batch's calls counted once
            f.moved = (f.item.num_tokens - f.item.first) * per_token
        with self.lock:
            self.flights.extend(group)

    def _done_event(self, rem: Remote):
        """An event (pooled) recorded on the load stream after the copies just queued from
        ``rem``, also in the ipc transport's busy list of ``rem`` (a close of the mapping waits
        for it; completed ones are pruned once it holds 16)."""
        import torch

        ev = self._pool.pop() if self._pool else torch.cuda.Event()
        ev.record(self.rt.order.stream("load"))
        busy = self.ipc.busy.setdefault(id(rem), [])
        if len(busy) >= 16:
            busy[:] = [e for e in busy if not event_done(e)]
        busy.append(ev)
        return ev

    # ----------------------------------------------------------------------- complete
    def complete(self) -> None:
        """Check and report every one-sided load whose copy completed (``poll()`` calls it); one
        notification per remote for all of them."""
        if not self.flights:
            return
        with self.lock:
            flights, self.flights = self.flights, []
        still = []
        notes: dict[int, tuple[Remote, list, list]] = {}
        now_ns = time.monotonic_ns()
        pooled: set[int] = set()  # a batch's loads share one event: back to the pool once
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
            self._report(f, self._check(f, now_ns), notes)
            if ev is not None and len(self._pool) < _POOL_MAX and id(ev) not in pooled:
                pooled.add(id(ev))
                self._pool.append(ev)
        for rem, done, failed in notes.values():
            self.loader.notify(rem, done, failed)
        if still:
            with self.lock:
                self.flights[:0] = still

    def _check(self, f: _Flight, now_ns: int) -> str:
        """The check after a completed copy: "" when the load landed, else why not."""
        hook = self.rt.hooks.get("after_ipc_copy")
        ids = f.item.src_ids
        for s, v, i, g, m, snap, *_ in f.checks:
            if hook:
                hook(m.epochs)
                now_ns = time.monotonic_ns()
            # released first: an exporter that closed released every export before it shut,
            # so that is what happened to the blocks (the messaged path says the same)
            got = v.check(i, g, m.epochs_np, ids, snap, now_ns, _STALE_NS)
            if got == 1:
                return f"exporter rank {s}: blocks released before or during the copy (lease ended); not delivered"
            if got:  # nothing released, but the exporter stopped beating (killed, hung)
                return f"exporter rank {s}: {v.alive(_STALE_NS, now_ns) or 'stopped'}"
        return ""

    def _report(self, f: _Flight, why: str, notes: dict | None = None) -> None:
        """Report ``f`` once: landed (``why`` empty: done marks in the slots) or failed for
        ``why``; its notification goes into ``notes`` (remote -> loads), or now."""
        rt = self.rt
        rank, item, rem = self.rank, f.item, f.target.rem
        self._active.discard(f.key)
        t = now()
        if why:
            rt.metrics.record_load(f.t0, t, 0, f.calls, [])
            if rt.loads.fail(item.request_id, why):
                rt.metrics.add("failures")
        else:
            rt.metrics.record_load(f.t0, t, f.moved, f.calls, rt.loads.finish_many([item.request_id], t))
            checks = f.checks
            for v, k in f.target.marks:
                i, g = (checks[k][2], checks[k][3]) if k >= 0 else v.find(*f.b)
                if i >= 0:
                    v.mark_done(i, g, rank.tp_rank, rank.tp_size)
        if notes is None:
            self.loader.notify(rem, [] if why else [item], [item] if why else [])
            return
        note = notes.get(id(rem))
        if note is None:
            note = notes[id(rem)] = (rem, [], [])
        note[2 if why else 1].append(item)

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
        return {"loads": self.loads, "in_flight": len(self.flights), "fallbacks": dict(self.fallbacks)}
