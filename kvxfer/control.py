"""Side channel between engines: pyzmq sockets carrying msgspec-encoded (msgpack) messages
(:mod:`kvxfer.messages`, re-exported here: ``control.Hello``, ``control.encode``, ...).

Every engine rank binds one ROUTER socket (:class:`ControlServer`, served by one thread).
Requests carry an 8-byte id; replies echo it. :class:`ControlClient` (one DEALER socket per
remote rank, used from one thread) sends requests and waits for the matching reply with a
bound; every message is a request with a reply (notifications and heartbeats are acknowledged
and retried by the engine). A request whose peer is gone fails at once, not at its bound
(:class:`PeerGone`): each client socket is watched (a zmq socket monitor) and exchanges ZMTP
heartbeats, so a refused connection, a closed one, or a peer that stops answering heartbeats
for ``PEER_TIMEOUT_MS`` ends the requests pending on it within about that. Stale replies of timed-out requests, and frames that do not decode,
are dropped and logged; a malformed request gets an :class:`ErrorReply`, never crashes the
serving thread. :class:`FaultInjector` drops messages on purpose (tests and soaks).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import operator
import os
import socket
import struct
import time
from collections.abc import Callable

import zmq

from .limits import MAX_MESSAGE_BYTES
from .messages import (
    HELLO_REFUSED,
    PROTOCOL_VERSION,
    Ack,
    ErrorReply,
    Heartbeat,
    Hello,
    HelloReply,
    NixlPairReq,
    Notify,
    PairReq,
    ReadReply,
    ReadReq,
    SendReply,
    SendReq,
    decode,
    encode,
)
from .tracing import batch_tag, trace

_LOG = logging.getLogger(__name__)


def _msg_tag(msg) -> str:
    """Trace name of a served message: its type and the request(s) it is about."""
    ids = getattr(msg, "request_ids", None) or [r for r in [getattr(msg, "request_id", None)] if r]
    return f"{type(msg).__name__} {batch_tag(ids)}" if ids else type(msg).__name__


__all__ = [
    "HELLO_REFUSED",
    "PROTOCOL_VERSION",
    "Ack",
    "ControlClient",
    "ControlServer",
    "ControlTimeout",
    "Deferred",
    "ErrorReply",
    "FaultInjector",
    "Heartbeat",
    "Hello",
    "HelloReply",
    "NixlPairReq",
    "Notify",
    "PairReq",
    "PeerGone",
    "ReadReply",
    "ReadReq",
    "SendReply",
    "SendReq",
]


class Deferred:
    """What a handler returns to answer later (a long poll): the server calls ``reply(final)``
    every tick until it returns a message, and with ``final=True`` once ``deadline`` passed."""

    __slots__ = ("deadline", "reply")

    def __init__(self, reply: Callable[[bool], object | None], deadline: float) -> None:
        self.reply = reply
        self.deadline = deadline


class ControlTimeout(RuntimeError):
    """A side-channel request got no reply within its bound."""


class PeerGone(ControlTimeout):
    """A side-channel request's peer refused the connection, closed it, or stopped answering
    heartbeats while the request was pending: its process is gone (or hung), so the request
    fails now rather than at its bound. ``addr``: the peer's address; ``why``: what happened."""

    def __init__(self, addr: str, why: str) -> None:
        super().__init__(f"side channel to {addr}: {why}")
        self.addr = addr
        self.why = why


