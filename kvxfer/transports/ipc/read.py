"""The loader's ``ipc`` read: one fused copy from the exporter rank's cache, mapped in this
process (shared memory on CPU, CUDA IPC on a GPU), then one check of the block epochs
(:mod:`kvxfer.transports.epochs`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from ... import ops
from ...batching import plan_loads, wire_bytes
from ...engine_types import Remote, time_left
from ...plan import Read
from ...views import CacheViews
from ..epochs import stale_loads
from . import offer

if TYPE_CHECKING:  # pragma: no cover
    from ...rank import Rank, Runtime

__all__ = ["IpcMap", "launch", "map_rank", "read"]


class IpcMap(NamedTuple):
    """An exporter rank's caches and epoch array, mapped in this process."""

    views: CacheViews  # the exporter's caches, registered in each unit
    epochs: torch.Tensor  # int64 [num_blocks], the exporter's, shared
    epochs_np: np.ndarray  # a numpy view of it (made once, not per read)
    handles: list  # for offer.detach


def map_rank(rem: Remote, s: int, device: torch.device) -> IpcMap:
    """Map source rank ``s`` of ``rem`` (its handshake's ``ipc`` entry) in this process."""
    caches, ep, handles = offer.attach(rem.replies[s].ipc, device)
    return IpcMap(CacheViews(caches, rem.spec), ep, ep.numpy(), handles)


def launch(
    rank: Rank,
    mapped: IpcMap,
    rem: Remote,
    reads: list[Read],
    loads,
    layers: list[int] | None = None,
) -> tuple[int, int, int]:
    """Issue the copies of the plan's ``reads`` (``layers``, default all) for ``loads`` straight
    from ``mapped`` caches, one ops call per batch call and read, on the current stream (CUDA:
    queued, not waited for). Returns (wire bytes moved, bytes a repeated block saved, ops calls)."""
    src, dst = mapped.views, rank.views
    src_bs, dst_bs = rem.spec.block_size, rank.spec.block_size
    bp = plan_loads(rank, loads, src_bs, src.units)
    moved = saved = 0
    # The ids were checked already (source: against the exporter's block count, on the
    # grant; destination: range and repeats, at load()): ops skips its own checks, and
    # still checks a call that carries several loads for repeats among them unless their
    # blocks are disjoint (the plan's ``distinct``).
    distinct = bp.distinct
    for c in bp.calls:
        su, du = bp.units(c)
        sv = src.at(su, c.src_offset)
        dv = dst.at(du, c.dst_offset)
        src_ids = ops.CheckedIds(c.src, rem.num_blocks * (src_bs // su), False)
        dst_ids = ops.CheckedIds(c.dst, rank.num_blocks * (dst_bs // du), distinct or len(c.request_ids) == 1)
        for r in reads:
            ops.copy_blocks(
                sv.caches,
                sv.spec,
                src_ids,
                dv.caches,
                dv.spec,
                dst_ids,
                c.num_tokens,
                r.src_head_start,
                r.dst_head_start,
                r.num_heads,
                layers=layers,
            )
    for r in reads:
        m, sk = wire_bytes(rank.spec, bp, r.num_heads, layers)
        moved, saved = moved + m, saved + sk
    return moved, saved, len(bp.calls) * len(reads)


def read(
    rank: Rank,
    rt: Runtime,
    mapped: IpcMap,
    rem: Remote,
    s: int,
    reads: list[Read],
    loads,
    granted: dict[str, bytes],
    deadline: float,
    layers: list[int] | None = None,
) -> tuple[int, set[str], dict[str, str]]:
    """Copy the plan's ``reads`` of source rank ``s`` (``layers``, default all) for ``loads``
    straight from its ``mapped`` caches (:func:`launch`), wait for the copy, then check the
    block epochs against the grant's (``granted``: local id -> int64 epochs, native bytes).
    Returns (wire bytes moved, the local ids that landed: copied, the copy completed and their
    epochs unchanged; local id -> why for the loads whose blocks were released meanwhile)."""
    hook = rt.hooks.get("before_ipc_copy")
    if hook:
        hook()
    moved, saved, calls = launch(rank, mapped, rem, reads, loads, layers)
    rt.order.wait_done(time_left(deadline))  # CUDA: the copy ran before the epochs are re-read
    hook = rt.hooks.get("after_ipc_copy")
    if hook:
        hook(mapped.epochs)
    # One epoch check, after the copy: epochs only grow, so it also catches blocks released
    # between the grant and the copy (a separate check before the copy cost ~15 us per batch
    # and only spared copying data that is then never delivered).
    bad = stale_loads(mapped.epochs_np, loads, granted, s)
    rt.metrics.record_ops(calls, saved)
    landed = {it.request_id for it in loads if it.request_id not in bad}
    return moved, landed, bad
