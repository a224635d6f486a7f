"""Worker side of the vLLM connector (no vLLM import): one :class:`kvxfer.TransferEngine` per
TP rank, driven by the scheduler side's :class:`~kvxfer.vllm.transfer_meta.TransferMeta`.

Each step: :meth:`WorkerSide.start` queues the step's loads, exports and releases; the
engine's ``poll()`` (one per step, in :meth:`finished`) starts them and reports what
completed. vLLM counts a request done when every worker (TP rank) reported it, so every
rank reports each of its loads and exports exactly once: a load that failed is reported as
finished together with its block ids (``kv_load_failure_policy`` then recomputes or fails
it), an export whose lease ended as finished sending (its blocks may be freed).

A state group's layers (Mamba, GDN, short conv) are registered as attention-shaped views over
their pages (:func:`kvxfer.vllm.state.attention_view_of_state`: vLLM's hybrid allocator gives
every group one page size), with a ``StateGroup`` each; the scheduler's per-request list of a
state group reaches the engine unchanged (the engine takes its running state block).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
from collections.abc import Callable, Iterator, Mapping

import torch
import zmq

from ..engine import TransferEngine
from ..params import KVTransferParams
from ..ports import free_port_base
from .config import ConnectorConfig, port_in_use_message
from .groups import VllmGroup, engine_groups, expand_group_ids
from .layout import KVLayout, caches_from_vllm, check_pair
from .state import attention_view_of_state
from .transfer_meta import NULL_BLOCK_ID, NULL_BLOCK_WHY, LoadSpec, TransferMeta, expand_block_ids

_LOG = logging.getLogger(__name__)

__all__ = ["COUNTERS", "WorkerSide"]

_BIND_ERRORS = (OSError, zmq.ZMQError)  # a side-channel port in use (errno EADDRINUSE)

COUNTERS = (  # the engine counters a stats interval reports as deltas
    "transfers",
    "bytes",
    "failures",
    "expirations",
    "finished_exports",
    "handshakes",
    "ops_calls",
    "onesided_loads",
)


def process_cpus() -> set[int]:
    """The CPUs this process may run on: the union of its threads' affinities. vLLM's CPU
    worker binds its OpenMP threads (``GOMP_CPU_AFFINITY``: the main thread to the first core of
    its list, with ``auto`` binding the same core for every server on the host); its other threads
    keep the process's own set. Empty where the platform has no affinity calls."""
    if not hasattr(os, "sched_getaffinity"):
        return set()
    cpus: set[int] = set()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        tids = ["0"]
    for tid in tids:
        with contextlib.suppress(OSError, ValueError):  # a thread that ended meanwhile
            cpus |= os.sched_getaffinity(int(tid))
    return cpus


