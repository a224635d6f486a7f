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
        alive = any(t.is_alive() for t in self.threads)
        if not alive:  # a thread still serving keeps its socket (the context's destroy ends it)
            for s in self.servers:
                s.sock.close(0)
        assert not alive, "a serving thread did not stop"


def _hb(name: str) -> C.Heartbeat:
    return C.Heartbeat(name, 0, [], [])


def test_fast_and_slow_replies_each_land_in_their_request_place(ctx, monkeypatch):
    """Replies within the first wait, replies after it (taken by the poll) and both in one call
    (the first wait takes the fast ones, the poll the slow ones): each in the place of the
    request it answers."""
    taken = []
    first = C.ControlClient._first_replies

    def counted(self, pending, out, deadline):
        before = len(pending)
        first(self, pending, out, deadline)
        taken.append(before - len(pending))

    monkeypatch.setattr(C.ControlClient, "_first_replies", counted)
    served = _Served(ctx, [_echo("fast"), _echo("slow", delay_s=4 * FIRST_S), _echo("fast2")])
    client = C.ControlClient(ctx)
    try:
        fast, slow, fast2 = served.addrs
        for _ in range(3):
            assert client.call(fast, _hb("a"), 5.0).failed == {"a": "fast"}
            assert client.call(slow, _hb("b"), 5.0).failed == {"b": "slow"}
        assert taken[-2:] == [1, 0]  # the fast reply in the first wait, the slow one by the poll
        calls = [
            (fast, _hb("f1")),
            (slow, _hb("s1")),
            (fast2, _hb("g1")),
            (fast, _hb("f2")),
            (slow, _hb("s2")),
        ]
        got = client.call_many(calls, 5.0)
        assert [r.failed for r in got] == [
            {"f1": "fast"},
            {"s1": "slow"},
            {"g1": "fast2"},
            {"f2": "fast"},
            {"s2": "slow"},
        ]
        assert 1 <= taken[-1] <= 3, f"the first wait took {taken[-1]} of the five replies"
    finally:
        client.close()
        served.close()


def _dies_on_request(ctx):
    """A server whose thread closes its socket (the process gone, as far as the client can
    tell) once a request came, without answering it; returns (address, its thread)."""
    srv = C.ControlServer(ctx, "127.0.0.1", 0)
    got = threading.Event()

    def loop():
        while not got.is_set():
            srv.serve_once(lambda m: got.set(), 5)
        srv.sock.close(0)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return f"tcp://127.0.0.1:{srv.port}", t


def test_a_peer_gone_is_seen_within_two_first_waits_while_another_keeps_answering(ctx, monkeypatch):
    """With a first wait of 0.2 s, a call of eight requests to a peer answering one every 0.15 s
    and one to a peer that dies on its request raises PeerGone naming the dead one within about
    two first waits, not once every reply of the live peer came (1.2 s)."""
    monkeypatch.setattr(C, "FIRST_WAIT_MS", 200)  # read as each socket is made, and by the call
    served = _Served(ctx, [_echo("live", delay_s=0.15)])
    dead, dead_thread = _dies_on_request(ctx)
    client = C.ControlClient(ctx)
    try:
        (live,) = served.addrs
        client.call(live, _hb("warm"), 5.0)
        began = time.monotonic()
        with pytest.raises(C.PeerGone) as ei:
            client.call_many([*((live, _hb(f"l{i}")) for i in range(8)), (dead, _hb("d"))], 5.0)
        took = time.monotonic() - began
        assert ei.value.addr == dead
        assert took < 0.8, f"the dead peer was seen after {took:.2f} s"
    finally:
        client.close()
        served.close()
        dead_thread.join(5)
        assert not dead_thread.is_alive()


def test_the_first_wait_never_runs_past_the_calls_bound(ctx, monkeypatch):
    """With a first wait of 0.2 s, a call bounded by 0.1 s to a peer that never answers times
    out by its bound, not after a whole first wait."""
    monkeypatch.setattr(C, "FIRST_WAIT_MS", 200)
    served = _Served(ctx, [lambda m: None])
    client = C.ControlClient(ctx)
    try:
        (addr,) = served.addrs
        began = time.monotonic()
        with pytest.raises(C.ControlTimeout):
            client.call(addr, _hb("x"), 0.1)
        took = time.monotonic() - began
        assert took < 0.18, f"a call bounded by 0.1 s took {took:.3f} s"
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
    """Twenty-four servers answer 3 ms apart (each within the first wait of the one before): a
    call bounded by 20 ms ends by its bound with the replies that came (partial), instead of
    taking every reply as it trickles in for 72 ms."""
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

    served = _Served(ctx, [at(k) for k in range(24)])
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
        assert took < bound + 0.025, (
            f"the call took {took * 1000:.1f} ms against a {bound * 1000:.0f} ms bound"
        )
        for k, r in enumerate(got):  # whatever came is in its place
            assert r is None or r.failed == {f"r{k}": str(k)}
        assert got[-1] is None, "the last reply (72 ms) came within a 20 ms bound"
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
        time.sleep(0.3)  # all six frame sets queued at the server
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
