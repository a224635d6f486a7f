"""Completion reports: what ``poll()`` returns (:class:`PollResult`), the loads in flight, and
the aggregator. The exporter side's leases are :mod:`kvxfer.exports`.

Loader side (:class:`LoadTracker`): pending loads, each reported exactly once, finished or
failed with its local block ids. :func:`native_load_book` gives the same tracker in C (the
control module's ``LoadBook``, ``csrc/ctl/load_book.h``), which also holds the records of the
one-sided native lane (:mod:`kvxfer.transports.ipc.onesided`); the engine takes it at
``start()`` when the module is in use.

:class:`CompletionAggregator` merges the per-rank :class:`PollResult` of one engine: a request
counts as done only when every rank has reported it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from . import idops
from .params import FIELD_LIMITS

__all__ = ["CompletionAggregator", "LoadTracker", "PollResult", "native_load_book"]


@dataclass
class PollResult:
    """What :meth:`TransferEngine.poll` returns.

    finished_sending: exported requests whose blocks the caller may now free (all expected
        notifications arrived, successful or not on the loader).
    finished_recving: loads that landed completely and correctly.
    failed: load request id -> local block ids to recompute.
    expired: exported requests whose lease ended before the loader finished; blocks released.
    errors: request id -> why it failed (for failed and expired requests).
    """

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed: dict[str, list[int]] = field(default_factory=dict)
    expired: set[str] = field(default_factory=set)
    errors: dict[str, str] = field(default_factory=dict)

    def empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.failed or self.expired)


class LoadTracker:
    """Loads in flight on this rank; each is reported exactly once (finished or failed)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._pending: dict[str, tuple] = {}  # request id -> (local block ids, start time)
        self._done: set[str] = set()
        self._failed: dict[str, list[int]] = {}
        self._errors: dict[str, str] = {}

    def add(self, request_id: str, block_ids: list[int] | np.ndarray, start: float) -> None:
        with self.lock:
            if request_id in self._pending:
                raise ValueError(f"request_id: {request_id!r} is already being loaded")
            self._pending[request_id] = (block_ids, start)

    def pending(self) -> int:
        with self.lock:
            return len(self._pending)

    def finish(self, request_id: str) -> bool:
        """Report ``request_id`` finished; False if it was not pending (already reported)."""
        return bool(self.finish_many([request_id]))

    def finish_many(self, request_ids: list[str], end: float = 0.0) -> list[float]:
        """:meth:`finish` each of ``request_ids`` under one lock; for those that were pending
        (each is reported once), ``end`` minus their start (their latency when ``end`` is now)."""
        out = []
        with self.lock:
            pending, done = self._pending, self._done
            for rid in request_ids:
                e = pending.pop(rid, None)
                if e is not None:
                    done.add(rid)
                    out.append(end - e[1])
        return out

    def finish_one(self, request_id: str, end: float) -> float | None:
        """:meth:`finish_many` of one load: its latency (``end`` minus its start), or None when
        it was not pending (already reported)."""
        with self.lock:
            e = self._pending.pop(request_id, None)
            if e is None:
                return None
            self._done.add(request_id)
            return end - e[1]

    def fail(self, request_id: str, reason: str) -> bool:
        with self.lock:
            e = self._pending.pop(request_id, None)
            if e is None:
                return False
            ids = e[0]
            self._failed[request_id] = ids.tolist() if isinstance(ids, np.ndarray) else list(ids)
            self._errors[request_id] = reason
            return True

    def drain(self, out: PollResult) -> None:
        """Move the loads finished or failed since the last drain into ``out`` (once each)."""
        if not (self._done or self._failed):
            return  # nothing to report (read without the lock: a racing report shows next poll)
        with self.lock:
            done, failed, errors = self._done, self._failed, self._errors
            self._done, self._failed, self._errors = set(), {}, {}
        # ``out`` is the poll's own: its containers are taken over when empty, else merged
        if out.finished_recving:
            out.finished_recving |= done
        else:
            out.finished_recving = done
        out.failed.update(failed)
        out.errors.update(errors)


def native_load_book(active: set, stale_ns: int):
    """The loads in flight as the control module's ``LoadBook``: :class:`LoadTracker`'s methods
    and reports in C, plus the one-sided native lane's records (``active``: the params keys of
    one-sided loads in flight, shared with the Python path; ``stale_ns``: an exporter silent
    that long is not read). None when the module is not in use (``KVXFER_NATIVE_CTL=0``, not
    built): :class:`LoadTracker` then."""
    mod = idops.native()
    if mod is None:
        return None
    return mod.LoadBook(FIELD_LIMITS, active, np.frombuffer, np.dtype(np.int64), int(stale_ns))


class CompletionAggregator:
    """Merge the :class:`PollResult` of every TP rank of one engine.

    A request is reported once, when all ``tp_size`` ranks have reported it: loads as
    ``finished_recving`` when every rank finished, else ``failed`` (union of block ids);
    exports as ``finished_sending`` when every rank freed them, else ``expired``.
    """

    def __init__(self, tp_size: int) -> None:
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tp_size: must be a positive int, got {tp_size!r}")
        self.tp_size = tp_size
        self._recv: dict[str, dict[int, list[int] | None]] = {}
        self._send: dict[str, dict[int, bool]] = {}
        self._errors: dict[str, str] = {}

    def add(self, tp_rank: int, result: PollResult) -> PollResult:
        """Fold in one rank's poll result; return the requests now complete on every rank."""
        if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not 0 <= tp_rank < self.tp_size:
            raise ValueError(f"tp_rank: must be in [0, {self.tp_size}), got {tp_rank!r}")
        out = PollResult()
        self._errors.update(result.errors)
        for rid in result.finished_recving:
            self._recv.setdefault(rid, {})[tp_rank] = None
        for rid, ids in result.failed.items():
            self._recv.setdefault(rid, {})[tp_rank] = list(ids)
        for rid in result.finished_sending:
            self._send.setdefault(rid, {})[tp_rank] = False
        for rid in result.expired:
            self._send.setdefault(rid, {})[tp_rank] = True
        for rid in set(result.finished_recving) | set(result.failed):
            ranks = self._recv[rid]
            if len(ranks) < self.tp_size:
                continue
            del self._recv[rid]
            failed = [ids for ids in ranks.values() if ids is not None]
            if failed:
                out.failed[rid] = sorted({b for ids in failed for b in ids})
                out.errors[rid] = self._errors.pop(rid, "failed on some rank")
            else:
                out.finished_recving.add(rid)
                self._errors.pop(rid, None)
        for rid in set(result.finished_sending) | set(result.expired):
            ranks = self._send[rid]
            if len(ranks) < self.tp_size:
                continue
            del self._send[rid]
            if any(ranks.values()):
                out.expired.add(rid)
                out.errors[rid] = self._errors.pop(rid, "lease expired on some rank")
            else:
                out.finished_sending.add(rid)
                self._errors.pop(rid, None)
        return out

    def pending(self) -> int:
        """Requests reported by some but not all ranks."""
        return len(self._recv) + len(self._send)
