"""The loader's notifier thread (:class:`kvxfer.notifier.Notifier`): a notification is what frees the
exporter's blocks, so it must leave as soon as it is queued, batched with whatever else is
queued by then, and retried (bounded) when the exporter does not acknowledge it.

The loop runs against a recording queue and a fake side-channel client, so the order of its
waits and sends is checked exactly, without timing anything.
"""

from __future__ import annotations

import queue
import threading
import time

import pytest

from kvxfer import control as C
from kvxfer.metrics import Metrics
from kvxfer.notifier import Notifier

DEADLINE_S = 10.0


class _RecordingQueue(queue.Queue):
    """A queue that logs every take: ("wait", timeout, got) for a blocking get,
    ("nowait", got) for ``get_nowait``."""

    def __init__(self, log: list) -> None:
        super().__init__()
        self.log = log

    def get(self, block=True, timeout=None):
        if not block:
            return self.get_nowait()
        try:
            item = super().get(True, timeout)
        except queue.Empty:
            self.log.append(("wait", timeout, None))
            raise
        self.log.append(("wait", timeout, item[1].request_ids[0]))
        return item

    def get_nowait(self):
        try:
            item = super().get(False)
        except queue.Empty:
            self.log.append(("nowait", None))
            raise
        self.log.append(("nowait", item[1].request_ids[0]))
        return item


class _FakeClient:
    """Answers every call: Ack, or nothing (no reply) for the first ``silent`` calls."""

    def __init__(self, log: list, silent: int = 0) -> None:
        self.log, self.silent = log, silent
        self.sent = threading.Event()

    def call_many(self, calls, timeout_s, partial=False):
        self.log.append(("send", sorted(m.request_ids[0] for _, m in calls)))
        self.sent.set()
        if self.silent:
            self.silent -= 1
            return [None] * len(calls)
        return [C.Ack(failed={}) for _ in calls]

    def drop(self, addr) -> None:
        self.log.append(("drop", addr))

    def close(self) -> None:
        pass


def _notify(rid: str) -> C.Notify:
    return C.Notify("D", 0, 1, [rid], [], ["0" * 48])


def _run_loop(monkeypatch, log: list, client: _FakeClient, feed) -> None:
    """Run the notifier loop of a minimal loader on the recording queue until ``feed`` (given
    the queue and the client) returns; then stop it and join it against a deadline."""
    monkeypatch.setattr(C, "ControlClient", lambda ctx: client)
    me = Notifier("D", threading.Event(), Metrics())
    me.queue = _RecordingQueue(log)
    th = threading.Thread(target=me.run, args=(None,), daemon=True)
    th.start()
    try:
        feed(me.queue, client)
    finally:
        me.stop.set()
        th.join(DEADLINE_S)
    assert not th.is_alive(), "the notifier did not stop within its deadline"
    return me


def _takes_before_first_send(log: list) -> list:
    out = []
    for e in log:
        if e[0] == "send":
            return out
        out.append(e)
    raise AssertionError(f"nothing was sent: {log}")


def test_a_notification_is_sent_without_waiting_on_an_empty_queue(monkeypatch):
    log: list = []
    client = _FakeClient(log)

    def feed(q, client):
        time.sleep(0.05)  # the loop is idle, blocked on the empty queue
        q.put(("tcp://p:1", _notify("a"), time.monotonic() + DEADLINE_S))
        assert client.sent.wait(DEADLINE_S), f"the notification was never sent: {log}"

    _run_loop(monkeypatch, log, client, feed)
    before = _takes_before_first_send(log)
    taken = [k for k, e in enumerate(before) if e[-1] == "a"]
    assert taken, before
    # After it took the notification, the loop only drained what was already queued (no
    # blocking wait on an empty queue sits between taking it and sending it).
    after = before[taken[0] + 1 :]
    assert all(e[0] == "nowait" for e in after), f"waited before sending: {before}"
    assert log[len(before)] == ("send", ["a"])


def test_notifications_queued_together_go_in_one_round_trip(monkeypatch):
    log: list = []
    client = _FakeClient(log)

    def feed(q, client):
        for rid in ("a", "b", "c"):
            q.put(("tcp://p:1", _notify(rid), time.monotonic() + DEADLINE_S))
        assert client.sent.wait(DEADLINE_S), f"nothing was sent: {log}"

    _run_loop(monkeypatch, log, client, feed)
    sends = [e for e in log if e[0] == "send"]
    assert sends[0] == ("send", ["a", "b", "c"]), log


def test_an_unacknowledged_notification_is_retried_on_a_fresh_socket_then_acknowledged(monkeypatch):
    log: list = []
    client = _FakeClient(log, silent=1)
    acked = threading.Event()

    def feed(q, client):
        q.put(("tcp://p:1", _notify("a"), time.monotonic() + DEADLINE_S))
        end = time.monotonic() + DEADLINE_S
        while sum(e[0] == "send" for e in log) < 2 and time.monotonic() < end:
            time.sleep(0.01)
        acked.set()

    _run_loop(monkeypatch, log, client, feed)
    assert acked.is_set()
    sends = [e for e in log if e[0] in ("send", "drop")]
    assert sends[:3] == [("send", ["a"]), ("drop", "tcp://p:1"), ("send", ["a"])], log
    # between the two tries the loop waited for the retry to come due (bounded waits, each
    # no longer than the back-off), never a busy spin of non-blocking takes
    between = log[log.index(("drop", "tcp://p:1")) + 1 : [i for i, e in enumerate(log) if e[0] == "send"][1]]
    waits = [e for e in between if e[0] == "wait"]
    assert waits and all(0 < e[1] <= 0.1 + 1e-6 for e in waits), between  # first back-off: 100 ms


