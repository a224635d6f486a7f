"""The ``nixl`` transport's session with one peer: each source rank's agent, geometry, epoch
array and staging buffers from the handshake (:class:`SrcRank`, the agent connected and the
epoch mirror registered once, at :meth:`NixlTransport.open
<kvxfer.transports.nixl.transport.NixlTransport.open>`), and its transfers per (source rank,
head slice), on the path chosen then:

* **direct** — layouts, block sizes and head slices line up
  (:func:`~kvxfer.transports.nixl.descs.direct_why`): one READ per (batch, source rank) of
  the exporter's blocks straight into the loader's. Its descriptors were prepared at the
  open, one per (head slice, layer, kv, block) on each side
  (:class:`~kvxfer.transports.nixl.descs.DirectTables`; this rank's side shared by the peers
  that read the same head slices), so a READ computes indices into them; the partial blocks'
  runs (a request's last block, a partial load's first) go in a second transfer of the same
  READ, listed by address. Then a READ of the exporter's epochs of those blocks (one prepared
  descriptor per block), compared with the lease grant's snapshot as ``ipc`` does (the
  outcome carries them to the load planner, :func:`kvxfer.planner.stale_loads`: a block
  released before or during the READ is never delivered);
* **staged** — otherwise: the chunked pipeline of :mod:`~kvxfer.transports.nixl.staged`
  (a ``SendReq`` on the side channel with the tokens, :func:`kvxfer.transports.streams.ask_stream`;
  the exporter gathers under its lease lock and its stream's status says which requests
  landed). The first staged read of a pair sends the exporter a ``NixlPairReq`` with the
  loader's connection-only metadata (for the notifications); a stream refused because the
  exporter no longer knows the pairing (evicted at its cap, :mod:`~kvxfer.transports.nixl.pairings`,
  or restarted) pairs anew once.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from ... import control
from ...engine_types import HandshakeError, LoadItem, time_left
from ...ordering import FenceTimeout
from ...plan import Read
from ...tracing import batch_tag, trace
from ...transfer import Done, Outcome, Route, Transfer
from ..base import LoaderLink
from ..streams import PairFailed, ask_paired, ask_stream, stream_scatters, take_status
from .agent import NixlAgent, NixlError, Prepped, XferFence, XferTimeout, mem_of
from .descs import CacheGeometry, DirectTables, descs, epoch_index
from .pairings import UNKNOWN_NIXL_PAIR
from .staged import NixlStaging, recv_stream

if TYPE_CHECKING:  # pragma: no cover
    from ...peer import Peer
    from ...rank import Rank, Runtime

__all__ = ["NixlSession", "NixlSide", "SrcRank", "read_key", "src_rank"]


class NixlSide(Protocol):
    """What a session uses of the rank's nixl transport
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
    # The direct reads' descriptors, prepared at the open (None: no direct read): the tables,
    # the exporter's blocks and epochs and the mirror's (owned), this rank's blocks (shared).
    tables: DirectTables | None = None
    remote_blocks: Prepped | None = None
    local_blocks: Prepped | None = None
    remote_epochs: Prepped | None = None
    local_epochs: Prepped | None = None


def read_key(r: Read) -> tuple[int, int, int]:
    return (r.src_head_start, r.dst_head_start, r.num_heads)


def src_rank(peer: Peer, s: int) -> SrcRank:
    """Source rank ``s`` of ``peer`` from its handshake's ``nixl`` entry (``HandshakeError``
    naming a malformed one)."""
    e = peer.replies[s].nixl or {}
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


