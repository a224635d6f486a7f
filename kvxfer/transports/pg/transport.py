"""The ``pg`` transport of one engine rank (:class:`~kvxfer.transports.Transport`).

Exporter: a TCPStore the loaders' pair groups meet at, the backends it serves
(:mod:`~kvxfer.transports.pg.groups`), and the pair groups loaders asked for, each joined and
served by a thread of its own (:mod:`~kvxfer.transports.pg.send`). Loader: a pair group with
each source rank, joined on first use, and the staged receive
(:mod:`~kvxfer.transports.pg.read`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ... import control
from ...engine_types import LoadItem, Remote, time_left
from ...plan import Read
from ..base import LoaderLink, StreamJob
from . import groups
from . import read as pg_read
from .send import PairSenders, stream_send

if TYPE_CHECKING:  # pragma: no cover
    from ...rank import Rank, Runtime

__all__ = ["PgTransport"]


class PgTransport:
    """See the module doc. ``senders``: the exporter's pair groups."""

    name = "pg"

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
        self._pairs: dict[int, tuple[Remote, dict[int, tuple]]] = {}  # id(remote) -> {rank: (group, key)}

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
            why = f"unknown pair group {key} (never paired here, evicted, or this rank restarted)"
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
    def setup(self, rem: Remote) -> str:
        return ""

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
        try:
            pair = self._pair(loader, rem, s, loads[0], deadline)
        except Exception as e:
            return 0, set(), pg_read.pair_error(s, e, loads)
        moved, landed, bad = pg_read.read(
            loader, pair, lambda why: self.drop_pair(rem, s, why), rem, s, reads, loads, deadline, layers
        )
        if landed:  # finished only once the scatters ran
            self.rt.order.wait_done(time_left(deadline))
        return moved, landed, bad

    def _pair(self, loader: LoaderLink, rem: Remote, s: int, token_of: LoadItem, deadline: float) -> tuple:
        got = self._pairs.get(id(rem))
        if got is None or got[0] is not rem:
            got = self._pairs[id(rem)] = (rem, {})
        pair = got[1].get(s)
        if pair is None:
            pair = got[1][s] = pg_read.join_pair(loader, rem, s, token_of, deadline)
        return pair

    def drop_pair(self, rem: Remote, s: int, why: str = "an op failed or timed out") -> None:
        """Abort and forget the pair group with source rank ``s`` of ``rem`` (the next read
        re-pairs)."""
        got = self._pairs.get(id(rem))
        if got is not None and got[0] is rem:
            pair = got[1].pop(s, None)
            if pair is not None:
                groups.discard_pair(pair[0], why)

    def forget(self, rem: Remote) -> None:
        got = self._pairs.get(id(rem))
        if got is not None and got[0] is rem:
            for s in list(got[1]):
                self.drop_pair(rem, s, "the remote is forgotten")
            del self._pairs[id(rem)]

    # ------------------------------------------------------------------ both
    def abort(self, why: str) -> None:
        self.senders.discard_all(why)
        for rem, pairs in list(self._pairs.values()):
            for s in list(pairs):
                self.drop_pair(rem, s, why)

    def threads(self) -> list:
        return self.senders.threads()

    def close(self, busy: bool = False) -> None:
        self.abort("engine closed")
        self._pairs.clear()
        self.store = None

    def stats(self) -> dict:
        return {}
