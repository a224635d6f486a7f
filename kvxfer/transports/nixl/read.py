"""The loader's ``nixl`` reads, per (source rank, head slice), on the path chosen at handshake:

* **direct** — layouts, block sizes and head slices line up
  (:func:`~kvxfer.transports.nixl.descs.direct_why`): one READ per (batch, source rank) of
  the exporter's blocks straight into the loader's, one descriptor per contiguous run; then a
  READ of the exporter's epochs of those blocks, compared with the lease grant's snapshot as
  ``ipc`` does (:mod:`kvxfer.transports.epochs`: a block released before or during the READ
  is never delivered);
* **staged** — otherwise: the chunked pipeline of :mod:`~kvxfer.transports.nixl.staged`
  (a ``SendReq`` on the side channel with the tokens, :func:`kvxfer.transports.streams.ask_stream`;
  the exporter gathers under its lease lock and its stream's status says which requests
  landed). The first staged read of a pair sends the exporter a ``NixlPairReq`` with the
  loader's connection-only metadata (for the notifications).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from ... import control
from ...batching import plan_batch, plan_loads, wire_bytes
from ...engine_types import HandshakeError, LoadItem, Remote, describe_error, time_left
from ...plan import Read
from ...tracing import batch_tag, trace
from ..base import LoaderLink
from ..epochs import stale_loads
from ..streams import ask_stream, stream_scatters, take_status
from .agent import NixlAgent, mem_of
from .descs import CacheGeometry, descs, direct_runs, epoch_runs
from .staged import NixlStaging, recv_stream

if TYPE_CHECKING:  # pragma: no cover
    from ...rank import Rank, Runtime

__all__ = ["NixlSide", "SrcRank", "direct", "read_key", "src_rank", "staged"]


class NixlSide(Protocol):
    """What the reads use of the rank's nixl transport
    (:class:`~kvxfer.transports.nixl.transport.NixlTransport`)."""

    rank: Rank
    rt: Runtime
    agent: NixlAgent
    geometry: CacheGeometry

    def receive_staging(self) -> NixlStaging: ...


@dataclass
class SrcRank:
    """A loader's view of one exporter rank it reads over NIXL."""

    agent: str
    geometry: CacheGeometry
    mem: str
    dev: int
    epochs_addr: int
    staging: dict
    staging_bytes: int
    units: list[int]
    mirror: torch.Tensor  # local copy target of the exporter's epochs (registered)
    mirror_reg: object = None
    paired: bool = False  # the exporter loaded our connection info (staged reads)
    paths: dict = field(default_factory=dict)  # (src head start, dst head start, heads) -> "" | why staged


def read_key(r: Read) -> tuple[int, int, int]:
    return (r.src_head_start, r.dst_head_start, r.num_heads)


def src_rank(rem: Remote, s: int) -> SrcRank:
    """Source rank ``s`` of ``rem`` from its handshake's ``nixl`` entry (``HandshakeError``
    naming a malformed one)."""
    e = rem.replies[s].nixl or {}
    try:
        geo = CacheGeometry.from_dict(e.get("geometry") or {})
        ep = e["epochs"]
        return SrcRank(
            agent=str(e["agent"]),
            geometry=geo,
            mem=str(e["mem"]),
            dev=int(e["dev"]),
            epochs_addr=int(ep["addr"]),
            staging=dict(e["staging"]),
            staging_bytes=int(e["staging_bytes"]),
            units=[int(u) for u in e["units"]],
            mirror=torch.zeros(int(ep["num_blocks"]), dtype=torch.int64),
        )
    except (KeyError, TypeError, ValueError) as x:
        raise HandshakeError(f"nixl: exporter rank {s} sent a malformed entry ({x})") from None


def direct(
    nixl: NixlSide,
    rem: Remote,
    s: int,
    st: SrcRank,
    reads: list[Read],
    loads,
    granted: dict,
    deadline: float,
    layers: list[int] | None = None,
) -> tuple[int, set[str], dict[str, str]]:
    """One direct READ of ``reads`` for ``loads``, then the epoch READ and check; (bytes, the
    local ids that landed: READ completed, epochs unchanged; local id -> why)."""
    rank, rt, agent = nixl.rank, nixl.rt, nixl.agent
    sbs, dbs = rem.spec.block_size, rank.spec.block_size
    # block units on both sides (n>1 prefixes once; a partial load starting inside a block
    # gets a short head call at the same offset on both sides: equal block sizes)
    bp = plan_batch(loads, sbs, [sbs], dbs, [dbs])
    sa, da, ln = direct_runs(st.geometry, nixl.geometry, bp.calls, [read_key(r) for r in reads], layers)
    moved = saved = 0
    for r in reads:
        m, sk = wire_bytes(rank.spec, bp, r.num_heads, layers)
        moved, saved = moved + m, saved + sk
    mem, dev = mem_of(rank.caches[0])
    tag = batch_tag([it.request_id for it in loads])
    hook = rt.hooks.get("before_nixl_read")
    if hook:
        hook()
    if sa.size:
        with trace("copy", tag):
            agent.read(
                descs(da, ln, dev), mem, st.agent, descs(sa, ln, st.dev), st.mem, deadline,
                f"READ of {sa.size} runs from {st.agent}",
            )  # fmt: skip
    hook = rt.hooks.get("after_nixl_read")
    if hook:
        hook()
    # The epoch check, after the READ (as ipc does): epochs only grow, so a block released
    # before or during the READ shows a moved epoch; its load is failed, never delivered.
    ids = np.concatenate([it.src_ids for it in loads])
    es, ed, el = epoch_runs(st.epochs_addr, int(st.mirror.data_ptr()), ids)
    agent.read(
        descs(ed, el, 0), "DRAM", st.agent, descs(es, el, 0), "DRAM", deadline, f"epoch READ from {st.agent}"
    )
    bad = stale_loads(st.mirror.numpy(), loads, granted, s)
    rt.metrics.add("dedup_bytes", saved)
    return moved, {it.request_id for it in loads if it.request_id not in bad}, bad


