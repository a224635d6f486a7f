"""TransferEngine: the object a model runner holds, one per TP rank.

It plays both roles: it *exports* requests whose KV it holds (prefill, or decode for
multi-turn reuse) and *loads* requests from remote engines. Threads (all bounded, all stopped
by :meth:`close`):

* server: the rank's ROUTER side channel — handshakes, lease grants, pg send requests,
  notifications, heartbeats — and lease expiry;
* worker: runs the loads queued by :meth:`load`, one batch per :meth:`poll`, and heartbeats;
* sender: joins pair groups and sends gathered wires for ``pg`` exports.

Completion: the loader notifies the exporter ranks the plan names (``notify_targets``); an
exporter rank frees a request when it has the ``expected_notifications`` of the plan of the
pair of engines. A load is reported exactly once, finished or failed; an export once,
finished or expired.
"""

from __future__ import annotations

import array
import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from . import control as C
from . import ops
from .metrics import Metrics, now
from .ordering import NOT_READY, StreamOrder
from .params import KVTransferParams, params_dict
from .plan import Read, plan_reads
from .spec import KVCacheSpec
from .tracing import trace
from .tracker import UNKNOWN, ExportTracker, LoadTracker, PollResult
from .transports import (
    TRANSPORTS,
    BatchPlan,
    CacheView,
    Item,
    WirePipeline,
    cache_views,
    choice,
    mapper,
    plan_batch,
)
from .transports.cuda_ipc import host_id

__all__ = ["HandshakeError", "TransferEngine"]

_TICK_MS = 20


class HandshakeError(RuntimeError):
    """The remote engine cannot be reached or is incompatible (the message names why)."""


def _compat_hash(spec: KVCacheSpec) -> str:
    d = spec.to_dict()
    return "|".join(str(d[k]) for k in ("use_mla", "num_layers", "num_kv_heads", "head_dim", "dtype"))


def _tag(request_ids) -> str:
    """NVTX name of a batch: its request id, or the first id and how many more."""
    n = len(request_ids)
    return "" if not n else request_ids[0] if n == 1 else f"{request_ids[0]}+{n - 1}"


def _ids(x, need: int, num_blocks: int, what: str) -> np.ndarray:
    """The first ``need`` of block ids ``x`` (list/tuple of ints, int array or tensor) as a new
    int64 array, each in ``[0, num_blocks)``; ``ValueError`` naming ``block_ids`` otherwise.

    A list takes one C conversion (``array('Q')``: ~2.5 us for 256 ids, the torch conversion
    it replaced ~15 us); one ``max`` of the uint64 view bounds both ends (negative ids wrap).
    """
    n = len(x) if isinstance(x, (list, tuple)) else None
    if n is not None:
        if n < need:
            raise ValueError(f"block_ids: num_tokens={what} needs {need} blocks, got {n}")
        try:
            a = np.frombuffer(array.array("Q", x if n == need else x[:need]), dtype=np.uint64)
        except OverflowError:
            raise ValueError(f"block_ids: out of range [0, {num_blocks})") from None
        except TypeError as e:
            raise ValueError(f"block_ids: must hold ints ({e})") from None
    else:
        t = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
        if t.dtype.kind not in "iu":
            raise ValueError(f"block_ids: must hold integers, got {t.dtype}")
        t = t.reshape(-1)
        if t.size < need:
            raise ValueError(f"block_ids: num_tokens={what} needs {need} blocks, got {t.size}")
        a = np.array(t[:need], dtype=np.int64).view(np.uint64)
    if need and int(a.max()) >= num_blocks:
        raise ValueError(f"block_ids: out of range [0, {num_blocks})")
    return a.view(np.int64)


@dataclass
class _Remote:
    """A handshaken remote engine, cached by engine id."""

    engine_id: str
    spec: KVCacheSpec
    tp_size: int
    addrs: list[str]
    transport: str
    replies: list[C.HelloReply]
    num_blocks: int
    plan: object = None  # TransferPlan of (remote -> this engine)
    reads: list = field(default_factory=list)  # plan.reads(this rank)
    notify_to: list = field(default_factory=list)  # plan.notify_targets(this rank)
    ipc: dict = field(default_factory=dict)  # src rank -> (cache views, epochs, handles)
    pairs: dict = field(default_factory=dict)  # src rank -> (pg, key)
    pair_gen: int = 0
    store: object = None


@dataclass
class _LoadItem:
    request_id: str
    params: KVTransferParams
    block_ids: np.ndarray  # local int64, exactly ceil(T / block_size)