class FaultInjector:
    """Drops (or delays) side-channel messages on purpose: each outgoing request (client) and
    each reply (server) that ``only(msg)`` selects (default all) is delayed by ``delay_s`` and
    dropped with probability ``drop`` (seeded). Install with :func:`set_fault_injector`
    (process-wide; ``None`` removes it)."""

    def __init__(
        self,
        drop: float = 0.0,
        seed: int = 0,
        only: Callable[[object], bool] | None = None,
        delay_s: float = 0.0,
    ) -> None:
        import random
        import threading

        if not 0.0 <= drop <= 1.0:
            raise ValueError(f"drop: must be in [0, 1], got {drop!r}")
        if not delay_s >= 0:
            raise ValueError(f"delay_s: must be >= 0, got {delay_s!r}")
        self.drop = drop
        self.only = only
        self.delay_s = delay_s
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.dropped = 0

    def should_drop(self, msg) -> bool:
        """Whether to drop ``msg`` (a selected message is first delayed by ``delay_s``)."""
        if self.only is not None and not self.only(msg):
            return False
        if self.delay_s:
            time.sleep(self.delay_s)
        with self._lock:
            if self._rng.random() < self.drop:
                self.dropped += 1
                return True
        return False


_faults: FaultInjector | None = None


def set_fault_injector(faults: FaultInjector | None) -> None:
    """Install (or, with ``None``, remove) the process-wide :class:`FaultInjector`."""
    global _faults
    _faults = faults


def _dropped(msg) -> bool:
    f = _faults
    return f is not None and f.should_drop(msg)


MAX_HELD = 1024  # long polls held at once; more are answered at once, as they stand
SERVER_RCVHWM = 64
# How long one serve_once() call goes on handling messages that keep arriving before it returns
# (what is left stays queued, bounded by SERVER_RCVHWM per peer): the exporter's loop then
# ticks, expires leases and answers held long polls, however fast peers send.
SERVE_BUDGET_S = 0.02


class ControlServer:
    """ROUTER socket bound to ``tcp://host:port``; :meth:`serve_once` handles what arrived.

    ``handler(msg) -> reply | None`` runs on the serving thread; a None reply sends nothing; a
    :class:`Deferred` is held (at most ``MAX_HELD`` at once) and answered when ready.
    """

    def __init__(self, ctx: zmq.Context, host: str, port: int) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)  # a larger frame drops its peer
        # frames queued per peer connection before zmq stops reading from it (default 1000): a
        # peer flooding faster than the handler decodes holds at most this many in memory
        self.sock.setsockopt(zmq.RCVHWM, SERVER_RCVHWM)
        try:
            if port:
                self.sock.bind(f"tcp://{host}:{port}")
                self.port = port
            else:
                self.port = self.sock.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError:
            self.sock.close(0)
            raise
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._held: list[tuple[bytes, bytes, Deferred]] = []  # long polls answered later

    def serve_once(self, handler: Callable, timeout_ms: int) -> int:
        """Handle the messages that arrive within ``timeout_ms`` (1 ms while long polls are
        held), until none is queued or :data:`SERVE_BUDGET_S` has passed since the first (the
        rest wait for the next call), and answer held long polls that are ready; returns how
        many messages were taken."""
        n = 0
        if self._held:
            self._answer_held()
            timeout_ms = min(timeout_ms, 1)
        if not self._poller.poll(timeout_ms):
            return 0
        sock = self.sock
        end = time.monotonic() + SERVE_BUDGET_S
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:  # a spurious wake-up
                return n
            n += 1
            self._take(frames, handler)
            # another message queued? (asked of the socket: cheaper than a receive that fails)
            if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN or time.monotonic() >= end:
                return n

    def _take(self, frames: list[bytes], handler: Callable) -> None:
        """Handle one received frame set: decode it, run ``handler``, send or hold the reply."""
        if len(frames) != 3 or len(frames[1]) != 8:
            _LOG.warning(
                "kvxfer side channel: dropped a frame set that is not a request (%d frames)", len(frames)
            )
            return
        ident, mid, payload = frames
        try:
            msg = decode(payload)
        except Exception as e:  # DecodeError, ValidationError, RecursionError (nested too deep)
            reply = ErrorReply(f"malformed message: {type(e).__name__}: {str(e)[:200]}")
        else:
            try:
                with trace("serve", _msg_tag, msg):
                    reply = handler(msg)
            except Exception as e:  # a handler bug must not kill the side channel
                _LOG.warning(
                    "kvxfer side channel: handler failed on %s (%s: %s)",
                    type(msg).__name__,
                    type(e).__name__,
                    e,
                )
                reply = ErrorReply(f"{type(e).__name__}: {e}")
        if isinstance(reply, Deferred):
            if len(self._held) < MAX_HELD:
                self._held.append((ident, mid, reply))
                return
            reply = self._final(reply)  # too many held already: answered now, as it stands
        self._send(ident, mid, reply)

    def _send(self, ident: bytes, mid: bytes, reply) -> None:
        if reply is not None and not _dropped(reply):
            with contextlib.suppress(zmq.Again):  # peer gone and its queue full: drop
                self.sock.send_multipart([ident, mid, encode(reply)], zmq.NOBLOCK)

    def _answer_held(self) -> None:
        now = time.monotonic()
        still = []
        for ident, mid, d in self._held:
            final = now >= d.deadline
            reply = self._final(d) if final else self._reply_of(d, False)
            if reply is None:
                still.append((ident, mid, d))
            else:
                self._send(ident, mid, reply)
        self._held = still

    @staticmethod
    def _reply_of(d: Deferred, final: bool):
        try:
            return d.reply(final)
        except Exception as e:  # a handler bug must not kill the side channel
            _LOG.warning("kvxfer side channel: held reply failed (%s: %s)", type(e).__name__, e)
            return ErrorReply(f"{type(e).__name__}: {e}")

    def _final(self, d: Deferred):
        return self._reply_of(d, True)

    def close(self) -> None:
        self.sock.close(0)


