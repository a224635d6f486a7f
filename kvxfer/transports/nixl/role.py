"""The ``nixl`` transport's part of :class:`~kvxfer.engine.TransferEngine`, both roles.

One NIXL agent per engine rank (:class:`kvxfer.transports.nixl.NixlAgent`), made at
``start()`` when the engine is configured ``transport="nixl"``, else (``"auto"``) on first
need: when a loader on another host that offers NIXL handshakes with this rank, or when this
rank as a loader picks ``nixl``. Making it registers, once, the rank's caches, the lease-epoch
array and a send staging pool (``pipeline.depth`` x ``pipeline.buffer_bytes``: device memory
for CUDA caches, pinned host memory with ``pipeline.pin_memory``, host memory on CPU).

Handshake: the exporter's ``HelloReply.nixl`` entry (given only to a loader that presented a
request's token, like every cache description) carries its agent metadata, cache geometry
(:class:`~kvxfer.transports.nixl.descs.CacheGeometry`), epoch array and staging buffers.
The loader loads the metadata and decides per read (source rank, head slice):

* **direct** — layouts, block sizes and head slices line up
  (:func:`~kvxfer.transports.nixl.descs.direct_why`): one READ per (batch, source rank) of
  the exporter's blocks straight into the loader's, one descriptor per contiguous run; then a
  READ of the exporter's epochs of those blocks, compared with the lease grant's snapshot as
  ``ipc`` does (a block released before or during the READ is never delivered);
* **staged** — otherwise: the chunked pipeline of :mod:`kvxfer.transports.nixl.staged`
  (``SendReq`` on the side channel with the tokens; the exporter gathers under its lease lock,
  so released blocks are never read). The first staged read of a pair sends the exporter a
  ``NixlPairReq`` with the loader's connection-only metadata (for the notifications).

Completion, leases, heartbeats and notifications are the engine's, as for the other
transports. The paths chosen are appended to ``stats()["transport_reasons"]``.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ... import control as C
from ... import ops
from ...engine_types import HandshakeError, LoadItem, Remote, describe_error, time_left
from ...ordering import FenceTimeout
from ...plan import Read
from ...tracing import batch_tag, trace
from ..batching import plan_batch, view_at
from .agent import NixlAgent, NixlError, XferTimeout, mem_of, nixl_status
from .descs import CacheGeometry, descs, direct_runs, direct_why, epoch_runs
from .staged import NixlStaging, recv_stream, send_stream, stream_error

_LOG = logging.getLogger(__name__)

__all__ = ["NixlRole"]


@dataclass
class _SrcRank:
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


def _read_key(r: Read) -> tuple[int, int, int]:
    return (r.src_head_start, r.dst_head_start, r.num_heads)


class NixlRole:
    """Methods of :class:`~kvxfer.engine.TransferEngine` for the ``nixl`` transport."""

    # ------------------------------------------------------------------ lifecycle
    def _nixl_init(self) -> None:
        """At start: offer ``nixl`` when NIXL imports (no agent yet, unless configured ``nixl``)."""
        self._nixl = None
        self._nixl_build_lock = threading.Lock()
        self._nixl_remotes: dict[str, tuple[Remote, dict[int, _SrcRank]]] = {}
        self._nixl_peers: dict[str, float] = {}  # loader agents paired with us -> their timeout_s
        self._nixl_entry_d: dict | None = None
        self._nixl_recv: NixlStaging | None = None
        self._nixl_send: NixlStaging | None = None
        self._nixl_geo: CacheGeometry | None = None
        if self.transport not in ("auto", "nixl"):
            self._nixl_why = f"the engine is configured for transport {self.transport!r}"
            return
        self._nixl_why = nixl_status()
        if self._nixl_why:
            return
        self._offers.append("nixl")
        if self.transport == "nixl":
            self._nixl_side(raise_errors=True)

    def _nixl_side(self, raise_errors: bool = False) -> NixlAgent | None:
        """This rank's agent, made (and its memory registered) on first call; None when it
        cannot be made (``_nixl_why`` says why; ``raise_errors`` raises instead)."""
        if self._nixl is not None or self._nixl_why:
            return self._nixl
        with self._nixl_build_lock:
            if self._nixl is not None or self._nixl_why:
                return self._nixl
            t0 = time.monotonic()
            agent = None
            try:
                name = f"kvxfer/{self.engine_id}/{self.tp_rank}/{self._incarnation}"
                agent = NixlAgent(name, stop=self._stop)
                agent.register(self.caches, "caches")
                agent.register([self._exports.epochs], "lease epochs")
                send = NixlStaging(
                    agent,
                    self.pipeline.depth,
                    self.pipeline.buffer_bytes,
                    self.device,
                    self.pipeline.pin_memory,
                    "send staging",
                )
                geo = CacheGeometry.of(self.caches, self.spec)
                mem, dev = mem_of(self.caches[0])
                self._nixl_entry_d = {
                    "agent": agent.name,
                    "md": agent.metadata(),  # after every registration: it lists them
                    "mem": mem,
                    "dev": dev,
                    "geometry": geo.to_dict(),
                    "epochs": {"addr": int(self._exports.epochs.data_ptr()), "num_blocks": self.num_blocks},
                    "staging": send.describe(),
                    "staging_bytes": self.pipeline.buffer_bytes,
                    "units": [v.unit for v in self._views],
                    "backends": list(agent.backends),
                }
                agent.start_pump(f"kvxfer-nixl-{self.engine_id}-{self.tp_rank}")
            except Exception as e:
                why = f"NIXL agent could not be set up: {type(e).__name__}: {e}"
                if agent is not None:
                    agent.close()
                if raise_errors:
                    raise NixlError(why) from e
                _LOG.warning(
                    "kvxfer engine %s rank %d: %s; nixl is not offered", self.engine_id, self.tp_rank, why
                )
                self._nixl_why = why
                if "nixl" in self._offers:
                    self._offers.remove("nixl")
                return None
            self._nixl_send, self._nixl_geo = send, geo
            self._nixl = agent
            _LOG.info(
                "kvxfer engine %s rank %d: NIXL agent %s ready in %.0f ms (%s memory)",
                self.engine_id,
                self.tp_rank,
                agent.name,
                1e3 * (time.monotonic() - t0),
                mem,
            )
            return agent

    def _nixl_close(self) -> None:
        """Close the agent (after the engine's threads stopped). A thread still inside a NIXL
        call (close() gave up on it) keeps the agent alive rather than freeing it under it."""
        agent = getattr(self, "_nixl", None)
        if agent is None:
            return
        if any(t.is_alive() for t in getattr(self, "_threads", [])):
            _LOG.warning(
                "kvxfer engine %s rank %d: a thread is still running; the NIXL agent is left open",
                self.engine_id,
                self.tp_rank,
            )
            return
        self._nixl = None
        agent.close()

    def _nixl_local_why(self) -> str:
        """ "" when this rank (as a loader) can use NIXL, else why not."""
        return self._nixl_why

    def _nixl_stats(self) -> dict:
        agent = getattr(self, "_nixl", None)
        return agent.stats() if agent is not None else {}

    # ------------------------------------------------------------------ exporter
    def _nixl_entry(self, msg: C.Hello) -> dict | None:
        """The ``nixl`` entry of the HelloReply to ``msg`` (an authenticated Hello): given to a
        loader configured for ``nixl``, and to an ``auto`` loader that offers NIXL when it is on
        another host or this rank offers nothing else; None otherwise (building the agent costs
        ~0.5 s and registers memory, so an auto rank does it only when it may be used)."""
        if self.transport not in ("auto", "nixl"):
            return None
        asked = msg.transport == "nixl" or (
            msg.transport in ("", "auto")
            and "nixl" in msg.transports
            and (msg.hostname != self._identity or self.transport == "nixl")
        )
        if not asked:
            return None
        if self._nixl_side() is None:
            return {"why": self._nixl_why}
        return self._nixl_entry_d

    def _handle_nixl_pair(self, msg: C.NixlPairReq) -> C.SendReply:
        """Load a loader's connection info (staged reads notify it), once per loader agent."""
        if self._authorized([msg.request_id], [msg.token], [msg.digest]):
            return C.SendReply(ok=False, failed={"*": "unauthorized: the token does not match the request"})
        agent = self._nixl_side()
        if agent is None:
            return C.SendReply(ok=False, failed={"*": f"nixl not offered by this engine: {self._nixl_why}"})
        try:
            name = agent.add_remote(msg.md, expect=msg.agent)
        except NixlError as e:
            return C.SendReply(ok=False, failed={"*": str(e)})
        self._nixl_peers[name] = float(msg.timeout_s)
        return C.SendReply(ok=True, failed={})

    def _nixl_owns(self, key: str) -> bool:
        """Whether a SendReq's key names a staged nixl stream (``<loader agent>#<hex>``)."""
        return self._nixl is not None and key.rpartition("#")[0] in self._nixl_peers

    def _handle_nixl_send(self, msg: C.SendReq):
        """Check a staged nixl send request (its tokens were verified) and queue its stream."""
        job = self._stream_job(msg)  # kvxfer.exporter: the checks of a pg stream
        if isinstance(job, C.SendReply):
            return job
        self._send_q.put(("nixl", msg.key, job))
        return C.SendReply(ok=True, failed={})

    def _nixl_stream_send(self, job) -> None:
        """Sender thread: gather the stream's chunks (under the tracker lock: a request released
        mid-stream is marked not landed in the stream's status) and let the loader READ them."""
        agent = self._nixl
        msg = job.msg
        peer = msg.key.rpartition("#")[0]
        calls, gather, status = self._stream_gathers(job)  # kvxfer.exporter: as for a pg stream
        try:
            hook = self._hooks.get("before_send")
            if hook:
                hook()
            with self._order.on_stream("send"):
                sent = send_stream(
                    agent,
                    peer,
                    msg.key,
                    self._nixl_send,
                    self.spec,
                    msg.num_heads,
                    msg.unit,
                    msg.chunk_tokens,
                    calls,
                    gather,
                    self.timeout_s,
                    self._nixl_peers.get(peer, self.timeout_s),
                    batch_tag(msg.request_ids),
                    len(msg.layers) or None,
                    status,
                )
        except Exception as e:
            _LOG.warning(
                "kvxfer exporter %s rank %d: nixl stream %s to %s failed (%s)",
                self.engine_id,
                self.tp_rank,
                msg.key,
                peer,
                stream_error(e),
            )
            if getattr(e, "peer_gone", False):
                agent.remove_remote(peer)
                self._nixl_peers.pop(peer, None)
            return
        self._metrics.add("bytes_sent", sent)

    # ------------------------------------------------------------------ loader
    def _nixl_setup(self, rem: Remote) -> None:
        """At the handshake with ``rem`` (transport nixl): load every source rank's metadata,
        decide each read's path, and say which in ``stats()["transport_reasons"]``."""
        agent = self._nixl_side()
        if agent is None:
            raise HandshakeError(f"nixl: {self._nixl_why}")
        old = self._nixl_remotes.pop(rem.engine_id, None)
        if old is not None:
            self._nixl_drop(old[1])
        ranks: dict[int, _SrcRank] = {}
        try:
            for s in sorted({r.src_rank for r in rem.reads}):
                e = rem.replies[s].nixl or {}
                try:
                    geo = CacheGeometry.from_dict(e.get("geometry") or {})
                    ep = e["epochs"]
                    nb = int(ep["num_blocks"])
                    mirror = torch.zeros(nb, dtype=torch.int64)
                    st = _SrcRank(
                        agent=str(e["agent"]),
                        geometry=geo,
                        mem=str(e["mem"]),
                        dev=int(e["dev"]),
                        epochs_addr=int(ep["addr"]),
                        staging=dict(e["staging"]),
                        staging_bytes=int(e["staging_bytes"]),
                        units=[int(u) for u in e["units"]],
                        mirror=mirror,
                    )
                except (KeyError, TypeError, ValueError) as x:
                    raise HandshakeError(f"nixl: exporter rank {s} sent a malformed entry ({x})") from None
                ranks[s] = st
                st.mirror_reg = agent.register([mirror], "epoch mirror")
                agent.add_remote(bytes(e["md"]), expect=st.agent)
                agent.connect(st.agent)
        except NixlError as x:
            self._nixl_drop(ranks)
            raise HandshakeError(f"nixl: {x}") from None
        except BaseException:
            self._nixl_drop(ranks)
            raise
        notes = []
        for r in rem.reads:
            st = ranks[r.src_rank]
            why = direct_why(st.geometry, self._nixl_geo, r.src_head_start, r.dst_head_start, r.num_heads)
            st.paths[_read_key(r)] = why
            notes.append(f"rank {r.src_rank} " + ("direct" if not why else f"staged ({why})"))
        self._nixl_remotes[rem.engine_id] = (rem, ranks)
        base = self._transport_reasons.get(rem.engine_id, "nixl")
        self._transport_reasons[rem.engine_id] = f"{base}; paths: " + ", ".join(notes)

    def _nixl_drop(self, ranks: dict[int, _SrcRank]) -> None:
        agent = self._nixl
        if agent is None:
            return
        for st in ranks.values():
            agent.remove_remote(st.agent)
            agent.deregister(st.mirror_reg)

    def _nixl_forget(self, rem: Remote) -> None:
        """Drop the NIXL state of a forgotten remote (its agents are removed: disconnected)."""
        got = self._nixl_remotes.get(rem.engine_id)
        if got is not None and got[0] is rem:
            del self._nixl_remotes[rem.engine_id]
            self._nixl_drop(got[1])

    def _nixl_read(
        self,
        rem: Remote,
        s: int,
        reads: list[Read],
        loads: list[LoadItem],
        granted: dict,
        deadline: float,
        layers: list[int] | None = None,
    ) -> tuple[int, set[str], dict[str, str]]:
        """Read the plan's heads (and ``layers``, default all) of source rank ``s`` over NIXL:
        direct reads first (one READ, then the epoch check), then staged ones; (bytes moved,
        the local ids that landed in every read, local id -> why for failures)."""
        got = self._nixl_remotes.get(rem.engine_id)
        if got is None or got[0] is not rem or s not in got[1]:
            raise RuntimeError(f"nixl: no state for exporter rank {s} (handshake not done)")
        st = got[1][s]
        direct = [r for r in reads if not st.paths.get(_read_key(r), "?")]
        staged = [r for r in reads if st.paths.get(_read_key(r), "?")]
        moved, bad = 0, {}
        landed = {it.request_id for it in loads}
        try:
            if direct:
                moved, got, bad = self._nixl_direct(rem, s, st, direct, loads, granted, deadline, layers)
                landed &= got
            for r in staged:
                todo = [it for it in loads if it.request_id not in bad]
                if not todo:
                    break
                m, got, b = self._nixl_staged(rem, s, st, r, todo, deadline, layers)
                moved += m
                bad.update(b)
                landed &= got
        except XferTimeout as e:  # the READ may still write our blocks: fenced until it ended
            raise FenceTimeout(str(e), e.fence) from None
        except NixlError as e:
            if not self._nixl.stopping():
                self._forget(rem, f"nixl: {e}")  # the next load handshakes (and connects) anew
            raise
        return moved, landed - bad.keys(), bad

    def _nixl_direct(
        self,
        rem: Remote,
        s: int,
        st: _SrcRank,
        reads: list[Read],
        loads,
        granted: dict,
        deadline: float,
        layers: list[int] | None = None,
    ) -> tuple[int, set[str], dict[str, str]]:
        """One direct READ of ``reads`` for ``loads``, then the epoch READ and check; (bytes,
        the local ids that landed: READ completed, epochs unchanged; local id -> why)."""
        agent = self._nixl
        sbs, dbs = rem.spec.block_size, self.spec.block_size
        # block units on both sides (n>1 prefixes once; a partial load starting inside a block
        # gets a short head call at the same offset on both sides: equal block sizes)
        bp = plan_batch(loads, sbs, [sbs], dbs, [dbs])
        sa, da, ln = direct_runs(st.geometry, self._nixl_geo, bp.calls, [_read_key(r) for r in reads], layers)
        moved = saved = 0
        for r in reads:
            m, sk = self._count(bp, r.num_heads, layers)
            moved, saved = moved + m, saved + sk
        mem, dev = mem_of(self.caches[0])
        tag = batch_tag([it.request_id for it in loads])
        hook = self._hooks.get("before_nixl_read")
        if hook:
            hook()
        if sa.size:
            with trace("copy", tag):
                agent.read(
                    descs(da, ln, dev),
                    mem,
                    st.agent,
                    descs(sa, ln, st.dev),
                    st.mem,
                    deadline,
                    f"READ of {sa.size} runs from {st.agent}",
                )
        hook = self._hooks.get("after_nixl_read")
        if hook:
            hook()
        # The epoch check, after the READ (as ipc does): epochs only grow, so a block released
        # before or during the READ shows a moved epoch; its load is failed, never delivered.
        ids = np.concatenate([it.src_ids for it in loads])
        es, ed, el = epoch_runs(st.epochs_addr, int(st.mirror.data_ptr()), ids)
        agent.read(
            descs(ed, el, 0),
            "DRAM",
            st.agent,
            descs(es, el, 0),
            "DRAM",
            deadline,
            f"epoch READ from {st.agent}",
        )
        bad = self._stale(st.mirror.numpy(), loads, granted, s)
        self._metrics.add("dedup_bytes", saved)
        return moved, {it.request_id for it in loads if it.request_id not in bad}, bad

    def _nixl_scatterer(self, head_start: int, layers: list[int] | None):
        def scatter(c, wire: torch.Tensor) -> None:
            dv = view_at(self._by_unit, c.unit, c.offset, self._offset_views)
            ops.scatter_blocks(wire, dv.caches, dv.spec, c.units, c.num_tokens, head_start, layers)

        return scatter

    def _nixl_pair(self, rem: Remote, s: int, st: _SrcRank, token_of: LoadItem, deadline: float) -> None:
        """Give exporter rank ``s`` our connection info (once), so it can notify us."""
        if st.paired:
            return
        agent = self._nixl
        req = C.NixlPairReq(
            self.engine_id,
            self.tp_rank,
            agent.name,
            agent.metadata(conn_only=True),
            float(self.timeout_s),
            token_of.params.request_id,
            token_of.params.token,
            token_of.params.digest(),
        )
        try:
            rep = self._client.call(rem.addrs[s], req, time_left(deadline))
        except C.ControlTimeout:
            self._forget(rem, "a nixl pair request timed out")
            raise
        if not isinstance(rep, C.SendReply) or not rep.ok:
            raise RuntimeError(
                f"nixl pair refused: {getattr(rep, 'failed', None) or getattr(rep, 'error', rep)}"
            )
        st.paired = True

    def _nixl_staged(
        self,
        rem: Remote,
        s: int,
        st: _SrcRank,
        r: Read,
        loads: list[LoadItem],
        deadline: float,
        layers: list[int] | None = None,
    ) -> tuple[int, set[str], dict[str, str]]:
        """One staged read (head slice ``r``, ``layers``) from source rank ``s``; (bytes, the
        local ids the exporter's status says landed, id -> why). A refused load leaves the
        batch and the rest is asked again."""
        agent = self._nixl
        try:
            self._nixl_pair(rem, s, st, loads[0], deadline)
        except Exception as e:
            return 0, set(), {it.request_id: f"nixl pair with rank {s}: {describe_error(e)}" for it in loads}
        if self._nixl_recv is None:
            self._nixl_recv = NixlStaging(
                agent,
                self.pipeline.depth,
                self.pipeline.buffer_bytes,
                self.device,
                self.pipeline.pin_memory,
                "receive staging",
            )
        bad: dict[str, str] = {}
        landed: set[str] = set()
        moved = saved = 0
        while True:
            loads = [it for it in loads if it.request_id not in bad]
            if not loads:
                break
            bp = self._plan(loads, rem.spec.block_size, st.units)
            bpt = self.spec.bytes_per_token(num_heads=r.num_heads, num_layers=len(layers) if layers else None)
            chunk_tokens = self.pipeline.chunk_tokens_for(
                {"staging_bytes": st.staging_bytes}, bpt, bp.src_unit, bp.dst_unit
            )
            key = f"{agent.name}#{secrets.token_hex(8)}"
            agent.open_box(key)
            try:
                refused = self._send_req(rem, s, key, r, loads, bp, chunk_tokens, deadline, layers)
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
            tag = batch_tag([it.request_id for it in loads])
            hook = self._hooks.get("before_recv")
            if hook:
                try:
                    hook()
                except BaseException:
                    agent.close_box(key)
                    raise
            n, flags = recv_stream(
                agent,
                st.agent,
                key,
                st.staging,
                self._nixl_recv,
                self.spec,
                r.num_heads,
                bp.dst_unit,
                chunk_tokens,
                [(c.dst, c.num_tokens, c.dst_offset, c.dst_unit) for c in bp.calls],
                self._nixl_scatterer(r.dst_head_start, layers),
                deadline,
                tag,
                len(layers) if layers else None,
                len(loads),
            )
            self._order.wait_done(time_left(deadline))  # CUDA: the scatters ran
            self._metrics.add("ops_calls", n)
            for it, flag in zip(loads, flags):
                if flag == 1:
                    landed.add(it.request_id)
                else:
                    bad[it.request_id] = (
                        f"exporter rank {s}: released during the stream (lease ended or aborted); not delivered"
                    )
            m, sk = self._count(bp, r.num_heads, layers)
            moved, saved = moved + m, saved + sk
            break
        self._metrics.add("dedup_bytes", saved)
        return moved, landed, bad