class TransferEngine:
    """Moves paged KV between engines; one instance per TP rank.

    Args:
        spec: this engine's cache spec (all ranks alike).
        caches: this rank's per-layer caches (``spec.cache_shape(num_blocks, tp_size)`` each).
            For the ``ipc`` transport on CPU, allocate them with
            :func:`kvxfer.transports.shm.alloc_shm_caches` so loaders can map them.
        tp_rank, tp_size: this rank and the engine's TP size.
        engine_id: unique id of the engine (all ranks alike).
        host: address the side channel (and pg store) bind to and that params advertise.
        transport: ``"auto"`` (ipc when both sides are on one host and the exporter's caches
            can be mapped, else pg), ``"ipc"`` or ``"pg"``; an explicit transport that cannot
            be used fails the request naming why.
        lease_s: how long exported blocks are held without a heartbeat.
        port: side-channel port of rank 0; rank r binds ``port + r``. 0 picks a free port,
            allowed only with ``tp_size == 1`` (other ranks could not be found).
        timeout_s: bound of every side-channel wait and data transfer (default
            ``min(lease_s, 10)``).
        pipeline: :class:`~kvxfer.transports.WirePipeline` moving pg wires (extension point);
            :class:`kvxfer.transports.staged.StagedPipeline` streams chunks through staging
            buffers allocated once, double-buffered (Gloo on CPU, NCCL or pinned host on GPU).

    Stream ordering on CUDA caches (:mod:`kvxfer.ordering`): ``export(..., ready=event)`` or
    :meth:`set_compute_stream` make the transfer wait for the compute that wrote the blocks;
    a load is reported finished only after its scatter/copy completed on the GPU.
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        caches: Sequence[torch.Tensor],
        tp_rank: int,
        tp_size: int,
        engine_id: str,
        host: str = "127.0.0.1",
        transport: str = "auto",
        lease_s: float = 30.0,
        *,
        port: int = 0,
        timeout_s: float | None = None,
        pipeline: WirePipeline | None = None,
    ) -> None:
        if not isinstance(spec, KVCacheSpec):
            raise ValueError(f"spec: expected a KVCacheSpec, got {type(spec).__name__}")
        spec.heads_of_rank(tp_rank, tp_size)  # validates tp_rank / tp_size
        side = ops.make_side(caches, spec, [], 0)
        if side.num_heads != spec.heads_per_rank(tp_size):
            raise ValueError(
                f"caches: hold {side.num_heads} heads per layer, tp_size={tp_size} needs "
                f"{spec.heads_per_rank(tp_size)}"
            )
        if not isinstance(engine_id, str) or not engine_id:
            raise ValueError(f"engine_id: must be a non-empty string, got {engine_id!r}")
        if transport not in ("auto", *TRANSPORTS):
            raise ValueError(f"transport: must be 'auto', 'ipc' or 'pg', got {transport!r}")
        if not (isinstance(lease_s, (int, float)) and lease_s > 0):
            raise ValueError(f"lease_s: must be > 0, got {lease_s!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535 - tp_size:
            raise ValueError(f"port: must be an int in [0, {65535 - tp_size}], got {port!r}")
        if port == 0 and tp_size > 1:
            raise ValueError("port: a tp_size > 1 engine needs an explicit base port (rank r binds port + r)")
        self.spec = spec
        self.caches = list(caches)
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.engine_id = engine_id
        self.host = host
        self.transport = transport
        self.lease_s = float(lease_s)
        self.timeout_s = float(timeout_s) if timeout_s is not None else min(self.lease_s, 10.0)
        self.pipeline = pipeline or WirePipeline()
        self.num_blocks = side.num_blocks
        self.device = side.device
        self._base_port = port
        # Registered once (ops skip per-layer checks); whole blocks, and token slots if possible.
        self._views: tuple[CacheView, ...] = cache_views(self.caches, spec)
        self._by_unit: dict[int, CacheView] = {v.unit: v for v in self._views}
        self._expected: dict[int, int] = {}  # loader tp size -> notifications per request
        self._bpt: dict[int, int] = {}  # heads -> wire bytes per token
        self._hooks: dict[str, object] = {}  # test hooks: "after_ipc_copy", "before_send"
        self._metrics = Metrics()
        self._loads = LoadTracker()
        self._incoming: list[_LoadItem] = []
        self._lock = threading.Lock()
        self._remotes: dict[str, _Remote] = {}
        self._loader_tp: dict[str, int] = {}
        self._work: queue.Queue = queue.Queue()
        self._send_q: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._started = False
        self._closed = False
        self._identity = host_id()
        self._order = StreamOrder(self.device)
        self._transport_reasons: dict[str, str] = {}  # remote engine -> why this transport
        self._topo = None  # kvxfer.topology.probe(), only when two different GPUs handshake

    # ----------------------------------------------------------------------- lifecycle
    def start(self) -> TransferEngine:
        """Bind the side channel, share the cache description, start the threads."""
        import zmq

        if self._started:
            raise RuntimeError("start: already started")
        self._ctx = zmq.Context()
        port = self._base_port + self.tp_rank if self._base_port else 0
        self._server = C.ControlServer(self._ctx, self.host, port)
        self.port = self._server.port - self.tp_rank
        self._offers: list[str] = []
        # ipc entry of the handshake (shm mapper for CPU caches, CUDA IPC for CUDA caches)
        offer = choice.offer_ipc(
            self.caches, self.device, self.num_blocks, self.engine_id, self.transport != "pg"
        )
        self._ipc_desc, self._epoch_shm = offer.desc, offer.epoch_shm
        if offer.offered:
            self._offers.append("ipc")
        self._exports = ExportTracker(self.num_blocks, self.lease_s, offer.epochs)
        self._store = None
        if self.transport in ("auto", "pg"):
            from .transports import pg

            self._store = pg.serve_store(self.host, self.timeout_s)
            self._pg_backend = getattr(self.pipeline, "pg_backend", pg.pg_backend_for)(self.device)
            self._offers.append("pg")
        self._client = C.ControlClient(self._ctx)
        self._sender_pairs: dict[str, object] = {}
        for target, name in (
            (self._serve, "server"),
            (self._work_loop, "worker"),
            (self._send_loop, "sender"),
        ):
            t = threading.Thread(
                target=target, name=f"kvxfer-{name}-{self.engine_id}-{self.tp_rank}", daemon=True
            )
            t.start()
            self._threads.append(t)
        self._started = True
        return self

    def close(self) -> None:
        """Stop the threads (bounded), close sockets and shared memory. Idempotent."""
        if self._closed or not self._started:
            self._closed = True
            return
        self._closed = True
        self._stop.set()
        self._work.put(None)
        self._send_q.put(None)
        for t in self._threads:
            t.join(timeout=self.timeout_s + 2)
        self._server.close()
        self._client.close()
        for rem in self._remotes.values():
            for _, _, handles in rem.ipc.values():
                choice.detach(handles)
        self._remotes.clear()
        self._sender_pairs.clear()
        if self._epoch_shm is not None:
            mapper("shm").release_segment(self._epoch_shm)
        self._ctx.term()

    def __enter__(self) -> TransferEngine:
        return self.start() if not self._started else self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_started(self) -> None:
        if not self._started or self._closed:
            raise RuntimeError("engine: call start() first (and not after close())")

    # -------------------------------------------------------------------------- export
    def export(self, request_id: str, block_ids, num_tokens: int, ready=None) -> dict:
        """Hold ``block_ids`` (token order, ``ceil(num_tokens / block_size)`` of them) under a lease.

        Returns the params dict (identical on every rank) that a loader passes to :meth:`load`.
        The caller frees the blocks once ``poll()`` reports the request in ``finished_sending``
        or ``expired``. ``ready``: CUDA event(s) recorded after the compute that wrote the
        blocks, or a CUDA stream (an event is recorded on it now); no loader reads the blocks
        before they completed (default: the :meth:`set_compute_stream` stream, if any).
        """
        self._check_started()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id: must be a non-empty string, got {request_id!r}")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
            raise ValueError(f"num_tokens: must be a positive int, got {num_tokens!r}")
        ids = _ids(block_ids, self.spec.num_blocks_for(num_tokens), self.num_blocks, num_tokens)
        self._order.mark(request_id, ready)
        self._exports.add(request_id, ids, num_tokens)
        return params_dict(
            request_id, self.engine_id, self.host, self.port, self.tp_size, ids.tolist(), num_tokens
        )

    def set_compute_stream(self, stream) -> None:
        """Exports made after this wait for the work issued on ``stream`` before each export
        (a CUDA event recorded at export; polled, never synchronised). ``None`` stops it."""
        self._order.set_compute_stream(stream)

    def abort_export(self, request_id: str) -> bool:
        """Release an exported request now (e.g. the client went away); reported as finished_sending.

        A loader still reading it gets it reported failed, never delivered.
        """
        self._check_started()
        return self._exports.abort(request_id)

    # ---------------------------------------------------------------------------- load
    def load(self, request_id: str, params: dict | KVTransferParams, block_ids) -> None:
        """Queue a load of ``params`` into local ``block_ids``; it starts at the next :meth:`poll`.

        Malformed params or block ids raise ``ValueError`` (naming the field) here; every
        later problem is reported by :meth:`poll` as a failed request.
        """
        self._check_started()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id: must be a non-empty string, got {request_id!r}")
        p = KVTransferParams.from_dict(params)
        if isinstance(p, list):
            raise ValueError("params: load takes one child's params; call load once per n>1 child")
        need = self.spec.num_blocks_for(p.num_tokens)
        ids = _ids(block_ids, need, self.num_blocks, p.num_tokens)
        if need > 1:
            srt = np.sort(ids)
            if (srt[1:] == srt[:-1]).any():
                raise ValueError("block_ids: repeated block id")
        self._loads.add(request_id, ids, now())
        with self._lock:
            self._incoming.append(_LoadItem(request_id, p, ids))

    def poll(self) -> PollResult:
        """Start the loads queued since the last poll (one batch) and report what completed.

        Call it once per scheduler step. A tight ``while: poll()`` loop with no pause starves
        the engine's own threads of the GIL (measured on CPU: a 1 MiB load took 100-460 ms
        instead of 2.5 ms); pause between calls, e.g. ``time.sleep(0.0002)``, when waiting.
        """
        self._check_started()
        with self._lock:
            batch, self._incoming = self._incoming, []
        if batch:
            self._work.put(batch)
        out = PollResult()
        self._exports.drain(out)
        self._loads.drain(out)
        return out

    def stats(self) -> dict:
        """Counters, bytes, p50/p90/p99 transfer time, busy-time throughput, transports."""
        s = self._metrics.snapshot()
        if self._started:
            s["exports_live"] = self._exports.num_live()
            s["blocks_held"] = self._exports.held_blocks()
        s["loads_pending"] = self._loads.pending()
        s["transport_reasons"] = dict(self._transport_reasons)
        s.update(getattr(self.pipeline, "stats", dict)())
        s["not_ready_grants"] = self._order.num_not_ready
        s["engine_id"] = self.engine_id
        s["tp_rank"] = self.tp_rank
        return s

    # -------------------------------------------------------------------------- server
    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                self._server.serve_once(self._handle, _TICK_MS)
                n = self._exports.expire()
                if n:
                    self._metrics.add("expirations", n)
            except Exception:  # pragma: no cover - keep serving; errors surface as timeouts
                if self._stop.is_set():
                    return

    def _hello_reply(self, error: str | None = None) -> C.HelloReply:
        pg = (
            {
                "host": self.host,
                "port": self._store.port,
                "backend": self._pg_backend,
                "units": [v.unit for v in self._views],  # what a SendReq's unit may be
                **getattr(self.pipeline, "handshake_info", dict)(),
            }
            if self._store
            else None
        )
        return C.HelloReply(
            engine_id=self.engine_id,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            spec=self.spec.to_dict(),
            compat=_compat_hash(self.spec),
            transports=list(self._offers),
            hostname=self._identity,
            num_blocks=self.num_blocks,
            ipc=self._ipc_desc,
            pg=pg,
            error=error,
        )

    def _handle(self, msg):
        if isinstance(msg, C.Hello):
            if msg.version != C.PROTOCOL_VERSION:
                return self._hello_reply(f"protocol version {msg.version} != {C.PROTOCOL_VERSION}")
            self._loader_tp[msg.engine_id] = msg.tp_size
            return self._hello_reply()
        if isinstance(msg, C.ReadReq):
            self._loader_tp[msg.engine_id] = msg.tp_size
            ok, bad = self._exports.grant(msg.request_ids)
            for rid in self._order.not_ready(list(ok)):  # compute still writing: ask again
                del ok[rid]
                bad[rid] = NOT_READY
            return C.ReadReply(ok=list(ok), epochs=[e.tobytes() for e in ok.values()], failed=bad)
        if isinstance(msg, C.Heartbeat):
            self._exports.heartbeat(msg.request_ids)
            return None
        if isinstance(msg, C.Notify):
            expected = self._expected.get(msg.tp_size)
            if expected is None:
                plan = plan_reads(self.spec, self.tp_size, self.spec, msg.tp_size)
                expected = self._expected[msg.tp_size] = plan.expected_notifications(self.tp_rank)
            released = 0
            for rid in [*msg.request_ids, *msg.failed]:
                released += self._exports.notify(rid, (msg.engine_id, msg.tp_rank), expected)
            if released:
                self._metrics.add("finished_exports", released)
            return None
        if isinstance(msg, C.PairReq):
            if self._store is None:
                return C.SendReply(ok=False, failed={"*": "pg transport not offered by this engine"})
            self._send_q.put(("pair", msg.key))
            return C.SendReply(ok=True, failed={})
        if isinstance(msg, C.SendReq):
            return self._handle_send(msg)
        return C.ErrorReply(f"unexpected message {type(msg).__name__}")

    def _handle_send(self, msg: C.SendReq):
        """Gather the chunks under the tracker lock (a consistent snapshot of leased blocks)."""
        if msg.key not in self._sender_pairs and not self._pair_pending(msg.key):
            return C.SendReply(ok=False, failed={"*": f"unknown pair group {msg.key}"})
        view = self._by_unit.get(msg.unit)
        if view is None:
            return C.SendReply(ok=False, failed={"*": f"unit {msg.unit}: not one of {sorted(self._by_unit)}"})
        wires = []
        with self._exports.lock:
            bad = {}
            for rid in msg.request_ids:
                if self._exports.lookup(rid) is None:
                    bad[rid] = "not exported here, already released or lease expired"
            if bad:
                return C.SendReply(ok=False, failed=bad)
            self._exports.heartbeat(msg.request_ids)
            if msg.chunk_tokens and getattr(self.pipeline, "streams", False):  # staged: sender gathers
                why = self.pipeline.check_chunk(self.spec, msg.num_heads, msg.chunk_tokens, msg.unit)
                if why:
                    return C.SendReply(ok=False, failed={"*": f"staging: {why}"})
                self._send_q.put(("stream", msg.key, msg))
                return C.SendReply(ok=True, failed={})
            for units_b, num_tokens in msg.chunks:
                units = np.frombuffer(units_b, dtype=np.int64)  # ops copies and checks them
                with trace("gather", _tag(msg.request_ids)):
                    wires.append(
                        ops.gather_blocks(
                            view.caches, view.spec, units, num_tokens, msg.head_start, msg.num_heads
                        )
                    )
        self._send_q.put(("send", msg.key, wires))
        return C.SendReply(ok=True, failed={})

    def _stream_send(self, pair, msg: C.SendReq) -> None:
        """Staged pg export: gather each chunk (under the tracker lock, so a request released
        mid-stream is never read: the stream stops and the loader times out and fails it)."""
        view = self._by_unit[msg.unit]  # checked by _handle_send

        def gather(units, num_tokens: int, out: torch.Tensor) -> None:
            with self._exports.lock:
                gone = [r for r in msg.request_ids if self._exports.lookup(r) is None]
                if gone:
                    raise RuntimeError(f"released during the stream: {gone}")
                ops.gather_blocks(
                    view.caches, view.spec, units, num_tokens, msg.head_start, msg.num_heads, out=out
                )

        calls = [(torch.from_numpy(np.frombuffer(b, dtype=np.int64).copy()), t) for b, t in msg.chunks]
        with self._order.on_stream("send"):
            sent = self.pipeline.send_stream(
                pair,
                1,
                self.timeout_s,
                self._pg_backend,
                self.spec,
                self.device,
                msg.num_heads,
                msg.unit,
                msg.chunk_tokens,
                calls,
                gather,
                _tag(msg.request_ids),
            )
        self._metrics.add("bytes_sent", sent)

    def _pair_pending(self, key: str) -> bool:
        return True  # pairs are created in FIFO order on the sender thread before any send

    # -------------------------------------------------------------------------- sender
    def _send_loop(self) -> None:
        from .transports import pg

        while not self._stop.is_set():
            try:
                job = self._send_q.get(timeout=0.1)
            except queue.Empty:
                continue
            if job is None:
                return
            key = job[1]
            try:
                if job[0] == "pair":
                    store = pg.connect_store(self.host, self._store.port, self.timeout_s)
                    self._sender_pairs[key] = pg.new_pair(
                        store, key, 0, self.host, self.timeout_s, self._pg_backend
                    )
                else:
                    hook = self._hooks.get("before_send")
                    if hook:
                        hook()
                    pair = self._sender_pairs.get(key)
                    if pair is None:
                        continue
                    if job[0] == "stream":
                        self._stream_send(pair, job[2])
                        continue
                    for wire in job[2]:
                        with trace("send", key):
                            self.pipeline.send(pair, wire, 1, self.timeout_s)
                        self._metrics.add("bytes_sent", wire.numel() * wire.element_size())
            except Exception:
                self._sender_pairs.pop(key, None)  # the loader times out and re-pairs

    # -------------------------------------------------------------------------- worker
    def _work_loop(self) -> None:
        last_beat = time.monotonic()
        beat_every = self.lease_s / 3
        while not self._stop.is_set():
            try:
                batch = self._work.get(timeout=min(0.05, beat_every))
            except queue.Empty:
                batch = None
            if batch is None and self._stop.is_set():
                return
            if batch:
                try:
                    self._run_batch(batch)
                except Exception as e:  # every request of the batch is still reported once
                    for it in batch:
                        if self._loads.fail(it.request_id, f"internal error: {type(e).__name__}: {e}"):
                            self._metrics.add("failures")
            if time.monotonic() - last_beat >= beat_every:
                self._heartbeat()
                last_beat = time.monotonic()

    def _heartbeat(self) -> None:
        """Renew the leases of loads queued but not yet run (run ones were renewed by the grant)."""
        with self._lock:
            waiting = list(self._incoming)
        try:
            queued = [it for b in list(self._work.queue) if b for it in b]
        except Exception:  # pragma: no cover
            queued = []
        by_addr: dict[str, list[str]] = {}
        for it in waiting + queued:
            p = it.params
            for r in range(p.tp_size):
                by_addr.setdefault(f"tcp://{p.host}:{p.port + r}", []).append(p.request_id)
        for addr, rids in by_addr.items():
            self._client.send(addr, C.Heartbeat(self.engine_id, self.tp_rank, rids))

    def _fail(self, items, reason: str) -> None:
        for it in items:
            if self._loads.fail(it.request_id, reason):
                self._metrics.add("failures")

    def _run_batch(self, batch: list[_LoadItem]) -> None:
        groups: dict[str, list[_LoadItem]] = {}
        for it in batch:
            groups.setdefault(it.params.engine_id, []).append(it)
        for engine_id, items in groups.items():
            try:
                if engine_id in self._remotes:
                    rem = self._remote(items[0].params)
                else:
                    with trace("handshake", engine_id):
                        rem = self._remote(items[0].params)
            except HandshakeError as e:
                self._fail(items, f"handshake with {engine_id}: {e}")
                continue
            self._run_remote(rem, items)

    # ------------------------------------------------------------------------ handshake
    def _remote(self, p: KVTransferParams) -> _Remote:
        rem = self._remotes.get(p.engine_id)
        if rem is not None:
            return rem
        t0 = now()
        addrs = [f"tcp://{p.host}:{p.port + r}" for r in range(p.tp_size)]
        hello = C.Hello(
            engine_id=self.engine_id,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            spec=self.spec.to_dict(),
            compat=_compat_hash(self.spec),
            transports=list(self._offers),
            hostname=self._identity,
        )
        try:
            replies = self._client.call_many([(a, hello) for a in addrs], self.timeout_s)
        except C.ControlTimeout as e:
            for a in addrs:
                self._client.drop(a)
            raise HandshakeError(str(e)) from None
        for r, rep in enumerate(replies):
            if not isinstance(rep, C.HelloReply):
                raise HandshakeError(f"rank {r} answered {type(rep).__name__}: {getattr(rep, 'error', '')}")
            if rep.error:
                raise HandshakeError(f"rank {r}: {rep.error}")
            if rep.engine_id != p.engine_id or rep.tp_rank != r or rep.tp_size != p.tp_size:
                raise HandshakeError(
                    f"rank {r} at {addrs[r]} is engine {rep.engine_id!r} rank {rep.tp_rank}/{rep.tp_size}, "
                    f"params name {p.engine_id!r} with tp_size {p.tp_size}"
                )
        spec = KVCacheSpec.from_dict(replies[0].spec)
        mismatch = spec.model_mismatch(self.spec)
        if mismatch:
            raise HandshakeError(f"incompatible peer: {mismatch}")
        try:
            plan = plan_reads(spec, p.tp_size, self.spec, self.tp_size)
        except ValueError as e:
            raise HandshakeError(f"incompatible peer: TP {p.tp_size} -> {self.tp_size}: {e}") from None
        transport = self._choose_transport(replies)
        rem = _Remote(
            p.engine_id, spec, p.tp_size, addrs, transport, replies, min(r.num_blocks for r in replies), plan
        )
        rem.reads, rem.notify_to = plan.reads(self.tp_rank), plan.notify_targets(self.tp_rank)
        self._remotes[p.engine_id] = rem
        self._metrics.record_handshake(p.engine_id, now() - t0, transport)
        return rem

    def _choose_transport(self, replies: list[C.HelloReply]) -> str:
        """Pick the transport (kvxfer.transports.choice); its reason goes to stats()."""
        try:
            transport, why = choice.choose(
                self.transport, self.device, self._ipc_desc["info"], self._identity, replies, self._topology
            )
        except ValueError as e:
            raise HandshakeError(str(e)) from None
        self._transport_reasons[replies[0].engine_id] = why
        return transport

    def _topology(self):
        if self._topo is None:
            from .topology import probe

            self._topo = probe()
        return self._topo

    # ------------------------------------------------------------------------ transfers
    def _run_remote(self, rem: _Remote, items: list[_LoadItem]) -> None:
        good: list[_LoadItem] = []
        for it in items:
            need = rem.spec.num_blocks_for(it.params.num_tokens)
            src_ids = it.params.block_id_array()  # uint64: max() bounds both ends
            if src_ids.size != need:
                self._fail([it], f"params.block_ids: has {src_ids.size} ids, num_tokens needs {need}")
            elif int(src_ids.max()) >= rem.num_blocks:
                self._fail([it], f"params.block_ids: out of the exporter's range [0, {rem.num_blocks})")
            else:
                good.append(it)
        seen_remote: set[str] = set()
        for it in list(good):
            if it.params.request_id in seen_remote:
                good.remove(it)
                self._fail([it], f"params.request_id: {it.params.request_id!r} is loaded twice in one batch")
            seen_remote.add(it.params.request_id)
        if not good:
            return
        remote_of = {it.request_id: it.params.request_id for it in good}
        local_of = {v: k for k, v in remote_of.items()}
        plan = rem.plan
        reads = rem.reads
        src_ranks = sorted({r.src_rank for r in reads})
        alive = {it.request_id: it for it in good}
        reasons: dict[str, str] = {}
        # Lease grants from every source rank read (renews the leases). A rank that does not
        # know a request yet (its export may trail the rank that published the params) is
        # asked again until timeout_s; a released request fails at once.
        epochs: dict[int, dict[str, np.ndarray]] = {s: {} for s in src_ranks}
        todo = {s: list(alive) for s in src_ranks}
        deadline = time.monotonic() + self.timeout_s
        while any(todo.values()):
            ranks = [s for s in src_ranks if todo[s]]
            calls = [
                (
                    rem.addrs[s],
                    C.ReadReq(self.engine_id, self.tp_rank, self.tp_size, [remote_of[r] for r in todo[s]]),
                )
                for s in ranks
            ]
            try:
                grants = self._client.call_many(calls, max(0.01, deadline - time.monotonic()))
            except C.ControlTimeout as e:
                self._forget(rem)
                self._fail(good, f"lease grant: {e}")
                self._notify(rem, plan, [], [it.params.request_id for it in good])
                return
            for s, g in zip(ranks, grants):
                if not isinstance(g, C.ReadReply):
                    for rid in list(alive):
                        reasons[rid] = f"rank {s}: {getattr(g, 'error', g)}"
                    alive.clear()
                    todo = {}
                    break
                epochs[s].update(
                    {local_of[rid]: np.frombuffer(b, dtype=np.int64) for rid, b in zip(g.ok, g.epochs)}
                )
                retry = []
                for rrid, why in g.failed.items():
                    rid = local_of.get(rrid)
                    if rid not in alive:
                        continue
                    if why in (UNKNOWN, NOT_READY) and time.monotonic() < deadline:
                        retry.append(rid)
                    else:
                        del alive[rid]
                        reasons[rid] = f"exporter rank {s}: {why}"
                todo[s] = [rid for rid in retry if rid in alive]
            if any(todo.values()):
                time.sleep(0.005)
        for s in src_ranks:
            if not alive:
                break
            s_reads = [r for r in reads if r.src_rank == s]
            t0 = now()
            try:
                with self._order.on_stream():  # CUDA: the rank's load stream (kvxfer.ordering)
                    if rem.transport == "ipc":
                        with trace("copy", _tag(list(alive))):
                            moved, bad = self._ipc_read(rem, s, s_reads, list(alive.values()), epochs[s])
                    else:
                        moved, bad = self._pg_read(rem, s, s_reads, list(alive.values()))
                    if rem.transport == "pg" and alive:  # finished only once the scatters ran
                        self._order.wait_done(self.timeout_s)
            except Exception as e:
                moved, bad = (
                    0,
                    {rid: f"{rem.transport} read from rank {s}: {type(e).__name__}: {e}" for rid in alive},
                )
            self._metrics.record_batch(t0, now(), moved, 0)
            for rid, why in bad.items():
                if rid in alive:
                    del alive[rid]
                    reasons[rid] = why
        done = list(alive)
        t_end = now()
        lat = []
        for rid in done:
            start = self._loads.start_of(rid)
            if self._loads.finish(rid):
                lat.append(t_end - start)
        self._metrics.record_done(lat)
        failed = [it for it in good if it.request_id in reasons]
        for it in failed:
            if self._loads.fail(it.request_id, reasons[it.request_id]):
                self._metrics.add("failures")
        self._notify(rem, plan, [remote_of[r] for r in done], [it.params.request_id for it in failed])

    def _notify(self, rem: _Remote, plan, done: list[str], failed: list[str]) -> None:
        if not done and not failed:
            return
        msg = C.Notify(self.engine_id, self.tp_rank, self.tp_size, done, failed)
        for s in rem.notify_to:
            self._client.send(rem.addrs[s], msg)

    def _forget(self, rem: _Remote) -> None:
        """Drop a remote that stopped answering; the next load handshakes again."""
        self._remotes.pop(rem.engine_id, None)
        for _, _, handles in rem.ipc.values():
            choice.detach(handles)
        rem.ipc.clear()
        for a in rem.addrs:
            self._client.drop(a)

    def _plan(self, loads: list[_LoadItem], src_bs: int, src_units: list[int]) -> BatchPlan:
        """Units and ops calls for ``loads`` from one source rank (block lists in, no per-token
        arrays unless requests with partial last blocks share a call)."""
        items = [
            Item(it.request_id, it.params.block_id_array().view(np.int64), it.block_ids, it.params.num_tokens)
            for it in loads
        ]
        return plan_batch(items, src_bs, src_units, self.spec.block_size, [v.unit for v in self._views])

    def _count(self, bp: BatchPlan, num_heads: int) -> tuple[int, int]:
        bpt = self._bpt.get(num_heads)
        if bpt is None:
            bpt = self._bpt[num_heads] = self.spec.bytes_per_token(num_heads=num_heads)
        return sum(c.num_tokens for c in bp.chunks) * bpt, bp.skipped_tokens * bpt

    def _ipc_map(self, rem: _Remote, s: int):
        got = rem.ipc.get(s)
        if got is None:
            caches, ep, handles = choice.attach(rem.replies[s].ipc, self.device)
            got = rem.ipc[s] = (cache_views(caches, rem.spec), ep, handles)
        return got

    def _ipc_read(self, rem, s, reads: list[Read], loads, granted: dict[str, np.ndarray]):
        src_views, ep, _ = self._ipc_map(rem, s)
        bp = self._plan(loads, rem.spec.block_size, [v.unit for v in src_views])
        sv = next(v for v in src_views if v.unit == bp.src_unit)
        dv = self._by_unit[bp.dst_unit]
        moved = saved = calls = 0
        for r in reads:
            for ch in bp.chunks:
                ops.copy_blocks(
                    sv.caches,
                    sv.spec,
                    ch.src,
                    dv.caches,
                    dv.spec,
                    ch.dst,
                    ch.num_tokens,
                    r.src_head_start,
                    r.dst_head_start,
                    r.num_heads,
                )
                calls += 1
            m, sk = self._count(bp, r.num_heads)
            moved, saved = moved + m, saved + sk
        self._order.wait_done(self.timeout_s)  # CUDA: the copy ran before the epochs are re-read
        hook = self._hooks.get("after_ipc_copy")
        if hook:
            hook(ep)
        # One epoch check, after the copy: epochs only grow, so it also catches blocks released
        # between the grant and the copy (a separate check before the copy cost ~15 us per
        # batch and only spared copying data that is then never delivered).
        bad = self._stale(ep.numpy(), loads, granted, s)
        self._metrics.add("ops_calls", calls)
        self._metrics.add("dedup_bytes", saved)
        return moved, bad

    @staticmethod
    def _stale(ep: np.ndarray, loads, granted: dict[str, np.ndarray], s: int) -> dict[str, str]:
        """Loads whose source blocks' epochs moved since the grant snapshot -> why."""
        why = f"exporter rank {s}: blocks released before or during the copy (lease ended); not delivered"
        if len(loads) == 1:
            it = loads[0]
            moved = (ep[it.params.block_id_array().view(np.int64)] != granted[it.request_id]).any()
            return {it.request_id: why} if moved else {}
        ids = [it.params.block_id_array().view(np.int64) for it in loads]
        diff = ep[np.concatenate(ids)] != np.concatenate([granted[it.request_id] for it in loads])
        if not diff.any():
            return {}
        starts = np.cumsum([0] + [a.size for a in ids[:-1]])
        per = np.logical_or.reduceat(diff, starts)
        return {loads[k].request_id: why for k in np.flatnonzero(per).tolist()}

    def _pair(self, rem: _Remote, s: int):
        from .transports import pg

        got = rem.pairs.get(s)
        if got is not None:
            return got
        rem.pair_gen += 1
        key = f"{self.engine_id}/{self.tp_rank}/{os.getpid()}/{rem.pair_gen}"
        rep = self._client.call(rem.addrs[s], C.PairReq(self.engine_id, self.tp_rank, key), self.timeout_s)
        if not isinstance(rep, C.SendReply) or not rep.ok:
            raise RuntimeError(f"pair group refused: {getattr(rep, 'failed', rep)}")
        info = rem.replies[s].pg
        store = pg.connect_store(info["host"], info["port"], self.timeout_s)
        group = pg.new_pair(store, key, 1, self.host, self.timeout_s, info["backend"])
        got = rem.pairs[s] = (group, key)
        return got

    def _pg_read(self, rem, s, reads: list[Read], loads):
        bad: dict[str, str] = {}
        try:
            group, key = self._pair(rem, s)
        except Exception as e:
            return 0, {it.request_id: f"pg pair with rank {s}: {type(e).__name__}: {e}" for it in loads}
        moved = saved = calls = 0
        staged = getattr(self.pipeline, "streams", False)
        pg_info = rem.replies[s].pg
        for r in reads:
            for _attempt in range(3):
                loads = [it for it in loads if it.request_id not in bad]
                if not loads:
                    break
                bp = self._plan(loads, rem.spec.block_size, pg_info.get("units") or [rem.spec.block_size])
                chunks, dv = bp.chunks, self._by_unit[bp.dst_unit]
                chunk_tokens = 0
                if staged:
                    bpt = self.spec.bytes_per_token(num_heads=r.num_heads)
                    chunk_tokens = self.pipeline.chunk_tokens_for(pg_info, bpt, bp.src_unit, bp.dst_unit)
                req = C.SendReq(
                    self.engine_id,
                    self.tp_rank,
                    key,
                    [it.params.request_id for it in loads],
                    r.src_head_start,
                    r.num_heads,
                    bp.src_unit,
                    [(c.src.tobytes(), c.num_tokens) for c in chunks],
                    chunk_tokens,
                )
                try:
                    rep = self._client.call(rem.addrs[s], req, self.timeout_s)
                except C.ControlTimeout:
                    rem.pairs.pop(s, None)
                    self._forget(rem)
                    raise
                if not isinstance(rep, C.SendReply):
                    raise RuntimeError(f"send request refused: {getattr(rep, 'error', rep)}")
                if not rep.ok:
                    if "*" in rep.failed:
                        rem.pairs.pop(s, None)
                        raise RuntimeError(rep.failed["*"])
                    local_of = {it.params.request_id: it.request_id for it in loads}
                    for rid, why in rep.failed.items():
                        bad[local_of.get(rid, rid)] = f"exporter rank {s}: {why}"
                    continue
                tag = _tag([it.request_id for it in loads])
                try:
                    if staged:
                        calls += self.pipeline.recv_stream(
                            group, 0, self.timeout_s, rem.replies[s].pg["backend"], self.spec, self.device,
                            r.num_heads, bp.dst_unit, chunk_tokens, [(c.dst, c.num_tokens) for c in chunks],
                            self._scatterer(dv, r.dst_head_start), tag,
                        )  # fmt: skip
                    for c in chunks if not staged else ():
                        wire = torch.empty(
                            self.spec.wire_shape(c.num_tokens, r.num_heads),
                            dtype=self.spec.dtype,
                            device=self.device,
                        )
                        with trace("recv", tag):
                            self.pipeline.recv(group, wire, 0, self.timeout_s)
                        with trace("scatter", tag):
                            ops.scatter_blocks(
                                wire, dv.caches, dv.spec, c.dst, c.num_tokens, r.dst_head_start
                            )
                        calls += 1
                except Exception:
                    rem.pairs.pop(s, None)  # a timed-out pair may hold a stale receive
                    raise
                m, sk = self._count(bp, r.num_heads)
                moved, saved = moved + m, saved + sk
                break
        self._metrics.add("ops_calls", calls)
        self._metrics.add("dedup_bytes", saved)
        return moved, bad

    def _scatterer(self, view: CacheView, head_start: int):
        def scatter(units, num_tokens: int, wire: torch.Tensor) -> None:
            ops.scatter_blocks(wire, view.caches, view.spec, units, num_tokens, head_start)

        return scatter
