"""kvxfer's ops as torch custom ops (kvxfer/torch_ops.py): the same bytes as kvxfer.ops, poison
untouched, schemas and fake implementations that pass torch's opcheck, and a compiled graph
(fullgraph) that gathers and scatters as eager code does."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from kvxfer import KVCacheSpec, ops
from kvxfer import torch_ops as T

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn]
POISON = 0x5A


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _caches(spec: KVCacheSpec, num_blocks: int, tp: int, seed: int) -> list[torch.Tensor]:
    """Random bytes in every layer (each layer's seed differs: a wrong layer names itself)."""
    shape = spec.cache_shape(num_blocks, tp)
    nbytes = torch.Size(shape).numel() * spec.element_size
    out = []
    for layer in range(spec.num_layers):
        g = torch.Generator().manual_seed(seed * 100 + layer)
        raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
        out.append(raw.view(spec.dtype).view(shape))
    return out


def _poisoned(spec: KVCacheSpec, num_blocks: int, tp: int) -> list[torch.Tensor]:
    shape = spec.cache_shape(num_blocks, tp)
    nbytes = torch.Size(shape).numel() * spec.element_size
    return [
        torch.full((nbytes,), POISON, dtype=torch.uint8).view(spec.dtype).view(shape)
        for _ in range(spec.num_layers)
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["NHD", "HND", "MLA"])
def test_gather_scatter_ops_move_the_bytes_kvxfer_ops_move(dtype, layout):
    mla = layout == "MLA"
    spec = KVCacheSpec(3, 1 if mla else 4, 16, 4, dtype, "NHD" if mla else layout, use_mla=mla)
    src = _caches(spec, 12, 1, seed=1)
    ids, n = [7, 2, 9], 10  # a partial last block
    hs, nh = (0, None) if mla else (1, 2)
    want = ops.gather_blocks(src, spec, ids, n, hs, nh, layers=[2, 0])
    got = T.gather_blocks(src, spec, torch.tensor(ids, dtype=torch.int32), n, hs, nh, layers=[2, 0])
    assert got.shape == want.shape and torch.equal(_bytes(got), _bytes(want))

    full = T.gather_blocks(src, spec, ids, n)
    dst_ref, dst = _poisoned(spec, 12, 1), _poisoned(spec, 12, 1)
    ops.scatter_blocks(full, dst_ref, spec, [4, 11, 0], n)
    T.scatter_blocks(full, dst, spec, [4, 11, 0], n)
    for a, b in zip(dst, dst_ref, strict=True):
        assert torch.equal(_bytes(a), _bytes(b))
    untouched = [1, 2, 3, 5, 6, 7, 8, 9, 10]
    for t in dst:
        blocks = t if mla else t.transpose(0, 1)  # [blocks, ...]
        assert bool((_bytes(blocks[untouched]) == POISON).all())
        assert not bool((_bytes(blocks[[4, 11]]) == POISON).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e5m2], ids=str)
def test_copy_op_converts_layout_block_size_and_heads_into_poison(dtype):
    src_spec = KVCacheSpec(2, 4, 8, 16, dtype, "NHD")
    dst_spec = KVCacheSpec(2, 4, 8, 4, dtype, "HND")
    src = _caches(src_spec, 6, 1, seed=3)
    # 2 heads of a TP-1 source land at heads [0, 2) of a TP-2 destination (2 heads a rank)
    ref, got = _poisoned(dst_spec, 20, 2), _poisoned(dst_spec, 20, 2)
    ids_src, ids_dst, n = [5, 1], [19, 3, 7, 0, 12, 2, 8, 4], 29
    ops.copy_blocks(src, src_spec, ids_src, ref, dst_spec, ids_dst, n, 2, 0, 2)
    T.copy_blocks(src, src_spec, ids_src, got, dst_spec, ids_dst, n, 2, 0, 2)
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(_bytes(a), _bytes(b))
        assert bool((_bytes(a[:, [1, 5, 6, 9, 10, 11, 13]]) == POISON).all())
    wire = ops.gather_blocks(src, src_spec, ids_src, n, 2, 2)
    assert torch.equal(_bytes(ops.gather_blocks(got, dst_spec, ids_dst, n)), _bytes(wire))


