"""``KvxferConnector``: vLLM's ``KVConnectorBase_V1`` over kvxfer (imports vLLM; tested with 0.32, 0.33).

A thin adapter: the scheduler role delegates to :class:`~kvxfer.vllm.scheduler.SchedulerSide`,
the worker role to :class:`~kvxfer.vllm.worker.WorkerSide`; both are vLLM-free and tested
against fakes without vLLM installed. Loads are asynchronous (between scheduler steps):
``wait_for_layer_load`` and ``save_kv_layer`` do nothing, exports are of whole finished
requests.

vLLM 0.32/0.33 connector API points this connector answers explicitly:

* ``requires_kv_delivery``: True on a server that exports (``kv_producer``, ``kv_both``): a
  request preempted while its hand-off is pending is recomputed, never handed off from blocks
  the preemption freed.
* ``handle_preemptions``: nothing to do. Loads write blocks of requests waiting for their KV
  (never running, so never preempted) and exports read blocks of finished requests that vLLM
  keeps until ``get_finished`` reports them.
* ``request_finished``'s block ids: the scheduler clips them to the computed tokens, partial
  tail block included; the export covers exactly those (whole, for CPU_ATTN pages).
* Hybrid models: this connector declares ``SupportsHMA``, so vLLM 0.32/0.33 keep the hybrid
  KV cache manager on and hand it one block list per KV cache group
  (``request_finished_all_groups``, ``KVCacheBlocks.get_block_ids()``). Full-attention and
  sliding-window groups (Gemma-2/3, gpt-oss, an all-sliding Mistral-style model) are carried:
  every group registered with the engine (:mod:`kvxfer.vllm.groups`), a request is a set of
  groups (:mod:`kvxfer.grouped`), a sliding group moves only the blocks its window still
  needs (vLLM's null block stands for the others). A request whose window needs a block vLLM
  already freed is not handed off (P answers without ``kv_transfer_params``, naming why; D
  computes the prompt). State groups (``MambaSpec``: Mamba1/2 as in GraniteMoeHybrid, GDN as
  in Qwen3-Next, short conv) are carried too, with the N−1 flow: ``on_new_request`` truncates
  P's requests by one prompt token, so P's state is h(N−1) and D computes the last prompt token
  from it (:mod:`kvxfer.vllm.backoff`); the state page moves whole where P and D lay it out
  alike, else the engine re-shards each rank's units (same model and state dtypes required;
  the engines' handshake decides). With prefix caching on (vLLM's "align" mode) a state list
  is positional. Other group kinds (chunked local attention, linear attention/KDA) are refused
  at start by :class:`HybridModelUnsupported`, naming the group and why.
* ``get_loaded_kv_cache_group_ids``: every transfer group (a load writes the request's own
  blocks of every group, so vLLM must not zero them after allocating).
* Failed loads are reported by request too (``get_transfer_results``'s ``failed_recving``,
  vLLM 0.32+), not only as block ids: vLLM then fails (or recomputes) the request whatever its
  block table holds by then.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

try:  # vLLM 0.32+: the hybrid KV cache manager's per-group block ids
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:  # pragma: no cover - an older vLLM: one group only
    SupportsHMA = object

try:  # vLLM 0.32+: loads reported failed by request
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover - an older vLLM: failures are reported as block ids only
    KVConnectorTransferResults = None

from .config import ConnectorConfig
from .groups import HybridModelUnsupported, groups_from_config
from .logs import join_vllm_logging
from .scheduler import SchedulerSide
from .state import conv_layout_from_env
from .transfer_meta import ExportSpec, LoadSpec, TransferMeta
from .worker import COUNTERS, WorkerSide

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

_LOG = logging.getLogger(__name__)

__all__ = [
    "HybridModelUnsupported",
    "KvxferConnector",
    "KvxferConnectorMetadata",
    "KvxferHandshakeMetadata",
    "KvxferStats",
]


@dataclass
class KvxferConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step (see :class:`~kvxfer.vllm.transfer_meta.TransferMeta`)."""

    loads: list[LoadSpec] = field(default_factory=list)
    exports: list[ExportSpec] = field(default_factory=list)
    releases: list[dict] = field(default_factory=list)

    def as_meta(self) -> TransferMeta:
        return TransferMeta(self.loads, self.exports, self.releases)


@dataclass
class KvxferHandshakeMetadata(KVConnectorHandshakeMetadata):
    """Worker -> scheduler once after registration: the registered caches' block size and size."""

    block_size: int
    bytes_per_token: int
    tp_rank: int
    kv_layout: dict = field(default_factory=dict)


_SUMMED = (*COUNTERS, "busy_s", "latency_sum_s")  # summed over workers


