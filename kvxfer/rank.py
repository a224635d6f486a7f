"""One engine rank's shared state: what its exporter, loader, notifier and transports all read.

A :class:`~kvxfer.engine.TransferEngine` is a facade over role objects (an
:class:`~kvxfer.exporter.Exporter`, a :class:`~kvxfer.loader.Loader`, a
:class:`~kvxfer.notifier.Notifier`) and one object per transport
(:mod:`kvxfer.transports`). Each of them is handed this :class:`Rank`: the configuration
(spec, caches and their registered views, TP rank, address, bounds), the parts every role
shares (metrics, test hooks, stream ordering, the stop event, the completion trackers, the
engine secret and incarnation, the transports offered), and the arithmetic both sides of a
transfer use to find their caches (``views``, ``by_unit``, ``offset_views``: what
:func:`kvxfer.transports.batching.view_at` and :func:`~kvxfer.transports.batching.plan_loads`
take). It owns no thread and no socket, and imports nothing of the transports.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from .completion import LoadTracker
from .engine_types import compat_hash
from .exports import ExportTracker
from .metrics import Metrics
from .ordering import StreamOrder
from .spec import KVCacheSpec
from .views import CacheViews

__all__ = ["Rank"]


class Rank:
    """One engine rank as its parts see it (see the module doc).

    Set at construction: the configuration below (``pipeline``: the
    :class:`~kvxfer.transports.pg.pipeline.StagedPipeline`; ``views``: the registered
    :class:`~kvxfer.transports.batching.CacheView` s of ``caches``, whole blocks and token slots
    where the layout has them; ``identity``: this host, for the transport choice), ``metrics``,
    ``hooks`` (test hooks by name, each read where it is called), ``order`` (CUDA stream
    ordering), ``stop`` (set by ``close()``) and ``loads`` (the loads in flight). Set by ``start()``: ``ctx`` (the zmq context),
    ``port`` (rank 0's side-channel port), ``secret``, ``incarnation``, ``offers`` (the
    transports offered) and ``exports`` (the export tracker)."""

    def __init__(
        self,
        spec: KVCacheSpec,
        caches: Sequence[torch.Tensor],
        tp_rank: int,
        tp_size: int,
        engine_id: str,
        host: str,
        transport: str,
        lease_s: float,
        timeout_s: float,
        pipeline,
        views: CacheViews,
        num_blocks: int,
        device: torch.device,
        identity: str,
    ) -> None:
        self.spec = spec
        self.caches = list(caches)
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.engine_id = engine_id
        self.host = host
        self.transport = transport
        self.lease_s = lease_s
        self.timeout_s = timeout_s
        self.pipeline = pipeline
        self.views = views
        self.by_unit: dict = views.by_unit
        self.units: list[int] = views.units  # coarsest first
        self.num_blocks = num_blocks
        self.device = device
        self.metrics = Metrics()
        self.hooks: dict[str, object] = {}
        self.order = StreamOrder(device)
        self.stop = threading.Event()
        self.identity = identity
        self.loads = LoadTracker()
        self.ctx = None
        self.port = 0
        self.secret = None
        self.incarnation = ""
        self.offers: list[str] = []
        self.exports: ExportTracker | None = None
        self.onesided = False  # loads read one-sided over ipc when they can (set by the engine)

    def identity_fields(self) -> dict:
        """Who this rank is and what it speaks: the fields shared by ``Hello`` (as loader) and
        ``HelloReply`` (as exporter)."""
        return {
            "engine_id": self.engine_id,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "spec": self.spec.to_dict(),
            "compat": compat_hash(self.spec),
            "transports": list(self.offers),
            "hostname": self.identity,
        }
