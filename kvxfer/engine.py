"""TransferEngine: the object a model runner holds, one per TP rank.

It plays both roles: it *exports* requests whose KV it holds (prefill, or decode for
multi-turn reuse) and *loads* requests from remote engines. The class is the public API and
the lifecycle, a facade over objects that each do one job, all handed the rank's configuration
(:class:`~kvxfer.rank.Rank`) and what they share while it runs (:class:`~kvxfer.rank.Runtime`):

* :class:`~kvxfer.exporter.Exporter` — the side-channel server thread: handshakes, lease
  grants, send requests, notifications, heartbeats, lease expiry;
* :class:`~kvxfer.loader.Loader` — the worker thread: the loads queued by :meth:`load`, one
  batch per :meth:`poll`, and heartbeats;
* :class:`~kvxfer.notifier.Notifier` — the thread that sends the loader's notifications and
  heartbeats until acknowledged;
* one object per transport (``{"ipc", "pg", "nixl"}``, :mod:`kvxfer.transports`), with
  threads of their own where they stream (a ``pg`` pair's, the staged ``nixl`` sender).

Completion: the loader notifies the exporter ranks the plan names (``notify_targets``); an
exporter rank frees a request when it has the ``expected_notifications`` of the plan of the
pair of engines. A load is reported exactly once, finished or failed; an export once,
finished or expired. Every thread is bounded and stopped by :meth:`close`.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import Sequence

import torch

from . import idops, ops, tracing
from .auth import EngineSecret
from .completion import PollResult, native_load_book
from .engine_args import check_engine_args, export_ids_of, layer_mask, windows_end
from .engine_types import HandshakeError, LoadItem, ReleaseItem, check_block_ids
from .exporter import Exporter
from .exports import ExportTracker
from .grouped import load_ids
from .groups.attention import AttentionGroup
from .groups.blocks import NULL_BLOCK
from .groups.state_group import StateGroup
from .loader import Loader
from .metrics import now
from .notifier import Notifier
from .params import KVTransferParams, params_dict
from .rank import Rank, Runtime
from .spec import KVCacheSpec
from .stuck_threads import join_or_leave
from .transports.ipc.cuda_ipc import host_id
from .transports.ipc.onesided import OneSided
from .transports.ipc.transport import IpcTransport
from .transports.nixl.transport import NixlTransport
from .transports.pg.pipeline import StagedPipeline
from .transports.pg.transport import PgTransport
from .views import CacheViews

_LOG = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 5.0  # close() returns within this, even with a thread stuck in a transfer

__all__ = ["HandshakeError", "TransferEngine"]


class TransferEngine:
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
            ``"pg"`` or ``"nixl"`` (NIXL one-sided READs over UCX, :mod:`kvxfer.transports.nixl`;
            needs ``kvxfer[nixl]``, checked here); an explicit transport that cannot be used
            fails the request naming why.
        lease_s: how long exported blocks are held without a heartbeat.
        port: side-channel port of rank 0; rank r binds ``port + r``. 0 picks a free port,
            allowed only with ``tp_size == 1`` (other ranks could not be found).
        timeout_s: a load's deadline, from the ``poll()`` that starts it: its handshake,
            lease grants, copy or stream, and GPU completion all end by then (default
            ``min(lease_s, 10)``); also the bound of the exporter's side of a transfer.
        pipeline: the :class:`~kvxfer.transports.pg.pipeline.StagedPipeline` of the ``pg``
            transport (staging buffer size and depth, pinned-host staging on GPU, chunk cap,
            streams at once); default ``StagedPipeline()``: 2 x 32 MiB buffers per stream, up
            to 4 streams per role at once (their buffers made when streams overlap).
        auth_key: a cluster-wide key the engines' secrets derive from (default
            ``$KVXFER_AUTH_KEY``, else a random secret shared by the ranks on this host:
            :mod:`kvxfer.auth`). Params carry per-request tokens of it; nothing else needs it.
        max_sms: SM budget of this engine's transfers (a positive int, or None for none): the
            kernels launch at most that many CTAs, and whole-block copies may go to the copy
            engines (:mod:`kvxfer.backends.dma`); ``stats()["copy_path"]`` says what ran and why.
        onesided: let ``load()`` read straight from an ``ipc`` exporter it has mapped, with no
            message before the copy, when the exporter's lease-slot table says the export is
            live and ready (:mod:`kvxfer.transports.ipc.onesided`; ``stats()["onesided"]`` says
            how many did and why the others did not). False: every load takes the messaged path.
        groups: the model's attention KV cache groups (vLLM's hybrid allocator: full-attention
            and sliding-window groups, :class:`~kvxfer.groups.attention.AttentionGroup`), each
            owning some of ``caches`` (layer indices; every layer in exactly one group). Then a
            request is a set of groups: :meth:`export`, :meth:`params_for` and :meth:`load`
            take one positional block list per group (:mod:`kvxfer.grouped`), a sliding group
            moves only its in-window blocks, and ``null_block`` (vLLM's 0) may not stand where
            a group still holds tokens. Both engines of a transfer must have the same groups
            (the handshake checks). Every transport carries them (``ipc`` one-sided too).
            State groups (Mamba/GDN/short conv: :class:`~kvxfer.groups.state_group.StateGroup`)
            own layers whose blocks are state pages: their list's running state block moves
            whole between engines laid out alike, else re-sharded into this engine's layout.
            None: one group of every layer, block ids as one list.
        null_block: the block id that stands for a position whose tokens a sliding window
            passed (vLLM's null block, 0; None: none); only with ``groups``.

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
        onesided: bool = True,
        groups: Sequence[AttentionGroup | StateGroup] | None = None,
        null_block: int | None = NULL_BLOCK,
    ) -> None:
        side, gs = check_engine_args(
            spec, caches, tp_rank, tp_size, engine_id, transport, lease_s, port, pipeline, auth_key,
            onesided, groups, null_block,
        )  # fmt: skip
        self.groups = gs
        self.spec = spec
        self.caches = list(caches)
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.engine_id = engine_id
        self.host = host
        self.transport = transport
        self.lease_s = float(lease_s)
        self.timeout_s = float(timeout_s) if timeout_s is not None else min(self.lease_s, 10.0)
        self.pipeline = pipeline if pipeline is not None else StagedPipeline()
        self.num_blocks = side.num_blocks
        self.device = side.device
        self.port = port  # the bound base port once started
        self._auth_key = auth_key
        # Registered once (ops skip per-layer checks); whole blocks, and token slots if possible.
        # max_sms: the SM budget of every op on these caches (kvxfer.ops.register_caches)
        views = CacheViews(self.caches, spec, max_sms)
        rank = self._rank = Rank(
            spec, tuple(self.caches), views, tp_rank, tp_size, engine_id, host, port, transport,
            self.lease_s, self.timeout_s, self.pipeline, self.device, host_id(), onesided, gs,
        )  # fmt: skip
        rt = self._rt = Runtime(self.device)
        self._transports = {
            "ipc": IpcTransport(rank, rt),
            "pg": PgTransport(rank, rt),
            "nixl": NixlTransport(rank, rt),
        }
        self._notifier = Notifier(engine_id, rt.stop, rt.metrics)
        self._loader = Loader(rank, rt, self._transports, self._notifier)
        self._exporter = Exporter(rank, rt, self._transports)
        self._onesided = OneSided(rank, rt, self._loader) if onesided else None
        # load()'s native lane (OneSided.load_native), set by start() when the control module
        # is in use and this engine has no groups; None: every load takes the Python path
        self._native_load = None
        self._hooks = rt.hooks  # test hooks, by name (each read where it is called)
        self._ctx = None  # the zmq context, made by start()
        self._started = False
        self._closed = False
        self._open = False  # started and not closed: what every API call checks first

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
        rank, rt = self._rank, self._rt
        self.port = self._exporter.bind(self._ctx)
        rt.secret = EngineSecret(self.engine_id, rank.port, self.tp_rank, self._auth_key, self.timeout_s)
        rt.incarnation = secrets.token_hex(8)
        idops.ensure()  # the native bookkeeping helpers, built now if missing (not on a request)
        # the loads in flight in C (completion.native_load_book), with the one-sided native lane
        os_ = self._onesided
        book = os_.native_book(self.timeout_s) if os_ is not None else native_load_book(set(), 0)
        if book is not None:
            rt.loads = book
            if os_ is not None and os_.lane is not None and self.groups is None:
                self._native_load = os_.load_native
        if self.device.type == "cuda":  # compile/load the kernels now, not on the first request
            for v in rank.views.views:
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
        ipc = self._transports["ipc"]
        ipc.start()  # the epochs the export tracker keeps, in shared memory when ipc is offered
        rt.exports = ExportTracker(self.num_blocks, self.lease_s, ipc.epochs)
        ipc.follow(rt.exports)  # the lease-slot table one-sided loaders on this host read
        for name in ("pg", "nixl"):  # nixl registers the tracker's epochs with its agent
            self._transports[name].start()
        self._loader.start(self._ctx)
        self._notifier.start(self._ctx, f"kvxfer-notifier-{self.engine_id}-{self.tp_rank}")
        self._exporter.start()

    def _threads(self) -> list:
        """Every thread the engine's parts run."""
        out = [*self._exporter.threads(), *self._loader.threads(), *self._notifier.threads()]
        for t in self._transports.values():
            out += t.threads()
        return out

    def close(self) -> None:
        """Stop the threads, close sockets and shared memory. Idempotent.

        Returns within ``CLOSE_TIMEOUT_S`` (5 s): pair groups are aborted first, so a thread
        blocked in a transfer wakes up; notifications still unacknowledged get until then; a
        thread still stuck after the bound (a pair join a peer never completed) is left behind
        (a daemon) and logged, and the process's exit waits for it until its own bound
        (``2 * timeout_s``) instead of aborting. One-sided CUDA copies still reading an
        exporter's memory get up to 2 s more before it is unmapped.
        """
        self._open = False
        if self._closed or not self._started:
            self._closed = True
            return
        self._closed = True
        rt = self._rt
        # End every live export first: its blocks' epochs move, so a loader that granted one
        # and copies it after this (ipc, nixl direct) fails the load instead of delivering
        # bytes the runner may already be reusing; a stream stops sending it.
        rt.exports.release_all("the exporting engine closed")
        if self._onesided is not None:  # queued while the notifier still sends
            self._onesided.flush()
        self._loader.flush_releases()  # release() since the last poll(): still sent
        rt.stop.set()
        self._loader.stop()
        threads = self._threads()
        for t in self._transports.values():
            t.abort("engine closed")
        # a stuck thread's call is bounded by timeout_s (a pair join: connecting to the store,
        # then waiting in it), both parts at most: the process's exit waits for it that long
        stuck = join_or_leave(threads, CLOSE_TIMEOUT_S, 2 * self.timeout_s)
        if stuck:
            _LOG.warning(
                "kvxfer engine %s rank %d: close() left threads still in a transport call: %s; "
                "the process's exit waits for them (at most %.0f s more)",
                self.engine_id,
                self.tp_rank,
                [t.name for t in stuck],
                2 * self.timeout_s,
            )
        self._release_parts(busy=bool(stuck))

    def _release_parts(self, busy: bool = False) -> None:
        """Free what :meth:`start` made (whatever part of it was made); ``busy``: a thread is
        still inside a transport call."""
        rt = self._rt
        self._loader.close()
        for t in self._transports.values():
            t.close(busy)
        self._exporter.close()
        if rt.secret is not None:
            rt.secret.close()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)  # closes any socket still open: term() would wait on it

    def __enter__(self) -> TransferEngine:
        return self.start() if not self._started else self

    def __exit__(self, *exc) -> None:
        self.close()

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
        computed_tokens: int | None = None,
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

        An engine with ``groups``: ``block_ids`` is one positional list per group (vLLM's
        ``tuple[list[int], ...]``); of each, the positions from the block holding the group's
        window's first token on are held and moved (all for full attention), the others may
        hold ``null_block``. ``computed_tokens``: where the windows end (default
        ``num_tokens``; less when whole blocks are exported past the last computed token).
        """
        if not self._open:
            self._check_started()
        rt = self._rt
        if not streaming and computed_tokens is None and self.groups is None and type(block_ids) is list:
            got = rt.exports.export_plain(  # the common export in one native call, or None
                request_id, block_ids, num_tokens, self.spec.num_blocks_for, rt.secret, token, rt.order, ready
            )
            if got is not None:
                return params_dict(
                    request_id, self.engine_id, self.host, self.port, self.tp_size, got[1], num_tokens, got[0]
                )
        ids, sizes, block_ids = export_ids_of(self, request_id, block_ids, num_tokens, computed_tokens)
        gen = rt.exports.generation(request_id)  # the token's nonce (kvxfer.auth)
        token, digest = rt.secret.for_export(request_id, gen, num_tokens, ids, token, sizes)
        gated, undo = (rt.order.gated(request_id), None) if streaming else rt.order.mark(request_id, ready)
        layers = self.spec.num_layers if streaming else 0
        try:
            rt.exports.add(request_id, ids, num_tokens, layers, token, digest, gen, not gated, sizes)
        except BaseException:
            rt.order.restore(request_id, undo)  # refused (already exported, token reused): gates as they were
            raise
        # plain ints: that list is the params' (JSON-safe); else the checked array's values
        listed = block_ids if type(block_ids) is list and idops.exact_ints(block_ids) else ids.tolist()
        return params_dict(
            request_id, self.engine_id, self.host, self.port, self.tp_size, listed, num_tokens, token,
            groups=sizes,
        )  # fmt: skip

    def mark_ready(self, request_id: str, layers, ready=None) -> None:
        """Layers ``layers`` (an int, a range or a sequence of layer indices) of the layer-wise
        export ``request_id`` are written once ``ready`` (CUDA event(s) or a stream, as for
        :meth:`export`; None: already written) has completed. Raises ``ValueError`` for a layer
        out of range or marked twice, a request not exported layer-wise, or one already ended;
        nothing is changed then."""
        self._check_started()
        mask = layer_mask(layers, self.spec.num_layers)
        events = [] if ready is None else self._rt.order.events(ready)
        self._rt.exports.mark_layers(request_id, mask, events)

    def params_for(
        self, request_id: str, block_ids, num_tokens: int, *, computed_tokens: int | None = None
    ) -> dict:
        """The params :meth:`export` will return for these arguments, without exporting: for a
        caller that hands params out before the blocks are written (a loader's grant then waits,
        bounded, until the export appears). The token is that of the request id's next
        generation on this rank (:mod:`kvxfer.auth`), so ``export()`` gives the same params as
        long as no export of the id is released in between. A process without an engine (a
        scheduler) makes a token with :meth:`kvxfer.auth.EngineSecret.new_token` and hands it
        to every rank's ``export(..., token=)``. ``block_ids`` and ``computed_tokens`` as for
        :meth:`export`."""
        self._check_started()
        ids, sizes, _ = export_ids_of(self, request_id, block_ids, num_tokens, computed_tokens)
        gen = self._rt.exports.generation(request_id)
        token = self._rt.secret.for_export(request_id, gen, num_tokens, ids, None, sizes)[0]
        return params_dict(
            request_id, self.engine_id, self.host, self.port, self.tp_size, ids.tolist(), num_tokens, token,
            groups=sizes,
        )  # fmt: skip

    def set_compute_stream(self, stream) -> None:
        """Exports made after this wait for the work issued on ``stream`` before each export
        (a CUDA event recorded at export; polled, never synchronised). ``None`` stops it."""
        self._rt.order.set_compute_stream(stream)

    def abort_export(self, request_id: str) -> bool:
        """Release an exported request now (e.g. the client went away); reported as finished_sending.

        A loader still reading it gets it reported failed, never delivered.
        """
        self._check_started()
        return self._rt.exports.abort(request_id)

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
        self._loader.queue_releases([ReleaseItem(x) for x in (p if isinstance(p, list) else [p])])

    # ---------------------------------------------------------------------------- load
    def load(
        self,
        request_id: str,
        params: dict | KVTransferParams,
        block_ids,
        num_computed_tokens: int = 0,
        *,
        computed_tokens: int | None = None,
    ) -> None:
        """Queue a load of ``params`` into local ``block_ids``; it starts at the next :meth:`poll`.

        ``block_ids`` cover the whole request (``ceil(num_tokens / block_size)`` of them).
        ``num_computed_tokens=k``: this engine already holds tokens ``[0, k)`` (a prefix-cache
        hit); only ``[k, num_tokens)`` is pulled and the first ``k / block_size`` blocks are
        not written. ``k`` must be a multiple of this engine's block size, below ``num_tokens``;
        the exporter's block size may differ. Malformed params, block ids or ``k`` raise
        ``ValueError`` (naming the field) here; every later problem is reported by
        :meth:`poll` as a failed request.

        An engine with ``groups``: ``block_ids`` is one positional list per group; each group
        is written from the block holding the first token it needs (``num_computed_tokens``,
        or its window's first token measured at ``computed_tokens``, default the params'
        ``num_tokens``) on; those positions may not hold ``null_block``.
        """
        if not self._open:
            self._check_started()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id: must be a non-empty string, got {request_id!r}")
        native = self._native_load  # a plain whole load read one-sided: one native call
        if (
            native is not None
            and type(params) is dict
            and type(num_computed_tokens) is int
            and not num_computed_tokens
            and computed_tokens is None
            and native(request_id, params, block_ids, self.timeout_s)
        ):
            return
        p = KVTransferParams.from_dict(params)
        if type(p) is list:
            raise ValueError("params: load takes one child's params; call load once per n>1 child")
        n = p.num_tokens
        per = None
        if self.groups is None:
            ids = check_block_ids(block_ids, self.spec.num_blocks_for(n), self.num_blocks, n, unique=True)
        k = num_computed_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < n:
            raise ValueError(f"num_computed_tokens: must be an int in [0, {n}), got {k!r}")
        if k % self.spec.block_size:
            raise ValueError(
                f"num_computed_tokens: {k} is not a multiple of the block size {self.spec.block_size}"
            )
        if self.groups is not None:
            end = windows_end(computed_tokens, n)
            ids, per = load_ids(self.groups, block_ids, n, k, self.spec.block_size, self.num_blocks, end)
        self._rt.loads.add(request_id, ids, now())
        item = (
            LoadItem(request_id, p, ids, 0.0, k) if per is None else LoadItem(request_id, p, ids, 0.0, 0, per)
        )
        if self._onesided is not None and self._onesided.try_load(item, self.timeout_s):
            return  # launched here, reported by a later poll()
        self._loader.queue_load(item)

    def batched_loads(self) -> contextlib.AbstractContextManager[None]:
        """Within the block, loads that read one-sided (``ipc``, the remote mapped) are looked
        up as :meth:`load` is called and launched together when the block ends: per remote one
        ops call per plan read and source rank for all of them, one completion event, where each
        would otherwise be its own launch. For a caller that issues a step's loads at once (the
        vLLM worker's ``start_load_kv``); loads taking the messaged path are batched by the
        worker anyway. Nests; per thread. Loads made in the block are launched even when it
        raises (:meth:`kvxfer.transports.ipc.onesided.OneSided.batch`)."""
        return contextlib.nullcontext() if self._onesided is None else self._onesided.batch()

    def poll(self) -> PollResult:
        """Start the loads queued since the last poll (one batch) and report what completed.

        Call it once per scheduler step. A tight ``while: poll()`` loop with no pause starves
        the engine's own threads of the GIL (on CPU a small load then takes a hundred times as
        long); pause between calls, e.g. ``time.sleep(0.0002)``, when waiting.
        """
        if not self._open:
            self._check_started()
        return self._poll_into(PollResult())

    def _poll_into(self, out: PollResult) -> PollResult:
        """:meth:`poll`, its reports added to ``out`` (the drains merge into what it holds)."""
        self._loader.dispatch(self.timeout_s)
        if self._onesided is not None:
            self._onesided.complete()
        self._exporter.tick(beat=False)  # ready flags, done marks of one-sided reads
        rt = self._rt
        rt.exports.drain(out)
        rt.loads.drain(out)
        return out

    def wait(self, request_ids, timeout_s: float) -> PollResult:
        """Like :meth:`poll`, but block until each load of ``request_ids`` has been reported
        (finished or failed) or ``timeout_s`` passed; returns everything reported meanwhile.

        For a caller that wants the least latency: a one-sided load's completion event is
        queried every 20 us while it is waited for (no sleep of the messaged path's polls)."""
        if not self._open:
            self._check_started()
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        want = set(request_ids)
        if not (isinstance(timeout_s, (int, float)) and timeout_s >= 0):
            raise ValueError(f"timeout_s: must be a number >= 0, got {timeout_s!r}")
        deadline = time.monotonic() + timeout_s
        out = self._poll_into(PollResult())
        while True:
            want -= out.finished_recving
            want -= out.failed.keys()
            if not want or time.monotonic() >= deadline:
                return out
            if self._onesided is not None:
                self._onesided.wait_some(want, deadline)
            else:
                time.sleep(min(2e-4, max(0.0, deadline - time.monotonic())))
            self._poll_into(out)

    def stats(self) -> dict:
        """Counters, bytes, p50/p90/p99 transfer time (of the last 100 000 loads), busy-time
        throughput, transports."""
        rank, rt = self._rank, self._rt
        s = rt.metrics.snapshot()
        # freed by every notification or mark (counted by the tracker, made at start())
        s["finished_exports"] = rt.exports.finished_exports if rt.exports is not None else 0
        if self._started:
            s["exports_live"] = rt.exports.num_live()
            s["blocks_held"] = rt.exports.held_blocks()
        s["loads_pending"] = rt.loads.pending()
        s["transport_reasons"] = dict(self._loader.peers.reasons)
        s["onesided"] = self._onesided.stats() if self._onesided is not None else {"off": True}
        s.update(self.pipeline.stats())
        for t in self._transports.values():
            s.update(t.stats())
        s["not_ready_grants"] = rt.order.num_not_ready
        s["bookkeeping"] = idops.status()  # "native: <path>" or "numpy (<why>)"
        s["nvtx"] = tracing.status()  # "on: ..." or "off: <why>" (no tool attached, KVXFER_NVTX=0, ...)
        s["copy_path"] = ops.path_stats(rank.views.whole.caches)  # SM budget, kernel/DMA calls and why
        s["engine_id"] = self.engine_id
        s["tp_rank"] = self.tp_rank
        return s
