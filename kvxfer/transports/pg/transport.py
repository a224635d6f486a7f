"""The ``pg`` transport of one engine rank (:class:`~kvxfer.transports.Transport`).

Exporter: a TCPStore the loaders' pair groups meet at, the backends it serves
(:mod:`~kvxfer.transports.pg.groups`), and the pair groups loaders asked for, each joined and
served by a thread of its own (:mod:`~kvxfer.transports.pg.send`). Loader: a pair group with
each source rank of a peer, joined on first use, and the staged receive
(:mod:`~kvxfer.transports.pg.session`)."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from ... import control
from ..base import LoaderLink, StreamJob
from . import groups
from .groups import UNKNOWN_PAIR
from .send import PairSenders, stream_send
from .session import PgSession

if TYPE_CHECKING:  # pragma: no cover
    from ...peer import Peer
    from ...rank import Rank, Runtime

__all__ = ["PgTransport"]


class PgTransport:
    """See the module doc. ``senders``: the exporter's pair groups."""

    name = "pg"
    ticks = False  # tick() has nothing to keep up to date: the exporter skips it

    def __init__(self, rank: Rank, rt: Runtime) -> None:
        self.rank = rank
        self.rt = rt
        self.why = "not started"
        self.store = None
        self.backend = ""  # the backend this rank prefers for its caches
        self.backends: list[str] = []  # the backends it serves
        self.senders = PairSenders(
            f"kvxfer-{rank.engine_id}-{rank.tp_rank}",
            self._join,
            self._stream,
            groups.discard_pair,
            rt.stop,
        )
        self._sessions: weakref.WeakSet[PgSession] = weakref.WeakSet()  # the loader's, open

    # ------------------------------------------------------------------ exporter
    def start(self) -> None:
        rank = self.rank
        if rank.transport not in ("auto", "pg"):
            self.why = f"the engine is configured for transport {rank.transport!r}"
            return
        self.store = groups.serve_store(rank.host, rank.timeout_s)
        self.backend = rank.pipeline.pg_backend(rank.device)
        self.backends = groups.offered_pg_backends(self.backend, rank.device)
        self.why = ""

    def hello_entry(self, hello: control.Hello) -> dict | None:
        if self.store is None:
            return None
        return {
            "host": self.rank.host,
            "port": self.store.port,
            "backend": self.backend,
            "backends": self.backends,
            "units": list(self.rank.units),  # what a SendReq's unit may be
            **self.rank.pipeline.handshake_info(),
        }

    def serves(self) -> dict:
        return {control.PairReq: self.serve_pair}

    def serve_pair(self, msg: control.PairReq) -> control.SendReply:
        """Join pair group ``msg.key`` (its token verified) on a thread of its own."""
        if self.store is None:
            return control.SendReply(ok=False, failed={"*": "pg transport not offered by this engine"})
        backend = msg.backend or self.backend
        if backend not in self.backends:
            why = f"pg backend {backend!r} not served here (offers {self.backends})"
            return control.SendReply(ok=False, failed={"*": why})
        why = self.senders.open(msg.key, backend)
        return control.SendReply(ok=not why, failed={"*": why} if why else {})

    def tick(self, beat: bool, expected) -> int:
        return 0

    def serve_stream(self, job: StreamJob) -> control.SendReply:
        key = job.msg.key
        if self.senders.backend(key) is None:
            why = f"{UNKNOWN_PAIR} {key} (never paired here, evicted, or this rank restarted)"
            return control.SendReply(ok=False, failed={"*": why})
        why = self.senders.submit(key, job)  # run by the pair's own thread
        return control.SendReply(ok=not why, failed={"*": why} if why else {})

    def _join(self, key: str, backend: str):
        """Join pair group ``key`` as its rank 0 (a pair's own thread: blocks until the loader
        joins, at most ``timeout_s``)."""
        rank = self.rank
        store = groups.connect_store(rank.host, self.store.port, rank.timeout_s)
        return groups.new_pair(store, key, 0, rank.host, rank.timeout_s, backend)

    def _stream(self, group, backend: str, job: StreamJob) -> None:
        stream_send(self.rank, self.rt, group, backend, job)

    # ------------------------------------------------------------------ loader
    def open(self, peer: Peer, link: LoaderLink) -> PgSession:
        """A session with ``peer``: its pair groups are joined on first use."""
        session = PgSession(self.rank, self.rt, peer, link)
        self._sessions.add(session)
        return session

    # ------------------------------------------------------------------ both
    def abort(self, why: str) -> None:
        self.senders.discard_all(why)
        for session in list(self._sessions):
            session.close(why)

    def threads(self) -> list:
        return self.senders.threads()

    def close(self, busy: bool = False) -> None:
        self.abort("engine closed")
        self._sessions.clear()
        self.store = None

    def stats(self) -> dict:
        return {}