def test_fake_gather_has_the_real_wire_shape():
    spec = KVCacheSpec(3, 8, 16, 4, torch.bfloat16, "HND")
    src = _caches(spec, 5, 2, seed=2)
    real = T.gather_blocks(src, spec, [4, 0], 7, 1, None, layers=[1])
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_src = [mode.from_tensor(t) for t in src]
        fake = T.gather_blocks(fake_src, spec, torch.tensor([4, 0]), 7, 1, None, layers=[1])
    assert (tuple(fake.shape), fake.dtype) == (tuple(real.shape), real.dtype)


def test_opcheck_passes_for_every_op():
    spec = KVCacheSpec(2, 4, 8, 4, torch.float16, "NHD")
    s = T.spec_arg(spec)
    # finite values: opcheck compares outputs with allclose, and random bytes hold NaNs
    src = [torch.randn(spec.cache_shape(8, 1)).half() for _ in range(2)]
    dst = [torch.zeros(spec.cache_shape(8, 1), dtype=torch.float16) for _ in range(2)]
    ids = torch.tensor([6, 1, 3])
    wire = ops.gather_blocks(src, spec, ids, 10)
    torch.library.opcheck(torch.ops.kvxfer.gather_blocks.default, (src, s, ids, 10, 1, 2, None, None, None))
    torch.library.opcheck(
        torch.ops.kvxfer.scatter_blocks.default,
        (wire, dst, s, torch.tensor([0, 2, 7]), 10, 0, None, None, None),
    )
    torch.library.opcheck(
        torch.ops.kvxfer.copy_blocks.default,
        (src, s, ids, dst, s, torch.tensor([5, 4, 0]), 10, 0, 0, None, [1], None, None),
    )


def test_a_compiled_graph_gathers_and_scatters_as_eager_code_does():
    spec = KVCacheSpec(2, 4, 8, 4, torch.float32, "NHD")
    src = _caches(spec, 8, 1, seed=5)
    src_ids, dst_ids = torch.tensor([6, 1, 3]), torch.tensor([2, 7, 4])

    def step(src, dst, x):
        wire = T.gather_blocks(src, spec, src_ids, 11)
        T.scatter_blocks(wire, dst, spec, dst_ids, 11)
        return x * 2, wire

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    x = torch.ones(3)
    dst_eager, dst_comp = _poisoned(spec, 8, 1), _poisoned(spec, 8, 1)
    (y_eager, w_eager), (y_comp, w_comp) = step(src, dst_eager, x), compiled(src, dst_comp, x)
    assert torch.equal(y_eager, y_comp) and torch.equal(_bytes(w_eager), _bytes(w_comp))
    for a, b in zip(dst_comp, dst_eager, strict=True):
        assert torch.equal(_bytes(a), _bytes(b))  # the scatter's mutation survives compilation
    assert not bool((_bytes(dst_comp[0][:, 2]) == POISON).all())


