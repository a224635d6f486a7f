"""How the side channel's client takes replies, and its server takes requests (CPU, in process).

:meth:`ControlClient.call_many` first waits for each reply in a blocking receive bounded by
``FIRST_WAIT_MS`` and only then polls the sockets with their monitors: every reply must land in
its request's place whichever of the two took it, a stale reply must never stand in for a new
one, and the call must not outlast its own bound while replies trickle in. The server handles
what is queued in one :meth:`ControlServer.serve_once`, asking the socket whether more is
queued instead of receiving until a receive fails. Each reply names the request it answers (its
heartbeat's engine id and the server that answered), so a misplaced reply names itself.
"""

from __future__ import annotations

import struct
import threading
import time

import pytest
import zmq

from kvxfer import control as C

FIRST_S = C.FIRST_WAIT_MS / 1000


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def _echo(tag: str, delay_s: float = 0.0):
    """A handler answering a heartbeat with an Ack whose one failed entry names the heartbeat's
    engine id and ``tag`` (which server answered), after ``delay_s``."""

    def handle(msg):
        if delay_s:
            time.sleep(delay_s)
        return C.Ack({msg.engine_id: tag})

    return handle


class _Served:
    """ControlServers each served by its own thread with its own handler; joined on close."""

    def __init__(self, ctx, handlers) -> None:
        self.servers = [C.ControlServer(ctx, "127.0.0.1", 0) for _ in handlers]
        self.addrs = [f"tcp://127.0.0.1:{s.port}" for s in self.servers]
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._loop, args=(s, h), daemon=True)
            for s, h in zip(self.servers, handlers)
        ]
        for t in self.threads:
            t.start()

    def _loop(self, srv, handler) -> None:
        while not self.stop.is_set():
            srv.serve_once(handler, 5)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(5)
        assert not any(t.is_alive() for t in self.threads), "a serving thread did not stop"
        for s in self.servers:
            s.sock.close(0)


def _hb(name: str) -> C.Heartbeat:
    return C.Heartbeat(name, 0, [], [])


def test_fast_and_slow_replies_each_land_in_their_request_place(ctx):
    """Replies within the first wait, replies after it (taken by the poll) and a mix of both in
    one call: each in the place of the request it answers."""
    served = _Served(ctx, [_echo("fast"), _echo("slow", delay_s=4 * FIRST_S), _echo("fast2")])
    client = C.ControlClient(ctx)
    try:
        fast, slow, fast2 = served.addrs
        for _ in range(3):
            assert client.call(fast, _hb("a"), 5.0).failed == {"a": "fast"}
            assert client.call(slow, _hb("b"), 5.0).failed == {"b": "slow"}
        calls = [
            (slow, _hb("s1")),
            (fast, _hb("f1")),
            (fast2, _hb("g1")),
            (fast, _hb("f2")),
            (slow, _hb("s2")),
        ]
        got = client.call_many(calls, 5.0)
        assert [r.failed for r in got] == [
            {"s1": "slow"},
            {"f1": "fast"},
            {"g1": "fast2"},
            {"f2": "fast"},
            {"s2": "slow"},
        ]
    finally:
        client.close()
        served.close()


def test_a_stale_reply_never_stands_in_for_the_next_request(ctx):
    """A request that timed out is answered later; the next request on that socket gets its own
    reply, not the stale one that arrives first."""
    served = _Served(ctx, [_echo("late", delay_s=0.15)])
    client = C.ControlClient(ctx)
    try:
        (addr,) = served.addrs
        with pytest.raises(C.ControlTimeout):
            client.call(addr, _hb("first"), 0.05)
        time.sleep(0.2)  # the stale reply is queued at the client now
        assert client.call(addr, _hb("second"), 5.0).failed == {"second": "late"}
    finally:
        client.close()
        served.close()


def test_replies_that_trickle_in_do_not_stretch_the_call_past_its_bound(ctx):
    """Sixteen servers answer 3 ms apart (each within the first wait of the one before): a call
    bounded by 20 ms ends by its bound with the replies that came (partial), instead of taking
    every reply as it trickles in for 48 ms."""
    gap = 0.003
    start = threading.Event()
    t0 = [0.0]

    def at(k):
        def handle(msg):
            start.wait(5)
            left = t0[0] + gap * (k + 1) - time.monotonic()
            if left > 0:
                time.sleep(left)
            return C.Ack({msg.engine_id: str(k)})

        return handle

    served = _Served(ctx, [at(k) for k in range(16)])
    client = C.ControlClient(ctx)
    try:
        for k, a in enumerate(served.addrs):  # connect each socket first
            start.set()
            t0[0] = time.monotonic() - 1.0
            assert client.call(a, _hb("warm"), 5.0).failed == {"warm": str(k)}
        start.clear()
        calls = [(a, _hb(f"r{k}")) for k, a in enumerate(served.addrs)]
        bound = 0.02
        t0[0] = time.monotonic()
        start.set()
        began = time.monotonic()
        got = client.call_many(calls, bound, partial=True)
        took = time.monotonic() - began
        assert took < bound + 0.015, (
            f"the call took {took * 1000:.1f} ms against a {bound * 1000:.0f} ms bound"
        )
        for k, r in enumerate(got):  # whatever came is in its place
            assert r is None or r.failed == {f"r{k}": str(k)}
        assert got[-1] is None, "the last reply (48 ms) came within a 20 ms bound"
    finally:
        start.set()
        client.close()
        served.close()


def test_serve_once_takes_every_queued_request_and_skips_a_malformed_one(ctx):
    """Five requests and a malformed frame set queued before one serve_once: it takes all six,
    answers the five (each its own id) and drops the malformed one."""
    srv = C.ControlServer(ctx, "127.0.0.1", 0)
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(f"tcp://127.0.0.1:{srv.port}")
    try:
        for i in range(5):
            d.send_multipart([struct.pack("<Q", i), C.encode(_hb(f"q{i}"))])
            if i == 2:
                d.send_multipart([b"not an id", b"x", b"y"])
        deadline = time.monotonic() + 5
        while srv.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # all six frame sets queued at the server
        assert srv.serve_once(_echo("s"), 100) == 6
        got = {}
        for _ in range(5):
            assert d.poll(5000), "a reply did not come"
            mid, payload = d.recv_multipart()
            got[struct.unpack("<Q", mid)[0]] = C.decode(payload).failed
        assert got == {i: {f"q{i}": "s"} for i in range(5)}
        assert not d.poll(100), "the malformed frame set was answered"
    finally:
        d.close(0)
        srv.sock.close(0)