class NixlSession:
    """The ``nixl`` session with ``peer`` (see the module doc): ``ranks``, source rank ->
    :class:`SrcRank` (connected, its paths decided); ``nixl``: the rank's transport."""

    def __init__(self, nixl: NixlSide, peer: Peer, link: LoaderLink, ranks: dict[int, SrcRank]) -> None:
        self.nixl = nixl
        self.peer = peer
        self.link = link
        self.ranks = ranks
        self.closed = False

    def routes(self, source: int, reads: list[Read]) -> list[Route]:
        """The direct reads of ``source`` together in block units (one READ), then each staged
        one in the units the exporter's entry offers."""
        st = self._rank_of(source)
        sbs, dbs = self.peer.spec.block_size, self.nixl.rank.spec.block_size
        direct = [r for r in reads if not st.paths.get(read_key(r), "?")]
        out = [Route(direct, [sbs], [dbs])] if direct else []
        units = self.nixl.rank.units
        return out + [Route([r], st.units, units) for r in reads if st.paths.get(read_key(r), "?")]

    def _rank_of(self, s: int) -> SrcRank:
        st = self.ranks.get(s)
        if st is None or self.closed:
            raise RuntimeError(f"nixl: no state for exporter rank {s} (handshake not done)")
        return st

    def start_whole(self, source: int, load, deadline: float) -> None:
        """Nothing moves unplanned here: every transfer is planned (:meth:`start`)."""
        return None

    def start(self, transfer: Transfer) -> Done:
        """Move ``transfer`` (one direct READ and the epoch READ, or one staged stream); it has
        completed when this returns. A READ that timed out may still write this rank's blocks:
        :class:`~kvxfer.ordering.FenceTimeout` until it ended; another NIXL error forgets the
        peer (the next load handshakes, and connects, anew)."""
        st = self._rank_of(transfer.source)
        try:
            if transfer.landing is not None or st.paths.get(read_key(transfer.reads[0]), "?"):
                return Done(self._staged(st, transfer))
            return Done(self._direct(st, transfer))
        except XferTimeout as e:  # the READ may still write our blocks: fenced until it ended
            raise FenceTimeout(str(e), e.fence) from None
        except NixlError as e:
            if not self.nixl.agent.stopping():
                self.link.forget(self.peer, f"nixl: {e}")
            raise

    def _direct(self, st: SrcRank, transfer: Transfer) -> Outcome:
        """One READ of the transfer's blocks (indices into the prepared lists; the partial
        blocks' runs by address), then one READ of the exporter's epochs of them (into the
        registered mirror)."""
        nixl = self.nixl
        rank, rt, agent = nixl.rank, nixl.rt, nixl.agent
        loads = transfer.loads
        if st.tables is None:
            raise RuntimeError(f"nixl: no direct descriptors prepared for exporter rank {transfer.source}")
        keys = [read_key(r) for r in transfer.reads]
        sel = st.tables.select(transfer.plan.calls, keys, transfer.layers)
        mem, dev = mem_of(rank.caches[0])
        tag = batch_tag([it.request_id for it in loads])
        hook = rt.hooks.get("before_nixl_read")
        if hook:
            hook()
        n = sel.src.size + sel.tail_src.size
        if n:
            what = f"READ of {sel.src.size} blocks and {sel.tail_src.size} runs from {st.agent}"
            with trace("copy", tag):
                handles = []
                try:
                    if sel.src.size:
                        handles.append(
                            agent.start_prepped(st.local_blocks, sel.dst, st.remote_blocks, sel.src)
                        )
                    if sel.tail_src.size:
                        local = descs(sel.tail_dst, sel.tail_lens, dev)
                        remote = descs(sel.tail_src, sel.tail_lens, st.dev)
                        handles.append(agent.start_read(local, mem, st.agent, remote, st.mem))
                except BaseException:
                    _abandon(agent, handles, what)
                    raise
                agent.finish(handles, transfer.deadline, what)
        hook = rt.hooks.get("after_nixl_read")
        if hook:
            hook()
        # The epochs, after the READ (as ipc reads them): epochs only grow, so a block released
        # before or during the READ shows a moved epoch; the planner fails its load.
        ids = epoch_index([it.src_ids for it in loads], st.remote_epochs.size)
        h = agent.start_prepped(st.local_epochs, ids, st.remote_epochs, ids)
        agent.finish([h], transfer.deadline, f"epoch READ from {st.agent}")
        return Outcome({it.request_id for it in loads}, {}, {}, st.mirror.numpy(), 0)

    def _pair(self, s: int, st: SrcRank, token_of: LoadItem, deadline: float) -> None:
        """Give exporter rank ``s`` our connection info (once), so it can notify us."""
        if st.paired:
            return
        rank, agent = self.nixl.rank, self.nixl.agent
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
            rep = self.link.client.call(self.peer.addrs[s], req, time_left(deadline))
        except control.ControlTimeout:
            self.link.forget(self.peer, "a nixl pair request timed out")
            raise
        if not isinstance(rep, control.SendReply) or not rep.ok:
            raise RuntimeError(
                f"nixl pair refused: {getattr(rep, 'failed', None) or getattr(rep, 'error', rep)}"
            )
        st.paired = True

    def _staged(self, st: SrcRank, transfer: Transfer) -> Outcome:
        """One staged stream (one head slice) from the transfer's source rank; its outcome is
        the exporter's status (or the refusals of its send request)."""
        nixl = self.nixl
        rank, rt, agent = nixl.rank, nixl.rt, nixl.agent
        s, loads, deadline, layers = transfer.source, transfer.loads, transfer.deadline, transfer.layers
        (r,) = transfer.reads
        bp = transfer.plan
        receive = nixl.receive_staging()
        into = transfer.landing or rank  # where the chunks are scattered
        bpt = into.spec.bytes_per_token(num_heads=r.num_heads, num_layers=len(layers) if layers else None)
        chunk_tokens = rank.pipeline.chunk_tokens_for(
            {"staging_bytes": st.staging_bytes}, bpt, bp.src_unit, bp.dst_unit
        )
        keys: list[str] = []  # the stream's key, its mailbox open once the request went

        def pair() -> str:
            self._pair(s, st, loads[0], deadline)
            return f"{agent.name}#{secrets.token_hex(8)}"

        def ask(key: str) -> dict[str, str]:
            agent.open_box(key)
            try:
                got = ask_stream(
                    self.link, rank, "nixl", self.peer, s, key, r, loads, bp, chunk_tokens, deadline, layers
                )
            except BaseException:
                agent.close_box(key)
                raise
            keys.append(key)
            return got

        def unpair(why: str) -> None:
            if UNKNOWN_NIXL_PAIR in why:  # the exporter no longer knows it: the next stream pairs
                st.paired = False

        try:
            refused = ask_paired(pair, ask, unpair, UNKNOWN_NIXL_PAIR, deadline)
        except PairFailed as e:
            why = f"nixl pair with rank {s}: {e}"
            return Outcome(set(), dict.fromkeys([it.request_id for it in loads], why), {}, None, 0)
        key = keys[0]
        if refused:
            agent.close_box(key)
            return Outcome(set(), {}, refused, None, 0)
        hook = rt.hooks.get("before_recv")
        if hook:
            try:
                hook()
            except BaseException:
                agent.close_box(key)
                raise
        stream, scatter = stream_scatters(into, r, bp, chunk_tokens, loads, layers)
        n, flags = recv_stream(
            agent, st.agent, key, st.staging, receive, stream, scatter, deadline, len(loads)
        )
        rt.order.wait_done(time_left(deadline))  # CUDA: the scatters ran
        landed, failed = take_status(loads, flags, s)
        return Outcome(landed, failed, {}, None, n)

    def close(self) -> None:
        """Remove the source ranks' agents (disconnected) and deregister their epoch mirrors."""
        self.closed = True
        ranks, self.ranks = self.ranks, {}
        drop_ranks(self.nixl.agent, ranks)


def _abandon(agent: NixlAgent, handles: list, what: str) -> None:
    """Cancel the transfers of a READ that could not be posted whole; raises
    :class:`XferTimeout` (fenced) when one cannot be cancelled."""
    left = agent.cancel(handles)
    if left:
        raise XferTimeout(
            f"NIXL {what}: a part already posted cannot be cancelled; fenced until it ends",
            XferFence(agent, left),
        )


def drop_ranks(agent: NixlAgent | None, ranks: dict[int, SrcRank]) -> None:
    """Release ``ranks``' prepared lists (not this rank's shared ones), remove their agents
    from ``agent`` and deregister their epoch mirrors."""
    if agent is None:
        return
    for st in ranks.values():
        # released, not dropped: a READ racing the close finds them released (a NixlError)
        for p in (st.remote_blocks, st.remote_epochs, st.local_epochs):
            agent.release_prep(p)
        agent.remove_remote(st.agent)
        agent.deregister(st.mirror_reg)
