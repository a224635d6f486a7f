"""The exporter's ``pg`` pair groups, each joined and served by a thread of its own.

A loader asks an exporter rank to join a pair group (``PairReq``), then joins it itself; the
exporter's join blocks until the loader's arrives (at most ``timeout_s``). Each pair gets its
own thread that joins it and then runs the streams the loader asks for on it (``SendReq``), one
after another, from its own queue. So a pairing that is never completed parks only its own
thread, and one slow stream delays only its own pair's next streams, never another loader's.

At most ``max_pairs`` pairs are kept; a pairing beyond that first evicts the pair used least
recently that is idle (its group is aborted, its thread ends; the loader re-pairs when it next
reads), and is refused, naming why, when every pair is busy. A stream or join that fails
discards its pair (the loader re-pairs). :meth:`PairSenders.discard_all` stops every thread.
:func:`stream_send` is what a pair's thread runs for one send request: the gathers of
:mod:`kvxfer.transports.streams` through the staged pipeline, then the stream's status.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from ..base import StreamJob
from ..streams import stream_gathers
from .groups import UNKNOWN_PAIR

if TYPE_CHECKING:  # pragma: no cover
    from ...rank import Rank, Runtime

_LOG = logging.getLogger(__name__)

__all__ = ["MAX_PAIRS", "PairSenders", "stream_send"]

MAX_PAIRS = 64  # pair groups an exporter rank serves at once (a thread and a communicator each)


class _Pair:
    __slots__ = ("backend", "busy", "discarded", "group", "jobs", "last_used", "thread")

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.group = None  # set once joined
        self.discarded = False  # the group was aborted (once)
        self.jobs: queue.Queue = queue.Queue()
        self.busy = True  # joining, or running a stream
        self.last_used = time.monotonic()
        self.thread: threading.Thread | None = None


class PairSenders:
    """The exporter rank's pair groups (see the module doc).

    Args:
        name: thread name prefix (the engine and rank).
        join: ``join(key, backend) -> group``: joins pair ``key`` as rank 0 (blocks, bounded).
        stream: ``stream(group, backend, job)``: runs one send request's stream on a joined pair.
        discard: ``discard(group, why)``: aborts a pair group (never raises).
        stop: the engine's stop event.
        max_pairs: pairs kept at once.
    """

    def __init__(
        self,
        name: str,
        join: Callable[[str, str], object],
        stream: Callable[[object, str, object], None],
        discard: Callable[[object, str], None],
        stop: threading.Event,
        max_pairs: int = MAX_PAIRS,
    ) -> None:
        if isinstance(max_pairs, bool) or not isinstance(max_pairs, int) or max_pairs < 1:
            raise ValueError(f"max_pairs: must be a positive int, got {max_pairs!r}")
        self._name, self._join, self._stream, self._discard = name, join, stream, discard
        self._stop = stop
        self.max_pairs = max_pairs
        self._lock = threading.Lock()
        self._pairs: dict[str, _Pair] = {}

    def __iter__(self) -> Iterator[str]:
        with self._lock:
            return iter(list(self._pairs))

    def __len__(self) -> int:
        return len(self._pairs)

    def backend(self, key: str) -> str | None:
        """The backend pair ``key`` was opened with (None: no such pair)."""
        p = self._pairs.get(key)
        return None if p is None else p.backend

    def open(self, key: str, backend: str) -> str:
        """Start joining pair ``key`` in a thread of its own; "" when started, else why not."""
        with self._lock:
            if key in self._pairs:
                return f"pair group {key} is already open"
            if len(self._pairs) >= self.max_pairs:
                idle = [(p.last_used, k) for k, p in self._pairs.items() if not p.busy and p.jobs.empty()]
                if not idle:
                    return f"busy: {len(self._pairs)} pair groups are joining or streaming; try again later"
                _, old = min(idle)
                self._evict(old, "the least recently used idle pair group, evicted for a new one")
            pair = self._pairs[key] = _Pair(backend)
            pair.thread = threading.Thread(
                target=self._serve, args=(key, pair), name=f"{self._name}-pair", daemon=True
            )
        pair.thread.start()
        return ""

    def submit(self, key: str, msg) -> str:
        """Queue a stream on pair ``key`` (run once it is joined); "" when queued, else why."""
        with self._lock:
            pair = self._pairs.get(key)
            if pair is None:
                return f"{UNKNOWN_PAIR} {key}"
            pair.busy = True
            pair.jobs.put(msg)
        return ""

    def _evict(self, key: str, why: str) -> None:
        """Drop pair ``key`` (under the lock): its thread ends at its next job; a joined group is
        aborted (a thread blocked on it wakes up)."""
        pair = self._pairs.pop(key, None)
        if pair is None:
            return
        pair.jobs.put(None)
        self._abort(pair, why)

    def _abort(self, pair: _Pair, why: str) -> None:
        if pair.group is not None and not pair.discarded:
            pair.discarded = True
            self._discard(pair.group, why)

    def _serve(self, key: str, pair: _Pair) -> None:
        why = "its thread ended"
        try:
            pair.group = self._join(key, pair.backend)
            while not self._stop.is_set():
                with self._lock:
                    if self._pairs.get(key) is not pair:
                        return  # evicted or discarded
                    if pair.jobs.empty():
                        pair.busy = False
                        pair.last_used = time.monotonic()
                try:
                    msg = pair.jobs.get(timeout=0.1)
                except queue.Empty:
                    continue
                if msg is None:
                    return
                self._stream(pair.group, pair.backend, msg)
        except Exception as e:
            why = f"{type(e).__name__}: {e}"
            _LOG.warning(
                "kvxfer %s: pg pair %s failed (%s); the pair is torn down and the loader re-pairs",
                self._name,
                key,
                why,
            )
        finally:
            with self._lock:
                if self._pairs.get(key) is pair:
                    del self._pairs[key]
                self._abort(pair, why)  # also a group joined after its pair was evicted

    def discard_all(self, why: str) -> None:
        """Abort every pair group (a thread blocked in a transfer wakes up) and end the threads."""
        with self._lock:
            for key in list(self._pairs):
                self._evict(key, why)

    def threads(self) -> list[threading.Thread]:
        """The pair threads still running (for a bounded join at close)."""
        with self._lock:
            return [p.thread for p in self._pairs.values() if p.thread is not None]


def stream_send(rank: Rank, rt: Runtime, group, backend: str, job: StreamJob) -> None:
    """Gather and send one checked send request's stream over pair ``group`` (``backend``) on
    the rank's send stream, then its status (one byte per request: landed or released
    meanwhile). A failure raises (the pair's thread discards the pair)."""
    hook = rt.hooks.get("before_send")
    if hook:
        hook()
    stream, gather, status = stream_gathers(rank, rt, job)
    # without an SM budget, each stream's GPU work on its lane's own CUDA stream (NCCL waits
    # hold the stream they are issued on); with one, one stream keeps the budget for all
    own = rank.views.whole.caches.max_sms is None
    with rt.order.on_stream("send"):
        sent = rank.pipeline.send_stream(
            group, 1, backend, rank.device, stream, gather, rank.timeout_s, status, own
        )
    rt.metrics.add("bytes_sent", sent)