@contextlib.contextmanager
def threads_on(cpus: set[int]) -> Iterator[None]:
    """While in the block, the calling thread may run on ``cpus`` (the threads it starts inherit
    that); its own affinity is restored after. Nothing changes where ``cpus`` is empty or already
    the thread's set, or the platform has no affinity calls."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        yield
        return
    own = os.sched_getaffinity(0)
    if own == cpus:
        yield
        return
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as e:
        _LOG.warning("kvxfer connector: could not widen the CPU affinity to %s (%s)", sorted(cpus), e)
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, own)


def _state_as_attention(
    kv_caches: dict[str, torch.Tensor], groups: list[VllmGroup]
) -> dict[str, torch.Tensor]:
    """``kv_caches`` with every state layer's tensor replaced by an attention-shaped view of its
    pages (the first attention layer's shape, strides and dtype)."""
    state = {n for g in groups if g.is_state for n in g.layer_names}
    if not state:
        return kv_caches
    template = next((t for n, t in kv_caches.items() if n not in state), None)
    if template is None:
        raise ValueError("kv_caches: state layers but no attention layer to shape their pages after")
    out = {}
    for n, t in kv_caches.items():
        try:
            out[n] = attention_view_of_state(t, template) if n in state else t
        except ValueError as e:
            raise ValueError(f"kv_caches[{n!r}]: {e}") from None
    return out


class WorkerSide:
    """The worker half of ``KvxferConnector`` on one TP rank.

    Args:
        cfg: the connector configuration.
        tp_rank: this worker's TP rank.
        engine_factory: builds the engine (tests inject one); default :class:`TransferEngine`.
        groups: the KV cache groups a request is a set of (:mod:`kvxfer.vllm.groups`; the
            metadata's block ids are then one list per group); None: one group.
    """

    def __init__(
        self,
        cfg: ConnectorConfig,
        tp_rank: int,
        engine_factory: Callable[..., TransferEngine] = TransferEngine,
        groups: list[VllmGroup] | None = None,
    ) -> None:
        self.cfg = cfg
        self.groups = groups
        self.tp_rank = tp_rank
        self._factory = engine_factory
        self.engine: TransferEngine | None = None
        self.layout: KVLayout | None = None
        self.ratio = 1  # manager block -> kernel blocks
        self._attn_groups: list | None = None  # the engine's groups (register)
        self.state_caches: dict[str, torch.Tensor] = {}  # vLLM's views of the state layers (register)
        self._loads: dict[str, list[int]] = {}  # loading request -> its manager block ids
        self._exported: set[str] = set()
        self._sending_done: set[str] = set()  # exports to report without the engine (refused)
        self._recving_done: set[str] = set()  # loads to report without the engine (refused)
        self._bad_blocks: set[int] = set()
        self._failed: set[str] = set()  # loads that failed or were refused, not yet taken
        self._refused = 0  # loads and exports refused here (counted as failures in the stats)
        self._last: dict[str, float] = {}

    # ----------------------------------------------------------------- registration
    def register(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        *,
        backend: str,
        head_size: int,
        total_kv_heads: int,
        use_mla: bool,
        isa: str | None = None,
        cache_dtype: str = "auto",
    ) -> None:
        """Map vLLM's per-layer caches to kvxfer views and start this rank's engine.

        ``isa``: the CPU attention ISA of ``CPU_ATTN`` caches (their pages move only between
        identical layouts, see :mod:`kvxfer.vllm.layout`); ``cache_dtype``: vLLM's.
        """
        if self.engine is not None:
            raise RuntimeError("register: caches are already registered")
        scopes = None
        if self.groups is not None:  # the groups' layers, group by group (one may alias another's)
            scopes = {n: g.index for g in self.groups for n in g.layer_names if n in kv_caches}
            missing = [n for g in self.groups for n in g.layer_names if n not in kv_caches]
            if missing:
                raise ValueError(
                    f"kv_caches: no tensor registered for layer {missing[0]!r} of a KV cache group"
                )
            kv_caches = {n: kv_caches[n] for g in self.groups for n in g.layer_names}
            self.state_caches = {n: kv_caches[n] for g in self.groups if g.is_state for n in g.layer_names}
            kv_caches = _state_as_attention(kv_caches, self.groups)
        spec, views, names, layout = caches_from_vllm(
            kv_caches,
            backend=backend,
            head_size=head_size,
            total_kv_heads=total_kv_heads,
            tp_size=self.cfg.tp_size,
            use_mla=use_mla,
            isa=isa,
            cache_dtype=cache_dtype,
            scopes=scopes,
        )
        self._attn_groups = None
        if self.groups is not None:
            where = {(scopes[n], n): i for i, n in enumerate(names)}
            self._attn_groups = engine_groups(self.groups, where)
        if layout.whole_blocks and layout.isa is None:
            _LOG.warning(
                "kvxfer connector: the CPU attention ISA of backend %s is unknown: this server's KV "
                "can be neither exported to nor loaded from another server (KVLayoutMismatch)",
                backend,
            )
        if self.cfg.block_size % spec.block_size:
            raise ValueError(
                f"kv_caches: block dim {spec.block_size} does not divide vLLM's block_size {self.cfg.block_size}"
            )
        self.ratio = self.cfg.block_size // spec.block_size
        if self.ratio != 1 and any(g.is_state for g in self.groups or ()):
            raise ValueError(
                f"kv_caches: vLLM split its {self.cfg.block_size}-token blocks into kernel blocks of "
                f"{spec.block_size}; a state page spans the whole block, so state groups are carried only "
                "with unsplit blocks"
            )
        self.layout = layout
        # The engine's threads (side channel, loader, notifier, transports' and their libraries'
        # threads, all started from here) inherit this thread's CPU affinity. vLLM's CPU worker
        # binds this (main) thread to one core, and every server on a host to the same one: its
        # busy-waiting main thread, its OpenMP work and the engine's threads of both P and D
        # then share that core, and side-channel replies and streams stalled for seconds
        # (handshakes and lease grants past their deadline, loads failing at lease end). The
        # engine's threads run on every CPU of the process instead.
        cpus = process_cpus()
        own = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
        with threads_on(cpus):
            self.engine = self._start_engine(spec, views)
        if cpus and own and cpus != own:
            _LOG.info(
                "kvxfer connector: the engine's threads run on CPUs %s (this worker thread is bound to %s)",
                sorted(cpus),
                sorted(own),
            )
            if os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") == "auto" and own == {min(cpus)}:
                _LOG.warning(
                    "kvxfer connector: vLLM bound this worker to CPU %d, the first of this process's "
                    "CPUs %s (VLLM_CPU_OMP_THREADS_BIND=auto): every vLLM CPU server on this host with "
                    "that setting binds its worker there too, and with P and D on one host their "
                    "busy-waiting workers then starve each other and the KV transfers (loads time "
                    "out). Give each server its own CPUs (VLLM_CPU_OMP_THREADS_BIND=<cpu list>, "
                    "disjoint) or VLLM_CPU_OMP_THREADS_BIND=nobind",
                    min(cpus),
                    sorted(cpus),
                )
        _LOG.info(
            "kvxfer connector: engine %s rank %d/%d on %s:%d, %d layers (%s, %s), %s",
            self.cfg.engine_id,
            self.tp_rank,
            self.cfg.tp_size,
            self.cfg.host,
            self.engine.port + self.tp_rank,
            len(names),
            "MLA" if use_mla else f"{spec.num_kv_heads} kv heads",
            spec.dtype,
            layout.describe(),
        )

    def _start_engine(self, spec, views) -> TransferEngine:
        """Start this rank's engine on its side-channel port: ``kv_port + rank`` (exporting
        servers; a port in use is an error naming it and the fix), or a free port (a
        ``kv_consumer``: nobody dials it)."""
        cfg, r = self.cfg, self.tp_rank
        kw = {
            "host": cfg.host,
            "transport": cfg.transport,
            "lease_s": cfg.lease_s,
            "timeout_s": cfg.timeout_s,
            "max_sms": cfg.max_sms,
            "onesided": cfg.onesided,
        }
        if self._attn_groups is not None:
            kw["groups"] = self._attn_groups
        if cfg.base_port == 0:  # kv_consumer
            if cfg.tp_size == 1:
                return self._factory(spec, views, r, 1, cfg.engine_id, port=0, **kw).start()
            # ranks bind free ports of their own (the engine wants a base: rank r binds base + r);
            # a consumer never exports, so its secret is this process's own (no shared key file)
            last: Exception | None = None
            for _ in range(3):  # a probed port can be taken before it is bound: probe again
                p = free_port_base(1, host=cfg.host)
                try:
                    return self._factory(
                        spec, views, r, cfg.tp_size, cfg.engine_id, port=p - r,
                        auth_key=secrets.token_hex(16), **kw,
                    ).start()  # fmt: skip
                except _BIND_ERRORS as e:
                    if getattr(e, "errno", None) != errno.EADDRINUSE:
                        raise
                    last = e
            raise RuntimeError(f"kvxfer connector: no free side-channel port on {cfg.host} ({last})")
        port = cfg.base_port + r
        try:
            return self._factory(spec, views, r, cfg.tp_size, cfg.engine_id, port=cfg.base_port, **kw).start()
        except _BIND_ERRORS as e:
            if getattr(e, "errno", None) != errno.EADDRINUSE:
                raise
            raise RuntimeError(port_in_use_message(cfg.host, port, e, cfg.engine_id, r)) from e

    def handshake_info(self) -> dict:
        """What the scheduler side needs to know about the registered caches."""
        eng = self._engine()
        return {
            "block_size": eng.spec.block_size,
            "bytes_per_token": eng.spec.bytes_per_token(),
            "tp_rank": self.tp_rank,
            "kv_layout": self.layout.to_dict(),
        }

    def _engine(self) -> TransferEngine:
        if self.engine is None:
            raise RuntimeError("kvxfer connector: register_kv_caches was not called")
        return self.engine

    # ----------------------------------------------------------------- per step
    def _group_lists(self, block_ids, num_tokens: int) -> list[list[int]]:
        """One group's kernel block ids per group from the metadata's manager lists (null blocks
        kept null), each clipped to ``num_tokens``."""
        if not isinstance(block_ids, (list, tuple)) or len(block_ids) != len(self.groups or ()):
            raise ValueError(f"block_ids: expected one list per KV cache group ({len(self.groups or ())})")
        need = self._engine().spec.num_blocks_for(num_tokens)
        return [
            list(ids) if g.is_state else expand_group_ids(ids, self.ratio, NULL_BLOCK_ID)[:need]
            for g, ids in zip(self.groups, block_ids)
        ]

    def start(self, meta: TransferMeta) -> None:
        """Queue this step's exports, loads and releases (they run at the next poll)."""
        eng = self._engine()
        if self.groups is not None:
            self._start_grouped(eng, meta)
            return
        for ex in meta.exports:
            ids = expand_block_ids(ex.block_ids, self.ratio)[: eng.spec.num_blocks_for(ex.num_tokens)]
            try:
                if NULL_BLOCK_ID in ex.block_ids:
                    raise ValueError(NULL_BLOCK_WHY)
                eng.export(ex.request_id, ids, ex.num_tokens, token=ex.token or None)
                self._exported.add(ex.request_id)
            except ValueError as e:
                _LOG.warning("kvxfer: export of %s refused (%s); its blocks are freed", ex.request_id, e)
                self._sending_done.add(ex.request_id)
                self._refused += 1
        with eng.batched_loads():  # the step's one-sided loads: one launch per remote
            for ld in meta.loads:
                try:
                    if NULL_BLOCK_ID in ld.block_ids:  # never written: it must stay vLLM's zeros
                        raise ValueError(NULL_BLOCK_WHY)
                    check_pair(KVLayout.from_dict(ld.params.get("kv_layout")), self.layout)
                    # the dict as the exporter made it: load() checks it (a whole load in one
                    # native call), takes the first ids its num_tokens needs, names what is wrong
                    ids = expand_block_ids(ld.block_ids, self.ratio)
                    eng.load(ld.request_id, ld.params, ids, num_computed_tokens=ld.num_computed_tokens)
                    self._loads[ld.request_id] = self._written(ld)
                except ValueError as e:  # KVLayoutMismatch included: nothing was written
                    _LOG.warning(
                        "kvxfer: load of %s refused (%s: %s); reported failed",
                        ld.request_id,
                        type(e).__name__,
                        e,
                    )
                    self._recving_done.add(ld.request_id)
                    self._failed.add(ld.request_id)
                    self._refused += 1
                    self._bad_blocks.update(self._written(ld))
                    self._release_quietly(ld.params)
        for prm in meta.releases:
            self._release_quietly(prm)

    def _written(self, ld: LoadSpec) -> list[int]:
        """The manager blocks the load of ``ld`` writes: what a failed one leaves invalid. The
        local prefix-cache hit before them is vLLM's own and stays valid (other running requests
        may share those blocks: reported invalid, vLLM would fail or recompute them too)."""
        return list(ld.block_ids[ld.num_computed_tokens // self.cfg.block_size :])

    def _start_grouped(self, eng: TransferEngine, meta: TransferMeta) -> None:
        """:meth:`start` for a model of several KV cache groups: per-group block lists, the null
        block where a window passed (the engine refuses it where a group still needs tokens)."""
        for ex in meta.exports:
            try:
                lists = self._group_lists(ex.block_ids, ex.num_tokens)
                eng.export(
                    ex.request_id, lists, ex.num_tokens, token=ex.token or None,
                    computed_tokens=ex.computed_tokens or None,
                )  # fmt: skip
                self._exported.add(ex.request_id)
            except ValueError as e:
                _LOG.warning("kvxfer: export of %s refused (%s); its blocks are freed", ex.request_id, e)
                self._sending_done.add(ex.request_id)
                self._refused += 1
        for ld in meta.loads:
            mgr = [b for ids in ld.block_ids for b in ids if b != NULL_BLOCK_ID]
            try:
                check_pair(KVLayout.from_dict(ld.params.get("kv_layout")), self.layout)
                prm = KVTransferParams.from_dict(ld.params)
                if type(prm) is list:
                    raise ValueError("params: a load takes one child's params, got a list")
                lists = self._group_lists(ld.block_ids, prm.num_tokens)
                eng.load(
                    ld.request_id, prm, lists, num_computed_tokens=ld.num_computed_tokens,
                    computed_tokens=ld.computed_tokens or None,
                )  # fmt: skip
                self._loads[ld.request_id] = mgr
            except ValueError as e:  # KVLayoutMismatch included: nothing was written
                _LOG.warning(
                    "kvxfer: load of %s refused (%s: %s); reported failed", ld.request_id, type(e).__name__, e
                )
                self._recving_done.add(ld.request_id)
                self._failed.add(ld.request_id)
                self._refused += 1
                self._bad_blocks.update(mgr)
                self._release_quietly(ld.params)
        for prm in meta.releases:
            self._release_quietly(prm)

    def _release_quietly(self, params: dict) -> None:
        try:
            self._engine().release(params)
        except ValueError as e:
            _LOG.warning("kvxfer: release of %s not sent (%s)", params.get("request_id"), e)

    def finished(self) -> tuple[set[str], set[str]]:
        """(finished sending, finished receiving) since the last call; polls the engine once."""
        res = self._engine().poll()
        sending = (res.finished_sending | res.expired) & self._exported
        self._exported -= sending
        for rid in res.expired:
            _LOG.warning("kvxfer: export %s: %s", rid, res.errors.get(rid, "lease expired"))
        sending |= self._sending_done
        self._sending_done = set()
        recving = set(res.finished_recving)
        for rid in res.failed:
            _LOG.warning("kvxfer: load of %s failed (%s)", rid, res.errors.get(rid, "unknown reason"))
            self._bad_blocks.update(self._loads.get(rid, ()))
            self._failed.add(rid)
            recving.add(rid)
        for rid in recving:
            self._loads.pop(rid, None)
        recving |= self._recving_done
        self._recving_done = set()
        return sending, recving

    def take_load_errors(self) -> set[int]:
        """Manager block ids of failed loads reported since the last call; none with KV cache
        groups (vLLM 0.32 raises on block-level failures of a model with several groups, its ids
        being per group: those loads are reported by request, :meth:`take_failed_loads`)."""
        out, self._bad_blocks = self._bad_blocks, set()
        return set() if self.groups is not None else out

    def take_failed_loads(self) -> set[str]:
        """Request ids of loads that failed or were refused, reported (in ``finished``'s
        receiving set) since the last call: vLLM fails or recomputes them by request, whatever
        its view of their blocks (a sliding-window group swaps blocks for its null block)."""
        out, self._failed = self._failed, set()
        return out

    def stats_delta(self) -> dict | None:
        """Counters since the last call, plus the engine's latency percentiles (None if idle)."""
        if self.engine is None:
            return None
        s = dict(self.engine.stats())
        s["failures"] += self._refused  # refused here, before the engine saw them
        s["onesided_loads"] = s.get("onesided", {}).get("loads", 0)  # read with no message to P
        out = {k: s[k] - self._last.get(k, 0) for k in COUNTERS}
        for k in ("busy_s", "latency_sum_s"):
            out[k] = s[k] - self._last.get(k, 0.0)
        self._last = {k: s[k] for k in (*COUNTERS, "busy_s", "latency_sum_s")}
        if not any(out.values()):
            return None
        out.update({k: s[k] for k in ("p50_s", "p90_s", "p99_s")})
        out["blocks_held"] = s.get("blocks_held", 0)
        out["transports"] = sorted(set(s["transports"].values()))
        return out

    def pending(self) -> int:
        """Loads and exports not yet reported (0 when nothing is left in flight)."""
        return len(self._loads) + len(self._exported)

    def close(self) -> None:
        """Stop the engine (bounded). Idempotent."""
        if self.engine is not None:
            self.engine.close()