@dataclass
class KvxferStats(KVConnectorStats):
    """kvxfer counters of the last interval, summed over workers; latency percentiles are the
    worst worker's (engine-lifetime percentiles)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KvxferStats:
        if not other.is_empty():
            if self.is_empty():
                self.data = dict(other.data)
            else:
                for k in _SUMMED:
                    self.data[k] = self.data.get(k, 0) + other.data.get(k, 0)
                for k in ("p50_s", "p90_s", "p99_s", "blocks_held"):
                    self.data[k] = max(self.data.get(k, 0), other.data.get(k, 0))
                self.data["transports"] = sorted(
                    set(self.data.get("transports", [])) | set(other.data.get("transports", []))
                )
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        busy = d.get("busy_s", 0.0)
        return {
            "kvxfer_transfers": d.get("transfers", 0),
            "kvxfer_failures": d.get("failures", 0),
            "kvxfer_expirations": d.get("expirations", 0),
            "kvxfer_bytes": d.get("bytes", 0),
            "kvxfer_onesided": d.get("onesided_loads", 0),  # of the transfers: read one-sided
            "kvxfer_GBps": d.get("bytes", 0) / busy / 1e9 if busy > 0 else 0.0,
            # the interval's loads: mean time from load() (start_load_kv) to landed
            "kvxfer_avg_ms": d.get("latency_sum_s", 0.0) / d["transfers"] * 1e3
            if d.get("transfers")
            else 0.0,
            "kvxfer_p50_ms": d.get("p50_s", 0.0) * 1e3,
            "kvxfer_p99_ms": d.get("p99_s", 0.0) * 1e3,
        }

    def is_empty(self) -> bool:
        return not self.data


def _window(group) -> str:
    """A KV cache group's attention window, described ("" for full attention or MLA)."""
    spec = getattr(group, "kv_cache_spec", group)
    for attr in ("sliding_window", "attention_chunk_size"):
        w = getattr(spec, attr, None)
        if w:
            return f"{attr.replace('_', ' ')} of {w} tokens ({type(spec).__name__})"
    return ""


def _cpu_platform() -> bool:
    """Whether vLLM runs on its CPU platform (its GDN kernels read SSM states as ``[h, K, V]``)."""
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    except Exception:  # pragma: no cover - a vLLM without it
        return False


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def _cpu_isa(vllm_config, layer_names, block_size: int) -> str | None:
    """The CPU attention ISA the layers use: set on each attention layer by vLLM's CPU
    metadata builder (``cpu_attn.py``) before the caches are registered; else vLLM's own
    selection for these settings; None (a warning) when neither answers."""
    ctx = getattr(vllm_config.compilation_config, "static_forward_context", None) or {}
    isas = {getattr(ctx.get(n), "isa", None) for n in layer_names} - {None}
    if len(isas) > 1:
        raise ValueError(f"CPU attention: layers use different ISAs {sorted(isas)}; kvxfer needs one")
    if isas:
        return str(isas.pop())
    mc = vllm_config.model_config
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return str(
            _get_attn_isa(mc.dtype, block_size, mc.get_head_size(), vllm_config.cache_config.cache_dtype)
        )
    except Exception as e:  # a vLLM without it: the layout cannot be paired (KVLayoutMismatch)
        _LOG.warning("kvxfer connector: could not find the CPU attention ISA (%s: %s)", type(e).__name__, e)
        return None


# vLLM 0.32's backends of state layers (``v1/attention/backends/{mamba1,mamba2,gdn,short_conv}
# _attn.py``): their layers are state groups, registered apart from the attention backend's
STATE_BACKENDS = frozenset(
    {"MAMBA1_ATTN", "MAMBA2_ATTN", "GDN_ATTN", "SHORT_CONV_ATTN", "PLE_SHORT_CONV_ATTN"}
)


