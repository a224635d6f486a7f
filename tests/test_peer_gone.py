"""A dead peer fails a side-channel request at once, not at its bound (CPU, in process).

The side channel's client watches each socket: a refused connection, a closed one, or a peer
that stops answering heartbeats ends the requests pending on it with :class:`PeerGone` naming
the address and what happened. A load whose exporter is gone fails within a fraction of a
second with ``timeout_s=10``, its reason naming the exporter's address.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch
import zmq

from kvxfer import KVCacheSpec, TransferEngine
from kvxfer import control as C
from kvxfer.ports import free_port_base

SPEC = KVCacheSpec(2, 2, 16, 8, torch.float16)
FAST_S = 1.0  # a gone peer fails within this (the bound is 10 s; about 0.1 s is typical)


class Forwarder:
    """A TCP relay to ``port`` that can freeze: it then keeps both connections open and moves
    no byte, as a stopped process (SIGSTOP) or a cut network does."""

    def __init__(self, port: int) -> None:
        self.up = port
        self.frozen = threading.Event()
        self.lst = socket.create_server(("127.0.0.1", 0))
        self.port = self.lst.getsockname()[1]
        self.socks: list[socket.socket] = []
        self.stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        self.lst.settimeout(0.1)
        while not self.stop.is_set():
            try:
                a, _ = self.lst.accept()
            except OSError:
                continue
            b = socket.create_connection(("127.0.0.1", self.up))
            self.socks += [a, b]
            for x, y in ((a, b), (b, a)):
                threading.Thread(target=self._pump, args=(x, y), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        src.settimeout(0.05)
        while not self.stop.is_set():
            if self.frozen.is_set():
                time.sleep(0.01)
                continue
            try:
                data = src.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return
            while self.frozen.is_set() and not self.stop.is_set():  # held, never delivered
                time.sleep(0.01)
            try:
                dst.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        self.stop.set()
        for s in [self.lst, *self.socks]:
            s.close()


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def _server(ctx, port: int = 0) -> C.ControlServer:
    return C.ControlServer(ctx, "127.0.0.1", port)


def _serve(srv: C.ControlServer, stop: threading.Event) -> threading.Thread:
    def loop():
        while not stop.is_set():
            srv.serve_once(lambda m: C.Ack({}), 10)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return t


def _hb():
    return C.Heartbeat("D", 0, [], [])


def _timed_gone(client, addr):
    t0 = time.monotonic()
    with pytest.raises(C.PeerGone) as ei:
        client.call(addr, _hb(), 10.0)
    return time.monotonic() - t0, ei.value


def test_refused_connection_fails_at_once(ctx):
    addr = f"tcp://127.0.0.1:{free_port_base(1)}"
    client = C.ControlClient(ctx)
    try:
        dt, e = _timed_gone(client, addr)
        assert dt < FAST_S and "refused" in str(e) and addr in str(e), (dt, e)
        # partial calls give up on it too, and say why
        t0 = time.monotonic()
        assert client.call_many([(addr, _hb())], 10.0, partial=True) == [None]
        assert time.monotonic() - t0 < FAST_S and "refused" in client.gone[addr]
    finally:
        client.close()


def test_closed_peer_fails_at_once_and_a_live_one_answers(ctx):
    srv = _server(ctx)
    addr = f"tcp://127.0.0.1:{srv.port}"
    stop = threading.Event()
    t = _serve(srv, stop)
    client = C.ControlClient(ctx)
    try:
        assert isinstance(client.call(addr, _hb(), 5.0), C.Ack)
        stop.set()
        t.join(5)
        srv.close()  # the peer's socket goes away (its process died or closed)
        time.sleep(0.2)
        dt, e = _timed_gone(client, addr)  # the socket had seen the close before this request
        assert dt < FAST_S and addr in str(e), (dt, e)
    finally:
        client.close()


def test_peer_restarted_on_the_same_port_is_answered(ctx):
    """A closed peer that is back on its port before the request: answered, no false PeerGone."""
    srv = _server(ctx)
    port = srv.port
    addr = f"tcp://127.0.0.1:{port}"
    stop = threading.Event()
    t = _serve(srv, stop)
    client = C.ControlClient(ctx)
    try:
        assert isinstance(client.call(addr, _hb(), 5.0), C.Ack)
        stop.set()
        t.join(5)
        srv.close()
        time.sleep(0.1)
        srv = _server(ctx, port)
        stop = threading.Event()
        t = _serve(srv, stop)
        for _ in range(20):
            assert isinstance(client.call(addr, _hb(), 5.0), C.Ack)
    finally:
        stop.set()
        t.join(5)
        srv.close()
        client.close()


def test_peer_that_stops_answering_heartbeats_fails_within_the_peer_timeout(ctx):
    srv = _server(ctx)
    stop = threading.Event()
    t = _serve(srv, stop)
    fwd = Forwarder(srv.port)
    addr = f"tcp://127.0.0.1:{fwd.port}"
    client = C.ControlClient(ctx)
    try:
        assert isinstance(client.call(addr, _hb(), 5.0), C.Ack)
        fwd.frozen.set()  # the connection stays open; nothing crosses it any more
        dt, e = _timed_gone(client, addr)
        assert dt < C.PEER_TIMEOUT_MS / 1000 + FAST_S and "connection lost" in str(e), (dt, e)
    finally:
        client.close()
        fwd.close()
        stop.set()
        t.join(5)
        srv.close()


def _wait(eng, rid, timeout=15.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        r = eng.poll()
        if rid in r.finished_recving:
            return "done", ""
        if rid in r.failed:
            return "failed", r.errors.get(rid, "")
        time.sleep(0.002)
    return "pending", ""


@pytest.mark.parametrize("after_a_load", [False, True])
def test_load_from_a_dead_exporter_fails_at_once_naming_it(after_a_load):
    """P closes (as a killed process does) after handing out params: D's load fails well within
    its 10 s bound, saying which address and what happened; first contact (handshake) or over
    a connection D had used for an earlier load (lease grant)."""
    caches = [torch.zeros(SPEC.cache_shape(16, 1), dtype=SPEC.dtype) for _ in range(2)]
    dc = [torch.zeros(SPEC.cache_shape(16, 1), dtype=SPEC.dtype) for _ in range(2)]
    port = free_port_base(1)
    p = TransferEngine(SPEC, caches, 0, 1, "P", transport="pg", port=port, auth_key="k").start()
    d = TransferEngine(SPEC, dc, 0, 1, "D", transport="pg", timeout_s=10.0).start()
    try:
        if after_a_load:
            d.load("a", p.export("a", [1, 2], 12), [3, 4])
            assert _wait(d, "a") == ("done", "")
        params = p.export("b", [5, 6], 12)
        p.close()
        time.sleep(0.2)
        t0 = time.monotonic()
        d.load("b", params, [7, 8])
        state, why = _wait(d, "b")
        dt = time.monotonic() - t0
        assert state == "failed" and dt < FAST_S, (state, dt, why)
        assert f"127.0.0.1:{port}" in why and ("refused" in why or "lost" in why), why
    finally:
        d.close()
        p.close()
