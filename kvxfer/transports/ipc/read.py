"""The loader's ``ipc`` read: one fused copy from the exporter rank's cache, mapped in this
process (shared memory on CPU, CUDA IPC on a GPU), then one check of the block epochs.

A mixin of :class:`~kvxfer.loader.LoaderRole` (and so of the engine): it uses the engine's
caches, views, ordering and metrics.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from ... import idops, ops
from ...engine_types import Remote, time_left
from ...plan import Read
from ..batching import cache_views, view_at
from . import offer as choice


class IpcMap(NamedTuple):
    """An exporter rank's caches and epoch array, mapped in this process."""

    views: dict  # unit -> cache view (kvxfer.transports.cache_views)
    units: list[int]  # the units of ``views``, coarsest first
    epochs: torch.Tensor  # int64 [num_blocks], the exporter's, shared
    epochs_np: np.ndarray  # a numpy view of it (made once: ~10 us per read cold)
    handles: list  # for choice.detach
    memo: dict  # offset views made so far (kvxfer.transports.batching.view_at)


class IpcReads:
    """Methods of :class:`~kvxfer.engine.TransferEngine` that read over ``ipc``."""

    def _ipc_map(self, rem: Remote, s: int) -> IpcMap:
        """Source rank ``s``'s caches, mapped on first use (kept in ``rem.ipc``)."""
        got = rem.ipc.get(s)
        if got is None:
            caches, ep, handles = choice.attach(rem.replies[s].ipc, self.device)
            views = {v.unit: v for v in cache_views(caches, rem.spec)}
            got = rem.ipc[s] = IpcMap(views, list(views), ep, ep.numpy(), handles, {})
        return got

    def _ipc_read(
        self,
        rem,
        s,
        reads: list[Read],
        loads,
        granted: dict[str, bytes],
        deadline: float,
        layers: list[int] | None = None,
    ) -> tuple[int, set[str], dict[str, str]]:
        """Copy the plan's ``reads`` of source rank ``s`` (``layers``, default all) for ``loads``
        straight from its mapped caches, one ops call per batch call, then check the block
        epochs against the grant's (``granted``: local id -> int64 epochs, native bytes).
        Returns (wire bytes moved, the local ids that landed: copied, the copy completed and
        their epochs unchanged; local id -> why for the loads whose blocks were released
        meanwhile)."""
        mapped = self._ipc_map(rem, s)
        src_by_unit, memo = mapped.views, mapped.memo
        src_bs, dst_bs = rem.spec.block_size, self.spec.block_size
        bp = self._plan(loads, src_bs, mapped.units)
        moved = saved = 0
        # The ids were checked already (source: against the exporter's block count, on the
        # grant; destination: range and repeats, at load()): ops skips its own checks, and
        # still checks a call that carries several loads for repeats among them unless their
        # blocks are disjoint (the plan's ``distinct``).
        distinct = bp.distinct
        hook = self._hooks.get("before_ipc_copy")
        if hook:
            hook()
        for c in bp.calls:
            su, du = bp.units(c)
            sv = view_at(src_by_unit, su, c.src_offset, memo)
            dv = view_at(self._by_unit, du, c.dst_offset, self._offset_views)
            src_ids = ops.CheckedIds(c.src, rem.num_blocks * (src_bs // su), False)
            dst_ids = ops.CheckedIds(
                c.dst, self.num_blocks * (dst_bs // du), distinct or len(c.request_ids) == 1
            )
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
            m, sk = self._count(bp, r.num_heads, layers)
            moved, saved = moved + m, saved + sk
        calls = len(bp.calls) * len(reads)
        self._order.wait_done(time_left(deadline))  # CUDA: the copy ran before the epochs are re-read
        hook = self._hooks.get("after_ipc_copy")
        if hook:
            hook(mapped.epochs)
        # One epoch check, after the copy: epochs only grow, so it also catches blocks released
        # between the grant and the copy (a separate check before the copy cost ~15 us per
        # batch and only spared copying data that is then never delivered).
        bad = self._stale(mapped.epochs_np, loads, granted, s)
        self._metrics.record_ops(calls, saved)
        landed = {it.request_id for it in loads if it.request_id not in bad}
        return moved, landed, bad

    @staticmethod
    def _stale(ep: np.ndarray, loads, granted: dict[str, bytes], s: int) -> dict[str, str]:
        """Loads whose source blocks' epochs moved since the grant snapshot (``granted``: local
        id -> the grant's epochs, native int64 bytes) -> why."""
        why = f"exporter rank {s}: blocks released before or during the copy (lease ended); not delivered"
        if len(loads) == 1:  # one load: one compare, no lists
            it = loads[0]
            g = granted[it.request_id]
            if len(g) == 8 * it.src_ids.size and idops.unchanged(ep, it.src_ids, g):
                return {}
        out: dict[str, str] = {}
        ids_list, snaps, checked = [], [], []
        for it in loads:
            ids = it.src_ids
            g = granted[it.request_id]
            if len(g) != 8 * ids.size:  # the exporter grants only params naming its export's ids
                out[it.request_id] = f"exporter rank {s}: the grant covers other blocks than the params'"
                continue
            ids_list.append(ids)
            snaps.append(g)
            checked.append(it.request_id)
        for i in idops.moved(ep, ids_list, snaps) if checked else ():
            out[checked[i]] = why
        return out
