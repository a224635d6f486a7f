"""Types shared by the engine's roles: queued loads and releases, block-id checks."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from . import idops
from .params import KVTransferParams
from .spec import KVCacheSpec

TICK_MS = 20


class HandshakeError(RuntimeError):
    """The remote engine cannot be reached or is incompatible (the message names why).
    ``answered``: addresses of the exporter ranks that accepted the request's token;
    ``refused``: an exporter rank refused the request's params (not the engine as a whole)."""

    answered: tuple[str, ...] = ()
    refused: bool = False


class Expired(TimeoutError):
    """A load's deadline passed before a step could start."""


def time_left(deadline: float) -> float:
    """Seconds to ``deadline`` (monotonic); :class:`Expired` when none are left."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise Expired("the load's deadline passed")
    return left


def full_layer_mask(num_layers: int) -> int:
    """Every layer as an int bit mask in wire bit order: layer ``i`` is bit ``i`` counted from
    the most significant bit of ``ceil(L / 8)`` big-endian bytes, so ``mask.to_bytes(n, "big")``
    is ``numpy.packbits`` of the layer flags (the ``want``/``layers`` fields of the grant
    messages). Ints, not numpy arrays: a small numpy op costs microseconds with a cold cache, and
    a load made about ten of them (profiling/results/2026-11-24-cpu-hostcost/)."""
    pad = -num_layers % 8
    return ((1 << num_layers) - 1) << pad


def mask_layers(mask: int, num_layers: int) -> list[int]:
    """The layer indices set in ``mask`` (see :func:`full_layer_mask`), ascending."""
    top = num_layers + (-num_layers % 8) - 1
    return [i for i in range(num_layers) if mask >> (top - i) & 1]


def compat_hash(spec: KVCacheSpec) -> str:
    d = spec.to_dict()
    return "|".join(str(d[k]) for k in ("use_mla", "num_layers", "num_kv_heads", "head_dim", "dtype"))


def describe_error(e: BaseException) -> str:
    """``"Type: message"`` of ``e``, with its notes (e.g. what else failed while a staged
    pipeline drained after it): the reason a failed request or a dropped pair reports."""
    notes = getattr(e, "__notes__", None)
    return f"{type(e).__name__}: {e}" + ("".join(f"; {n}" for n in notes) if notes else "")


def loaded_twice(request_id: str) -> str:
    """Why a load fails whose params (the remote's ``request_id``) another load of the same
    batch already reads: the messaged path's words, which the one-sided path uses too."""
    return f"params.request_id: {request_id!r} is loaded twice in one batch"


def disjoint_blocks(loads: list[LoadItem], block_size: int) -> bool:
    """Whether no local block that ``loads`` write is named by two of them (each load's own ids
    were checked for repeats at ``load()``; the blocks of a prefix this engine already holds,
    ``first // block_size`` of them, are not written and may be shared): then the destination
    ids of any ops call over them, block ids or token slots, repeat nothing either, and the ops
    may skip that check. One check of the block lists together (2K ids for eight 4K-token loads)
    where the ops would sort each call's ids (16x as many when they are token slots).
    False for n>1 siblings that share prefix blocks (their batch is deduped, and the ops check
    what is left) and for loads that really overlap (the ops then refuse the call, naming the
    repeated id). One native pass over a set (:func:`kvxfer.idops.any_repeat`)."""
    if len(loads) < 2:
        return True
    return not idops.any_repeat(
        [it.block_ids[it.first // block_size :] if it.first else it.block_ids for it in loads]
    )


def check_block_ids(x, need: int, num_blocks: int, what: str, unique: bool = False) -> np.ndarray:
    """The first ``need`` of block ids ``x`` (list/tuple of ints, int array or tensor) as a new
    int64 array, each in ``[0, num_blocks)`` and, with ``unique``, none repeated; ``ValueError``
    naming ``block_ids`` otherwise.

    A list or tuple takes one call (:func:`kvxfer.idops.ids_from_list`: one native loop that
    converts, bounds and, with ``unique``, checks repeats).
    """
    n = len(x) if isinstance(x, (list, tuple)) else None
    if n is not None:
        if n < need:
            raise ValueError(f"block_ids: num_tokens={what} needs {need} blocks, got {n}")
        return idops.ids_from_list(x, need, num_blocks, unique)
    else:
        t = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
        if t.dtype.kind not in "iu":
            raise ValueError(f"block_ids: must hold integers, got {t.dtype}")
        t = t.reshape(-1)
        if t.size < need:
            raise ValueError(f"block_ids: num_tokens={what} needs {need} blocks, got {t.size}")
        a = np.array(t[:need], dtype=np.int64).view(np.uint64)
    if need and int(a.max()) >= num_blocks:
        raise ValueError(f"block_ids: out of range [0, {num_blocks})")
    if unique and need > 1 and idops.any_repeat([a.view(np.int64)]):  # in range: none negative
        raise ValueError("block_ids: repeated block id")
    return a.view(np.int64)


class LoadItem:
    """One queued load (a plain slotted class: made per ``load()``). It is also the
    :class:`~kvxfer.batching.Item` the batch planner reads (``src``, ``dst``,
    ``num_tokens``, ``skip``, ``first``; read only): no per-load copy to plan a batch."""

    __slots__ = (
        "block_ids",
        "deadline",
        "dst",
        "first",
        "group_dst",
        "groups",
        "num_tokens",
        "params",
        "request_id",
        "skip",
        "src",
        "src_ids",
    )

    def __init__(
        self,
        request_id: str,
        params: KVTransferParams,
        block_ids: np.ndarray,
        deadline: float = 0.0,
        first: int = 0,
        group_dst: list | None = None,
    ) -> None:
        self.request_id = request_id
        self.params = params
        self.block_ids = block_ids  # local int64, exactly ceil(T / block_size)
        self.deadline = deadline  # monotonic: every wait of this load ends by then (set at dispatch)
        self.first = first  # tokens already held here (a partial load): pull [first, num_tokens)
        # An engine with KV cache groups (kvxfer.grouped): per group (positional local ids, first
        # token moved), from load(); ``block_ids`` is then every group's written ids and
        # ``first`` 0. ``groups``: the planner's items, one per group, made once the exporter's
        # block size is known (the loader's checks).
        self.group_dst = group_dst
        self.groups: list | None = None
        # the params' read-only ids seen as int64, no copy: unsigned, they were bounded by one
        # max() (the loader bounds them by the exporter's block count before it plans)
        self.src_ids: np.ndarray = params.block_id_array().view(np.int64)
        # as the planner's Item: block ids of both sides (the backends that hand ids to torch
        # copy the read-only source ids themselves: kvxfer.backends.base.ids_tensor)
        self.src, self.dst, self.num_tokens, self.skip = self.src_ids, block_ids, params.num_tokens, 0


@dataclass
class ReleaseItem:
    """A queued :meth:`TransferEngine.release`: ``params`` will never be loaded here.

    ``request_id`` is empty, never a load's id, so the worker's error path (which fails the
    queued loads by id) reports nothing for it.
    """

    params: KVTransferParams
    request_id: str = ""
    deadline: float = 0.0  # monotonic, set at dispatch like a load's
