"""Transfer plans between two engines, and the token <-> (block, offset) mapping.

A plan answers, for a source engine (spec, tp) and a destination engine (spec, tp):

* which source ranks each destination rank reads, and which head slice of each
  (:class:`Read`: source-local and destination-local head offsets, number of heads);
* which source ranks each destination rank notifies when a request has landed, and so how
  many notifications each source rank must receive before it frees a request's blocks.

Every source rank holds blocks for every request, so every source rank is notified at least
once, also the ones nobody reads (MLA, replicated GQA heads). Both sides compute the same plan
from the handshake, so the counts agree without being sent.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from .spec import KVCacheSpec

__all__ = [
    "RankPlan",
    "Read",
    "TransferPlan",
    "plan_reads",
    "token_block_index",
    "token_slots",
]


class Read(NamedTuple):
    """``num_heads`` heads read from ``src_rank``: source-local ``[src_head_start, +num_heads)``
    land at destination-local ``[dst_head_start, +num_heads)``."""

    src_rank: int
    src_head_start: int
    dst_head_start: int
    num_heads: int


class RankPlan:
    """What every plan of reads between a source and a destination engine answers. A subclass
    (a frozen dataclass) holds ``src_tp``, ``dst_tp``, ``_reads`` (per destination rank, reads
    with a ``src_rank``), ``_notify`` (per destination rank) and ``_expected`` (per source rank)."""

    def reads(self, dst_rank: int) -> list:
        """The reads destination rank ``dst_rank`` issues, in the plan's order."""
        self._check(dst_rank, self.dst_tp, "dst_rank")
        return list(self._reads[dst_rank])

    def notify_targets(self, dst_rank: int) -> list[int]:
        """Source ranks that ``dst_rank`` notifies once a request has landed on it."""
        self._check(dst_rank, self.dst_tp, "dst_rank")
        return list(self._notify[dst_rank])

    def expected_notifications(self, src_rank: int) -> int:
        """Notifications source rank ``src_rank`` must receive before freeing a request."""
        self._check(src_rank, self.src_tp, "src_rank")
        return self._expected[src_rank]

    def readers_of(self, src_rank: int) -> list[int]:
        """Destination ranks that read data from ``src_rank``."""
        self._check(src_rank, self.src_tp, "src_rank")
        return [d for d in range(self.dst_tp) if any(r.src_rank == src_rank for r in self._reads[d])]

    @staticmethod
    def _check(rank: int, size: int, name: str) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
            raise ValueError(f"{name}: must be in [0, {size}), got {rank!r}")


@dataclass(frozen=True)
class TransferPlan(RankPlan):
    """Who reads what from whom between a source and a destination engine (see module doc);
    its reads are ordered by destination head."""

    src_tp: int
    dst_tp: int
    use_mla: bool
    _reads: tuple[tuple[Read, ...], ...]
    _notify: tuple[tuple[int, ...], ...]
    _expected: tuple[int, ...]


def plan_reads(src_spec: KVCacheSpec, src_tp: int, dst_spec: KVCacheSpec, dst_tp: int) -> TransferPlan:
    """Plan a transfer from a ``src_tp``-rank engine to a ``dst_tp``-rank engine.

    Raises ``ValueError`` if the specs describe different models (layers, heads, head_dim,
    dtype, MLA) or a TP size cannot shard the heads. Layout and block size may differ.
    Plans are cached: calling again with the same arguments is a dictionary lookup.
    """
    mismatch = src_spec.model_mismatch(dst_spec)
    if mismatch:
        raise ValueError(f"incompatible peer: {mismatch}")
    src_spec.check_tp(src_tp)
    dst_spec.check_tp(dst_tp)
    return _plan_cached(src_spec, src_tp, dst_spec, dst_tp)


@functools.lru_cache(maxsize=256)
def _plan_cached(src_spec: KVCacheSpec, src_tp: int, dst_spec: KVCacheSpec, dst_tp: int) -> TransferPlan:
    num_heads = src_spec.num_kv_heads
    src_heads = [src_spec.heads_of_rank(s, src_tp) for s in range(src_tp)]
    holders: list[list[int]] = [[] for _ in range(num_heads)]
    for s, heads in enumerate(src_heads):
        for h in heads:
            holders[h].append(s)

    all_reads: list[tuple[Read, ...]] = []
    for d in range(dst_tp):
        dst_heads = dst_spec.heads_of_rank(d, dst_tp)
        reads: list[Read] = []
        for local, h in enumerate(dst_heads):
            cands = holders[h]
            # Spread destination ranks over the replicas of a replicated head.
            s = cands[d % len(cands)]
            src_local = h - src_heads[s].start
            last = reads[-1] if reads else None
            if (
                last is not None
                and last.src_rank == s
                and last.src_head_start + last.num_heads == src_local
                and last.dst_head_start + last.num_heads == local
            ):
                reads[-1] = last._replace(num_heads=last.num_heads + 1)
            else:
                reads.append(Read(s, src_local, local, 1))
        all_reads.append(tuple(reads))

    read_by = [set() for _ in range(src_tp)]
    for d, reads in enumerate(all_reads):
        for r in reads:
            read_by[r.src_rank].add(d)
    notify: list[set[int]] = [{r.src_rank for r in reads} for reads in all_reads]
    for s in range(src_tp):
        if not read_by[s]:  # nobody reads this rank, yet it holds the request's blocks
            notify[s % dst_tp].add(s)
    expected = tuple(sum(s in n for n in notify) for s in range(src_tp))
    return TransferPlan(
        src_tp=src_tp,
        dst_tp=dst_tp,
        use_mla=src_spec.use_mla,
        _reads=tuple(all_reads),
        _notify=tuple(tuple(sorted(n)) for n in notify),
        _expected=expected,
    )


def token_block_index(num_tokens: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For tokens ``0..num_tokens-1``: (index into the request's block list, offset in block).

    Both int64 tensors of length ``num_tokens``; the last block may be partial.
    """
    t = torch.arange(num_tokens, dtype=torch.int64)
    return t // block_size, t % block_size


def token_slots(block_ids, block_size: int, num_tokens: int) -> torch.Tensor:
    """Flat cache slot (``block_id * block_size + offset``) of each of ``num_tokens`` tokens.

    ``block_ids`` is the request's block list (ints, array or int tensor; at least
    ``ceil(num_tokens / block_size)`` of them); int64 CPU tensor of length ``num_tokens``.
    One numpy broadcast (a few µs for 4K tokens) rather than a chain of small torch ops.
    """
    if isinstance(block_ids, torch.Tensor):
        ids = block_ids.detach().cpu().numpy()
    else:
        ids = np.asarray(block_ids)
    need = -(-num_tokens // block_size)
    ids = ids[:need].astype(np.int64, copy=False)
    slots = (ids[:, None] * block_size + np.arange(block_size, dtype=np.int64)).reshape(-1)[:num_tokens]
    return torch.from_numpy(slots)
