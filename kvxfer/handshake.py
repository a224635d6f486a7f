"""The loader's handshake: what it learns of a remote engine before its first load from it.

:func:`handshake` makes the :class:`~kvxfer.peer.Peer` that a load's params name, from one
``Hello`` round trip to every exporter rank of the params (each checks the request's token and
content digest before it says anything of itself), whose replies must agree on the engine, its
ranks and a model this engine can load (:meth:`KVCacheSpec.model_mismatch`); then the plan of
reads between the two TP layouts is made (:func:`kvxfer.plan.plan_reads`), the transport chosen
(:mod:`kvxfer.transports.choice`, with the reason) and its session with the peer opened
(``Transport.open``: ipc's lease-slot tables, nixl's agents and descriptors). Every refusal is a
:class:`~kvxfer.engine_types.HandshakeError` naming it, with the ranks that accepted the token
(they are told the loads failed) and whether an exporter refused the request's params rather
than the engine. The loader keeps the peers (:class:`~kvxfer.peer.Peers`).
"""

from __future__ import annotations

import json
from typing import Protocol

from . import control
from .engine_types import Expired, HandshakeError, LoadItem, describe_error, full_layer_mask, time_left
from .groups.state import StateSpec
from .groups.state_group import StateGroup, StateRoute, page_view
from .groups.state_plan import plan_state_reads
from .metrics import now
from .peer import Peer
from .plan import plan_reads
from .rank import Rank, Runtime
from .spec import KVCacheSpec
from .transports import Transport, choice, offered
from .transports.base import LoaderLink
from .transports.pg import groups as pg_groups

__all__ = ["HandshakeLink", "handshake"]


class HandshakeLink(LoaderLink, Protocol):
    """What a handshake uses of the loader (:class:`kvxfer.loader.Loader`) besides what a
    session does: the rank and its runtime, its transports by name, and the host's GPU topology
    (probed on the first call)."""

    rank: Rank
    rt: Runtime
    transports: dict[str, Transport]

    def topology(self): ...


def handshake(loader: HandshakeLink, it: LoadItem, deadline: float) -> Peer:
    """The peer ``it``'s params name, handshaken now, its transport's session open.
    ``HandshakeError`` or ``Expired`` when it cannot be (see the module doc)."""
    p = it.params
    t0 = now()
    addrs = [f"tcp://{p.host}:{p.port + r}" for r in range(p.tp_size)]
    hello = control.Hello(
        **loader.rank.identity_fields(offered(loader.transports)),
        request_id=p.request_id,
        token=p.token,
        transport=loader.rank.transport,
        digest=p.digest(),
    )
    try:
        peer = _ask(loader, p, addrs, hello, deadline)
    except Exception as e:
        for a in addrs:  # a failed handshake keeps no socket open (params may name 256 ranks)
            loader.client.drop(a)
        if isinstance(e, (HandshakeError, Expired)):
            raise
        raise HandshakeError(describe_error(e)) from None
    loader.rt.metrics.record_handshake(p.engine_id, now() - t0, peer.transport)
    return peer


def _ask(loader: HandshakeLink, p, addrs: list[str], hello: control.Hello, deadline: float) -> Peer:
    """Send ``hello`` to every exporter rank of ``p`` and make the :class:`Peer` of their
    replies. A :class:`HandshakeError` names why not, with ``answered``: the ranks that
    accepted the request's token (they are told of the failed loads: ``Loader._run_batch``)."""
    replies = loader.client.call_many([(a, hello) for a in addrs], time_left(deadline), partial=True)
    answered = [
        addrs[r]
        for r, rep in enumerate(replies)
        if isinstance(rep, control.HelloReply)
        and not rep.error
        and rep.engine_id == p.engine_id
        and rep.tp_rank == r
    ]
    try:
        silent = [a for a, rep in zip(addrs, replies) if rep is None]
        if silent:
            gone = loader.client.gone
            named = [f"{a} ({gone[a]})" if a in gone else a for a in silent[:4]]
            raise HandshakeError(f"no reply from {', '.join(named)}{' ...' if len(silent) > 4 else ''}")
        return _peer_of(loader, p, addrs, replies)
    except HandshakeError as e:
        e.answered = tuple(answered)
        raise


