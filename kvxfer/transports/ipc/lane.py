"""The one-sided mode's native lane: a whole load's lookup and record in one native call at
``load()``, its landing and report in one at ``poll()`` (the control module's ``LoadBook``,
``csrc/ctl/load_lane.h``).

:class:`NativeLane` is what :class:`~kvxfer.transports.ipc.onesided.OneSided` composes when the
control module is built and the CPU keeps the lease-slot protocol's store order. Each target
made for a peer with prepared copies gets its lane (:meth:`NativeLane.attach`: the tuple the
book reads it through); a load of that peer's params then is one ``LoadBook.begin`` call
(:meth:`OneSided.load_native <kvxfer.transports.ipc.onesided.OneSided.load_native>`: the params and
local ids checked, every source rank's slot read, the tracker entry and the flight written, or
nothing written and the Python path takes the load), the copy through the target's prepared
copies (:meth:`NativeLane.copy`, or held for its batch's launch and planned with the batch's
other loads), and ``launched``. ``poll()`` is one ``complete`` call over every flight whose copy
completed (:meth:`NativeLane.complete`): the checks after the copy and the done marks as
:meth:`Target.land <kvxfer.transports.ipc.target.Target.land>` makes them, the tracker's
reports, the metrics in one call, and the notifications the marks leave to the loader.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from ... import tracing
from ...engine_types import describe_error
from ...metrics import now
from ...ordering import event_done
from ...tracing import trace
from .copies import HeldLoad
from .target import Target

if TYPE_CHECKING:  # pragma: no cover
    from ...peer import Peer
    from ...rank import Rank, Runtime

__all__ = ["LaneLink", "NativeLane"]

_LOG = logging.getLogger(__name__)


class LaneLink(Protocol):
    """What the lane uses of the loader (:class:`kvxfer.loader.Loader`): its notifications."""

    def notify_ids(self, peer: Peer, done: list, failed: list) -> None: ...


class NativeLane:
    """The native lane of one loader rank (see the module doc).

    Args:
        book: the rank's ``LoadBook`` (also its load tracker).
        rank, rt: the rank's configuration and runtime.
        link: the rank's loader (notifications).
        need_ns: the lease a read needs left, in ns (what ``begin`` is given).
        mark_later: what defers the notification of a load whose every mark was counted
            (``mark_later((due, peer, params request id, token))``).
    """

    def __init__(
        self, book, rank: Rank, rt: Runtime, link: LaneLink, need_ns: int, mark_later: Callable[[tuple], None]
    ) -> None:
        self.book = book
        self.rank = rank
        self.rt = rt
        self.link = link
        self.need_ns = need_ns
        self.mark_later = mark_later
        rt.metrics.follow(book)  # complete() records the loads it reports: no call per poll()

    def attach(self, peer: Peer, t: Target) -> None:
        """Loads of ``peer``'s params read through target ``t`` from now on, when it has
        prepared copies and the native slot calls (else they keep the Python path)."""
        if t.ctl is None or t.plain is None:
            return
        rank = self.rank
        t.lane = (
            t, t.tables, t.epochs, t.mark_tables, peer.host, peer.port, peer.tp_size,
            peer.spec.block_size, peer.num_blocks, rank.spec.block_size, rank.num_blocks,
            t.per_token, len(t.plain), t.marks_all, peer,
        )  # fmt: skip
        self.book.set_target(peer.engine_id, t)

    def copy(self, request_id: str, params: dict, t: Target, src, dst, num_tokens: int) -> bool:
        """Issue the copy of the load ``LoadBook.begin`` recorded, through ``t``'s prepared copies, and
        mark it launched. False when the session closed since the lookup (the load is dropped
        from the book: the Python path takes it); a copy that raises fails the load by name."""
        book, rt = self.book, self.rt
        session = t.session
        try:
            with session.lock:
                if session.closed:  # the peer was forgotten since the lookup: its mapping may be gone
                    book.drop(request_id)
                    return False
                if rt.order.cuda or tracing.enabled():
                    with trace("copy", request_id), rt.order.on_stream():
                        for c in t.plain:
                            c.run_bounded(src, dst, num_tokens)
                    ev = session.done_event() if rt.order.cuda else None
                else:  # CPU caches, no NVTX: no range, no stream
                    for c in t.plain:
                        c.run_bounded(src, dst, num_tokens)
                    ev = None
        except Exception as e:  # the copy may have written part of the blocks: fail the load
            self.fail(t, [HeldLoad(t, request_id, src, dst, num_tokens, 0.0, params["request_id"], params["token"])],
                      f"one-sided ipc copy: {describe_error(e)}")  # fmt: skip
            return True
        book.launched(request_id, ev)
        return True

    def launched(self, held: list[HeldLoad], ev, calls: int) -> None:
        """The held loads ``held`` were launched together, in ``calls`` ops calls (counted once),
        ``ev`` after them (all marked in one call: a ``poll()`` on another thread sees the whole
        batch launched or none of it, so its event is reported, and recycled, once)."""
        self.book.launched([h.request_id for h in held], ev, calls)

    def fail(self, t: Target, held: list[HeldLoad], why: str) -> None:
        """The loads ``held`` of target ``t`` failed to launch: each one not launched is reported
        failed for ``why`` and the exporter notified of it."""
        book, rt = self.book, self.rt
        failed = [(h.prid, h.token) for h in held if book.cancel(h.request_id, why)]
        if failed:
            rt.metrics.add("failures", len(failed))
            self.link.notify_ids(t.peer, [], failed)

    def complete(self, grace_s: float) -> None:
        """Land and report every flight whose copy completed (``LoadBook.complete``; the one
        native call when they all landed with their done marks): a load whose marks
        every exporter rank counts has its notification deferred by ``grace_s``
        (``mark_later``); here the other loads' notifications and the failures' reasons
        (:meth:`Target.outcome <kvxfer.transports.ipc.target.Target.outcome>`), as the Python
        path makes them. The book records the metrics itself
        (:meth:`kvxfer.metrics.Metrics.follow`)."""
        now_ns = time.monotonic_ns()
        rank = self.rank
        got = self.book.complete(
            now_ns, now(), rank.tp_rank, rank.tp_size, event_done, self.mark_later, now_ns * 1e-9 + grace_s
        )  # fmt: skip
        if got is None:
            return
        results, events, late = got[:3]  # the metrics were recorded by the book (Metrics.follow)
        if events:
            recycled: set[int] = set()  # a batch's loads share one event: back to the pool once
            for lane, ev in events:
                if id(ev) not in recycled:
                    recycled.add(id(ev))
                    lane[0].session.recycle(ev)
        for rid in late:
            _LOG.warning(
                "kvxfer loader %s rank %d: one-sided copy of %s not complete by its deadline; "
                "reported once it completed",
                rank.engine_id, rank.tp_rank, rid,
            )  # fmt: skip
        if not results:
            return
        rt = self.rt
        notes: dict[int, tuple[Peer, list, list]] = {}
        for code, lane, prid, token, rid in results:
            t = lane[0]
            why, _ = t.outcome(code, now_ns)
            if why and rt.loads.fail(rid, why):
                rt.metrics.add("failures")
            note = notes.get(id(t.peer))
            if note is None:
                note = notes[id(t.peer)] = (t.peer, [], [])
            note[2 if why else 1].append((prid, token))
        for peer, done, failed in notes.values():
            self.link.notify_ids(peer, done, failed)

    def events_of(self, request_ids) -> list:
        """The events of the launched flights of ``request_ids`` (what ``wait()`` queries)."""
        return self.book.events_of(request_ids)

    def in_flight(self) -> int:
        """Loads launched and not reported yet."""
        return self.book.in_flight()
