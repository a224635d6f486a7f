"""kvxfer's paged ops as torch custom ops (``torch.ops.kvxfer.*``), so a model runner can call
them inside a graph ``torch.compile`` captures (``fullgraph=True``) or a CUDA graph records.

Importing this module registers four ops (importing :mod:`kvxfer` does not):

=================================  ==================================================  =========
op                                 arguments                                           writes
=================================  ==================================================  =========
``kvxfer::gather_blocks``          caches, spec, block_ids, num_tokens, head_start,    (returns
                                   num_heads, layers, backend, max_sms                 the wire)
``kvxfer::scatter_blocks``         wire, caches, spec, block_ids, num_tokens,          caches
                                   head_start, layers, backend, max_sms
``kvxfer::copy_blocks``            src_caches, src_spec, src_block_ids, dst_caches,    dst_caches
                                   dst_spec, dst_block_ids, num_tokens,
                                   src_head_start, dst_head_start, num_heads, layers,
                                   backend, max_sms
``kvxfer::copy_blocks_batch``      src_caches, src_spec, src_ids, src_indptr,          dst_caches
                                   dst_caches, dst_spec, dst_ids, dst_indptr,
                                   num_tokens, src_head_start, dst_head_start,
                                   num_heads, layers, backend, max_sms
=================================  ==================================================  =========

Each runs the function of the same name in :mod:`kvxfer.ops` (same checks, same kernels, same
bytes; the batch runs :meth:`kvxfer.ops.PreparedCopy.batch`: request ``i`` moves
``num_tokens[i]`` tokens from ``src_ids[src_indptr[i]:src_indptr[i + 1]]`` to the destination's
segment ``i``); a spec travels as its JSON string (:func:`spec_arg`) because an op's schema
takes no Python objects, and block ids as an int tensor. Each has a fake implementation: the gather's
says the wire's shape and dtype, the others write nothing a tracer must see beyond the declared
mutation. The Python wrappers below take a :class:`~kvxfer.spec.KVCacheSpec` and ids as
:func:`kvxfer.ops.gather_blocks` does, and call the op.

Under ``torch.compile`` the op is opaque: its arguments are checked when it runs, not at trace
time. Registered caches (:func:`kvxfer.ops.register_caches`) reach the op as plain tensor
lists, so the op re-derives what registration memoises (a few microseconds per call); the
engine calls :mod:`kvxfer.ops` directly.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence

import numpy as np
import torch

from . import ops
from .spec import KVCacheSpec, Layout

__all__ = ["copy_blocks", "copy_blocks_batch", "gather_blocks", "scatter_blocks", "spec_arg"]


@torch.compiler.assume_constant_result  # a tracer calls it once and keeps the string
def spec_arg(spec: KVCacheSpec) -> str:
    """The string form of ``spec`` the ops take (:meth:`KVCacheSpec.to_dict` as JSON)."""
    if not isinstance(spec, KVCacheSpec):
        raise ValueError(f"spec: must be a KVCacheSpec, got {type(spec).__name__}")
    return json.dumps(spec.to_dict(), sort_keys=True)


@functools.lru_cache(maxsize=256)
def _spec(s: str) -> KVCacheSpec:
    try:
        d = json.loads(s)
    except ValueError as e:
        raise ValueError(f"spec: not a kvxfer spec string ({e}); make one with spec_arg()") from None
    return KVCacheSpec.from_dict(d)


def _ids(block_ids) -> torch.Tensor:
    """Block ids as the int64 tensor the ops take: a tensor as it is (the op checks its dtype),
    else ints only (a float is refused, not truncated to a block id)."""
    if isinstance(block_ids, torch.Tensor):
        return block_ids
    if isinstance(block_ids, ops.CheckedIds):
        return torch.from_numpy(np.ascontiguousarray(block_ids.ids, dtype=np.int64))
    arr = np.asarray(block_ids if isinstance(block_ids, np.ndarray) else list(block_ids))
    if arr.size == 0:
        return torch.zeros(0, dtype=torch.int64)
    if arr.dtype.kind not in "iu":  # float, bool, object: not block ids
        raise ValueError(f"block_ids: must hold integers, got {arr.dtype} values")
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.int64))


def _local_heads(cache: torch.Tensor, spec: KVCacheSpec) -> int:
    if spec.use_mla:
        return 1
    return cache.shape[3] if spec.layout is Layout.NHD else cache.shape[2]


# --------------------------------------------------------------------------- gather
@torch.library.custom_op("kvxfer::gather_blocks", mutates_args=())
def _gather_op(
    caches: list[torch.Tensor],
    spec: str,
    block_ids: torch.Tensor,
    num_tokens: int,
    head_start: int,
    num_heads: int | None,
    layers: list[int] | None,
    backend: str | None,
    max_sms: int | None,
) -> torch.Tensor:
    return ops.gather_blocks(
        caches, _spec(spec), block_ids, num_tokens, head_start, num_heads, layers, None, backend, max_sms
    )


@_gather_op.register_fake
def _gather_fake(caches, spec, block_ids, num_tokens, head_start, num_heads, layers, backend, max_sms):
    sp = _spec(spec)
    if not caches:
        raise ValueError("caches: must be a non-empty list of per-layer tensors")
    heads = num_heads if num_heads is not None else _local_heads(caches[0], sp) - head_start
    num_layers = len(layers) if layers is not None else len(caches)
    return caches[0].new_empty(sp.wire_shape(num_tokens, heads, num_layers))


def gather_blocks(
    caches: Sequence[torch.Tensor],
    spec: KVCacheSpec,
    block_ids,
    num_tokens: int,
    head_start: int = 0,
    num_heads: int | None = None,
    layers: Sequence[int] | None = None,
    backend: str | None = None,
    max_sms: int | None = None,
) -> torch.Tensor:
    """:func:`kvxfer.ops.gather_blocks` through ``torch.ops.kvxfer.gather_blocks`` (shapes and
    arguments as there; no ``out``: the op returns a new wire tensor)."""
    return torch.ops.kvxfer.gather_blocks(
        list(caches),
        spec_arg(spec),
        _ids(block_ids),
        num_tokens,
        head_start,
        num_heads,
        None if layers is None else list(layers),
        backend,
        max_sms,
    )


# --------------------------------------------------------------------------- scatter
@torch.library.custom_op("kvxfer::scatter_blocks", mutates_args=("caches",))
def _scatter_op(
    wire: torch.Tensor,
    caches: list[torch.Tensor],
    spec: str,
    block_ids: torch.Tensor,
    num_tokens: int,
    head_start: int,
    layers: list[int] | None,
    backend: str | None,
    max_sms: int | None,
) -> None:
    ops.scatter_blocks(wire, caches, _spec(spec), block_ids, num_tokens, head_start, layers, backend, max_sms)


@_scatter_op.register_fake
def _scatter_fake(wire, caches, spec, block_ids, num_tokens, head_start, layers, backend, max_sms) -> None:
    return None


def scatter_blocks(
    wire: torch.Tensor,
    caches: Sequence[torch.Tensor],
    spec: KVCacheSpec,
    block_ids,
    num_tokens: int,
    head_start: int = 0,
    layers: Sequence[int] | None = None,
    backend: str | None = None,
    max_sms: int | None = None,
) -> None:
    """:func:`kvxfer.ops.scatter_blocks` through ``torch.ops.kvxfer.scatter_blocks``."""
    torch.ops.kvxfer.scatter_blocks(
        wire,
        list(caches),
        spec_arg(spec),
        _ids(block_ids),
        num_tokens,
        head_start,
        None if layers is None else list(layers),
        backend,
        max_sms,
    )


# --------------------------------------------------------------------------- copy
@torch.library.custom_op("kvxfer::copy_blocks", mutates_args=("dst_caches",))
def _copy_op(
    src_caches: list[torch.Tensor],
    src_spec: str,
    src_block_ids: torch.Tensor,
    dst_caches: list[torch.Tensor],
    dst_spec: str,
    dst_block_ids: torch.Tensor,
    num_tokens: int,
    src_head_start: int,
    dst_head_start: int,
    num_heads: int | None,
    layers: list[int] | None,
    backend: str | None,
    max_sms: int | None,
) -> None:
    ops.copy_blocks(
        src_caches,
        _spec(src_spec),
        src_block_ids,
        dst_caches,
        _spec(dst_spec),
        dst_block_ids,
        num_tokens,
        src_head_start,
        dst_head_start,
        num_heads,
        backend,
        layers,
        max_sms,
    )


@_copy_op.register_fake
def _copy_fake(
    src_caches,
    src_spec,
    src_block_ids,
    dst_caches,
    dst_spec,
    dst_block_ids,
    num_tokens,
    src_head_start,
    dst_head_start,
    num_heads,
    layers,
    backend,
    max_sms,
) -> None:
    return None


def copy_blocks(
    src_caches: Sequence[torch.Tensor],
    src_spec: KVCacheSpec,
    src_block_ids,
    dst_caches: Sequence[torch.Tensor],
    dst_spec: KVCacheSpec,
    dst_block_ids,
    num_tokens: int,
    src_head_start: int = 0,
    dst_head_start: int = 0,
    num_heads: int | None = None,
    layers: Sequence[int] | None = None,
    backend: str | None = None,
    max_sms: int | None = None,
) -> None:
    """:func:`kvxfer.ops.copy_blocks` through ``torch.ops.kvxfer.copy_blocks``."""
    torch.ops.kvxfer.copy_blocks(
        list(src_caches),
        spec_arg(src_spec),
        _ids(src_block_ids),
        list(dst_caches),
        spec_arg(dst_spec),
        _ids(dst_block_ids),
        num_tokens,
        src_head_start,
        dst_head_start,
        num_heads,
        None if layers is None else list(layers),
        backend,
        max_sms,
    )


# --------------------------------------------------------------------------- copy, a batch in CSR form
@torch.library.custom_op("kvxfer::copy_blocks_batch", mutates_args=("dst_caches",))
def _copy_batch_op(
    src_caches: list[torch.Tensor],
    src_spec: str,
    src_ids: torch.Tensor,
    src_indptr: torch.Tensor,
    dst_caches: list[torch.Tensor],
    dst_spec: str,
    dst_ids: torch.Tensor,
    dst_indptr: torch.Tensor,
    num_tokens: torch.Tensor,
    src_head_start: int,
    dst_head_start: int,
    num_heads: int | None,
    layers: list[int] | None,
    backend: str | None,
    max_sms: int | None,
) -> None:
    src = ops.PagedCache(src_caches, _spec(src_spec), "src_caches")
    dst = ops.PagedCache(dst_caches, _spec(dst_spec), "dst_caches")
    copy = ops.PreparedCopy(src, dst, src_head_start, dst_head_start, num_heads, layers, backend)
    copy.batch(src_ids, src_indptr, dst_ids, dst_indptr, num_tokens, max_sms)


@_copy_batch_op.register_fake
def _copy_batch_fake(
    src_caches,
    src_spec,
    src_ids,
    src_indptr,
    dst_caches,
    dst_spec,
    dst_ids,
    dst_indptr,
    num_tokens,
    src_head_start,
    dst_head_start,
    num_heads,
    layers,
    backend,
    max_sms,
) -> None:
    return None


def copy_blocks_batch(
    src_caches: Sequence[torch.Tensor],
    src_spec: KVCacheSpec,
    src_ids,
    src_indptr,
    dst_caches: Sequence[torch.Tensor],
    dst_spec: KVCacheSpec,
    dst_ids,
    dst_indptr,
    num_tokens,
    src_head_start: int = 0,
    dst_head_start: int = 0,
    num_heads: int | None = None,
    layers: Sequence[int] | None = None,
    backend: str | None = None,
    max_sms: int | None = None,
) -> None:
    """A batch of copies in CSR form (:meth:`kvxfer.ops.PreparedCopy.batch`: request ``i``
    moves its first ``num_tokens[i]`` tokens from ``src_ids[src_indptr[i]:src_indptr[i + 1]]``
    to ``dst_ids[dst_indptr[i]:dst_indptr[i + 1]]``) through ``torch.ops.kvxfer.copy_blocks_batch``.
    Shapes: ids ``[nnz]``, indptr ``[B + 1]``, ``num_tokens`` ``[B]`` (int tensors or sequences)."""
    torch.ops.kvxfer.copy_blocks_batch(
        list(src_caches),
        spec_arg(src_spec),
        _ids(src_ids),
        _ids(src_indptr),
        list(dst_caches),
        spec_arg(dst_spec),
        _ids(dst_ids),
        _ids(dst_indptr),
        _ids(num_tokens),
        src_head_start,
        dst_head_start,
        num_heads,
        None if layers is None else list(layers),
        backend,
        max_sms,
    )
