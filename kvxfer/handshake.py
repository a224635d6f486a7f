"""The loader's handshake: what it knows of a remote engine before its first load from it.

:func:`remote` returns the :class:`~kvxfer.engine_types.Remote` that a load's params name,
cached by engine id in ``loader.remotes`` while the params name the same address. A new one is
made from one ``Hello`` round trip to every exporter rank of the params (each checks the
request's token and content digest before it says anything of itself), whose replies must agree
on the engine, its ranks and a model this engine can load (:meth:`KVCacheSpec.model_mismatch`);
then the plan of reads between the two TP layouts is made (:func:`kvxfer.plan.plan_reads`), the
transport chosen (:mod:`kvxfer.transports.choice`, the reason kept in
``loader.transport_reasons``) and set up for the remote (``Transport.setup``: nixl's metadata,
ipc's mappings). Every refusal is a :class:`~kvxfer.engine_types.HandshakeError` naming it,
with the ranks that accepted the token (they are told the loads failed) and whether an exporter
refused the request's params rather than the engine.
"""

from __future__ import annotations

import logging
from typing import Protocol

from . import control
from .engine_types import (
    Expired,
    HandshakeError,
    LoadItem,
    Remote,
    describe_error,
    full_layer_mask,
    time_left,
)
from .metrics import now
from .plan import plan_reads
from .spec import KVCacheSpec
from .transports import Transport, choice, offered
from .transports.base import LoaderLink
from .transports.pg import groups as pg_groups

__all__ = ["HandshakeLink", "remote"]


class HandshakeLink(LoaderLink, Protocol):
    """What a handshake uses of the loader (:class:`kvxfer.loader.Loader`) besides what a
    transport does: its transports by name, why each remote's transport was chosen, and the
    host's GPU topology (probed on the first call)."""

    transports: dict[str, Transport]
    transport_reasons: dict[str, str]

    def topology(self): ...


_LOG = logging.getLogger(__name__)


def remote(loader: HandshakeLink, it: LoadItem, deadline: float) -> Remote:
    """The handshaken remote of ``it``'s params (cached while its address is the same): a remote
    that moved (restarted?) is forgotten with what its transport made for it, and handshaken
    anew. ``HandshakeError`` or ``Expired`` when it cannot be (see the module doc)."""
    p = it.params
    rem = loader.remotes.get(p.engine_id)
    if rem is not None:
        if rem.serves(p):
            return rem
        _LOG.info(
            "kvxfer loader %s: engine %s moved from %s:%d to %s:%d (restarted?): handshaking anew",
            loader.rank.engine_id,
            p.engine_id,
            rem.host,
            rem.port,
            p.host,
            p.port,
        )
        loader.forget(rem, "the remote moved to a new address")
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
        return _ask(loader, p, addrs, hello, deadline, t0)
    except Exception as e:
        for a in addrs:  # a failed handshake keeps no socket open (params may name 256 ranks)
            loader.client.drop(a)
        if isinstance(e, (HandshakeError, Expired)):
            raise
        raise HandshakeError(describe_error(e)) from None


def _ask(
    loader: HandshakeLink, p, addrs: list[str], hello: control.Hello, deadline: float, t0: float
) -> Remote:
    """Send ``hello`` to every exporter rank of ``p`` and make the :class:`Remote` of their
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
        return _remote_of(loader, p, addrs, replies, t0)
    except HandshakeError as e:
        e.answered = tuple(answered)
        raise


def _remote_of(loader: HandshakeLink, p, addrs: list[str], replies: list, t0: float) -> Remote:
    """The :class:`Remote` of the exporter ranks' handshake ``replies`` (cached in
    ``loader.remotes``)."""
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
    try:
        plan = plan_reads(spec, p.tp_size, rank.spec, rank.tp_size)
    except ValueError as e:
        raise HandshakeError(f"incompatible peer: TP {p.tp_size} -> {rank.tp_size}: {e}") from None
    transport, pg_backends = _choose_transport(loader, replies)
    rem = Remote(
        p.engine_id, spec, p.tp_size, addrs, transport, replies, min(r.num_blocks for r in replies), plan
    )
    rem.pg_backends, rem.host, rem.port = pg_backends, p.host, p.port
    rem.full_mask = full_layer_mask(spec.num_layers)
    rem.reads, rem.notify_to = plan.reads(rank.tp_rank), plan.notify_targets(rank.tp_rank)
    rem.src_ranks = sorted({r.src_rank for r in rem.reads})
    rem.reads_by_rank = {s: [r for r in rem.reads if r.src_rank == s] for s in rem.src_ranks}
    note = loader.transports[transport].setup(rem)  # nixl: metadata, direct/staged per read
    if note:
        loader.transport_reasons[rem.engine_id] += f"; {note}"
    loader.remotes[p.engine_id] = rem
    loader.rt.metrics.record_handshake(p.engine_id, now() - t0, transport)
    return rem


def _choose_transport(loader: HandshakeLink, replies: list[control.HelloReply]) -> tuple[str, list[str]]:
    """Pick the transport and, for pg, each source rank's pair backend
    (kvxfer.transports.choice); the reasons go to stats()["transport_reasons"]."""
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
    loader.transport_reasons[replies[0].engine_id] = why
    return transport, backends