@pytest.mark.parametrize("acked", [True, False])
def test_a_notification_past_its_deadline_is_given_up_and_counted(monkeypatch, acked):
    log: list = []
    client = _FakeClient(log, silent=0 if acked else 100)

    def feed(q, client):
        q.put(("tcp://p:1", _notify("a"), time.monotonic() + 0.3))
        end = time.monotonic() + DEADLINE_S
        want = 1 if acked else 2
        while sum(e[0] == "send" for e in log) < want and time.monotonic() < end:
            time.sleep(0.01)
        if not acked:  # retried until the deadline passed, then dropped
            time.sleep(0.5)

    me = _run_loop(monkeypatch, log, client, feed)
    failures = me.metrics.snapshot().get("notify_failures", 0)
    assert failures == (0 if acked else 1), (failures, log)


class _BrokenOnceClient(_FakeClient):
    """Raises an unexpected error (not a timeout) on its first call, then acknowledges."""

    def call_many(self, calls, timeout_s, partial=False):
        if not any(e[0] == "raised" for e in self.log):
            self.log.append(("raised", sorted(m.request_ids[0] for _, m in calls)))
            raise RuntimeError("socket exploded")
        return super().call_many(calls, timeout_s, partial)


def test_an_unexpected_send_error_is_logged_and_retried_and_the_notifier_lives_on(monkeypatch, caplog):
    log: list = []
    client = _BrokenOnceClient(log)

    def feed(q, client):
        q.put(("tcp://p:1", _notify("a"), time.monotonic() + DEADLINE_S))
        assert client.sent.wait(DEADLINE_S), f"never retried: {log}"
        q.put(("tcp://p:1", _notify("b"), time.monotonic() + DEADLINE_S))  # a later one still goes
        end = time.monotonic() + DEADLINE_S
        while ("send", ["b"]) not in log and time.monotonic() < end:
            time.sleep(0.01)

    with caplog.at_level("WARNING", logger="kvxfer.notifier"):
        me = _run_loop(monkeypatch, log, client, feed)
    sends = [e for e in log if e[0] in ("raised", "send")]
    assert sends[:3] == [("raised", ["a"]), ("send", ["a"]), ("send", ["b"])], log
    assert any("socket exploded" in r.getMessage() and "retrying" in r.getMessage() for r in caplog.records)
    assert me.metrics.snapshot().get("notify_failures", 0) == 0


class _StopsDuringFirstTry(_FakeClient):
    """No reply to its first call, during which the engine closes (``stop`` is set); then
    acknowledges."""

    def __init__(self, log: list, stop: threading.Event) -> None:
        super().__init__(log, silent=1)
        self.stop = stop

    def call_many(self, calls, timeout_s, partial=False):
        if self.silent:
            self.stop.set()
        return super().call_many(calls, timeout_s, partial)


def test_a_notification_unacknowledged_when_the_engine_closes_is_retried_before_it_stops(monkeypatch):
    """close() while a notification waits for its acknowledgement: it is retried (for
    ``DRAIN_S``), not given up after the one try, so the exporter still frees the blocks."""
    log: list = []
    me = Notifier("D", threading.Event(), Metrics())
    client = _StopsDuringFirstTry(log, me.stop)
    monkeypatch.setattr(C, "ControlClient", lambda ctx: client)
    me.queue.put(("tcp://p:1", _notify("a"), time.monotonic() + DEADLINE_S))
    th = threading.Thread(target=me.run, args=(None,), daemon=True)
    th.start()
    th.join(DEADLINE_S)
    assert not th.is_alive(), "the notifier did not stop within its deadline"
    assert [e for e in log if e[0] == "send"] == [("send", ["a"]), ("send", ["a"])], log
    assert me.metrics.snapshot().get("notify_failures", 0) == 0


def test_a_dead_exporter_holds_close_for_the_drain_only(monkeypatch):
    """An exporter that never answers: after the stop its notification is retried until
    ``DRAIN_S``, then given up and counted; the notifier ends within that bound."""
    from kvxfer import notifier as notifier_mod

    monkeypatch.setattr(notifier_mod, "DRAIN_S", 0.5)
    log: list = []
    me = Notifier("D", threading.Event(), Metrics())
    client = _FakeClient(log, silent=10**6)
    monkeypatch.setattr(C, "ControlClient", lambda ctx: client)
    me.queue.put(("tcp://p:1", _notify("a"), time.monotonic() + DEADLINE_S))
    th = threading.Thread(target=me.run, args=(None,), daemon=True)
    th.start()
    assert client.sent.wait(DEADLINE_S)
    t0 = time.monotonic()
    me.stop.set()
    th.join(DEADLINE_S)
    assert not th.is_alive()
    assert time.monotonic() - t0 < 0.5 + 1.0 + 0.5  # the drain, one back-off, one try's slack
    assert sum(e[0] == "send" for e in log) >= 2, log  # retried after the stop
    assert me.metrics.snapshot().get("notify_failures", 0) == 1
