"""The interfaces between an engine rank's roles and its transports.

:class:`Transport` is what the exporter and the loader ask of each transport object (one per
kind per rank, found by name in a dict); :class:`LoaderLink` is what a transport's read may use
of the loader that calls it; :class:`StreamJob` is a checked send request the exporter hands a
staged transport."""

from __future__ import annotations

from collections.abc import Callable
from threading import Thread
from typing import TYPE_CHECKING, NamedTuple, Protocol

from .. import control

if TYPE_CHECKING:  # pragma: no cover
    from ..engine_types import Remote
    from ..plan import Read
    from ..rank import Rank, Runtime

__all__ = ["LoaderLink", "StreamJob", "Transport", "offered"]


class StreamJob(NamedTuple):
    """A send request that passed its checks, with the exports its tokens opened (the ones its
    calls were checked against: a stream sends a request's bytes only while that same export
    is live, not a later export of its id)."""

    msg: control.SendReq
    exports: list


class LoaderLink(Protocol):
    """What a transport uses of the loader (:class:`kvxfer.loader.Loader`): the rank and its
    runtime, the worker
    thread's side-channel client, :meth:`forget` of a remote that stopped answering (the next
    load handshakes anew); and for the one-sided ``ipc`` path, the handshaken ``remotes`` by
    engine id and :meth:`notify` of loads it reported."""

    rank: Rank
    rt: Runtime
    client: control.ControlClient
    remotes: dict[str, Remote]

    def forget(self, rem: Remote, why: str = ...) -> None: ...

    def notify(self, rem: Remote, done: list, failed: list) -> None: ...


class Transport(Protocol):
    """What an engine rank's roles ask of one transport (one object per kind, built with the
    rank's :class:`~kvxfer.rank.Rank`).

    ``name``; ``why``: "" when this rank offers it, else the reason (after :meth:`start`)."""

    name: str
    why: str

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

    def setup(self, rem: Remote) -> str:
        """Loader: after a handshake chose this transport for ``rem``; what to add to the
        transport's reason ("" for nothing; ``HandshakeError`` when it cannot be used)."""

    def read(
        self,
        loader: LoaderLink,
        rem: Remote,
        s: int,
        reads: list[Read],
        loads: list,
        granted: dict,
        deadline: float,
        layers: list[int] | None,
    ) -> tuple[int, set[str], dict[str, str]]:
        """Loader: move ``reads`` of source rank ``s`` for ``loads``: (wire bytes moved, the
        local ids that landed by this transport's own record, local id -> why for failures)."""

    def forget(self, rem: Remote) -> None:
        """Loader: drop what was made for ``rem`` (mappings, pair groups, agents)."""

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
