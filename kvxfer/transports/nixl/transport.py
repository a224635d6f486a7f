"""The ``nixl`` transport of one engine rank (:class:`~kvxfer.transports.Transport`).

One NIXL agent per engine rank (:class:`~kvxfer.transports.nixl.agent.NixlAgent`), made at
``start()`` when the engine is configured ``transport="nixl"``, else (``"auto"``) on first
need: when a loader on another host that offers NIXL handshakes with this rank, or when this
rank as a loader picks ``nixl``. Making it registers, once, the rank's caches, the lease-epoch
array and a send staging pool (``pipeline.depth`` x ``pipeline.buffer_bytes``: device memory
for CUDA caches, pinned host memory with ``pipeline.pin_memory``, host memory on CPU).

Handshake: the exporter's ``HelloReply.nixl`` entry (given only to a loader that presented a
request's token, like every cache description) carries its agent metadata, cache geometry
(:class:`~kvxfer.transports.nixl.descs.CacheGeometry`), epoch array and staging buffers.
The loader loads the metadata and decides per read (source rank, head slice) between the
*direct* path and the *staged* one (:mod:`~kvxfer.transports.nixl.session`). The exporter's side
of a staged stream runs on this transport's own sender thread, one stream after another
(:func:`~kvxfer.transports.nixl.staged.send_stream`).

Completion, leases, heartbeats and notifications are the engine's, as for the other
transports.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING

from ... import control
from ...engine_types import HandshakeError
from ..base import LoaderLink, StreamJob
from ..streams import stream_gathers
from .agent import NixlAgent, NixlError, Prepped, mem_of
from .availability import nixl_status
from .descs import CacheGeometry, DirectTables, descs, direct_why, epoch_runs
from .pairings import UNKNOWN_NIXL_PAIR, Pairings
from .session import NixlSession, SrcRank, drop_ranks, read_key, src_rank
from .staged import NixlStaging, send_stream, stream_error

if TYPE_CHECKING:  # pragma: no cover
    from ...peer import Peer
    from ...rank import Rank, Runtime

_LOG = logging.getLogger(__name__)

__all__ = ["NixlTransport"]


class NixlTransport:
    """See the module doc. ``agent``: this rank's agent once made (else None); ``peers``:
    the loader agents paired with this rank (:class:`~kvxfer.transports.nixl.pairings.Pairings`,
    bounded)."""

    name = "nixl"
    ticks = False  # tick() has nothing to keep up to date: the exporter skips it

    def __init__(self, rank: Rank, rt: Runtime) -> None:
        self.rank = rank
        self.rt = rt
        self.why = "not started"
        self.agent: NixlAgent | None = None
        self.peers = Pairings()
        self.entry: dict | None = None  # the exporter's handshake entry, once the agent is made
        self.geometry: CacheGeometry | None = None
        self.send_staging: NixlStaging | None = None
        self.recv_staging: NixlStaging | None = None
        self._build_lock = threading.Lock()
        # this rank's block descriptors prepared for direct reads, by their head slices (shared
        # by every peer read with the same slices; released at close)
        self._local_blocks: dict[tuple, Prepped] = {}
        self._local_lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue()
        self._sender: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Offer ``nixl`` when NIXL imports (no agent yet, unless configured ``nixl``)."""
        rank = self.rank
        if rank.transport not in ("auto", "nixl"):
            self.why = f"the engine is configured for transport {rank.transport!r}"
            return
        self.why = nixl_status()
        if self.why:
            return
        if rank.transport == "nixl":
            self.side(raise_errors=True)
        self._sender = threading.Thread(
            target=self._send_loop, name=f"kvxfer-sender-{rank.engine_id}-{rank.tp_rank}", daemon=True
        )
        self._sender.start()

    def side(self, raise_errors: bool = False) -> NixlAgent | None:
        """This rank's agent, made (and its memory registered) on first call; None when it
        cannot be made (``why`` says why; ``raise_errors`` raises instead)."""
        if self.agent is not None or self.why:
            return self.agent
        with self._build_lock:
            if self.agent is not None or self.why:
                return self.agent
            return self._build(raise_errors)

    def _build(self, raise_errors: bool) -> NixlAgent | None:
        rank, rt = self.rank, self.rt
        t0 = time.monotonic()
        agent = None
        try:
            agent = NixlAgent(f"kvxfer/{rank.engine_id}/{rank.tp_rank}/{rt.incarnation}", stop=rt.stop)
            agent.register(rank.caches, "caches")
            agent.register([rt.exports.epochs], "lease epochs")
            pipe = rank.pipeline
            send = NixlStaging(
                agent, pipe.depth, pipe.buffer_bytes, rank.device, pipe.pin_memory, "send staging"
            )
            geo = CacheGeometry.of(rank.caches, rank.spec)
            mem, dev = mem_of(rank.caches[0])
            self.entry = {
                "agent": agent.name,
                "md": agent.metadata(),  # after every registration: it lists them
                "mem": mem,
                "dev": dev,
                "geometry": geo.to_dict(),
                "epochs": {"addr": int(rt.exports.epochs.data_ptr()), "num_blocks": rank.num_blocks},
                "staging": send.describe(),
                "staging_bytes": pipe.buffer_bytes,
                "units": list(rank.units),
                "backends": list(agent.backends),
            }
            agent.start_pump(f"kvxfer-nixl-{rank.engine_id}-{rank.tp_rank}")
        except Exception as e:
            why = f"NIXL agent could not be set up: {type(e).__name__}: {e}"
            if agent is not None:
                agent.close()
            if raise_errors:
                raise NixlError(why) from e
            _LOG.warning(
                "kvxfer engine %s rank %d: %s; nixl is not offered", rank.engine_id, rank.tp_rank, why
            )
            self.why = why  # no longer offered
            return None
        self.send_staging, self.geometry = send, geo
        self.agent = agent
        _LOG.info(
            "kvxfer engine %s rank %d: NIXL agent %s ready in %.0f ms (%s memory)",
            rank.engine_id,
            rank.tp_rank,
            agent.name,
            1e3 * (time.monotonic() - t0),
            mem,
        )
        return agent

    def abort(self, why: str) -> None:
        self._jobs.put(None)

    def threads(self) -> list:
        return [self._sender] if self._sender is not None else []

    def close(self, busy: bool = False) -> None:
        """Close the agent (after the engine's threads stopped). A thread still inside a NIXL
        call (``busy``: close() gave up on it) keeps the agent alive rather than freeing it
        under it."""
        agent = self.agent
        if agent is None:
            return
        if busy:
            _LOG.warning(
                "kvxfer engine %s rank %d: a thread is still running; the NIXL agent is left open",
                self.rank.engine_id,
                self.rank.tp_rank,
            )
            return
        self.agent = None
        with self._local_lock:
            shared, self._local_blocks = list(self._local_blocks.values()), {}
        for p in shared:
            agent.release_prep(p)
        agent.close()

    def stats(self) -> dict:
        return self.agent.stats() if self.agent is not None else {}

    # ------------------------------------------------------------------ exporter
    def hello_entry(self, hello: control.Hello) -> dict | None:
        """The ``nixl`` entry of the reply to an authenticated ``hello``: given to a loader
        configured for ``nixl``, and to an ``auto`` loader that offers NIXL when it is on
        another host or this rank offers nothing else; None otherwise (building the agent costs
        ~0.5 s and registers memory, so an auto rank does it only when it may be used)."""
        rank = self.rank
        if rank.transport not in ("auto", "nixl"):
            return None
        asked = hello.transport == "nixl" or (
            hello.transport in ("", "auto")
            and "nixl" in hello.transports
            and (hello.hostname != rank.identity or rank.transport == "nixl")
        )
        if not asked:
            return None
        if self.side() is None:
            return {"why": self.why}
        return self.entry

    def serves(self) -> dict:
        return {control.NixlPairReq: self.serve_pair}

    def serve_pair(self, msg: control.NixlPairReq) -> control.SendReply:
        """Load a loader's connection info (its staged reads are notified), once per loader
        agent (the request's token verified)."""
        agent = self.side()
        if agent is None:
            return control.SendReply(ok=False, failed={"*": f"nixl not offered by this engine: {self.why}"})
        new = msg.agent not in self.peers
        try:  # first: metadata that does not load changes no pairing (a refresh keeps the old)
            agent.add_remote(msg.md, expect=msg.agent, user="pair")
        except NixlError as e:
            return control.SendReply(ok=False, failed={"*": str(e)})
        why, evicted = self.peers.add(msg.agent, msg.timeout_s)
        if why:  # every pairing streams: refused, the agent loaded for it dropped
            if new:
                agent.remove_remote(msg.agent, "pair")
            return control.SendReply(ok=False, failed={"*": why})
        for old in evicted:  # its loader pairs anew if it streams again
            agent.remove_remote(old, "pair")
        return control.SendReply(ok=True, failed={})

    def tick(self, beat: bool, expected) -> int:
        return 0

    def serve_stream(self, job: StreamJob) -> control.SendReply:
        """Queue a checked staged stream for the sender thread (its key names a paired loader
        agent: ``<agent>#<hex>``)."""
        if self.agent is None or not self.peers.start(job.msg.key.rpartition("#")[0]):
            why = f"{UNKNOWN_NIXL_PAIR} for stream {job.msg.key} (never paired here, evicted, or this rank restarted)"
            return control.SendReply(ok=False, failed={"*": why})
        self._jobs.put((job, time.monotonic()))  # the sender thread ends its count (peers.done)
        return control.SendReply(ok=True, failed={})

    def _send_loop(self) -> None:
        """The sender thread: staged streams, one after another. A stream that waited past its
        loader's timeout (from the send request's arrival) is dropped: that loader gave it up
        (its abort may have come before the stream's mailbox opened), and running it would
        hold the thread and the staging buffers from the streams behind it."""
        rank = self.rank
        while not self.rt.stop.is_set():
            try:
                item = self._jobs.get(timeout=0.1)
            except queue.Empty:
                continue
            if item is None:
                return
            job, queued_at = item
            peer = job.msg.key.rpartition("#")[0]
            try:
                left = queued_at + self.peers.timeout_s(peer, rank.timeout_s) - time.monotonic()
                if left <= 0:
                    _LOG.warning(
                        "kvxfer exporter %s rank %d: nixl stream %s to %s dropped: it waited past the "
                        "loader's timeout behind other streams",
                        rank.engine_id, rank.tp_rank, job.msg.key, peer,
                    )  # fmt: skip
                    continue
                self._stream_send(job, min(rank.timeout_s, left))
            finally:
                self.peers.done(peer)

    def _stream_send(self, job: StreamJob, timeout_s: float) -> None:
        """Gather a stream's chunks (under the tracker lock: a request released mid-stream is
        marked not landed in the stream's status) and let the loader READ them; logs its own
        failures."""
        rt = self.rt
        rank, agent = self.rank, self.agent
        msg = job.msg
        peer = msg.key.rpartition("#")[0]
        try:  # whatever fails, the sender thread goes on with the next stream
            stream, gather, status = stream_gathers(rank, self.rt, job)
            hook = rt.hooks.get("before_send")
            if hook:
                hook()
            with rt.order.on_stream("send"):
                sent = send_stream(
                    agent,
                    peer,
                    msg.key,
                    self.send_staging,
                    stream,
                    gather,
                    timeout_s,
                    self.peers.timeout_s(peer, rank.timeout_s),
                    status,
                )
        except Exception as e:
            _LOG.warning(
                "kvxfer exporter %s rank %d: nixl stream %s to %s failed (%s)",
                rank.engine_id,
                rank.tp_rank,
                msg.key,
                peer,
                stream_error(e),
            )
            if getattr(e, "peer_gone", False):
                agent.remove_remote(peer, "pair")
                self.peers.forget(peer)
            return
        rt.metrics.add("bytes_sent", sent)

    # ------------------------------------------------------------------ loader
    def open(self, peer: Peer, link: LoaderLink) -> NixlSession:
        """At the handshake with ``peer``: load every source rank's metadata, connect, register
        its epoch mirror and decide each read's path (added to the peer's reason)."""
        agent = self.side()
        if agent is None:
            raise HandshakeError(f"nixl: {self.why}")
        ranks: dict[int, SrcRank] = {}
        try:
            for s in peer.src_ranks:
                ranks[s] = st = src_rank(peer, s)
                st.mirror_reg = agent.register([st.mirror], "epoch mirror")
                agent.add_remote(bytes(peer.replies[s].nixl["md"]), expect=st.agent)
                agent.connect(st.agent)
        except NixlError as x:
            drop_ranks(agent, ranks)
            raise HandshakeError(f"nixl: {x}") from None
        except BaseException:
            drop_ranks(agent, ranks)
            raise
        notes = []
        for r in peer.reads:
            st = ranks[r.src_rank]
            why = direct_why(st.geometry, self.geometry, r.src_head_start, r.dst_head_start, r.num_heads)
            st.paths[read_key(r)] = why
            notes.append(f"rank {r.src_rank} " + ("direct" if not why else f"staged ({why})"))
        try:
            for st in ranks.values():
                self._prepare(agent, st)
        except (NixlError, ValueError) as x:
            drop_ranks(agent, ranks)
            raise HandshakeError(f"nixl: preparing the direct reads' descriptors: {x}") from None
        except BaseException:
            drop_ranks(agent, ranks)
            raise
        peer.reason += "; paths: " + ", ".join(notes)
        return NixlSession(self, peer, link, ranks)

    def _prepare(self, agent: NixlAgent, st: SrcRank) -> None:
        """Prepare, once per peer, the descriptor lists of ``st``'s direct reads: every block of
        the exporter (per head slice, layer, kv) and one per block of its epoch array and of
        our mirror of it; this rank's blocks come from the lists shared by head slices. A READ
        then only computes indices into them."""
        keys = [k for k, why in st.paths.items() if not why]
        if not keys:
            return
        st.tables = tables = DirectTables(st.geometry, self.geometry, keys)
        addrs, lens = tables.src.runs()
        st.remote_blocks = agent.prep(descs(addrs, lens, st.dev), st.mem, "exporter blocks", st.agent)
        st.local_blocks = self._local_list(agent, tables)
        n = int(st.mirror.numel())
        st.remote_epochs = agent.prep(
            descs(*epoch_runs(st.epochs_addr, n), 0), "DRAM", "exporter epochs", st.agent
        )
        st.local_epochs = agent.prep(
            descs(*epoch_runs(int(st.mirror.data_ptr()), n), 0), "DRAM", "epoch mirror"
        )

    def _local_list(self, agent: NixlAgent, tables: DirectTables) -> Prepped:
        """This rank's prepared block list for the head slices of ``tables.dst`` (made once)."""
        key = tables.dst.slices
        with self._local_lock:
            p = self._local_blocks.get(key)
            if p is None:
                mem, dev = mem_of(self.rank.caches[0])
                addrs, lens = tables.dst.runs()
                p = self._local_blocks[key] = agent.prep(descs(addrs, lens, dev), mem, "local blocks")
            return p

    def receive_staging(self) -> NixlStaging:
        """The loader's registered receive staging pool (made on its first staged read)."""
        if self.recv_staging is None:
            pipe, rank = self.rank.pipeline, self.rank
            self.recv_staging = NixlStaging(
                self.agent, pipe.depth, pipe.buffer_bytes, rank.device, pipe.pin_memory, "receive staging"
            )
        return self.recv_staging