def _backend_name(vllm_config) -> str:
    """The attention backend of every attention layer (state layers' backends aside)."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    names = sorted({b.get_name() for b in get_current_attn_backends(vllm_config)} - STATE_BACKENDS)
    if len(names) != 1:
        raise ValueError(f"attention backends: kvxfer needs one for all layers, got {names}")
    return names[0]


class KvxferConnector(KVConnectorBase_V1, SupportsHMA):
    """Disaggregated prefill/decode (and D->P reuse) over kvxfer; see ``docs/INTEGRATION.md``."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        join_vllm_logging()
        self.cfg = ConnectorConfig.from_vllm(vllm_config)
        model = getattr(getattr(vllm_config, "model_config", None), "model", "?")
        # every KV cache group (HybridModelUnsupported names one that cannot be carried); None:
        # one full-attention group, block ids as one list
        self.groups = groups_from_config(
            kv_cache_config,
            model,
            tp_size=self.cfg.tp_size,
            hf_config=getattr(getattr(vllm_config, "model_config", None), "hf_text_config", None),
            conv_layout=conv_layout_from_env(),
            gdn_ssm_transposed=_cpu_platform(),
        )
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if self.groups is not None:
            _LOG.info(
                "kvxfer connector: model %s, %d KV cache groups carried: %s",
                model,
                len(self.groups),
                ", ".join(g.describe() for g in self.groups),
            )
        if role == KVConnectorRole.SCHEDULER:
            groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
            window = _window(groups[0]) if groups else ""
            self.scheduler_side = SchedulerSide(self.cfg, window, self.groups)
        else:
            self.worker_side = WorkerSide(self.cfg, _tp_rank(), groups=self.groups)

    # ------------------------------------------------------------------ scheduler side
    def on_new_request(self, request: Request) -> None:
        """A model with state groups: truncate a P request by one prompt token (the N−1 flow)."""
        self.scheduler_side.on_new_request(request)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """Every transfer group: a load restores the request's own blocks of each of them."""
        ids = getattr(self._kv_cache_config, "transfer_group_ids", None)
        if ids is None:
            return super().get_loaded_kv_cache_group_ids(request)
        return tuple(ids)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        m = self.scheduler_side.build_connector_meta()
        return KvxferConnectorMetadata(m.loads, m.exports, m.releases)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        stats = getattr(connector_output, "kv_connector_stats", None)
        self.scheduler_side.update_connector_output(
            connector_output.finished_recving, stats.data if isinstance(stats, KvxferStats) else None
        )

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.groups is not None:  # a vLLM that kept one list: the groups need theirs
            return self.scheduler_side.request_finished(request, (block_ids,))
        return self.scheduler_side.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``SupportsHMA``: the request's block ids, one list per KV cache group."""
        if self.groups is None:  # one group: its list
            return self.scheduler_side.request_finished(request, block_ids[0] if block_ids else [])
        return self.scheduler_side.request_finished(request, block_ids)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        info = {r: vars(m) for r, m in metadata.items() if isinstance(m, KvxferHandshakeMetadata)}
        if info and self.scheduler_side is not None:
            self.scheduler_side.set_handshake(info)

    def get_finished_count(self) -> int | None:
        return None  # every worker reports every request it moved

    @property
    def requires_kv_delivery(self) -> bool:
        """True where this server exports: a request preempted with its hand-off pending is
        recomputed rather than handed off from freed blocks."""
        return self.cfg.exports

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return None  # any layout: kvxfer reads strides

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KvxferStats(data=dict(data) if data else {})

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        vc = self._vllm_config
        mc = vc.model_config
        backend = _backend_name(vc)
        isa = None
        state = {n for g in self.groups or () if g.is_state for n in g.layer_names}
        attn = {n: t for n, t in kv_caches.items() if n not in state}
        if backend == "CPU_ATTN" and attn:
            isa = _cpu_isa(vc, list(attn), next(iter(attn.values())).shape[2])
        self.worker_side.register(
            kv_caches,
            backend=backend,
            head_size=mc.get_head_size(),
            total_kv_heads=mc.get_total_num_kv_heads(),
            use_mla=bool(getattr(mc, "use_mla", False)),
            isa=isa,
            cache_dtype=str(getattr(vc.cache_config, "cache_dtype", "auto")),
        )

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Nothing to do: loads target waiting requests and exports finished ones, neither of
        which a preemption frees (see the module doc)."""
        return None

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        if self.worker_side is None or self.worker_side.engine is None:
            return None
        return KvxferHandshakeMetadata(**self.worker_side.handshake_info())

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, KvxferConnectorMetadata):
            self.worker_side.start(meta.as_meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous, between scheduler steps

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # exports are of finished requests, started by start_load_kv

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = self.worker_side.finished()
        return sending or None, recving or None

    if KVConnectorTransferResults is not None:

        def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
            """``get_finished``'s sets, and the failed loads by request (``failed_recving``)."""
            sending, recving = self.worker_side.finished()
            return KVConnectorTransferResults(
                finished_sending=set(sending),
                finished_recving=set(recving),
                failed_recving=self.worker_side.take_failed_loads(),
            )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.take_load_errors()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.worker_side is None:
            return None
        d = self.worker_side.stats_delta()
        return KvxferStats(data=d) if d else None

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.close()

    # vLLM 0.33 sleep mode: the engine keeps views of the caches, so it cannot follow a remap.
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return False
