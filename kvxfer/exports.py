"""The exporter's lease table (:class:`ExportTracker`): exported requests, their leases and
notifications.

A request's blocks are held until it has received the number of notifications the transfer
plan says this rank must expect (a property of the pair of engines, known from the loader's TP
size), or until its lease expires. Blocks shared by several held requests (n>1 prefixes) are
refcounted; when a block's refcount drops to zero its *epoch* is bumped, so a loader that copies
straight out of this rank's memory (``ipc``) can tell, after the copy, whether the blocks were
released while it read them. What it finishes or expires goes out through ``poll()``
(:class:`~kvxfer.completion.PollResult`). A :class:`LeaseListener` subscribed to the tracker
(the ``ipc`` transport's lease-slot table) follows every lease it opens, renews and ends.

With the control module loaded, the records live in its ``ExportBook`` (``csrc/ctl/export_book.h``):
an export's checks, hold and record are one call, and a lease-slot table the tracker follows
(:meth:`ExportTracker.follow_slots`) is written by that call too, its done marks counted in one
more; the tracker's Python reads the same records. Without it, the Python below does the same.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from . import idops
from .completion import PollResult
from .export_records import ALTERED, MAX_FORGED, OTHER_EXPORT, ExportRecord, Verify, counted, verified
from .limits import MAX_LEASE_S
from .ordering import event_done

_LOG = logging.getLogger(__name__)

UNKNOWN = "unknown: not exported here (yet)"
_INT64 = np.dtype(np.int64)
RELEASED = "released: lease expired, aborted or already freed"
GONE_KEPT = 100_000  # released request ids remembered (generation, token), oldest forgotten first
# ... in batches, once this many more were released: a dict finds its oldest key by scanning
# past the ones deleted before it, so forgetting one per release made every release pay that
# scan once GONE_KEPT were reached, tens of us more each (profiling/bench_export_records.py)
GONE_SLACK = max(1, GONE_KEPT // 64)


def _ctl():
    """The control module when it is in use (its ``ExportBook`` then holds the records), else None."""
    return idops.native()


__all__ = ["ALTERED", "MAX_FORGED", "OTHER_EXPORT", "RELEASED", "UNKNOWN", "ExportTracker", "LeaseListener"]


class LeaseListener(Protocol):
    """What follows the tracker's leases (:meth:`ExportTracker.subscribe`; the ``ipc``
    transport's lease-slot table, :class:`kvxfer.transports.ipc.leases.LeaseSlots`). Called
    under the tracker's lock; none of them may raise."""

    def opened(
        self, request_id: str, token: str, digest: bytes, deadline: float, ready: bool, layerwise: bool
    ) -> None:
        """A lease was opened (``ready``: the compute that wrote its blocks completed)."""

    def renewed(self, request_id: str, deadline: float) -> None:
        """A lease now ends at ``deadline`` (monotonic)."""

    def closed(self, request_id: str) -> None:
        """A lease ended; its blocks' epochs move right after."""


