"""Calls the ops refuse by name before writing anything: caches whose elements share memory, a
wire sharing memory with the caches, float block ids or layers (never truncated), a source
spec that is not one, caches on a device the ops do not run on, ``dma=True`` where no copy
engine serves the caches, a batch within one cache reading a block it writes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvxfer import KVCacheSpec, ops, torch_ops
from kvxfer.backends import batch_copy

SPEC = KVCacheSpec(2, 2, 4, 4, torch.float16)  # 2 layers, 2 heads, head_dim 4, block 4 (NHD)
POISON = -3.0


def _caches(num_blocks: int = 6, fill: float = POISON) -> list[torch.Tensor]:
    return [torch.full((2, num_blocks, 4, 2, 4), fill, dtype=torch.float16) for _ in range(2)]


def _seeded(num_blocks: int = 6) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, num_blocks, 4, 2, 4, generator=g).to(torch.float16) for _ in range(2)]


def _untouched(caches, fill: float = POISON) -> bool:
    return all(bool((c == fill).all()) for c in caches)


def test_caches_whose_elements_share_memory_are_refused():
    flat = torch.full((2, 1, 4, 2, 4), POISON, dtype=torch.float16)
    expanded = [flat.expand(2, 3, 4, 2, 4)] * 2  # every block is the same memory
    wire = torch.zeros(SPEC.wire_shape(8), dtype=torch.float16)
    with pytest.raises(ValueError, match="share memory"):
        ops.register_caches(expanded, SPEC)
    with pytest.raises(ValueError, match="share memory"):
        ops.scatter_blocks(wire, expanded, SPEC, [0, 2], 8)
    assert bool((flat == POISON).all())


def test_a_wire_sharing_memory_with_the_caches_is_refused():
    caches = _caches()
    before = [c.clone() for c in caches]
    inside = caches[1].view(-1)[: int(np.prod(SPEC.wire_shape(4)))].view(SPEC.wire_shape(4))
    with pytest.raises(ValueError, match="wire: shares memory with the caches"):
        ops.scatter_blocks(inside, caches, SPEC, [2], 4)
    one_layer = caches[1].view(-1)[: int(np.prod(SPEC.wire_shape(4, num_layers=1)))]
    with pytest.raises(ValueError, match="out: shares memory with the caches"):  # layer 1 holds `out`
        ops.gather_blocks(
            caches, SPEC, [0], 4, out=one_layer.view(SPEC.wire_shape(4, num_layers=1)), layers=[0]
        )
    assert all(torch.equal(a, b) for a, b in zip(caches, before))
    reg = ops.register_caches(caches, SPEC)
    with pytest.raises(ValueError, match="shares memory"):
        ops.scatter_blocks(inside, reg, SPEC, [2], 4)  # registered: the same refusal


def test_float_block_ids_and_layers_are_refused_not_truncated():
    src = _seeded()
    with pytest.raises(ValueError, match="must hold integers"):
        torch_ops.gather_blocks(src, SPEC, [1.7], 4)
    with pytest.raises(ValueError, match="must hold integers"):
        torch_ops.gather_blocks(src, SPEC, np.array([0.99]), 4)
    with pytest.raises(ValueError, match="layers: must be a sequence of int layer indices"):
        ops.gather_blocks(src, SPEC, [1], 4, layers=[1.9])
    with pytest.raises(ValueError, match="layers"):
        ops.gather_blocks(src, SPEC, [1], 4, layers=[True])
    got = torch_ops.gather_blocks(src, SPEC, np.array([1], dtype=np.int32), 4)
    assert torch.equal(got, ops.gather_blocks(src, SPEC, [1], 4))  # integer arrays are ids
    assert torch.equal(
        ops.gather_blocks(src, SPEC, [1], 4, layers=[np.int64(1)]),
        ops.gather_blocks(src, SPEC, [1], 4, layers=[1]),
    )


def test_a_source_spec_that_is_not_one_is_named():
    src, dst = _seeded(), _caches()
    for bad in (None, {"num_layers": 2}):
        with pytest.raises(ValueError, match="src_spec: expected a KVCacheSpec"):
            ops.copy_blocks(src, bad, [0], dst, SPEC, [1], 4)
    assert _untouched(dst)


def test_caches_on_the_meta_device_are_refused_by_name():
    meta = [torch.empty(2, 6, 4, 2, 4, dtype=torch.float16, device="meta") for _ in range(2)]
    with pytest.raises(ValueError, match="on meta"):
        ops.register_caches(meta, SPEC)
    with pytest.raises(ValueError, match="on meta"):
        ops.gather_blocks(meta, SPEC, [0], 4)


@pytest.mark.skipif(batch_copy.serves_cpu(), reason="a batched copy serves CPU tensors here")
def test_dma_true_where_no_copy_engine_serves_the_caches_raises():
    src, dst = _seeded(), _caches()
    with pytest.raises(ValueError, match="dma=True: no batched copy for caches on cpu"):
        ops.copy_blocks(src, SPEC, [0, 1], dst, SPEC, [2, 3], 6, dma=True)
    with pytest.raises(ValueError, match="dma=True"):
        ops.gather_blocks(src, SPEC, [0], 3, dma=True)
    assert _untouched(dst)


def test_a_batch_within_one_cache_may_not_read_a_block_it_writes():
    """Whether block 1 is read before or after request 0 writes it would depend on how the batch
    is packed into kernel calls (request 0 filling its block or not)."""
    caches = ops.register_caches(_seeded(), SPEC)
    before = [c.clone() for c in caches]
    copy = ops.PreparedCopy(caches, caches)
    with pytest.raises(ValueError, match="block 1: read and written by one batch within one cache"):
        copy.batch([0, 1], [0, 1, 2], [1, 2], [0, 1, 2], [4, 4])
    assert all(torch.equal(a, b) for a, b in zip(caches, before))
    assert copy.batch([0, 1], [0, 1, 2], [4, 5], [0, 1, 2], [4, 4]) == 1  # disjoint: allowed
    for a, b in zip(caches, before):
        assert torch.equal(a[:, 4:6], b[:, 0:2]) and torch.equal(a[:, :4], b[:, :4])
    heads = ops.PreparedCopy(caches, caches, 0, 1, 1)  # head 0 onto head 1: never the same bytes
    heads.batch([0], [0, 1], [0], [0, 1], [4])