def _peer_of(loader: HandshakeLink, p, addrs: list[str], replies: list) -> Peer:
    """The :class:`Peer` of the exporter ranks' handshake ``replies``, its session open."""
    rank = loader.rank
    for r, rep in enumerate(replies):
        if not isinstance(rep, control.HelloReply):
            e = HandshakeError(f"rank {r} answered {type(rep).__name__}: {getattr(rep, 'error', '')}")
            e.refused = getattr(rep, "error", "").startswith(control.HELLO_REFUSED)
            raise e
        if rep.error:
            raise HandshakeError(f"rank {r}: {rep.error}")
        if rep.engine_id != p.engine_id or rep.tp_rank != r or rep.tp_size != p.tp_size:
            raise HandshakeError(
                f"rank {r} at {addrs[r]} is engine {rep.engine_id!r} rank {rep.tp_rank}/{rep.tp_size}, "
                f"params name {p.engine_id!r} with tp_size {p.tp_size}"
            )
    spec = KVCacheSpec.from_dict(replies[0].spec)
    mismatch = spec.model_mismatch(rank.spec)
    if mismatch:
        raise HandshakeError(f"incompatible peer: {mismatch}")
    theirs = getattr(replies[0], "groups", None)
    states = getattr(replies[0], "states", None)
    if rank.groups is not None:
        mismatch = rank.groups.mismatch(theirs, states)
    elif theirs is not None:
        mismatch = f"the peer has {len(theirs)} KV cache groups, this engine registered none"
    if mismatch:
        raise HandshakeError(f"incompatible peer: {mismatch}")
    try:
        plan = plan_reads(spec, p.tp_size, rank.spec, rank.tp_size)
    except ValueError as e:
        raise HandshakeError(f"incompatible peer: TP {p.tp_size} -> {rank.tp_size}: {e}") from None
    routes = {}
    if rank.groups is not None and rank.groups.states:
        src_ranks = {r.src_rank for r in plan.reads(rank.tp_rank)}
        routes = _state_routes(rank, spec, p.tp_size, states, src_ranks)
    transport, why, pg_backends = _choose_transport(loader, replies)
    peer = Peer(
        p.engine_id, spec, addrs, replies, plan, rank.tp_rank, transport, why,
        p.host, p.port, pg_backends, full_layer_mask(spec.num_layers),
    )  # fmt: skip
    peer.state_routes = routes
    peer.session = loader.transports[transport].open(peer, loader)  # nixl: metadata, direct/staged per read
    return peer


def _state_routes(
    rank: Rank, spec: KVCacheSpec, tp_size: int, states: list | None, src_ranks: set[int]
) -> dict[int, StateRoute]:
    """Per state group of this rank's engine that cannot take the peer's pages whole, how it
    moves (:class:`~kvxfer.groups.state_group.StateRoute`); ``HandshakeError`` naming the
    group when it cannot move at all (another model or state dtypes, a state the attention
    plan's source ranks ``src_ranks`` do not hold, caches without whole pages)."""
    gs = rank.groups
    geometry = StateGroup.peer_mismatch(
        {**rank.spec.to_dict(), "tp_size": rank.tp_size}, {**spec.to_dict(), "tp_size": tp_size}
    )
    out = {}
    for g, grp in enumerate(gs.groups):
        if not gs.whole[g]:
            continue
        where = f"incompatible peer: KV cache group {g} ({grp.describe()})"
        wire = states[g]
        try:
            theirs = StateSpec.from_dict(json.loads(wire))
        except (ValueError, TypeError) as e:
            raise HandshakeError(f"{where}: the peer's state spec does not read: {e}") from None
        if geometry is None and wire == grp.state_wire():
            continue  # laid out alike: pages move whole
        why = theirs.model_mismatch(grp.state) or theirs.dtype_mismatch(grp.state)
        if why:
            raise HandshakeError(f"{where}: {why}")
        if theirs.tp_size != tp_size:
            raise HandshakeError(
                f"{where}: the peer's state is at TP {theirs.tp_size}, its engine at {tp_size}"
            )
        runs = {r.src_rank: r.runs for r in plan_state_reads(theirs, grp.state).reads(rank.tp_rank)}
        extra = sorted(set(runs) - src_ranks)
        if extra:
            raise HandshakeError(
                f"{where}: this rank's state units lie on source ranks {extra}, which its attention heads "
                f"do not read from ({sorted(src_ranks)})"
            )
        try:
            for x in grp.layers:
                page_view(rank.caches[x])
        except ValueError as e:
            raise HandshakeError(f"{where}: {e}") from None
        diff = [f for f, v in theirs.to_dict().items() if v != grp.state.to_dict()[f]]
        out[g] = StateRoute(
            theirs, grp.state, runs, geometry or f"the state specs differ in {', '.join(diff)}"
        )
    return out


def _choose_transport(loader: HandshakeLink, replies: list[control.HelloReply]) -> tuple[str, str, list[str]]:
    """The transport, why, and for pg each source rank's pair backend (kvxfer.transports.choice)."""
    rank = loader.rank
    info = loader.transports["ipc"].entry["info"]
    backends: list[str] = []
    try:
        transport, why = choice.choose(
            rank.transport,
            rank.device,
            info,
            rank.identity,
            replies,
            loader.topology,
            local_nixl=loader.transports["nixl"].why,
        )
        if transport == "pg":
            for r in replies:
                if not isinstance((r.pg or {}).get("staging_bytes"), int):
                    raise ValueError(
                        f"pg: exporter rank {r.tp_rank} advertises no staging buffers (an incompatible kvxfer)"
                    )
            backends, bwhy = pg_groups.pair_backends(rank.device, info, replies)
            why = f"{why}; {bwhy}" if bwhy else why
    except ValueError as e:
        raise HandshakeError(str(e)) from None
    return transport, why, backends
