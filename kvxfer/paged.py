"""Registered caches and validated sides: what every op checks before anything is written.

:func:`register_caches` validates a rank's per-layer caches once (:class:`PagedCache`, also the
token-slot registration); :func:`make_side` validates one side of a transfer (caches, spec,
block ids, token count, head slice, layers) into the :class:`~kvxfer.backends.base.PagedSide`
the backends take; :class:`CheckedIds` carries ids their producer already checked. Each problem
raises ``ValueError`` naming it. :mod:`kvxfer.ops` re-exports the public names.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .backends import batch_copy as _batch_copy
from .backends import dma as _dma
from .backends.base import PagedSide
from .spec import KVCacheSpec, Layout

__all__ = [
    "MAX_SLOTS",
    "CheckedIds",
    "PagedCache",
    "as_block_ids",
    "check_caches",
    "check_layers_alike",
    "check_wire",
    "layer_list",
    "make_side",
    "path_stats",
    "register_caches",
    "side_and_info",
]

MAX_SLOTS = (1 << 31) - 1  # token slots of one registration: the kernels divide a slot in 32 bits


class CheckedIds:
    """Block ids their producer has already validated, passed where the ops take ``block_ids``.

    ``ids``: C-contiguous int64 numpy array, every id in ``[0, bound)``, and without repeats when
    ``unique``. An op trusts that and skips its own checks (a sort and a min/max per call) when
    ``bound`` is within the cache's block count and ``unique`` covers what the op needs (a destination);
    otherwise it checks the ids as it would any other. The engine makes them from ids it
    checked at ``load()`` / on the grant; a caller that wraps ids it did not check gets
    undefined behaviour, as with any unchecked index.
    """

    __slots__ = ("bound", "ids", "unique")

    def __init__(self, ids: np.ndarray, bound: int, unique: bool) -> None:
        self.ids, self.bound, self.unique = ids, bound, unique


_INT64 = np.dtype(np.int64)


def int_array(x, what: str, copy: bool = False) -> np.ndarray:
    """``x`` (a tensor or a sequence of ints) as a 1-D int64 numpy array; ``ValueError`` naming
    ``what`` when it holds no integers or has another number of dimensions. ``copy``: never a
    view of the caller's tensor (a sequence is always copied)."""
    if isinstance(x, torch.Tensor):
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise ValueError(f"{what}: must hold integers, got {x.dtype}")
        arr = x.detach().to("cpu", torch.int64).numpy()
        if copy:
            arr = arr.copy()
    else:
        try:
            arr = np.array(x, copy=True)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{what}: must be a sequence of ints ({e})") from None
        if arr.size == 0:
            arr = arr.astype(np.int64)
        if arr.dtype.kind not in "iu":
            raise ValueError(f"{what}: must hold integers, got {arr.dtype}")
        arr = arr.astype(np.int64, copy=False)
    if arr.ndim != 1:
        raise ValueError(f"{what}: must be 1-D, got shape {tuple(arr.shape)}")
    return arr


def as_block_ids(block_ids, num_blocks: int, needed: int, what: str, unique: bool) -> np.ndarray:
    """Validated C-contiguous int64 array of the first ``needed`` block ids."""
    if type(block_ids) is CheckedIds:
        c = block_ids
        ids = c.ids
        if (
            c.bound <= num_blocks
            and (c.unique or not unique)
            and ids.size >= needed
            and ids.dtype is _INT64
            and ids.flags.c_contiguous  # backends read the ids in place (the CPU one by address)
        ):
            return ids[:needed] if ids.size > needed else ids
        block_ids = ids  # not enough is known: checked (and made dense int64) like any other ids
    arr = int_array(block_ids, what)
    if arr.size < needed:
        raise ValueError(f"num_tokens: needs {needed} blocks, but {what} has {arr.size}")
    arr = arr[:needed]
    if needed:
        if unique and needed > 1:  # one sort gives the range and the repeats
            srt = np.sort(arr)
            lo, hi = int(srt[0]), int(srt[-1])
        else:
            srt = None
            lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= num_blocks:
            bad = lo if lo < 0 else hi
            raise ValueError(f"{what}: block id {bad} out of range [0, {num_blocks})")
        if srt is not None:
            dup = srt[1:] == srt[:-1]
            if dup.any():
                raise ValueError(f"{what}: repeated block id {int(srt[1:][dup][0])} in a destination")
    return np.ascontiguousarray(arr)


