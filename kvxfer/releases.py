"""The loader's releases (:meth:`kvxfer.engine.TransferEngine.release`): a batch of params
that this engine will never load, told to their exporters so that they free the blocks now
rather than when the lease ends. The worker thread runs them as a batch of their own
(``Loader._run_batch``); they move no data."""

from __future__ import annotations

import logging
import time
from typing import Protocol

from . import control
from .engine_types import Expired, HandshakeError, LoadItem, ReleaseItem
from .exports import UNKNOWN
from .peer import Peer, Peers
from .rank import Rank

__all__ = ["ReleaseLink", "run"]


class ReleaseLink(Protocol):
    """What the releases use of the loader (:class:`kvxfer.loader.Loader`)."""

    rank: Rank
    client: control.ControlClient
    peers: Peers

    def peer_of(self, it: LoadItem | ReleaseItem, deadline: float) -> Peer: ...

    def forget(self, peer: Peer, why: str = ...) -> None: ...

    def notify(self, peer: Peer, done: list, failed: list) -> None: ...


_LOG = logging.getLogger(__name__)


def run(loader: ReleaseLink, items: list[ReleaseItem]) -> None:
    """Tell exporters that these requests will never be loaded here (TransferEngine.release).

    Each exporter rank the plan names gets the notification a failed load would send, so
    it frees the blocks once every loader rank released or loaded them. A rank that does
    not know a request yet (the params were made before the export) is asked again until
    the release's deadline: a notification for an unknown request would be dropped.
    """
    groups: dict[str, list[ReleaseItem]] = {}
    for it in items:
        groups.setdefault(it.params.engine_id, []).append(it)
    for engine_id, its in groups.items():
        its = list({it.params.request_id: it for it in its}.values())
        rids = [it.params.request_id for it in its]
        deadline = min(it.deadline for it in its)
        try:
            peer = loader.peer_of(its[0], deadline)
        except (HandshakeError, Expired) as e:
            _LOG.warning(
                "kvxfer %s rank %d: release of %s: handshake with %s failed (%s); the exporter "
                "frees them when their lease ends",
                loader.rank.engine_id, loader.rank.tp_rank, rids, engine_id, e,
            )  # fmt: skip
            continue
        tok = {it.params.request_id: it.params.token for it in its}
        dig = {it.params.request_id: it.params.digest() for it in its}
        todo = {s: list(rids) for s in peer.notify_to}
        while any(todo.values()) and time.monotonic() < deadline:
            ranks = [s for s in peer.notify_to if todo[s]]
            calls = [
                (
                    peer.addrs[s],
                    control.ReadReq(
                        loader.rank.engine_id,
                        loader.rank.tp_rank,
                        loader.rank.tp_size,
                        todo[s],
                        [tok[r] for r in todo[s]],
                        digests=[dig[r] for r in todo[s]],
                    ),
                )
                for s in ranks
            ]
            try:
                replies = loader.client.call_many(calls, max(0.01, deadline - time.monotonic()))
            except control.ControlTimeout as e:
                loader.forget(peer, str(e))
                _LOG.warning(
                    "kvxfer %s rank %d: release of %s: %s; the exporter frees them when their lease ends",
                    loader.rank.engine_id, loader.rank.tp_rank, rids, e,
                )  # fmt: skip
                todo = {}
                break
            for s, g in zip(ranks, replies):
                asked = set(todo[s])  # what the reply names beyond it is not asked again
                todo[s] = (
                    [r for r, why in g.failed.items() if why == UNKNOWN and r in asked]
                    if isinstance(g, control.ReadReply)
                    else []
                )
            if any(todo.values()):
                time.sleep(0.005)
        if any(todo.values()):
            _LOG.warning(
                "kvxfer %s rank %d: release of %s: not exported by %s by the deadline; the exporter "
                "frees them when their lease ends",
                loader.rank.engine_id, loader.rank.tp_rank, sorted({r for v in todo.values() for r in v}), engine_id,
            )  # fmt: skip
        if loader.peers.get(engine_id) is peer:
            loader.notify(peer, [], its)
