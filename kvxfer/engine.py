"""TransferEngine: the object a model runner holds, one per TP rank.

It plays both roles: it *exports* requests whose KV it holds (prefill, or decode for
multi-turn reuse) and *loads* requests from remote engines. Threads (all bounded, all stopped
by :meth:`close`):

* server: the rank's ROUTER side channel — handshakes, lease grants, pg send requests,
  notifications, heartbeats — and lease expiry;
* worker: runs the loads queued by :meth:`load`, one batch per :meth:`poll`, and heartbeats;
* sender: the staged ``nixl`` streams of exports;
* notifier: sends the loader's notifications and heartbeats until acknowledged;
* one per ``pg`` pair group this rank exports over: joins it and sends its streams
  (:mod:`kvxfer.transports.pg.send`).

Completion: the loader notifies the exporter ranks the plan names (``notify_targets``); an
exporter rank frees a request when it has the ``expected_notifications`` of the plan of the
pair of engines. A load is reported exactly once, finished or failed; an export once,
finished or expired.

The class is the public API and the lifecycle; the exporting role's methods live in
:mod:`kvxfer.exporter`, the loading role's in :mod:`kvxfer.loader`, shared types in
:mod:`kvxfer.engine_types`.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections.abc import Sequence

import numpy as np
import torch

from . import control as C
from . import idops, ops, tracing
from .auth import EngineSecret, content_digest
from .completion import ExportTracker, LoadTracker, PollResult
from .engine_types import (
    HandshakeError,
    LoadItem,
    ReleaseItem,
    Remote,
    check_block_ids,
    compat_hash,
)
from .exporter import ExporterRole
from .loader import LoaderRole
from .metrics import Metrics, now
from .ordering import StreamOrder
from .params import KVTransferParams, params_dict
from .spec import KVCacheSpec
from .transports import TRANSPORTS, CacheView, cache_views
from .transports.ipc import offer as ipc_offer
from .transports.ipc.cuda_ipc import host_id
from .transports.ipc.mappers import mapper
from .transports.nixl.agent import require_nixl
from .transports.nixl.role import NixlRole
from .transports.pg import groups as pg_groups
from .transports.pg.pipeline import StagedPipeline
from .transports.pg.send import PairSenders

_LOG = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 5.0  # close() returns within this, even with a thread stuck in a transfer

__all__ = ["HandshakeError", "TransferEngine"]


def _discard_pair(group, why: str) -> None:
    pg_groups.discard_pair(group, why)


class TransferEngine(ExporterRole, LoaderRole, NixlRole):
    """Moves paged KV between engines; one instance per TP rank.

    Args:
        spec: this engine's cache spec (all ranks alike).
        caches: this rank's per-layer caches (``spec.cache_shape(num_blocks, tp_size)`` each).
            For the ``ipc`` transport on CPU, allocate them with
            :func:`kvxfer.transports.ipc.shm.alloc_shm_caches` so loaders can map them.
        tp_rank, tp_size: this rank and the engine's TP size.
        engine_id: unique id of the engine (all ranks alike).
        host: address the side channel (and pg store) bind to and that params advertise.
        transport: ``"auto"`` (ipc when both sides are on one host and the exporter's caches
            can be mapped; else nixl across hosts when both sides offer it; else pg), ``"ipc"``,
            ``"pg"`` or ``"nixl"`` (NIXL one-sided READs over UCX, :mod:`kvxfer.transports.nixl.role`;
            needs ``kvxfer[nixl]``, checked here); an explicit transport that cannot be used
            fails the request naming why.
        lease_s: how long exported blocks are held without a heartbeat.
        port: side-channel port of rank 0; rank r binds ``port + r``. 0 picks a free port,
            allowed only with ``tp_size == 1`` (other ranks could not be found).
        timeout_s: a load's deadline, from the ``poll()`` that starts it: its handshake,
            lease grants, copy or stream, and GPU completion all end by then (default
            ``min(lease_s, 10)``); also the bound of the exporter's side of a transfer.
        pipeline: the :class:`~kvxfer.transports.pg.pipeline.StagedPipeline` of the ``pg``
            transport (staging buffer size and depth, pinned-host staging on GPU, chunk cap);
            default ``StagedPipeline()``: 2 x 32 MiB buffers per role.
        auth_key: a cluster-wide key the engines' secrets derive from (default
            ``$KVXFER_AUTH_KEY``, else a random secret shared by the ranks on this host:
            :mod:`kvxfer.auth`). Params carry per-request tokens of it; nothing else needs it.
        max_sms: SM budget of this engine's transfers (a positive int, or None for none): the
            kernels launch at most that many CTAs, and whole-block copies may go to the copy
            engines (:mod:`kvxfer.backends.dma`); ``stats()["copy_path"]`` says what ran and why.

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
        pipeline: StagedPipeline | None = None,
        auth_key: str | None = None,
        max_sms: int | None = None,
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
            raise ValueError(f"transport: must be 'auto', 'ipc', 'pg' or 'nixl', got {transport!r}")
        if transport == "nixl":
            require_nixl()  # NixlUnavailable (an ImportError) naming how to install it
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
        if pipeline is not None and not isinstance(pipeline, StagedPipeline):
            raise ValueError(f"pipeline: expected a StagedPipeline or None, got {type(pipeline).__name__}")
        self.pipeline = pipeline if pipeline is not None else StagedPipeline()
        if auth_key is not None and (not isinstance(auth_key, str) or not auth_key):
            raise ValueError("auth_key: must be a non-empty string or None")
        self._auth_key = auth_key
        self.num_blocks = side.num_blocks
        self.device = side.device
        self._base_port = port
        # Registered once (ops skip per-layer checks); whole blocks, and token slots if possible.
        # max_sms: the SM budget of every op on these caches (kvxfer.ops.register_caches)
        self._views: tuple[CacheView, ...] = cache_views(self.caches, spec, max_sms)
        self._by_unit: dict[int, CacheView] = {v.unit: v for v in self._views}
        self._units: list[int] = [v.unit for v in self._views]  # coarsest first
        self._offset_views: dict = {}  # (unit, offset) -> view: partial loads starting mid-block
        # loader tp size -> (notifications per request, loader ranks that notify this rank), or
        # why a loader of that size cannot notify here (kvxfer.exporter: at most MAX_TP_SIZE keys)
        self._expected: dict[int, tuple[int, frozenset[int]] | str] = {}
        self._bpt: dict[int, int] = {}  # heads -> wire bytes per token
        self._hooks: dict[str, object] = {}  # test hooks, by name (each read where it is called)
        self._metrics = Metrics()
        self._loads = LoadTracker()
        self._incoming: list[LoadItem] = []
        self._lock = threading.Lock()
        self._remotes: dict[str, Remote] = {}
        self._work: queue.Queue = queue.Queue()
        self._send_q: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._started = False
        self._closed = False
        self._open = False  # started and not closed: what every API call checks first
        self._releases: list[ReleaseItem] = []  # queued release() items, run as their own batch
        self._identity = host_id()
        self._order = StreamOrder(self.device)
        self._transport_reasons: dict[str, str] = {}  # remote engine -> why this transport
        self._fenced: list = []  # loads held until their timed-out GPU work completed (loader)
        self._notify_q: queue.Queue = queue.Queue()  # (addr, Notify | Heartbeat, deadline)
        self._sender_pairs = PairSenders(
            f"kvxfer-{engine_id}-{tp_rank}", self._join_pair, self._stream_send, _discard_pair, self._stop
        )
        self._server = self._client = self._store = self._secret = None
        self._epoch_shm = None
        self._topo = None  # kvxfer.topology.probe(), only when two different GPUs handshake

    # ----------------------------------------------------------------------- lifecycle
    def start(self) -> TransferEngine:
        """Bind the side channel, share the cache description, start the threads.

        A failure (a port in use, a key file that cannot be read) releases everything it had
        made — sockets, the zmq context and its threads, shared memory — and re-raises.
        """
        import zmq

        if self._started:
            raise RuntimeError("start: already started")
        if self._closed:
            raise RuntimeError("start: the engine was closed; make a new one")
        self._ctx = zmq.Context()
        try:
            self._start_parts()
        except BaseException:
            self._release_parts()
            raise
        self._started = True
        self._open = True
        return self

    def _start_parts(self) -> None:
        port = self._base_port + self.tp_rank if self._base_port else 0
        self._server = C.ControlServer(self._ctx, self.host, port)
        self.port = self._server.port - self.tp_rank
        self._secret = EngineSecret(
            self.engine_id, self._base_port, self.tp_rank, self._auth_key, self.timeout_s
        )
        self._incarnation = secrets.token_hex(8)
        self._offers: list[str] = []
        idops.ensure()  # the native bookkeeping helpers, built now if missing (not on a request)
        if self.device.type == "cuda":  # compile/load the kernels now, not on the first request
            for v in self._views:
                try:
                    ops.warmup(v.caches, v.spec)
                except Exception as e:
                    _LOG.warning(
                        "kvxfer engine %s rank %d: kernel warm-up failed (%s: %s); the first transfer "
                        "will compile or fail with the reason",
                        self.engine_id,
                        self.tp_rank,
                        type(e).__name__,
                        e,
                    )
        # ipc entry of the handshake (shm mapper for CPU caches, CUDA IPC for CUDA caches)
        offer = ipc_offer.offer_ipc(
            self.caches, self.device, self.num_blocks, self.engine_id, self.transport in ("auto", "ipc")
        )
        self._ipc_desc, self._epoch_shm = offer.desc, offer.epoch_shm
        if offer.offered:
            self._offers.append("ipc")
        self._exports = ExportTracker(self.num_blocks, self.lease_s, offer.epochs)
        if self.transport in ("auto", "pg"):
            self._store = pg_groups.serve_store(self.host, self.timeout_s)
            self._pg_backend = self.pipeline.pg_backend(self.device)
            self._pg_backends = pg_groups.offered_pg_backends(self._pg_backend, self.device)
            self._offers.append("pg")
        self._nixl_init()  # offers nixl when NIXL imports; the agent now only for transport="nixl"
        self._client = C.ControlClient(self._ctx)
        for target, name in (
            (self._serve, "server"),
            (self._work_loop, "worker"),
            (self._send_loop, "sender"),
            (self._notify_loop, "notifier"),
        ):
            t = threading.Thread(
                target=target, name=f"kvxfer-{name}-{self.engine_id}-{self.tp_rank}", daemon=True
            )
            t.start()
            self._threads.append(t)

    def close(self) -> None:
        """Stop the threads, close sockets and shared memory. Idempotent.

        Returns within ``CLOSE_TIMEOUT_S`` (5 s): pair groups are aborted first, so a thread
        blocked in a transfer wakes up; notifications still unacknowledged get until then; a
        thread still stuck after the bound is left behind (a daemon) and logged.
        """
        self._open = False
        if self._closed or not self._started:
            self._closed = True
            return
        self._closed = True
        # End every live export first: its blocks' epochs move, so a loader that granted one
        # and copies it after this (ipc, nixl direct) fails the load instead of delivering
        # bytes the runner may already be reusing; a stream stops sending it.
        self._exports.release_all("the exporting engine closed")
        self._stop.set()
        self._work.put(None)
        self._send_q.put(None)
        threads = self._threads + self._sender_pairs.threads()
        self._discard_pairs("engine closed")
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in threads if t.is_alive()]
        if stuck:
            _LOG.warning(
                "kvxfer engine %s rank %d: close() left threads still in a transport call: %s",
                self.engine_id,
                self.tp_rank,
                stuck,
            )
        self._release_parts()

    def _discard_pairs(self, why: str) -> None:
        self._sender_pairs.discard_all(why)
        if not any(r.pairs for r in self._remotes.values()):
            return
        for rem in list(self._remotes.values()):
            for group, _ in list(rem.pairs.values()):
                pg_groups.discard_pair(group, why)

    def _release_parts(self) -> None:
        """Free what :meth:`start` made (whatever part of it was made)."""
        self._nixl_close()
        self._sender_pairs.discard_all("engine closed")
        for rem in list(self._remotes.values()):
            for m in rem.ipc.values():
                ipc_offer.detach(m.handles)
        self._remotes.clear()
        for name in ("_server", "_client"):
            part = getattr(self, name, None)
            if part is not None:
                part.close()
        if self._epoch_shm is not None:
            mapper("shm").release_segment(self._epoch_shm)
            self._epoch_shm = None
        if self._secret is not None:
            self._secret.close()
        self._store = None
        self._ctx.destroy(linger=0)  # closes any socket still open: term() would wait on it

    def __enter__(self) -> TransferEngine:
        return self.start() if not self._started else self

    def __exit__(self, *exc) -> None:
        self.close()

    def _identity_fields(self) -> dict:
        """Who this rank is and what it speaks: the fields shared by ``Hello`` (as loader) and
        ``HelloReply`` (as exporter)."""
        return {
            "engine_id": self.engine_id,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "spec": self.spec.to_dict(),
            "compat": compat_hash(self.spec),
            "transports": list(self._offers),
            "hostname": self._identity,
        }

    def _check_started(self) -> None:
        if not self._started or self._closed:
            raise RuntimeError("engine: call start() first (and not after close())")

    # -------------------------------------------------------------------------- export
    def export(
        self,
        request_id: str,
        block_ids,
        num_tokens: int,
        ready=None,
        *,
        streaming: bool = False,
        token: str | None = None,
    ) -> dict:
        """Hold ``block_ids`` (token order, ``ceil(num_tokens / block_size)`` of them, none
        repeated) under a lease.

        Returns the params dict (identical on every rank) that a loader passes to :meth:`load`.
        Its token opens this export only (:mod:`kvxfer.auth`): params of an earlier export of
        the same request id, or params whose block ids or token count were changed, are refused
        by name. ``token``: the token of params handed out before this export, made by a
        process without an engine (:meth:`kvxfer.auth.EngineSecret.new_token`, e.g. vLLM's
        scheduler) for these block ids and ``num_tokens``; ``ValueError`` when it is not.
        The caller frees the blocks once ``poll()`` reports the request in ``finished_sending``
        or ``expired``. ``ready``: CUDA event(s) recorded after the compute that wrote the
        blocks, or a CUDA stream (an event is recorded on it now); no loader reads the blocks
        before they completed (default: the :meth:`set_compute_stream` stream, if any).

        ``streaming=True``: a layer-wise export, made when the prefill starts. No layer is ready
        until :meth:`mark_ready` says so; loaders pull each group of layers as soon as it is
        (their grants are held, not spun, while none is), and a load finishes when its last
        layer landed. ``ready`` is then not used (each group brings its own).
        """
        if not self._open:
            self._check_started()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id: must be a non-empty string, got {request_id!r}")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
            raise ValueError(f"num_tokens: must be a positive int, got {num_tokens!r}")
        need = self.spec.num_blocks_for(num_tokens)
        if type(block_ids) is list:  # a copy: the params carry exactly the ids checked and held
            block_ids = block_ids[:need]
        ids = check_block_ids(block_ids, need, self.num_blocks, num_tokens, unique=True)
        token, digest, gen = self._export_token(request_id, ids, num_tokens, token)
        if not streaming:
            self._order.mark(request_id, ready)
        layers = self.spec.num_layers if streaming else 0
        self._exports.add(request_id, ids, num_tokens, layers, token, digest, gen)
        # plain ints: that list is the params' (JSON-safe); else the checked array's values
        listed = block_ids if type(block_ids) is list and idops.exact_ints(block_ids) else ids.tolist()
        return params_dict(
            request_id, self.engine_id, self.host, self.port, self.tp_size, listed, num_tokens, token
        )

    def mark_ready(self, request_id: str, layers, ready=None) -> None:
        """Layers ``layers`` (an int, a range or a sequence of layer indices) of the layer-wise
        export ``request_id`` are written once ``ready`` (CUDA event(s) or a stream, as for
        :meth:`export`; None: already written) has completed. Raises ``ValueError`` for a layer
        out of range or marked twice, a request not exported layer-wise, or one already ended;
        nothing is changed then."""
        self._check_started()
        L = self.spec.num_layers
        if isinstance(layers, bool):
            raise ValueError(f"layers: must be layer indices, got {layers!r}")
        idx = [layers] if isinstance(layers, int) else list(layers)
        if not idx or not all(isinstance(x, int) and not isinstance(x, bool) for x in idx):
            raise ValueError(f"layers: must be a non-empty set of layer indices, got {layers!r}")
        bad = [x for x in idx if not 0 <= x < L]
        if bad:
            raise ValueError(f"layers: layer {bad[0]} out of range [0, {L})")
        if len(set(idx)) != len(idx):
            raise ValueError(f"layers: repeated layer index in {idx}")
        mask = np.zeros(L, dtype=bool)
        mask[idx] = True
        events = [] if ready is None else self._order.events(ready)
        self._exports.mark_layers(request_id, mask, events)

    def params_for(self, request_id: str, block_ids, num_tokens: int) -> dict:
        """The params :meth:`export` will return for these arguments, without exporting: for a
        caller that hands params out before the blocks are written (a loader's grant then waits,
        bounded, until the export appears). The token is that of the request id's next
        generation on this rank (:mod:`kvxfer.auth`), so ``export()`` gives the same params as
        long as no export of the id is released in between. A process without an engine (a
        scheduler) makes a token with :meth:`kvxfer.auth.EngineSecret.new_token` and hands it
        to every rank's ``export(..., token=)``."""
        self._check_started()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id: must be a non-empty string, got {request_id!r}")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
            raise ValueError(f"num_tokens: must be a positive int, got {num_tokens!r}")
        need = self.spec.num_blocks_for(num_tokens)
        ids = check_block_ids(block_ids, need, self.num_blocks, num_tokens, unique=True)
        token = self._export_token(request_id, ids, num_tokens, None)[0]
        return params_dict(
            request_id, self.engine_id, self.host, self.port, self.tp_size, ids.tolist(), num_tokens, token
        )

    def _export_token(
        self, request_id: str, ids: np.ndarray, num_tokens: int, token: str | None
    ) -> tuple[str, bytes, int]:
        """(token, content digest, generation) of an export of ``request_id`` (:mod:`kvxfer.auth`):
        the generation's token, the same on every rank; or ``token`` checked to be one this
        engine's secret made for these ids and ``num_tokens``."""
        digest = content_digest(num_tokens, ids)
        gen = self._exports.generation(request_id)
        if token is None:
            return self._secret.token(request_id, gen.to_bytes(8, "big"), digest), digest, gen
        if not self._secret.verify(request_id, token, digest):
            raise ValueError(
                f"token: not a token of engine {self.engine_id!r} for request {request_id!r} with these "
                "block ids and num_tokens"
            )
        return token, digest, gen

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

    def release(self, params: dict | list | KVTransferParams) -> None:
        """Tell the exporter of ``params`` that this engine will never load them (the request was
        aborted, or its KV is already here), so it frees the blocks now rather than at lease end.

        Loader-side counterpart of :meth:`abort_export`; ``params`` may be an n>1 list. Sent
        from the worker at the next :meth:`poll`: the (cached) handshake, then the notification a
        failed load would send, to every exporter rank the plan names; the exporter frees a
        request once every loader rank released or loaded it. An exporter that has not exported
        the request yet is asked again until ``timeout_s``. Nothing is reported by :meth:`poll`;
        failures are logged. Malformed params raise ``ValueError`` here.
        """
        self._check_started()
        p = KVTransferParams.from_dict(params)
        items = [ReleaseItem(x) for x in (p if isinstance(p, list) else [p])]
        with self._lock:
            self._releases.extend(items)

    # ---------------------------------------------------------------------------- load
    def load(
        self, request_id: str, params: dict | KVTransferParams, block_ids, num_computed_tokens: int = 0
    ) -> None:
        """Queue a load of ``params`` into local ``block_ids``; it starts at the next :meth:`poll`.

        ``block_ids`` cover the whole request (``ceil(num_tokens / block_size)`` of them).
        ``num_computed_tokens=k``: this engine already holds tokens ``[0, k)`` (a prefix-cache
        hit); only ``[k, num_tokens)`` is pulled and the first ``k / block_size`` blocks are
        not written. ``k`` must be a multiple of this engine's block size, below ``num_tokens``;
        the exporter's block size may differ. Malformed params, block ids or ``k`` raise
        ``ValueError`` (naming the field) here; every later problem is reported by
        :meth:`poll` as a failed request.
        """
        if not self._open:
            self._check_started()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id: must be a non-empty string, got {request_id!r}")
        p = KVTransferParams.from_dict(params)
        if type(p) is list:
            raise ValueError("params: load takes one child's params; call load once per n>1 child")
        n = p.num_tokens
        ids = check_block_ids(block_ids, self.spec.num_blocks_for(n), self.num_blocks, n, unique=True)
        k = num_computed_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < n:
            raise ValueError(f"num_computed_tokens: must be an int in [0, {n}), got {k!r}")
        if k % self.spec.block_size:
            raise ValueError(
                f"num_computed_tokens: {k} is not a multiple of the block size {self.spec.block_size}"
            )
        self._loads.add(request_id, ids, now())
        item = LoadItem(request_id, p, ids, 0.0, k)
        with self._lock:
            self._incoming.append(item)

    def poll(self) -> PollResult:
        """Start the loads queued since the last poll (one batch) and report what completed.

        Call it once per scheduler step. A tight ``while: poll()`` loop with no pause starves
        the engine's own threads of the GIL (measured on CPU: a 1 MiB load took 100-460 ms
        instead of 2.5 ms); pause between calls, e.g. ``time.sleep(0.0002)``, when waiting.
        """
        if not self._open:
            self._check_started()
        if self._incoming or self._releases:
            with self._lock:
                batch, self._incoming = self._incoming, []
                releases, self._releases = self._releases, []
            deadline = time.monotonic() + self.timeout_s  # the loads' one deadline
            for b in (releases, batch):  # releases as their own batch: they move nothing
                if b:
                    for it in b:
                        it.deadline = deadline
                    self._work.put(b)
        out = PollResult()
        self._exports.drain(out)
        self._loads.drain(out)
        return out

    def stats(self) -> dict:
        """Counters, bytes, p50/p90/p99 transfer time (of the last 100 000 loads), busy-time
        throughput, transports."""
        s = self._metrics.snapshot()
        if self._started:
            s["exports_live"] = self._exports.num_live()
            s["blocks_held"] = self._exports.held_blocks()
        s["loads_pending"] = self._loads.pending()
        s["transport_reasons"] = dict(self._transport_reasons)
        s.update(getattr(self.pipeline, "stats", dict)())
        s.update(self._nixl_stats())
        s["not_ready_grants"] = self._order.num_not_ready
        s["bookkeeping"] = idops.status()  # "native: <path>" or "numpy (<why>)"
        s["nvtx"] = tracing.status()  # "on: ..." or "off: <why>" (no tool attached, KVXFER_NVTX=0, ...)
        s["copy_path"] = ops.path_stats(self._views[0].caches)  # SM budget, kernel/DMA calls and why
        s["engine_id"] = self.engine_id
        s["tp_rank"] = self.tp_rank
        return s
