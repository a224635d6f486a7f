"""The interfaces between an engine rank's roles and its transports.

:class:`Transport` is what the exporter and the loader ask of each transport object (one per
kind per rank, found by name in a dict): the exporter its handshake entry, the messages it
answers and the streams it runs; the loader a :class:`~kvxfer.transfer.Session` with each peer
(:meth:`Transport.open`), which moves the bytes the load planner hands it. :class:`LoaderLink`
is what a session may use of the loader that opened it; :class:`StreamJob` is a checked send
request the exporter hands a staged transport."""

from __future__ import annotations

from collections.abc import Callable
from threading import Thread
from typing import TYPE_CHECKING, NamedTuple, Protocol

from .. import control

if TYPE_CHECKING:  # pragma: no cover
    from ..peer import Peer
    from ..transfer import Session

__all__ = ["LoaderLink", "StreamJob", "Transport", "offered"]


class StreamJob(NamedTuple):
    """A send request that passed its checks, with the exports its tokens opened (the ones its
    calls were checked against: a stream sends a request's bytes only while that same export
    is live, not a later export of its id)."""

    msg: control.SendReq
    exports: list


class LoaderLink(Protocol):
    """What a transport's session uses of the loader (:class:`kvxfer.loader.Loader`): the worker
    thread's side-channel client (pair and send requests), and :meth:`forget` of a peer that
    stopped answering (the next load handshakes anew)."""

    client: control.ControlClient

    def forget(self, peer: Peer, why: str = ...) -> None: ...


class Transport(Protocol):
    """What an engine rank's roles ask of one transport (one object per kind, built with the
    rank's :class:`~kvxfer.rank.Rank` and :class:`~kvxfer.rank.Runtime`).

    ``name``; ``why``: "" when this rank offers it, else the reason (after :meth:`start`);
    ``ticks``: False when :meth:`tick` never has anything to do (the exporter then skips it)."""

    name: str
    why: str
    ticks: bool

    def start(self) -> None:
        """Make what offering it needs (memory descriptions, a store, an agent), or set ``why``."""

    def hello_entry(self, hello: control.Hello) -> dict | None:
        """Exporter: this transport's entry of the handshake reply to an authenticated ``hello``."""

    def serves(self) -> dict:
        """Exporter: ``{message type: handler}`` of the side-channel messages this transport
        answers itself (pair requests)."""

    def tick(self, beat: bool, expected: Callable[[int, int], int | str]) -> int:
        """Exporter, every side-channel tick and ``poll()``: what the transport keeps up to date
        (``beat``: the tick's heartbeat is due; ``expected``: the exporter's
        ``expected_from``); returns the exports it finished (``ipc``: by done marks)."""

    def serve_stream(self, job: StreamJob) -> control.SendReply:
        """Exporter: run a checked send request's stream (staged transports), or refuse it."""

    def open(self, peer: Peer, link: LoaderLink) -> Session:
        """Loader: a session with ``peer``, after a handshake chose this transport for it; what
        it adds to the peer's reason goes there (``HandshakeError`` when it cannot be used)."""

    def abort(self, why: str) -> None:
        """Tear down what a thread may be blocked in (pair groups), so ``close()`` is bounded."""

    def threads(self) -> list[Thread]:
        """Threads of its own still running (joined, bounded, at close)."""

    def close(self, busy: bool = False) -> None:
        """Free what :meth:`start` made, after the engine's threads stopped (``busy``: some
        thread did not stop by the bound and may still be inside this transport's calls)."""

    def stats(self) -> dict:
        """Its part of ``TransferEngine.stats()``."""


def offered(transports: dict[str, Transport]) -> list[str]:
    """The names of the transports a rank offers now (those whose ``why`` is empty)."""
    return [name for name, t in transports.items() if not t.why]