def test_copy_batch_op_moves_each_requests_bytes_eager_compiled_and_under_opcheck():
    """kvxfer::copy_blocks_batch (CSR: ids, indptr, tokens per request): the bytes of one
    ops.copy_blocks per request, also inside a fullgraph-compiled function; opcheck passes."""
    s_spec = KVCacheSpec(2, 4, 8, 4, torch.float32, "NHD")
    d_spec = KVCacheSpec(2, 4, 8, 8, torch.float32, "HND")
    src = [t.normal_() for t in _poisoned(s_spec, 10, 1)]  # finite values: opcheck compares them
    segs = [([3, 1], [4], 6), ([7, 0, 2], [0, 9], 9), ([5], [6], 3)]
    ref = _poisoned(d_spec, 10, 1)
    for s_ids, d_ids, n in segs:
        ops.copy_blocks(src, s_spec, s_ids, ref, d_spec, d_ids, n)
    s_ids = torch.tensor([i for s, _, _ in segs for i in s])
    d_ids = torch.tensor([i for _, d, _ in segs for i in d])
    s_ptr, d_ptr, tokens = torch.tensor([0, 2, 5, 6]), torch.tensor([0, 1, 3, 4]), torch.tensor([6, 9, 3])

    def step(src, dst, x):
        T.copy_blocks_batch(src, s_spec, s_ids, s_ptr, dst, d_spec, d_ids, d_ptr, tokens)
        return x + 1

    eager, comp = _poisoned(d_spec, 10, 1), _poisoned(d_spec, 10, 1)
    step(src, eager, torch.ones(2))
    torch._dynamo.reset()
    torch.compile(step, fullgraph=True, backend="aot_eager")(src, comp, torch.ones(2))
    for a, b, c in zip(eager, comp, ref, strict=True):
        assert torch.equal(_bytes(a), _bytes(c)) and torch.equal(_bytes(b), _bytes(c))
    dst = [torch.zeros_like(t) for t in ref]
    args = (src, T.spec_arg(s_spec), s_ids, s_ptr, dst, T.spec_arg(d_spec), d_ids, d_ptr, tokens)
    torch.library.opcheck(torch.ops.kvxfer.copy_blocks_batch.default, (*args, 0, 0, None, None, None, None))


def test_bad_arguments_are_named_before_anything_is_written():
    spec = KVCacheSpec(2, 4, 8, 4, torch.float16, "NHD")
    src = _caches(spec, 8, 1, seed=6)
    dst = _poisoned(spec, 8, 1)
    wire = ops.gather_blocks(src, spec, [1, 2], 8)
    with pytest.raises(ValueError, match=r"block id|out of range|block_ids"):
        T.scatter_blocks(wire, dst, spec, [1, 99], 8)
    with pytest.raises(ValueError, match="spec"):
        torch.ops.kvxfer.gather_blocks(src, "not json", torch.tensor([1]), 4, 0, None, None, None, None)
    with pytest.raises(ValueError, match="spec: must be a KVCacheSpec"):
        T.gather_blocks(src, {"num_layers": 2}, [1], 4)
    assert all(bool((_bytes(t) == POISON).all()) for t in dst)


def test_importing_kvxfer_registers_no_op():
    code = (
        "import torch, kvxfer, kvxfer.ops\n"
        "assert not hasattr(torch.ops.kvxfer, 'gather_blocks')\n"
        "import kvxfer.torch_ops\n"
        "assert hasattr(torch.ops.kvxfer, 'gather_blocks')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_ops_on_cuda_tensors_move_the_bytes_and_compile():
    """On a GPU: the ops (the default CUDA backend) byte-equal to the torch reference, and a
    fullgraph-compiled gather + scatter equal to eager code."""
    spec = KVCacheSpec(2, 8, 128, 16, torch.bfloat16, "HND")
    src = [t.cuda() for t in _caches(spec, 40, 1, seed=7)]
    ids, n = torch.tensor([37, 2, 11, 30]), 61
    want = ops.gather_blocks(src, spec, ids, n, 2, 4, backend="torch")
    got = T.gather_blocks(src, spec, ids, n, 2, 4)
    assert torch.equal(_bytes(got), _bytes(want))

    def step(src, dst):
        T.scatter_blocks(T.gather_blocks(src, spec, ids, n), dst, spec, torch.tensor([0, 5, 9, 3]), n)

    torch._dynamo.reset()
    eager, comp = [t.cuda() for t in _poisoned(spec, 10, 1)], [t.cuda() for t in _poisoned(spec, 10, 1)]
    step(src, eager)
    torch.compile(step, fullgraph=True, backend="aot_eager")(src, comp)
    torch.cuda.synchronize()
    for a, b in zip(comp, eager, strict=True):
        assert torch.equal(_bytes(a), _bytes(b))
    assert not bool((_bytes(comp[1][:, 9]) == POISON).all())
