"""A handshaken remote engine as a loader rank knows it (:class:`Peer`), and the loader rank's
peers by engine id (:class:`Peers`).

A peer is made by the handshake (:mod:`kvxfer.handshake`): what the exporter ranks said of
themselves, the plan of reads between the two TP layouts, the transport chosen and why, and
that transport's :class:`~kvxfer.transfer.Session` with it (``ipc``: the mapped caches and
lease-slot tables; ``pg``: a pair group per source rank; ``nixl``: the peer's agents and the
descriptors prepared for it). Forgetting a peer closes its session; the next load of it
handshakes anew.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from . import control
from .params import KVTransferParams
from .plan import Read, TransferPlan
from .spec import KVCacheSpec
from .transfer import Session

__all__ = ["Peer", "Peers"]


class Peer:
    """A handshaken remote engine (see the module doc).

    What the handshake learned: ``engine_id``, ``spec``, ``tp_size``, ``addrs`` (each exporter
    rank's side channel), ``replies`` (their ``HelloReply``), ``num_blocks`` (the fewest any of
    them holds), ``plan`` (remote -> this engine), ``reads`` / ``notify_to`` (this rank's part
    of it), ``src_ranks`` and ``reads_by_rank`` (the reads by source rank), ``full_mask``
    (every layer, :func:`~kvxfer.engine_types.full_layer_mask`), ``host`` and ``port`` (where the
    params said it listens), ``transport`` (the one chosen), ``reason`` (why, and what its
    session added), ``pg_backends`` (per source rank, for ``pg``), ``state_routes`` (the state
    groups that re-shard from it, :class:`~kvxfer.groups.state_group.StateRoute`). ``session``: the chosen
    transport's session with it, set once by the handshake."""

    __slots__ = (
        "addrs",
        "engine_id",
        "full_mask",
        "host",
        "notify_to",
        "num_blocks",
        "pg_backends",
        "plan",
        "port",
        "reads",
        "reads_by_rank",
        "reason",
        "replies",
        "session",
        "spec",
        "src_ranks",
        "state_routes",
        "tp_size",
        "transport",
    )

    def __init__(
        self,
        engine_id: str,
        spec: KVCacheSpec,
        addrs: list[str],
        replies: list[control.HelloReply],
        plan: TransferPlan,
        tp_rank: int,
        transport: str,
        reason: str,
        host: str = "",
        port: int = 0,
        pg_backends: list[str] | None = None,
        full_mask: int = 0,
    ) -> None:
        self.engine_id = engine_id
        self.spec = spec
        self.tp_size = len(addrs)
        self.addrs = addrs
        self.replies = replies
        self.num_blocks = min(r.num_blocks for r in replies)
        self.plan = plan
        self.reads: list[Read] = plan.reads(tp_rank)
        self.notify_to: list[int] = plan.notify_targets(tp_rank)
        self.src_ranks: list[int] = sorted({r.src_rank for r in self.reads})
        self.reads_by_rank: dict[int, list[Read]] = {
            s: [r for r in self.reads if r.src_rank == s] for s in self.src_ranks
        }
        self.transport = transport
        self.reason = reason
        self.host, self.port = host, port
        self.pg_backends = pg_backends or []
        self.full_mask = full_mask
        self.session: Session | None = None
        self.state_routes: dict = {}  # state group -> StateRoute (kvxfer.groups.state_group), set by the handshake

    def serves(self, p: KVTransferParams) -> bool:
        """Whether params ``p`` name this peer where it was handshaken (a change of address or
        TP size means a new peer: restarted, or another engine under the same id)."""
        return (self.host, self.port, self.tp_size) == (p.host, p.port, p.tp_size)

    def close(self) -> None:
        """Close the transport's session with it (what was made for it is dropped)."""
        session, self.session = self.session, None
        if session is not None:
            session.close()


class Peers:
    """A loader rank's handshaken peers by engine id, and why each one's transport was chosen
    (``stats()["transport_reasons"]``, kept after a peer is forgotten). :meth:`get` may be
    called from any thread (the one-sided path runs in the caller's)."""

    def __init__(self) -> None:
        self._by_id: dict[str, Peer] = {}
        self._lock = threading.Lock()
        self.reasons: dict[str, str] = {}
        # get(engine_id) -> the peer kept for it, or None (any thread): the dict's own lookup,
        # no Python frame (a one-sided load makes it in load())
        self.get: Callable[[str], Peer | None] = self._by_id.get

    def add(self, peer: Peer) -> None:
        """Keep ``peer`` (a peer it replaces was forgotten first: :meth:`forget`)."""
        with self._lock:
            self._by_id[peer.engine_id] = peer
            self.reasons[peer.engine_id] = peer.reason

    def forget(self, peer: Peer) -> bool:
        """Drop ``peer`` (if it is still the one kept for its engine id) and close its session;
        True when it was kept."""
        with self._lock:
            kept = self._by_id.get(peer.engine_id) is peer
            if kept:
                del self._by_id[peer.engine_id]
        peer.close()
        return kept

    def all(self) -> list[Peer]:
        with self._lock:
            return list(self._by_id.values())

    def close(self) -> None:
        """Forget every peer."""
        for peer in self.all():
            self.forget(peer)