def _pair(
    nixl: NixlSide,
    loader: LoaderLink,
    rem: Remote,
    s: int,
    st: SrcRank,
    token_of: LoadItem,
    deadline: float,
):
    """Give exporter rank ``s`` our connection info (once), so it can notify us."""
    if st.paired:
        return
    rank, agent = nixl.rank, nixl.agent
    p = token_of.params
    req = control.NixlPairReq(
        rank.engine_id,
        rank.tp_rank,
        agent.name,
        agent.metadata(conn_only=True),
        float(rank.timeout_s),
        p.request_id,
        p.token,
        p.digest(),
    )
    try:
        rep = loader.client.call(rem.addrs[s], req, time_left(deadline))
    except control.ControlTimeout:
        loader.forget(rem, "a nixl pair request timed out")
        raise
    if not isinstance(rep, control.SendReply) or not rep.ok:
        raise RuntimeError(f"nixl pair refused: {getattr(rep, 'failed', None) or getattr(rep, 'error', rep)}")
    st.paired = True


def staged(
    nixl: NixlSide,
    loader: LoaderLink,
    rem: Remote,
    s: int,
    st: SrcRank,
    r: Read,
    loads: list[LoadItem],
    deadline: float,
    layers: list[int] | None = None,
) -> tuple[int, set[str], dict[str, str]]:
    """One staged read (head slice ``r``, ``layers``) from source rank ``s``; (bytes, the local
    ids the exporter's status says landed, id -> why). A refused load leaves the batch and the
    rest is asked again."""
    rank, rt, agent = nixl.rank, nixl.rt, nixl.agent
    try:
        _pair(nixl, loader, rem, s, st, loads[0], deadline)
    except Exception as e:
        return 0, set(), {it.request_id: f"nixl pair with rank {s}: {describe_error(e)}" for it in loads}
    receive = nixl.receive_staging()
    bad: dict[str, str] = {}
    landed: set[str] = set()
    moved = saved = 0
    while True:
        loads = [it for it in loads if it.request_id not in bad]
        if not loads:
            break
        bp = plan_loads(rank, loads, rem.spec.block_size, st.units)
        bpt = rank.spec.bytes_per_token(num_heads=r.num_heads, num_layers=len(layers) if layers else None)
        chunk_tokens = rank.pipeline.chunk_tokens_for(
            {"staging_bytes": st.staging_bytes}, bpt, bp.src_unit, bp.dst_unit
        )
        key = f"{agent.name}#{secrets.token_hex(8)}"
        agent.open_box(key)
        try:
            refused = ask_stream(loader, "nixl", rem, s, key, r, loads, bp, chunk_tokens, deadline, layers)
        except BaseException:
            agent.close_box(key)
            raise
        if refused:
            agent.close_box(key)
            before = len(bad)
            bad.update(refused)
            if len(bad) == before:  # a refusal that names none of them: no progress
                why = f"exporter rank {s} refused the send request: {refused}"
                bad.update({it.request_id: why for it in loads})
            continue  # each refusal drops at least one load: bounded
        hook = rt.hooks.get("before_recv")
        if hook:
            try:
                hook()
            except BaseException:
                agent.close_box(key)
                raise
        stream, scatter = stream_scatters(rank, r, bp, chunk_tokens, loads, layers)
        n, flags = recv_stream(
            agent, st.agent, key, st.staging, receive, stream, scatter, deadline, len(loads)
        )
        rt.order.wait_done(time_left(deadline))  # CUDA: the scatters ran
        rt.metrics.add("ops_calls", n)
        take_status(loads, flags, s, landed, bad)
        m, sk = wire_bytes(rank.spec, bp, r.num_heads, layers)
        moved, saved = moved + m, saved + sk
        break
    rt.metrics.add("dedup_bytes", saved)
    return moved, landed, bad
