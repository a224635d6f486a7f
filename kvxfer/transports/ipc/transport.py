"""The ``ipc`` transport of one engine rank (:class:`~kvxfer.transports.Transport`).

Exporter: at start it describes the rank's caches for loaders on this host and allocates the
block-epoch array in shared memory (:mod:`~kvxfer.transports.ipc.offer`); the epochs are the
export tracker's, so a loader that maps them sees every release. Loader: it maps each source
rank on first use and copies straight from it (:mod:`~kvxfer.transports.ipc.read`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ... import control
from ...engine_types import Remote
from ...plan import Read
from ...tracing import items_tag, trace
from ..base import LoaderLink, StreamJob
from . import offer
from .mappers import mapper
from .read import IpcMap, map_rank, read

if TYPE_CHECKING:  # pragma: no cover
    from ...rank import Rank

__all__ = ["IpcTransport"]


class IpcTransport:
    """See the module doc; ``epochs`` is the shared epoch array once offered (else None),
    ``segment`` its shared-memory segment."""

    name = "ipc"

    def __init__(self, rank: Rank) -> None:
        self.rank = rank
        self.why = "not started"
        self.epochs = None
        self._entry: dict | None = None
        self.segment = None
        self._maps: dict[int, tuple[Remote, dict[int, IpcMap]]] = {}  # id(remote) -> its maps

    def start(self) -> None:
        rank = self.rank
        made = offer.offer_ipc(
            rank.caches, rank.device, rank.num_blocks, rank.engine_id, rank.transport in ("auto", "ipc")
        )
        self._entry, self.epochs, self.segment = made.desc, made.epochs, made.epoch_shm
        self.why = "" if made.offered else made.desc.get("why") or "not offered"

    @property
    def entry(self) -> dict:
        """The ``ipc`` entry every handshake reply carries (its ``info`` also when not offered)."""
        return self._entry or {}

    def hello_entry(self, hello: control.Hello) -> dict | None:
        return self._entry

    def serves(self) -> dict:
        return {}

    def serve_stream(self, job: StreamJob) -> control.SendReply:
        return control.SendReply(ok=False, failed={"*": "ipc does not stream: the loader copies itself"})

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
        got = self._maps.get(id(rem))
        if got is None or got[0] is not rem:
            got = self._maps[id(rem)] = (rem, {})
        mapped = got[1].get(s)
        if mapped is None:
            mapped = got[1][s] = map_rank(rem, s, self.rank.device)
        with trace("copy", items_tag, loads):
            return read(self.rank, mapped, rem, s, reads, loads, granted, deadline, layers)

    def forget(self, rem: Remote) -> None:
        got = self._maps.get(id(rem))
        if got is not None and got[0] is rem:
            del self._maps[id(rem)]
            for m in got[1].values():
                offer.detach(m.handles)

    def abort(self, why: str) -> None:
        pass

    def threads(self) -> list:
        return []

    def close(self, busy: bool = False) -> None:
        for rem, _ in list(self._maps.values()):
            self.forget(rem)
        if self.segment is not None:
            mapper("shm").release_segment(self.segment)
            self.segment = None

    def stats(self) -> dict:
        return {}
