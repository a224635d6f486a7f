"""What the vLLM connector's scheduler side hands its workers each step, and the block-id facts
both sides share (no vLLM import).

:class:`TransferMeta` carries one step's :class:`LoadSpec`, :class:`ExportSpec` and releases
(:class:`kvxfer.vllm.scheduler.SchedulerSide` fills it, :class:`kvxfer.vllm.worker.WorkerSide`
runs it); ``block_ids`` in them are vLLM's manager block ids, which :func:`expand_block_ids`
turns into kernel block ids, and in which :data:`NULL_BLOCK_ID` stands for a block out of a
sliding window.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "NULL_BLOCK_ID",
    "NULL_BLOCK_WHY",
    "ExportSpec",
    "LoadSpec",
    "TransferMeta",
    "expand_block_ids",
]

# vLLM's null block (BlockPool: the pool's first block, never a request's own). A sliding-window
# (or chunked-local) KV cache group puts it in place of each block out of its window.
NULL_BLOCK_ID = 0
NULL_BLOCK_WHY = (
    "block_ids: vLLM's null block (id 0) stands for blocks out of a sliding-window group's window; "
    "handing them off is not supported (moving the in-window blocks only is not done yet)"
)


def expand_block_ids(block_ids, ratio: int) -> list[int]:
    """Manager block ids -> kernel block ids when a manager block holds ``ratio`` kernel blocks
    (vLLM splits blocks a backend cannot take whole); the identity for ``ratio == 1``."""
    if ratio == 1:
        return list(block_ids)
    ids = np.asarray(block_ids, dtype=np.int64)
    return (ids[:, None] * ratio + np.arange(ratio)).reshape(-1).tolist()


@dataclass
class LoadSpec:
    """Load ``params`` (the exporter's, unmodified) into manager blocks ``block_ids`` of request
    ``request_id``; ``block_ids`` cover the whole request (a model of several KV cache groups:
    one positional list per group), and the first ``num_computed_tokens`` tokens (a local
    prefix-cache hit, a multiple of the block size) are neither pulled nor written.
    ``computed_tokens``: where sliding windows end (the exporter's valid tokens; 0: the
    params' ``num_tokens``)."""

    request_id: str
    params: dict
    block_ids: list
    num_computed_tokens: int = 0
    computed_tokens: int = 0


@dataclass
class ExportSpec:
    """Export the first ``num_tokens`` tokens of manager blocks ``block_ids`` as ``request_id``
    (for a whole-block layout, ``num_tokens`` is rounded up to whole kernel blocks)."""

    request_id: str
    block_ids: list  # manager ids; a model of several KV cache groups: one list per group
    num_tokens: int
    token: str = ""  # the params' token (kvxfer.auth): every worker's export is bound to it
    computed_tokens: int = 0  # where sliding windows end (0: num_tokens)


@dataclass
class TransferMeta:
    """What the scheduler side hands the workers for one step."""

    loads: list[LoadSpec] = field(default_factory=list)
    exports: list[ExportSpec] = field(default_factory=list)
    releases: list[dict] = field(default_factory=list)
