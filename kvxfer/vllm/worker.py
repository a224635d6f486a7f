"""Worker side of the vLLM connector (no vLLM import): one :class:`kvxfer.TransferEngine` per
TP rank, driven by the scheduler side's :class:`~kvxfer.vllm.scheduler.TransferMeta`.

Each step: :meth:`WorkerSide.start` queues the step's loads, exports and releases; the
engine's ``poll()`` (one per step, in :meth:`finished`) starts them and reports what
completed. vLLM counts a request done when every worker (TP rank) reported it, so every
rank reports each of its loads and exports exactly once: a load that failed is reported as
finished together with its block ids (``kv_load_failure_policy`` then recomputes or fails
it), an export whose lease ended as finished sending (its blocks may be freed).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import torch

from ..engine import TransferEngine
from .config import ConnectorConfig
from .layout import caches_from_vllm
from .scheduler import TransferMeta, expand_block_ids

_LOG = logging.getLogger(__name__)

__all__ = ["WorkerSide"]

_COUNTERS = ("transfers", "bytes", "failures", "expirations", "finished_exports", "handshakes", "ops_calls")


class WorkerSide:
    """The worker half of ``KvxferConnector`` on one TP rank.

    Args:
        cfg: the connector configuration.
        tp_rank: this worker's TP rank.
        engine_factory: builds the engine (tests inject one); default :class:`TransferEngine`.
    """

    def __init__(
        self,
        cfg: ConnectorConfig,
        tp_rank: int,
        engine_factory: Callable[..., TransferEngine] = TransferEngine,
    ) -> None:
        self.cfg = cfg
        self.tp_rank = tp_rank
        self._factory = engine_factory
        self.engine: TransferEngine | None = None
        self.ratio = 1  # manager block -> kernel blocks
        self._loads: dict[str, list[int]] = {}  # loading request -> its manager block ids
        self._exported: set[str] = set()
        self._sending_done: set[str] = set()  # exports to report without the engine (refused)
        self._recving_done: set[str] = set()  # loads to report without the engine (refused)
        self._bad_blocks: set[int] = set()
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
    ) -> None:
        """Map vLLM's per-layer caches to kvxfer views and start this rank's engine."""
        if self.engine is not None:
            raise RuntimeError("register: caches are already registered")
        spec, views, names = caches_from_vllm(
            kv_caches,
            backend=backend,
            head_size=head_size,
            total_kv_heads=total_kv_heads,
            tp_size=self.cfg.tp_size,
            use_mla=use_mla,
        )
        if self.cfg.block_size % spec.block_size:
            raise ValueError(
                f"kv_caches: block dim {spec.block_size} does not divide vLLM's block_size {self.cfg.block_size}"
            )
        self.ratio = self.cfg.block_size // spec.block_size
        self.engine = self._factory(
            spec,
            views,
            self.tp_rank,
            self.cfg.tp_size,
            self.cfg.engine_id,
            host=self.cfg.host,
            transport=self.cfg.transport,
            lease_s=self.cfg.lease_s,
            port=self.cfg.base_port,
            timeout_s=self.cfg.timeout_s,
        ).start()
        _LOG.info(
            "kvxfer connector: engine %s rank %d/%d on %s:%d, %d layers (%s, %s), block %d, backend %s",
            self.cfg.engine_id,
            self.tp_rank,
            self.cfg.tp_size,
            self.cfg.host,
            self.cfg.base_port + self.tp_rank,
            len(names),
            "MLA" if use_mla else f"{spec.num_kv_heads} kv heads",
            spec.dtype,
            spec.block_size,
            backend,
        )

    def handshake_info(self) -> dict:
        """What the scheduler side needs to know about the registered caches."""
        eng = self._engine()
        return {
            "block_size": eng.spec.block_size,
            "bytes_per_token": eng.spec.bytes_per_token(),
            "tp_rank": self.tp_rank,
        }

    def _engine(self) -> TransferEngine:
        if self.engine is None:
            raise RuntimeError("kvxfer connector: register_kv_caches was not called")
        return self.engine

    # ----------------------------------------------------------------- per step
    def start(self, meta: TransferMeta) -> None:
        """Queue this step's exports, loads and releases (they run at the next poll)."""
        eng = self._engine()
        for ex in meta.exports:
            ids = expand_block_ids(ex.block_ids, self.ratio)
            try:
                eng.export(ex.request_id, ids, ex.num_tokens, token=ex.token or None)
                self._exported.add(ex.request_id)
            except ValueError as e:
                _LOG.warning("kvxfer: export of %s refused (%s); its blocks are freed", ex.request_id, e)
                self._sending_done.add(ex.request_id)
        for ld in meta.loads:
            try:
                eng.load(ld.request_id, ld.params, expand_block_ids(ld.block_ids, self.ratio))
                self._loads[ld.request_id] = list(ld.block_ids)
            except ValueError as e:
                _LOG.warning("kvxfer: load of %s refused (%s); reported failed", ld.request_id, e)
                self._recving_done.add(ld.request_id)
                self._bad_blocks.update(ld.block_ids)
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
            recving.add(rid)
        for rid in recving:
            self._loads.pop(rid, None)
        recving |= self._recving_done
        self._recving_done = set()
        return sending, recving

    def take_load_errors(self) -> set[int]:
        """Manager block ids of failed loads reported since the last call."""
        out, self._bad_blocks = self._bad_blocks, set()
        return out

    def stats_delta(self) -> dict | None:
        """Counters since the last call, plus the engine's latency percentiles (None if idle)."""
        if self.engine is None:
            return None
        s = self.engine.stats()
        out = {k: s[k] - self._last.get(k, 0) for k in _COUNTERS}
        out["busy_s"] = s["busy_s"] - self._last.get("busy_s", 0.0)
        self._last = {k: s[k] for k in (*_COUNTERS, "busy_s")}
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