# A peer is gone when a connection to it is refused or closed, or when it answers no ZMTP
# heartbeat (sent every HEARTBEAT_IVL_MS by libzmq's I/O thread, answered by the peer's: a busy
# or GIL-bound peer still answers) for PEER_TIMEOUT_MS. A new connection whose ZMTP handshake
# does not complete within HANDSHAKE_IVL_MS is dropped too (a stopped process still accepts
# TCP connections in its kernel). A dropped connection is retried every RECONNECT_IVL_MS (zmq
# adds up to as much again at random); a request for a peer whose connection dropped and has not
# come back first checks it with one TCP connect (PROBE_S at most): refused, it fails at once. PEER_TIMEOUT_MS ($KVXFER_PEER_TIMEOUT_MS, default
# 1000) is a trade: a peer whose I/O thread gets no CPU for that long is taken for gone; 150 ms
# took live peers for gone on a loaded host (profiling/results/2026-11-28-cpu-vllm-pd/README.md).
def _peer_timeout_ms() -> int:
    raw = os.environ.get("KVXFER_PEER_TIMEOUT_MS", "1000")
    try:
        v = int(raw)
    except ValueError:
        v = 0
    if not 50 <= v <= 600_000:
        raise ValueError(
            f"$KVXFER_PEER_TIMEOUT_MS: must be an int of milliseconds in [50, 600000], got {raw!r}"
        )
    return v


