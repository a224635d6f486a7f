"""The loader's notifier: a thread that sends notifications and heartbeats to exporter ranks,
each until acknowledged or its deadline. A notification is what frees the exporter's blocks,
so it leaves as soon as it is queued, with whatever else is queued by then; the notifier has a
socket of its own, so a dead exporter never stalls the loads."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time

from . import control
from .engine_types import describe_error
from .metrics import Metrics
from .tracing import batch_tag, trace

_LOG = logging.getLogger(__name__)

__all__ = ["DRAIN_S", "Notifier"]

# Once the engine closes, what is still unacknowledged is retried this long (from the first
# look after the stop; within close()'s own bound, CLOSE_TIMEOUT_S): one try, then given up,
# lost the notifications of loads that landed last whenever the exporter was slow to answer,
# and an export whose done mark a stranger had overwritten stayed leased.
DRAIN_S = 2.0


def _notify_tag(due: list[list]) -> str:
    """Trace name of one notifier round trip: the request ids its messages carry."""
    return batch_tag([r for p in due for r in p[1].request_ids])


class Notifier:
    """Sends what :meth:`put` queues (see the module doc).

    Args:
        engine_id: the loader engine's id (for the logs).
        stop: set when the engine closes; what is queued or unacknowledged by then is retried
            for ``DRAIN_S`` more (and not past its own deadline).
        metrics: where ``notify_failures`` is counted.

    ``queue``: ``(address, Notify | Heartbeat, deadline)`` tuples. A ``SimpleQueue``: its put is
    one C call, where ``queue.Queue``'s takes a Python lock and condition (``poll()`` queues
    the one-sided path's notification; a put after an idle pause costs several times less:
    profiling/results/2026-11-26-cpu-idle/README.md)."""

    def __init__(self, engine_id: str, stop: threading.Event, metrics: Metrics) -> None:
        self.engine_id = engine_id
        self.stop = stop
        self.metrics = metrics
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def put(self, addr: str, msg, deadline: float) -> None:
        """Send ``msg`` to ``addr`` until acknowledged or ``deadline`` (monotonic)."""
        self.queue.put((addr, msg, deadline))

    def start(self, ctx, name: str) -> None:
        self._thread = threading.Thread(target=self.run, args=(ctx,), name=name, daemon=True)
        self._thread.start()

    def threads(self) -> list[threading.Thread]:
        return [self._thread] if self._thread is not None else []

    def run(self, ctx) -> None:
        """Send queued notifications and heartbeats, each until acknowledged or its deadline
        (retries back off from 100 ms, doubling up to 1 s)."""
        client = control.ControlClient(ctx)
        pending: list[list] = []  # [addr, msg, deadline, next_try, attempts]
        q = self.queue
        drain_end = None  # once stopped: what is still unacknowledged is retried until then
        try:
            while True:
                if self.stop.is_set():
                    if drain_end is None:
                        drain_end = time.monotonic() + DRAIN_S
                    if not pending and q.empty():
                        return
                # Block only until the next retry is due; a notification that arrives is sent at
                # once (it frees the exporter's blocks), with whatever else is queued by then.
                t = time.monotonic()
                wait = min([0.1] + [p[3] - t for p in pending])
                if wait > 0:
                    with contextlib.suppress(queue.Empty):
                        pending.append([*q.get(timeout=wait), 0.0, 0])
                while True:  # one round trip carries all that is queued
                    try:
                        pending.append([*q.get_nowait(), 0.0, 0])
                    except queue.Empty:
                        break
                t = time.monotonic()
                due = [p for p in pending if p[3] <= t]
                if not due:
                    continue
                try:
                    with trace("notify", _notify_tag, due):
                        replies = client.call_many([(p[0], p[1]) for p in due], 0.2, partial=True)
                except control.ControlTimeout:  # a send queue full: every one of them is retried
                    replies = [None] * len(due)
                except Exception as e:  # the notifier must outlive it: retried, given up by the deadline
                    _LOG.warning(
                        "kvxfer loader %s: sending %d notification(s) failed (%s); retrying",
                        self.engine_id,
                        len(due),
                        describe_error(e),
                    )
                    replies = [None] * len(due)
                for k, p in enumerate(due):
                    rep = replies[k]
                    if isinstance(rep, control.Ack):
                        pending.remove(p)
                        if rep.failed:
                            _LOG.warning(
                                "kvxfer loader %s: %s refused by %s: %s",
                                self.engine_id,
                                type(p[1]).__name__,
                                p[0],
                                rep.failed,
                            )
                        continue
                    p[4] += 1
                    now = time.monotonic()
                    if now >= p[2] or (drain_end is not None and now >= drain_end):
                        pending.remove(p)
                        _LOG.warning(
                            "kvxfer loader %s: %s to %s not acknowledged after %d tries (%s); given up",
                            self.engine_id,
                            type(p[1]).__name__,
                            p[0],
                            p[4],
                            "no reply" if rep is None else getattr(rep, "error", rep),
                        )
                        self.metrics.add("notify_failures")
                        continue
                    p[3] = time.monotonic() + min(1.0, 0.05 * 2 ** p[4])
                    client.drop(p[0])  # a fresh socket: stale replies cannot confuse the retry
        finally:
            client.close()
