"""The loader's lease grants: the requests that ask an exporter's ranks to renew a batch's
leases (:class:`~kvxfer.messages.ReadReq`), and what a round of their replies allows to read.

A grant renews the leases it names and returns the blocks' epochs (which the read then checks)
and, for a layer-wise export, the layers ready. A rank that does not know a request yet (its
export may trail the params) or whose compute is still writing it is asked again the next
round; one whose incarnation changed has restarted, and the loads of its previous start are
void (:data:`RESTARTED`). :class:`~kvxfer.loader.Loader` runs the rounds.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from . import control
from .engine_types import time_left
from .exports import UNKNOWN
from .ordering import NOT_READY
from .peer import Peer
from .rank import Rank
from .tracing import items_tag, trace

__all__ = ["RESTARTED", "ask_grants", "take_grants", "wanted"]

RESTARTED = "restarted (its incarnation changed): loads made from params of its previous start are void"


def ask_grants(client: control.ControlClient, calls: list, loads, deadline: float) -> list:
    """Send lease requests (``calls``: (address, ReadReq) pairs, each renewing the leases it
    names) and return the replies in order. A grant is held by the exporter (long poll)
    until some wanted layer is ready, at most ``wait_s`` (set here from the deadline)."""
    left = time_left(deadline)
    wait = max(0.0, min(0.5, left - 0.05))
    for _, msg in calls:
        msg.wait_s = wait
    with trace("grant", items_tag, loads):
        return client.call_many(calls, left)


def wanted(rank: Rank, peer: Peer, ranks: list[int], alive: dict, need: dict) -> list:
    """The lease requests of a later round: to each of ``ranks``, the loads that still want
    layers from it, with those layers (``b""``: all)."""
    full = peer.full_mask
    nbytes = (peer.spec.num_layers + 7) // 8
    calls = []
    for s in ranks:
        its = [it for rid, it in alive.items() if need[s][rid]]
        msg = control.ReadReq(
            rank.engine_id,
            rank.tp_rank,
            rank.tp_size,
            [it.params.request_id for it in its],
            [it.params.token for it in its],
            [
                b"" if need[s][it.request_id] == full else need[s][it.request_id].to_bytes(nbytes, "big")
                for it in its
            ],
            digests=[it.params.digest() for it in its],
        )
        calls.append((peer.addrs[s], msg))
    return calls


def take_grants(
    peer: Peer,
    ranks: list[int],
    replies: list,
    alive: dict,
    reasons: dict,
    deadline: float,
    forget: Callable[[Peer, str], None],
) -> dict:
    """What one round of grants (``replies`` of ``ranks``) allows to read:
    ``{rank: {local id: (epochs as native int64 bytes, layers ready mask)}}``. A rank that does not know a request
    yet (its export may trail the params) or whose compute is still writing it is asked
    again next round, until the deadline. Drops from ``alive`` (into ``reasons``) what
    cannot be read; a restarted rank's peer is ``forget``-ed (the loader's
    :meth:`~kvxfer.loader.Loader.forget`)."""
    local_of = {it.params.request_id: rid for rid, it in alive.items()}
    out: dict[int, dict] = {s: {} for s in ranks}
    full = peer.full_mask
    for s, g in zip(ranks, replies):
        if not isinstance(g, control.ReadReply):
            why = f"rank {s}: {getattr(g, 'error', g)}"
        elif g.incarnation != peer.replies[s].incarnation:
            why = f"exporter rank {s} {RESTARTED}"
            forget(peer, why)
        else:
            why = ""
        if why:
            reasons.update(dict.fromkeys(alive, why))
            alive.clear()
            return out
        for r, b, m in zip(g.ok, g.epochs, g.layers or [b""] * len(g.ok)):
            rid = local_of.get(r)
            if rid is None:  # a grant of what this round did not ask for: nothing to read
                continue
            mask = full if not m else int.from_bytes(m, "big") & full
            out[s][rid] = (b, mask)
        for rrid, why in g.failed.items():
            rid = local_of.get(rrid)
            if rid not in alive:
                continue
            if why in (UNKNOWN, NOT_READY) and time.monotonic() + 0.005 < deadline:
                continue  # asked again next round
            del alive[rid]
            reasons[rid] = f"exporter rank {s}: {why}"
    return out