PEER_TIMEOUT_MS = _peer_timeout_ms()
HEARTBEAT_IVL_MS = max(10, PEER_TIMEOUT_MS // 5)
HANDSHAKE_IVL_MS = max(1000, PEER_TIMEOUT_MS)
RECONNECT_IVL_MS = 20
_GONE_EVENTS = {
    zmq.EVENT_CLOSED: "connection refused (nothing listens there: the process is gone or restarting)",
    zmq.EVENT_DISCONNECTED: (
        f"connection lost (the peer closed it, or answered no heartbeat for {PEER_TIMEOUT_MS} ms)"
    ),
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "side-channel handshake failed (the peer stopped answering?)",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "side-channel handshake failed (not a kvxfer side channel?)",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "side-channel handshake failed (authentication)",
}
_MONITORED = functools.reduce(operator.or_, _GONE_EVENTS) | zmq.EVENT_HANDSHAKE_SUCCEEDED
_REFUSED = _GONE_EVENTS[zmq.EVENT_CLOSED]
# A reply mostly comes within a millisecond. call_many first waits for it in a blocking receive
# bounded by this (the socket's RCVTIMEO), which costs the thread one wake-up; only replies not
# there by then are polled for together with the sockets' monitors, which costs more per call
# (profiling/bench_side_channel.py). A peer that goes away is seen at most twice this later.
FIRST_WAIT_MS = 5
PROBE_S = 0.05  # bound of the TCP connect that checks a peer whose connection is down
_EVENT = struct.Struct("=HI")  # a monitor event's first frame: event (uint16), value (uint32)


class ControlClient:
    """DEALER sockets to remote ranks (by address), each watched by a socket monitor (see
    :class:`PeerGone`); use from one thread only."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.ctx = ctx
        self._socks: dict[str, zmq.Socket] = {}
        self._mons: dict[str, zmq.Socket] = {}  # addr -> its socket's monitor (PAIR)
        self._ids = itertools.count(1)
        self.gone: dict[str, str] = {}  # addr -> why, of requests a partial call_many gave up
        self._down: set[str] = set()  # addrs whose connection dropped and has not come back

    def _sock(self, addr: str) -> zmq.Socket:
        s = self._socks.get(addr)
        if s is None:
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 10_000)
            s.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)  # a larger reply drops its peer
            s.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
            s.setsockopt(zmq.HEARTBEAT_TIMEOUT, PEER_TIMEOUT_MS)
            s.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
            s.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
            s.setsockopt(zmq.RCVTIMEO, FIRST_WAIT_MS)  # call_many's blocking receives (only those)
            self._mons[addr] = s.get_monitor_socket(_MONITORED)
            s.connect(addr)
            self._socks[addr] = s
        return s

    def _gone(self, addr: str) -> str:
        """Drain ``addr``'s monitor; why its peer is gone ("" when no such event came)."""
        mon = self._mons.get(addr)
        why = ""
        while mon is not None and mon.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                frames = mon.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames[0]) != _EVENT.size:
                continue
            event = _EVENT.unpack(frames[0])[0]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._down.discard(addr)
            elif event in _GONE_EVENTS:
                self._down.add(addr)
                why = why or _GONE_EVENTS[event]
        return why

    @staticmethod
    def _refuses(addr: str) -> bool:
        """Whether ``tcp://host:port`` refuses a TCP connection now (bounded by ``PROBE_S``)."""
        host, _, port = addr.removeprefix("tcp://").rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_S).close()
        except ConnectionRefusedError:
            return True
        except (OSError, ValueError):
            return False
        return False

    def call(self, addr: str, msg, timeout_s: float):
        """Send ``msg`` and return the decoded reply; :class:`ControlTimeout` after ``timeout_s``."""
        return self.call_many([(addr, msg)], timeout_s)[0]

    def call_many(self, calls: list[tuple[str, object]], timeout_s: float, partial: bool = False) -> list:
        """Send every request at once, then wait for all replies (one overall bound).

        :class:`ControlTimeout` when some reply did not come in time (:class:`PeerGone`, at once,
        when a peer is gone: see the class), or with ``partial=True`` the replies that came,
        ``None`` for the others (``gone[addr]`` says why, for a peer that is gone)."""
        pending: dict[tuple[str, int], int] = {}
        dead: set[str] = set()
        for addr in {a for a, _ in calls}:
            self._gone(addr)  # what happened before these requests is not about them
            # a connection that dropped and has not come back: zmq would queue the request
            # until its next retry; a peer refusing connections now fails it at once
            if addr in self._down and self._refuses(addr):
                if not partial:
                    raise PeerGone(addr, _REFUSED)
                self.gone[addr] = _REFUSED
                dead.add(addr)
        out: list = [None] * len(calls)
        for i, (addr, msg) in enumerate(calls):
            if addr in dead:
                continue
            mid = next(self._ids)
            if not _dropped(msg):
                try:
                    self._sock(addr).send_multipart([struct.pack("<Q", mid), encode(msg)], zmq.NOBLOCK)
                except zmq.Again:
                    raise ControlTimeout(f"side channel to {addr}: send queue full") from None
            else:
                self._sock(addr)  # registered for polling; the reply will simply not come
            pending[(addr, mid)] = i
        deadline = time.monotonic() + timeout_s
        if pending:
            self._first_replies(pending, out, deadline)
        if not pending:
            return out
        poller = zmq.Poller()
        owner: dict = {}  # socket -> (addr, is the monitor)
        for addr in {a for a, _ in pending}:
            for sock, mon in ((self._sock(addr), False), (self._mons[addr], True)):
                poller.register(sock, zmq.POLLIN)
                owner[sock] = (addr, mon)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                if partial:
                    return out
                addrs = sorted({a for a, _ in pending})
                raise ControlTimeout(f"no reply from {', '.join(addrs)} within {timeout_s:.1f}s")
            for sock, _ in poller.poll(int(left * 1000) + 1):
                addr, is_mon = owner[sock]
                if is_mon:
                    why = self._gone(addr)
                    if why and any(a == addr for a, _ in pending):
                        if not partial:
                            raise PeerGone(addr, why)
                        self.gone[addr] = why
                        pending = {k: v for k, v in pending.items() if k[0] != addr}
                    continue
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._take(addr, frames, pending, out)
                    if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        break
        return out

    def _first_replies(self, pending: dict[tuple[str, int], int], out: list, deadline: float) -> None:
        """Take the replies that come within about :data:`FIRST_WAIT_MS`, socket by socket, in
        blocking receives that end before ``deadline`` and begin within that much of the first;
        the first one not there in time leaves the rest to :meth:`call_many`'s poll of the
        sockets and their monitors (a peer gone is then seen)."""
        wait_s = FIRST_WAIT_MS / 1000
        end = min(time.monotonic() + wait_s, deadline - wait_s)
        waiting: dict[str, int] = {}
        for addr, _ in pending:
            waiting[addr] = waiting.get(addr, 0) + 1
        for addr, k in waiting.items():
            sock = self._socks[addr]
            while k:
                if time.monotonic() >= end:
                    return
                try:
                    frames = sock.recv_multipart()  # bounded by the socket's RCVTIMEO
                except zmq.Again:
                    return
                k -= self._take(addr, frames, pending, out)

    @staticmethod
    def _take(addr: str, frames: list[bytes], pending: dict[tuple[str, int], int], out: list) -> bool:
        """Put a reply from ``addr`` in its place in ``out``; False for one that answers nothing
        pending (a stale reply to a request that timed out, or malformed: dropped)."""
        if len(frames) != 2 or len(frames[0]) != 8:
            _LOG.warning("kvxfer side channel: dropped a malformed reply from %s", addr)
            return False
        i = pending.pop((addr, struct.unpack("<Q", frames[0])[0]), None)
        if i is None:
            return False  # a stale reply to a request that timed out
        try:
            out[i] = decode(frames[1])
        except Exception as e:  # DecodeError, ValidationError, RecursionError
            raise ControlTimeout(
                f"side channel to {addr}: undecodable reply ({type(e).__name__}: {str(e)[:200]})"
            ) from None
        return True

    def drop(self, addr: str) -> None:
        """Forget the socket to ``addr`` (after a timeout, so stale replies cannot confuse a retry)."""
        s = self._socks.pop(addr, None)
        mon = self._mons.pop(addr, None)
        if s is not None:
            with contextlib.suppress(zmq.ZMQError):
                s.disable_monitor()
            s.close(0)
        if mon is not None:
            mon.close(0)
        self.gone.pop(addr, None)
        self._down.discard(addr)

    def close(self) -> None:
        for addr in list(self._socks):
            self.drop(addr)