class ExportTracker:
    """Requests this rank exported, their leases, notification counts and block epochs.

    ``epochs`` is an int64 tensor ``[num_blocks]`` (in shared memory when the rank offers
    ``ipc``); ``refcount`` counts live exports holding each block. Both are updated through
    numpy views of the same memory (a fancy-indexed numpy op costs less per call than the torch
    op it replaced), or natively by :mod:`kvxfer.idops` and the control module's ``ExportBook``,
    which then holds the records (``live``, ``gone``) this class reads.
    """

    def __init__(self, num_blocks: int, lease_s: float, epochs: torch.Tensor | None = None) -> None:
        if not 0 < lease_s < MAX_LEASE_S:
            raise ValueError(f"lease_s: must be > 0 and < {MAX_LEASE_S:.0f} seconds, got {lease_s!r}")
        self.lease_s = lease_s
        self.num_blocks = num_blocks
        self.epochs = epochs if epochs is not None else torch.zeros(num_blocks, dtype=torch.int64)
        self.refcount = torch.zeros(num_blocks, dtype=torch.int32)
        self._ep = self.epochs.numpy()
        self._rc = self.refcount.numpy()
        self.lock = threading.RLock()
        mod = _ctl()
        self._book = mod.ExportBook(self._rc, self._ep, GONE_KEPT, GONE_SLACK) if mod is not None else None
        self._live: dict[str, ExportRecord] = self._book.live if self._book is not None else {}
        # no live export's lease ends before this (monotonic): expire() looks at none until then
        self._no_expiry_before = 0.0
        # exports freed because every loader rank notified or marked done (stats()
        # "finished_exports"): counted here, under the lock the release holds anyway
        self.finished_exports = 0
        self._finished: set[str] = set()
        self._expired: set[str] = set()
        self._errors: dict[str, str] = {}
        # recently released ids -> (generation, token) (bounded): told apart from unknown ones,
        # and the next export of the id gets the next generation (a token of its own)
        self._gone: dict[str, tuple[int, str]] = self._book.gone if self._book is not None else {}
        # CUDA gathers reading a request's blocks that may not have run yet (pg exports): the
        # request's release is reported (finished_sending / expired) only once they completed,
        # so the caller cannot reuse the blocks before the gather read them.
        self._inflight: dict[str, list] = {}
        self._deferred: list[tuple[str, str, list]] = []  # (request id, "finished"|"expired", events)
        self._listeners: tuple[LeaseListener, ...] = ()  # subscribe()

    def subscribe(self, listener: LeaseListener) -> None:
        """Have ``listener`` follow every lease opened, renewed and ended from now on."""
        with self.lock:
            self._listeners = (*self._listeners, listener)

    def follow_slots(self, table, gens, used, owner: dict, unready: dict, on_full) -> bool:
        """Have the control module's book write the lease-slot table itself (what a
        :class:`~kvxfer.transports.ipc.leases.LeaseSlots` listener does, in the calls that open,
        renew and end each lease, and :meth:`take_marks`): ``table``, ``gens``, ``used``,
        ``owner`` and ``on_full`` as :meth:`kvxfer.transports.ipc.slots.ExporterSlots.native_state`
        gives them, ``unready`` the dict of slots whose ready flag is not set yet, kept by the
        book. False without the control module (subscribe a listener instead)."""
        if self._book is None:
            return False
        with self.lock:
            self._book.attach(table, gens, used, owner, unready, on_full)
        return True

    # ------------------------------------------------------------------ export
    def add(
        self,
        request_id: str,
        block_ids: np.ndarray | torch.Tensor,
        num_tokens: int,
        num_layers: int = 0,
        token: str = "",
        digest: bytes = b"",
        gen: int = 0,
        ready: bool = True,
        groups: tuple[int, ...] | None = None,
    ) -> None:
        """Hold ``block_ids`` (int, in range; the tracker keeps the array) for ``request_id``.
        ``num_layers > 0``: a layer-wise export, no layer ready until :meth:`mark_layers`.
        ``token``, ``digest``, ``gen``: the export's auth token, content digest and generation
        (:mod:`kvxfer.auth`), checked by :meth:`grant` and the like while it is live.
        ``ready``: the compute that wrote the blocks has completed (told to the listeners).
        ``groups``: a request of several KV cache groups, ids per group (:mod:`kvxfer.grouped`)."""
        ids = block_ids
        if type(ids) is not np.ndarray or ids.dtype is not _INT64 or not ids.flags.c_contiguous:
            ids = np.ascontiguousarray(block_ids, dtype=np.int64)
        with self.lock:
            if self._book is not None:  # the same checks, hold, record and slot, in one call
                marked = np.zeros(num_layers, dtype=bool) if num_layers else None
                deadline = time.monotonic() + self.lease_s
                self._book.add(
                    request_id, ids, num_tokens, deadline, token, digest, gen, groups, marked, ready
                )
                for listener in self._listeners:
                    listener.opened(request_id, token, digest, deadline, ready, bool(num_layers))
                return
            if request_id in self._live:
                raise ValueError(f"request_id: {request_id!r} is already exported and not yet released")
            gone = self._gone.get(request_id)
            if token and gone is not None and gone[1] == token:
                raise ValueError(
                    f"token: already used by an earlier export of {request_id!r} (released); "
                    "each export needs a token of its own"
                )
            # One count per live export holding a block (a block listed twice counts once,
            # and is released once).
            idops.hold(self._rc, ids)
            e = ExportRecord(ids, num_tokens, time.monotonic() + self.lease_s, token, digest, gen, groups)
            if num_layers:
                e.marked = np.zeros(num_layers, dtype=bool)
            self._live[request_id] = e
            for listener in self._listeners:
                listener.opened(request_id, token, digest, e.deadline, ready, bool(num_layers))

    def export_plain(
        self, request_id: str, block_ids: list, num_tokens: int, blocks_for, secret, token, order, ready
    ) -> tuple[str, list] | None:
        """:meth:`add` of a plain export (one KV cache group, not layer-wise, ids in a list) with
        what ``export()`` makes before it, in one native call: the first ``blocks_for(num_tokens)``
        ids checked, the generation, the content digest and the token (made by ``secret``, an
        :class:`~kvxfer.auth.EngineSecret`, or ``token`` verified to be its), after its compute's
        gate is set in ``order`` from ``ready`` (:meth:`kvxfer.ordering.StreamOrder.mark`).
        Returns (the token, the ids its params carry: a copy of the caller's first ids when each
        is exactly an int, else the checked ids as ints).
        None, with nothing written, for any export the Python path names a problem of (or
        without the control module, or while a listener follows the leases): ``export()`` takes
        that path then."""
        book = self._book
        if (
            book is None
            or self._listeners
            or type(request_id) is not str
            or not request_id
            or type(num_tokens) is not int
            or num_tokens < 1
        ):
            return None
        need = blocks_for(num_tokens)
        if len(block_ids) < need:
            return None
        listed = block_ids[:need]  # read before any Python code runs (an item's __index__)
        try:
            gated, undo = order.mark(request_id, ready)  # before the record: no grant sees it ungated
        except ValueError:
            return None  # ready is not events: named by the Python path, after what it checks first
        try:
            with self.lock:
                got = book.export(
                    request_id, listed, need, num_tokens, time.monotonic() + self.lease_s,
                    secret.secret, token, not gated, np.frombuffer, _INT64,
                )  # fmt: skip
        except BaseException:
            order.restore(request_id, undo)
            raise
        if got is None:
            order.restore(request_id, undo)  # no export: the gates as they were
            return None
        tok, ids, exact = got
        return tok, listed if exact else ids.tolist()

    def generation(self, request_id: str) -> int:
        """The generation the next export of ``request_id`` gets: 0, or one more than the last
        export of it that is remembered released (:mod:`kvxfer.auth`: the token's nonce)."""
        gone = self._gone.get(request_id)
        return 0 if gone is None else gone[0] + 1

    def mark_layers(self, request_id: str, layers: np.ndarray, events: list) -> None:
        """Layers ``layers`` (bool mask) of a layer-wise export are written once ``events``
        (``query()``) completed; ``ValueError`` naming the problem otherwise."""
        with self.lock:
            e = self._live.get(request_id)
            if e is None:
                raise ValueError(
                    f"request_id: {request_id!r} is not exported here (never, or released, expired or aborted)"
                )
            if e.marked is None:
                raise ValueError(
                    f"request_id: {request_id!r} was exported whole, not layer-wise (streaming=True)"
                )
            twice = np.flatnonzero(e.marked & layers)
            if twice.size:
                raise ValueError(f"layers: layer {int(twice[0])} of {request_id!r} is already marked ready")
            e.marked |= layers
            if events:
                e.gates.append((layers, list(events)))

    def layers_ready(self, request_id: str) -> np.ndarray | None:
        """Layers of ``request_id`` a loader may read now (marked, their events complete); None
        for a whole export (all of them). Call under :attr:`lock`."""
        e = self._live.get(request_id)
        if e is None or e.marked is None:
            return None
        if not e.gates:
            return e.marked
        ready = e.marked.copy()
        still = []
        for layers, evs in e.gates:
            evs = [x for x in evs if not event_done(x)]
            if evs:
                ready &= ~layers
                still.append((layers, evs))
        e.gates = still
        return ready

    def _release_many(self, request_ids) -> list[str]:
        """Drop live exports (under :attr:`lock`): their blocks one holder less each, the
        epochs of blocks no export holds now bumped; remembered as gone (bounded). An id not
        live (named twice, or released meanwhile) is skipped. Returns the ids released."""
        listeners = self._listeners
        if self._book is not None:
            if listeners:  # each lease ends before any epoch moves
                for rid in dict.fromkeys(rid for rid in request_ids if rid in self._live):
                    for listener in listeners:
                        listener.closed(rid)
            return self._book.release_many(request_ids)
        live, gone, rc, ep, release = self._live, self._gone, self._rc, self._ep, idops.release
        out = []
        for rid in request_ids:
            e = live.pop(rid, None)
            if e is None:
                continue
            out.append(rid)
            for listener in listeners:  # before the epochs move (kvxfer.transports.ipc.slots)
                listener.closed(rid)
            release(rc, ep, e.block_ids)
            gone.pop(rid, None)  # re-inserted last: the newest release is forgotten last
            gone[rid] = (e.gen, e.token)
        if len(gone) > GONE_KEPT + GONE_SLACK:
            for rid in list(itertools.islice(gone, len(gone) - GONE_KEPT)):
                del gone[rid]
        return out

    def grant(
        self,
        request_ids: list[str],
        tokens: list | None = None,
        verify: Verify | None = None,
        digests: list | None = None,
    ) -> tuple[dict[str, bytes], dict[str, str], dict[str, np.ndarray]]:
        """Check leases and renew them: (request id -> its blocks' epochs, native int64 bytes; id
        -> reason; id -> layers a loader may read now, for the granted layer-wise exports only:
        :meth:`layers_ready`).

        ``tokens`` and ``digests`` (one each per request id, as a loader presents them): a
        request whose token or content digest does not match its export is refused, neither
        granted nor renewed (:func:`~kvxfer.export_records.verified`)."""
        ok: dict[str, bytes] = {}
        bad: dict[str, str] = {}
        masks: dict[str, np.ndarray] = {}
        with self.lock:
            deadline = time.monotonic() + self.lease_s
            ep, snapshot = self._ep, idops.snapshot
            for rid, e in verified(self._live, request_ids, tokens, verify, bad, digests):
                if e is None:
                    bad[rid] = UNKNOWN if rid not in self._gone else RELEASED
                    continue
                if e.deadline < deadline:
                    self._renew(rid, e, deadline)
                ok[rid] = snapshot(ep, e.block_ids)
                if e.marked is not None:
                    masks[rid] = self.layers_ready(rid)
        return ok, bad, masks

    def grant_verified(
        self, request_ids: list[str], tokens: list, digests: list | None
    ) -> list[bytes] | None:
        """:meth:`grant` of the common request in one native call (the control module's book):
        when every one of ``request_ids`` is a live whole export presenting exactly its own
        token and content digest, each lease renewed and its blocks' epochs (native int64
        bytes, in request order). None, with nothing written, for any other request (or
        without the control module, or while a listener follows the leases): :meth:`grant`
        answers it with each id's reason."""
        book = self._book
        if book is None or digests is None or self._listeners:
            return None
        with self.lock:
            return book.grant(request_ids, tokens, digests, time.monotonic() + self.lease_s)

    def notify_verified(
        self,
        request_ids: list[str],
        tokens: list,
        rank: int,
        tp: int,
        expected: Callable[[int, int], int | str],
    ) -> int | None:
        """:meth:`notify_many` of the common notification in one native call: when every one of
        ``request_ids`` is live with exactly its own token, and loader rank ``rank`` of a
        ``tp``-rank loader may notify here (``expected(tp, rank)``, the callable
        :meth:`take_marks` is given: a count), each counted as that rank's notification; returns
        how many exports were released. None, with nothing counted, for any other notification
        (or without the control module): :meth:`notify_many` answers it with each id's reason."""
        book = self._book
        if book is None:
            return None
        with self.lock:
            done = book.notify(request_ids, tokens, rank, tp, expected)
            return None if done is None else self._finish(done)

    def unauthorized(
        self, request_ids: list[str], tokens: list, verify: Verify, digests: list | None = None
    ) -> dict[str, str]:
        """Request id -> why, for each of ``request_ids`` whose token (and digest, when given;
        one each per id) does not verify (:func:`~kvxfer.export_records.verified`); empty when all do."""
        bad: dict[str, str] = {}
        with self.lock:
            verified(self._live, request_ids, tokens, verify, bad, digests)
        return bad

    def lookup(self, request_id: str) -> ExportRecord | None:
        with self.lock:
            return self._live.get(request_id)

    def heartbeat(
        self, request_ids: list[str], tokens: list | None = None, verify: Verify | None = None
    ) -> dict[str, str]:
        """Renew the leases of ``request_ids`` still live; with ``tokens`` (one per id), only
        of those whose token verifies, checked in the same hold of the lock (so the token of an
        export released meanwhile cannot renew the next export of its request id). Returns id
        -> why for those refused."""
        bad: dict[str, str] = {}
        with self.lock:
            deadline = time.monotonic() + self.lease_s
            for rid, e in verified(self._live, request_ids, tokens, verify, bad):
                if e is not None and e.deadline < deadline:
                    self._renew(rid, e, deadline)
        return bad

    def _renew(self, request_id: str, e: ExportRecord, deadline: float) -> None:
        """The lease of ``e`` ends at ``deadline`` now (later than it did); under :attr:`lock`."""
        if self._book is not None:
            self._book.renew(e, deadline)  # and its slot's deadline, in a followed table
        else:
            e.deadline = deadline
        for listener in self._listeners:
            listener.renewed(request_id, deadline)

    def track_gather(self, request_ids: list[str], event) -> None:
        """A CUDA gather reading these requests' blocks was enqueued; ``event`` (``query()``)
        completes after it. Their release is reported only once it has."""
        with self.lock:
            for rid in request_ids:
                if rid in self._live:
                    evs = self._inflight.setdefault(rid, [])
                    if len(evs) >= 8:  # a long stream: drop the ones already complete
                        evs[:] = [e for e in evs if not event_done(e)]
                    evs.append(event)

    def _report_many(self, request_ids, kind: str) -> None:
        """Report released requests now, or each once the gathers reading its blocks completed
        (one set update when no CUDA gather of a pg export is in flight: the common case)."""
        now = self._finished if kind == "finished" else self._expired
        if not self._inflight:
            now.update(request_ids)
            return
        for rid in request_ids:
            inflight = self._inflight.pop(rid, ())
            pending = [e for e in inflight if not event_done(e)] if inflight else ()
            if pending:
                self._deferred.append((rid, kind, pending))
            else:
                now.add(rid)

    def notify(self, request_id: str, sender: tuple, expected: int) -> bool:
        """Count a notification from ``sender``; release when ``expected`` arrived. True if released."""
        return self.notify_many([request_id], sender, expected) == 1

    def notify_many(
        self,
        request_ids: list[str],
        sender: tuple,
        expected: int | Callable[[], int | str],
        tokens: list | None = None,
        verify: Verify | None = None,
        bad: dict[str, str] | None = None,
    ) -> int:
        """:meth:`notify` for each of ``request_ids`` (one notification message), under one
        lock; returns how many were released. ``tokens``, ``verify``: as :meth:`grant`; a
        request whose token does not verify counts nothing and goes into ``bad``
        (:func:`~kvxfer.export_records.verified`). ``expected`` may be a function, called once and only when a
        verified request is live (no work for an unverified message): the count, or a string
        saying why ``sender`` may not notify here (then nothing counts; each id goes into
        ``bad`` with it)."""
        done = []
        want: int | str | None = None
        with self.lock:
            for rid, e in verified(self._live, request_ids, tokens, verify, bad):
                if e is None:
                    continue
                if want is None:
                    want = expected() if callable(expected) else expected
                if type(want) is str:
                    if bad is not None:
                        bad[rid] = want
                    continue
                if counted(e, sender, want):
                    done.append(rid)
            return self._finish(done)

    def count_marks(
        self, marks: list[tuple[str, list[tuple[int, int]]]], expected: Callable[[int, int], int | str]
    ) -> int:
        """Count done marks (``[(request id, [(loader rank, loader tp size), ...])]``: one-sided
        reads that landed, :mod:`kvxfer.transports.ipc.slots`) as the notifications of those
        loader ranks (``expected(loader_tp, loader_rank)``:
        :meth:`kvxfer.exporter.Exporter.expected_from`, a count or why that rank may not notify
        here: then the mark counts nothing). Returns how many exports were released."""
        done = []
        with self.lock:
            live = self._live
            for rid, marks_of in marks:
                e = live.get(rid)
                if e is None:
                    continue
                landed = False
                for d, loader_tp in marks_of:
                    want = expected(loader_tp, d)
                    if want == 1 and not e.notified_by:  # a lone loader rank's mark: nothing to count
                        landed = True
                    elif type(want) is not str:
                        landed = counted(e, d, want) or landed
                if landed:
                    done.append(rid)
            return self._finish(done)

    def take_marks(self, expected: Callable[[int, int], int | str]) -> int:
        """:meth:`count_marks` of the done marks written in the table the book follows
        (:meth:`follow_slots`) since the last look, read and counted in one native call; returns
        how many exports were released (0 when no table is followed)."""
        with self.lock:
            return self._finish(self._book.take_marks(expected) if self._book is not None else ())

    def _finish(self, done) -> int:
        """Release the exports ``done`` whose count completed, reported finished (under
        :attr:`lock`); how many were released (an id named twice or released meanwhile: once)."""
        if not done:
            return 0
        done = self._release_many(done)
        self._report_many(done, "finished")
        self.finished_exports += len(done)
        return len(done)

    def abort(self, request_id: str) -> bool:
        """Release an export now (the caller aborted it); reported as finished_sending."""
        with self.lock:
            if request_id not in self._live:
                return False
            self._release_many((request_id,))
            self._report_many((request_id,), "finished")
            return True

    def expire(self) -> int:
        """Release every export whose lease has passed; returns how many. The live exports are
        looked at only once the earliest lease may have ended (the server thread calls this
        after each batch of messages it serves, and every tick): a renewed lease ends later,
        and one that begins after a look ends at least ``lease_s`` after it."""
        if time.monotonic() < self._no_expiry_before:
            return 0
        with self.lock:
            now = time.monotonic()
            dead = [rid for rid, e in self._live.items() if e.deadline < now]
            later = (e.deadline for e in self._live.values() if e.deadline >= now)
            self._no_expiry_before = min(later, default=now + self.lease_s)
            if dead:
                self._end_leases(dead, "lease expired before every loader notified")
            return len(dead)

    def release_all(self, why: str) -> int:
        """Release every live export now (the engine is closing), reported expired with ``why``:
        their blocks' epochs move, so a loader that copies them after this (``ipc``, ``nixl``
        direct) sees it and fails the load, and a stream stops. Returns how many."""
        with self.lock:
            rids = list(self._live)
            if rids:
                self._end_leases(rids, why)
            return len(rids)

    def _end_leases(self, request_ids: list[str], why: str) -> None:
        """Release ``request_ids`` (live) now, reported expired with ``why`` (under :attr:`lock`)."""
        self._release_many(request_ids)
        self._errors.update(dict.fromkeys(request_ids, why))
        self._report_many(request_ids, "expired")

    def num_deferred(self) -> int:
        """Released requests whose report waits for a CUDA gather still reading their blocks."""
        with self.lock:
            return len(self._deferred)

    def drain(self, out: PollResult) -> None:
        """Move the releases to report into ``out`` (once each)."""
        if not (self._finished or self._expired or self._deferred):
            return  # nothing to report (read without the lock: a racing release shows next poll)
        with self.lock:
            if self._deferred:
                still = []
                for rid, kind, evs in self._deferred:
                    evs = [e for e in evs if not event_done(e)]
                    if evs:
                        still.append((rid, kind, evs))
                    elif kind == "finished":
                        self._finished.add(rid)
                    else:
                        self._expired.add(rid)
                self._deferred = still
            finished, expired = self._finished, self._expired
            self._finished, self._expired = set(), set()
            for rid in expired:
                out.errors[rid] = self._errors.pop(rid, "lease expired")
        # ``out`` is the poll's own: its sets are taken over when empty, else merged
        if out.finished_sending:
            out.finished_sending |= finished
        else:
            out.finished_sending = finished
        if out.expired:
            out.expired |= expired
        else:
            out.expired = expired

    def idle(self) -> bool:
        """No live export (read without the lock: one added meanwhile shows at the next look)."""
        return not self._live

    def num_live(self) -> int:
        with self.lock:
            return len(self._live)

    def held_blocks(self) -> int:
        """Blocks still held by a live export (0 when nothing leaks)."""
        with self.lock:
            return int((self.refcount > 0).sum())
