"""kvxfer: move the paged KV cache between prefill and decode engines.

Importing kvxfer does no CUDA work and needs no GPU; kernels, transports and the engine load
on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .plan import Read, TransferPlan, plan_reads
from .spec import KVCacheSpec, Layout

__version__ = "0.1.0"

__all__ = [
    "AttentionGroup",
    "CompletionAggregator",
    "KVCacheSpec",
    "KVTransferParams",
    "Layout",
    "Read",
    "StateGroup",
    "StateSpec",
    "TransferEngine",
    "TransferPlan",
    "__version__",
    "alloc_shm_caches",
    "plan_reads",
]

# Heavier modules load on first attribute access (PEP 562), so `import kvxfer` stays cheap.
_LAZY = {
    "TransferEngine": "kvxfer.engine",
    "KVTransferParams": "kvxfer.params",
    "CompletionAggregator": "kvxfer.completion",
    "alloc_shm_caches": "kvxfer.transports.ipc.shm",
    "AttentionGroup": "kvxfer.groups",
    "StateGroup": "kvxfer.groups",
    "StateSpec": "kvxfer.groups",
}

if TYPE_CHECKING:  # pragma: no cover
    from .completion import CompletionAggregator
    from .engine import TransferEngine
    from .groups import AttentionGroup, StateGroup, StateSpec
    from .params import KVTransferParams
    from .transports.ipc.shm import alloc_shm_caches


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvxfer' has no attribute {name!r}")
