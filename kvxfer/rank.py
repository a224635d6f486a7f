"""One engine rank: its configuration (:class:`Rank`, immutable) and what its parts share while
it runs (:class:`Runtime`).

A :class:`~kvxfer.engine.TransferEngine` is a facade over role objects (an
:class:`~kvxfer.exporter.Exporter`, a :class:`~kvxfer.loader.Loader`, a
:class:`~kvxfer.notifier.Notifier`) and one object per transport (:mod:`kvxfer.transports`).
Each of them is handed the :class:`Rank` (spec, caches and their registered views, TP rank,
address, bounds: fixed when the engine is made) and, where it needs them, the :class:`Runtime`
(counters, test hooks, stream ordering, the stop event, the trackers of loads and exports, the
engine secret and incarnation). Neither owns a thread or a socket, and neither imports anything
of the transports.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .completion import LoadTracker
from .engine_types import compat_hash
from .metrics import Metrics
from .ordering import StreamOrder
from .spec import KVCacheSpec
from .views import CacheViews

if TYPE_CHECKING:  # pragma: no cover
    from .auth import EngineSecret
    from .exports import ExportTracker
    from .groups.attention import GroupSet

__all__ = ["Rank", "Runtime"]


@dataclass(frozen=True, eq=False)
class Rank:
    """One engine rank's configuration, fixed when the engine is made.

    ``caches``: the rank's per-layer caches; ``views``: the same caches registered in each unit
    an ops call may name (:class:`~kvxfer.views.CacheViews`: whole blocks, and token slots where
    the layout has them); ``port``: the side channel's configured base port (0: a free one);
    ``pipeline``: the :class:`~kvxfer.transports.pg.pipeline.StagedPipeline` of the staged
    transports; ``identity``: this host, for the transport choice; ``onesided``: loads read
    one-sided over ``ipc`` when they can; ``groups``: the attention groups a request is a set of
    (:mod:`kvxfer.grouped`), None for one group."""

    spec: KVCacheSpec
    caches: tuple[torch.Tensor, ...]
    views: CacheViews
    tp_rank: int
    tp_size: int
    engine_id: str
    host: str
    port: int
    transport: str
    lease_s: float
    timeout_s: float
    pipeline: Any
    device: torch.device
    identity: str
    onesided: bool
    groups: GroupSet | None = None  # KV cache groups (kvxfer.grouped); None: one group

    @property
    def num_blocks(self) -> int:
        """Blocks of each layer's cache."""
        return self.views.num_blocks

    @property
    def units(self) -> list[int]:
        """The units an ops call may name this rank's caches in, coarsest first."""
        return self.views.units

    def identity_fields(self, offers: Sequence[str] = ()) -> dict:
        """Who this rank is and what it speaks (``offers``: the transports it offers now): the
        fields shared by ``Hello`` (as loader) and ``HelloReply`` (as exporter)."""
        return {
            "engine_id": self.engine_id,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "spec": self.spec.to_dict(),
            "compat": compat_hash(self.spec),
            "transports": list(offers),
            "hostname": self.identity,
            "groups": None if self.groups is None else self.groups.to_wire(),
            "states": None if self.groups is None else self.groups.states_wire(),
        }


class Runtime:
    """What an engine rank's parts share while it runs.

    Made with the engine: ``metrics``; ``hooks`` (test hooks by name, each read where it is
    called); ``order`` (CUDA stream ordering); ``stop`` (set by ``close()``); ``loads`` (the
    loads in flight). Set once by ``start()``: ``incarnation`` (this start's id), ``secret``
    (the engine secret) and ``exports`` (the export tracker)."""

    __slots__ = ("exports", "hooks", "incarnation", "loads", "metrics", "order", "secret", "stop")

    def __init__(self, device: torch.device) -> None:
        self.metrics = Metrics()
        self.hooks: dict[str, object] = {}
        self.order = StreamOrder(device)
        self.stop = threading.Event()
        self.loads = LoadTracker()
        self.incarnation = ""
        self.secret: EngineSecret | None = None
        self.exports: ExportTracker | None = None
