"""kvxfer: move the paged KV cache between prefill and decode engines.

Importing kvxfer does no CUDA work and needs no GPU; kernels, transports and the engine load
on first use.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

from .plan import Read, TransferPlan, plan_reads
from .spec import KVCacheSpec, Layout

__version__ = "0.1.0"

# Run from a source checkout (tests, benchmarks), the top-level kernels/ directory is
# kvxfer.kernels, as it is once installed (pyproject.toml maps it).
_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isfile(os.path.join(_root, "kernels", "__init__.py")) and os.path.isdir(
    os.path.join(_root, "csrc")
):
    __path__.append(_root)  # type: ignore[name-defined]

__all__ = [
    "CompletionAggregator",
    "KVCacheSpec",
    "KVTransferParams",
    "Layout",
    "Read",
    "TransferEngine",
    "TransferPlan",
    "__version__",
    "plan_reads",
]

# Heavier modules load on first attribute access (PEP 562), so `import kvxfer` stays cheap.
_LAZY = {
    "TransferEngine": "kvxfer.engine",
    "KVTransferParams": "kvxfer.params",
    "CompletionAggregator": "kvxfer.tracker",
}

if TYPE_CHECKING:  # pragma: no cover
    from .engine import TransferEngine
    from .params import KVTransferParams
    from .tracker import CompletionAggregator


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvxfer' has no attribute {name!r}")