def check_layers_alike(caches, name: str) -> None:
    """Every layer of ``caches`` a tensor of layer 0's shape, strides, dtype and device."""
    first = caches[0]
    shape, stride = first.shape, first.stride()
    for i, c in enumerate(caches[1:], 1):
        if not isinstance(c, torch.Tensor):
            raise ValueError(f"{name}[{i}]: must be a tensor, got {type(c).__name__}")
        if c.shape != shape or c.stride() != stride:
            raise ValueError(
                f"{name}[{i}]: shape/strides {tuple(c.shape)}/{c.stride()} differ from layer 0's "
                f"{tuple(shape)}/{stride}"
            )
        if c.dtype != first.dtype:
            raise ValueError(f"{name}[{i}]: dtype {c.dtype} differs from layer 0's {first.dtype}")
        if c.device != first.device:
            raise ValueError(f"{name}[{i}]: device {c.device} differs from layer 0's {first.device}")


def self_overlapping(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory (a zero or too small stride: an
    ``expand``-ed or ``as_strided`` view). Strides taken smallest first, each must step past
    everything the smaller ones reach; a non-overlapping layout that interleaves its dims
    otherwise is refused too (as torch's own overlap test calls it too hard)."""
    reach = 0
    for st, sz in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1):
        if st <= reach:
            return True
        reach += st * (sz - 1)
    return False


def extent_bytes(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to past its last (non-negative strides)."""
    if t.numel() == 0:
        return 0
    return (sum((sz - 1) * st for st, sz in zip(t.stride(), t.shape)) + 1) * t.element_size()


def overlaps_caches(t: torch.Tensor, caches: Sequence[torch.Tensor]) -> bool:
    """Whether ``t``'s memory meets a layer of ``caches`` (on one device; the layers alike)."""
    if t.device != caches[0].device or t.numel() == 0:
        return False
    t0 = t.data_ptr()
    t1 = t0 + extent_bytes(t)
    memo = caches.__dict__ if type(caches) is PagedCache else None
    layers = memo.get("_layer_spans") if memo is not None else None
    if layers is None:  # (first, past the last) byte of each layer, and of them all
        ext = extent_bytes(caches[0])
        spans = [(p, p + ext) for p in (c.data_ptr() for c in caches)]
        layers = (min(a for a, _ in spans), max(b for _, b in spans), spans)
        if memo is not None:
            memo["_layer_spans"] = layers
    lo, hi, spans = layers
    return lo < t1 and t0 < hi and any(a < t1 and t0 < b for a, b in spans)


def _index(x) -> int:
    if isinstance(x, bool):
        raise TypeError("a bool is not a layer index")
    return operator.index(x)


def layer_list(layers, num_layers: int) -> list[int]:
    """``layers`` (None: all) as a checked list of distinct indices in ``[0, num_layers)``."""
    if layers is None:
        return list(range(num_layers))
    try:  # ints (numpy's too): a float is not truncated to a layer, a bool is not one
        out = [_index(x) for x in layers]
    except TypeError:
        raise ValueError(f"layers: must be a sequence of int layer indices, got {layers!r}") from None
    if not out:
        raise ValueError("layers: must not be empty")
    for x in out:
        if not 0 <= x < num_layers:
            raise ValueError(f"layers: layer {x} out of range [0, {num_layers})")
    if len(set(out)) != len(out):
        raise ValueError("layers: repeated layer index")
    return out


@dataclass(frozen=True)
class _CacheInfo:
    num_blocks: int
    heads_local: int
    layout: str
    strides: tuple[int, int, int, int]  # kv, block, token, head (elements)
    device: torch.device
    dtype: torch.dtype
    cuda: bool  # device.type == "cuda", kept: a device's .type is a torch call per op otherwise
    # The copy engines may move these tensors: CUDA ones, or others while a test's fake driver
    # serves CPU memory (:func:`kvxfer.backends.batch_copy.install_copier`), as of this check;
    # ops calls read it instead of asking per call.
    engines: bool
    slot_block: int = 1  # tokens per physical block when ids are token slots (register_caches)


class PagedCache(tuple):
    """One rank's per-layer caches, validated once against a spec (see :func:`register_caches`).

    A tuple of the layer tensors: pass it wherever the ops take ``caches`` and the per-layer
    checks are skipped (else they run per layer per call). ``max_sms``: the SM
    budget of every op on them (None: none); ``path_stats``: what those ops chose
    (:func:`path_stats`). ``spec``: the spec the ops take with these caches (with
    ``token_slots``, the registered spec with ``block_size=1``: the ids are token slots).
    """

    spec: KVCacheSpec
    info: _CacheInfo
    max_sms: int | None
    path_stats: _dma.PathStats

    def __new__(
        cls,
        caches: Sequence[torch.Tensor],
        spec: KVCacheSpec,
        name: str = "caches",
        max_sms: int | None = None,
        path_stats: _dma.PathStats | None = None,
        token_slots: bool = False,
    ) -> PagedCache:
        max_sms = _dma.check_max_sms(max_sms)
        if path_stats is not None and not isinstance(path_stats, _dma.PathStats):
            raise ValueError(f"path_stats: expected a PathStats or None, got {type(path_stats).__name__}")
        if type(token_slots) is not bool:
            raise ValueError(f"token_slots: must be True or False, got {token_slots!r}")
        info = check_caches(caches, spec, name)
        if token_slots and spec.block_size > 1:
            num_slots = info.num_blocks * spec.block_size
            if num_slots > MAX_SLOTS:
                raise ValueError(f"token_slots: {num_slots} slots in {name}, more than {MAX_SLOTS}")
            info = dataclasses.replace(info, num_blocks=num_slots, slot_block=spec.block_size)
            spec = dataclasses.replace(spec, block_size=1)
        self = super().__new__(cls, caches)
        self.spec, self.info, self.max_sms = spec, info, max_sms
        self.path_stats = path_stats if path_stats is not None else _dma.PathStats(max_sms)
        return self


def register_caches(
    caches: Sequence[torch.Tensor],
    spec: KVCacheSpec,
    max_sms: int | None = None,
    *,
    path_stats: _dma.PathStats | None = None,
    token_slots: bool = False,
) -> PagedCache:
    """Validate a rank's per-layer caches once; the result is accepted by every op.

    ``max_sms``: the SM budget every op on these caches runs under unless the call names its
    own (a positive int, or None for none; a copy between two registered caches takes the
    smaller). ``path_stats``: share one record of the chosen paths between several
    registrations of one engine's caches (its views); a fresh one by default.

    ``token_slots``: address tokens, not blocks. The ops then take one id per token, its slot
    ``block * block_size + offset`` (``[0, num_blocks * block_size)``), so a call may carry
    requests that end inside a block, any layout (an HND block cannot be re-viewed as token
    rows: only the kernels can address its slots), and the caches go with the spec
    ``result.spec`` (``block_size=1``); passing ``spec`` itself is refused. Such a call runs on
    the kernels, never the copy engines (a slot's rows are not block runs).
    """
    return PagedCache(caches, spec, max_sms=max_sms, path_stats=path_stats, token_slots=token_slots)


def path_stats(caches: PagedCache) -> dict:
    """What the ops on registered ``caches`` (and the registrations sharing their record) chose:
    ``{"max_sms", "dma", "kernel" (calls per path), "reasons" ("<op> <path>: <why>" -> calls),
    "last" (the latest choice with its details), "dma_path" (the driver's batched copy: on, or
    off and why)}``."""
    if not isinstance(caches, PagedCache):
        raise ValueError(f"caches: expected caches from register_caches, got {type(caches).__name__}")
    return caches.path_stats.snapshot()


def check_caches(caches: Sequence[torch.Tensor], spec: KVCacheSpec, name: str) -> _CacheInfo:
    if not isinstance(spec, KVCacheSpec):
        raise ValueError(f"spec: expected a KVCacheSpec, got {type(spec).__name__}")
    if isinstance(caches, torch.Tensor) or not isinstance(caches, Sequence):
        raise ValueError(f"{name}: must be a list of per-layer tensors")
    if len(caches) != spec.num_layers:
        raise ValueError(f"{name}: spec has {spec.num_layers} layers, got {len(caches)} tensors")
    first = caches[0]
    if not isinstance(first, torch.Tensor):
        raise ValueError(f"{name}[0]: must be a tensor, got {type(first).__name__}")
    ndim = 3 if spec.use_mla else 5
    if first.dim() != ndim:
        raise ValueError(f"{name}[0]: expected {ndim}-D cache, got shape {tuple(first.shape)}")
    if first.dtype != spec.dtype:
        raise ValueError(f"{name}[0]: dtype {first.dtype} does not match spec dtype {spec.dtype}")
    if spec.use_mla:
        num_blocks, bs, d = first.shape
        heads_local = 1
        layout = "MLA"
    elif spec.layout is Layout.NHD:
        two, num_blocks, bs, heads_local, d = first.shape
        layout = "NHD"
    else:
        two, num_blocks, heads_local, bs, d = first.shape
        layout = "HND"
    if not spec.use_mla and two != 2:
        raise ValueError(f"{name}[0]: first dim must be 2 (K, V), got shape {tuple(first.shape)}")
    if bs != spec.block_size:
        raise ValueError(f"{name}[0]: block_size {bs} does not match spec block_size {spec.block_size}")
    if d != spec.head_dim:
        raise ValueError(f"{name}[0]: head_dim {d} does not match spec head_dim {spec.head_dim}")
    if first.stride(-1) != 1:
        raise ValueError(f"{name}[0]: head_dim must be contiguous (stride 1), got {first.stride()}")
    if self_overlapping(first):
        raise ValueError(
            f"{name}[0]: shape/strides {tuple(first.shape)}/{first.stride()} make elements share "
            "memory (an expanded or as_strided view): a write to one would change another"
        )
    check_layers_alike(caches, name)
    stride = first.stride()
    if spec.use_mla:
        strides = (0, stride[0], stride[1], 0)
    elif layout == "NHD":
        strides = (stride[0], stride[1], stride[2], stride[3])
    else:
        strides = (stride[0], stride[1], stride[3], stride[2])
    device = first.device
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}[0]: on {device}; the ops move bytes of CPU and CUDA tensors")
    cuda = device.type == "cuda"
    engines = cuda or _batch_copy.serves_cpu()
    return _CacheInfo(num_blocks, heads_local, layout, strides, device, first.dtype, cuda, engines)


def make_side(
    caches: Sequence[torch.Tensor],
    spec: KVCacheSpec,
    block_ids,
    num_tokens: int,
    head_start: int = 0,
    num_heads: int | None = None,
    layers=None,
    unique_blocks: bool = False,
    name: str = "caches",
) -> PagedSide:
    """Validate one side of a transfer and describe it as a :class:`PagedSide`. A side of
    registered caches (:func:`register_caches`) carries the memo its backend keeps per head
    slice and layer set (:attr:`PagedSide.memo`)."""
    return side_and_info(
        caches, spec, block_ids, num_tokens, head_start, num_heads, layers, unique_blocks, name
    )[0]


def side_and_info(
    caches: Sequence[torch.Tensor],
    spec: KVCacheSpec,
    block_ids,
    num_tokens: int,
    head_start: int = 0,
    num_heads: int | None = None,
    layers=None,
    unique_blocks: bool = False,
    name: str = "caches",
) -> tuple[PagedSide, _CacheInfo]:
    """:func:`make_side`, and what checking ``caches`` found (the registration's, when they are
    registered), for the ops' dispatch (:attr:`_CacheInfo.engines`)."""
    registered = isinstance(caches, PagedCache) and (caches.spec is spec or caches.spec == spec)
    if registered:
        info = caches.info
    elif isinstance(caches, PagedCache) and caches.info.slot_block > 1:
        raise ValueError(
            f"{name}: registered with token_slots (ids are token slots), so they go with their "
            f"registration's spec (block_size 1), not one of block_size {spec.block_size}"
        )
    else:
        info = check_caches(caches, spec, name)
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens: must be a non-negative int, got {num_tokens!r}")
    heads_local = info.heads_local
    if num_heads is None:
        num_heads = heads_local - head_start
    for field, v in (("head_start", head_start), ("num_heads", num_heads)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{field}: must be an int, got {v!r}")
    if head_start < 0 or num_heads < 1 or head_start + num_heads > heads_local:
        raise ValueError(
            f"head_start/num_heads: [{head_start}, {head_start + num_heads}) is not within the "
            f"{heads_local} heads on this rank"
        )
    if layers is None:
        selected, memo_key = tuple(caches), (head_start, num_heads, None)
    else:
        picked = layer_list(layers, spec.num_layers)
        selected, memo_key = tuple(caches[i] for i in picked), (head_start, num_heads, tuple(picked))
    memo = _memo_of(caches, memo_key) if registered else None
    ids_name = name.replace("caches", "block_ids")
    ids = as_block_ids(block_ids, info.num_blocks, spec.num_blocks_for(num_tokens), ids_name, unique_blocks)
    return PagedSide(
        caches=selected,
        block_ids=ids,
        num_tokens=num_tokens,
        block_size=spec.block_size,
        num_blocks=info.num_blocks,
        head_start=head_start,
        num_heads=num_heads,
        head_dim=spec.head_dim,
        num_kv=spec.num_kv,
        stride_kv=info.strides[0],
        stride_block=info.strides[1],
        stride_token=info.strides[2],
        stride_head=info.strides[3],
        layout=info.layout,
        memo=memo,
        slot_block=info.slot_block,
    ), info


def _memo_of(caches: PagedCache, key: tuple) -> dict:
    """The backends' memo of registered ``caches`` for one (head_start, num_heads, layers)."""
    memos = caches.__dict__.get("_memos")
    if memos is None:
        memos = caches.__dict__["_memos"] = {}
    got = memos.get(key)
    if got is None:
        got = memos[key] = {}
    return got


def check_wire(
    wire: torch.Tensor, side: PagedSide, spec: KVCacheSpec, name: str, caches: Sequence[torch.Tensor] = ()
) -> None:
    """``wire`` as a call on ``side`` needs it; it shares no memory with ``caches`` (every layer of
    the side's caches: a gather writing it would change the cache, a scatter reading it as it
    writes would read bytes it wrote)."""
    if not isinstance(wire, torch.Tensor):
        raise ValueError(f"{name}: must be a tensor, got {type(wire).__name__}")
    want = spec.wire_shape(side.num_tokens, side.num_heads, side.num_layers)
    if tuple(wire.shape) != want:
        raise ValueError(f"{name}: expected wire shape {want}, got {tuple(wire.shape)}")
    if wire.dtype != side.dtype:
        raise ValueError(f"{name}: dtype {wire.dtype} does not match cache dtype {side.dtype}")
    if not wire.is_contiguous():
        raise ValueError(f"{name}: wire tensor must be contiguous")
    if overlaps_caches(wire, caches or side.caches):
        raise ValueError(f"{name}: shares memory with the caches (a wire must be a buffer of its own)")
    if wire.device != side.device:
        pinned_host = side.device.type == "cuda" and wire.device.type == "cpu" and wire.is_pinned()
        if not pinned_host:
            raise ValueError(
                f"{name}: on {wire.device}, caches on {side.device} (a CPU wire for CUDA caches "
                "must be pinned)"
            )
