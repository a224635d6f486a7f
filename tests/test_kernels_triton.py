"""Triton kernels (kvxfer.kernels) against the torch reference and a plain-indexing expectation.

CPU: the kernels run in Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1 before triton loads when no GPU is visible). GPU: the same matrix on the
device, plus pinned-host wires and a no-host-sync check (``@pytest.mark.gpu``).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # tests/conftest.py does the same; here for single-file runs
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from kvxfer import KVCacheSpec, ops, plan_reads
from kvxfer import kernels as tk
from kvxfer.kernels import launch
from tests.triton_cases import (
    POISON,
    RUNNERS,
    Case,
    assert_bytes_equal,
    case_id,
    matrix,
    place,
    poisoned_caches,
    run_copy,
    run_gather,
    run_scatter,
    truth,
)

interp = pytest.mark.skipif(
    not launch.INTERPRETED,
    reason="CPU kernel tests need TRITON_INTERPRET=1 before triton loads (a GPU run uses the gpu tests)",
)
MATRIX = matrix()


# --------------------------------------------------------------------------- CPU (interpreter)
@interp
@pytest.mark.parametrize("item", MATRIX, ids=[case_id(i) for i in MATRIX])
def test_matrix_cpu(item):
    op, case = item
    RUNNERS[op](case, "cpu")


@interp
@pytest.mark.parametrize("op", list(RUNNERS))
def test_many_token_tiles(op, monkeypatch):
    """Several token tiles per row group, the last one partial (37 tokens, 16-token tiles)."""
    monkeypatch.setattr(launch, "_INTERP_MAX_BLOCK_T", 16)
    RUNNERS[op](Case(layout="HND", dst_layout="NHD", dst_block_size=32), "cpu")


@interp
@pytest.mark.parametrize("op", list(RUNNERS))
def test_long_request_default_tiles(op):
    """More tokens than one interpreter tile (1024): 2 tiles per row group."""
    case = Case(
        num_tokens=1100,
        head_dim=8,
        num_layers=1,
        layers=None,
        heads_local=1,
        head_start=0,
        num_heads=1,
        dtype=torch.int8,
        dst_block_size=32,
    )
    RUNNERS[op](case, "cpu")


class _CountingKernel:
    """Stands in for the jitted kernel and counts launches."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@interp
@pytest.mark.parametrize("op", list(RUNNERS))
def test_one_launch_per_call(op, monkeypatch):
    """Three layers x several blocks x two heads: still exactly one kernel launch."""
    counter = _CountingKernel(launch.move_rows_kernel)
    monkeypatch.setattr(launch, "move_rows_kernel", counter)
    RUNNERS[op](Case(num_tokens=70, layers=None, layout="NHD", dst_layout="HND"), "cpu")
    assert counter.launches == 1


@interp
@pytest.mark.parametrize(
    ("src_tp", "dst_tp", "num_heads"),
    [(1, 2, 4), (2, 1, 4), (1, 4, 4), (4, 1, 4), (2, 3, 6), (3, 2, 6), (4, 1, 2)],  # last: replicated
)
def test_tp_resharding(src_tp, dst_tp, num_heads):
    """Each destination rank gathers its plan's head slices from each source rank and scatters them."""
    spec = KVCacheSpec(num_layers=2, num_kv_heads=num_heads, head_dim=16, block_size=16, dtype=torch.bfloat16)
    dspec = KVCacheSpec(
        num_layers=2, num_kv_heads=num_heads, head_dim=16, block_size=32, dtype=torch.bfloat16, layout="HND"
    )
    T = 21
    full = truth(Case(num_layers=2, heads_local=num_heads, head_dim=16, num_tokens=T, layers=None))
    src_ids, dst_ids = [2, 0], [1]
    srcs = []
    for r in range(src_tp):
        heads = spec.heads_of_rank(r, src_tp)
        caches = poisoned_caches(spec, 3, len(heads), "cpu", 0)
        place(caches, spec, full[:, :, heads.start : heads.stop], src_ids, range(2), 0)
        srcs.append(caches)
    plan = plan_reads(spec, src_tp, dspec, dst_tp)
    for d in range(dst_tp):
        heads = dspec.heads_of_rank(d, dst_tp)
        dst = poisoned_caches(dspec, 2, len(heads), "cpu", 0)
        for rd in plan.reads(d):
            wire = ops.gather_blocks(
                srcs[rd.src_rank], spec, src_ids, T, rd.src_head_start, rd.num_heads, backend="triton"
            )
            ops.scatter_blocks(wire, dst, dspec, dst_ids, T, rd.dst_head_start, backend="triton")
        want = poisoned_caches(dspec, 2, len(heads), "cpu", 0)
        place(want, dspec, full[:, :, heads.start : heads.stop], dst_ids, range(2), 0)
        assert_bytes_equal(dst, want, f"dst rank {d} of tp {src_tp}->{dst_tp}")


@interp
def test_poison_value_is_distinct_from_payload_stamp():
    # The origin stamp of row (0, 0, 0, 0) is zeros; poison must differ for "untouched" to mean something.
    assert POISON not in (0, 1, 2)


# --------------------------------------------------------------------------- host-side logic
@pytest.mark.parametrize(
    ("row", "values", "word", "align"),
    [
        (256, [4096, 256, 2048, 1 << 20], 8, 16),  # aligned bf16 x 128: 8-byte words, 128-bit vectors
        (192, [384, 192 * 16, 1 << 20], 8, 16),  # head_dim 96 bf16
        (144, [144, 144 * 16, 1 << 20], 8, 16),  # head_dim 72 bf16
        (72, [72, 72 * 16, 1 << 20], 8, 8),  # head_dim 72 fp8: no 16-byte alignment
        (256, [4096, 256, (1 << 20) + 2], 2, 2),  # a base pointer only 2-byte aligned
        (5, [5, 80, 1 << 20], 1, 1),  # 5-byte rows: bytes
        (256, [4096, 256, (1 << 20) + 4], 4, 4),
    ],
)
def test_plan_word_and_alignment(row, values, word, align):
    p = launch.Plan(row, values, num_tokens=100, interpreted=False)
    assert (p.word_bytes, p.align, p.vec) == (word, align, align // word)
    assert p.row_words * p.word_bytes == row and p.block_w >= p.row_words


def test_plan_tiles():
    p = launch.Plan(256, [256], num_tokens=5000, interpreted=True)
    assert p.block_t == launch._INTERP_MAX_BLOCK_T
    p = launch.Plan(256, [256], num_tokens=5, interpreted=True)
    assert p.block_t == 8
    p = launch.Plan(256, [256], num_tokens=5000, interpreted=False)
    assert p.block_t * p.block_w * p.word_bytes == launch._GPU_TILE_BYTES


def test_tile_and_warp_overrides_for_the_sweep(monkeypatch):
    """$KVXFER_TRITON_TILE_BYTES / $KVXFER_TRITON_NUM_WARPS (read at import, for
    profiling/sweep_triton_tiles.py) take powers of two in range; anything else raises naming
    the variable. A plan's GPU tile follows the tile bytes and its warps the warp count."""
    env = "KVXFER_TRITON_TILE_BYTES"
    monkeypatch.delenv(env, raising=False)
    assert launch._env_pow2(env, 16384, 1024, 1 << 18) == 16384
    monkeypatch.setenv(env, "65536")
    assert launch._env_pow2(env, 16384, 1024, 1 << 18) == 65536
    for bad, why in (("3000", "power of two"), ("512", "power of two"), ("big", "not an integer")):
        monkeypatch.setenv(env, bad)
        with pytest.raises(ValueError, match=rf"\$KVXFER_TRITON_TILE_BYTES=.*{why}"):
            launch._env_pow2(env, 16384, 1024, 1 << 18)
    monkeypatch.setattr(launch, "_GPU_TILE_BYTES", 4096)
    monkeypatch.setattr(launch, "_GPU_NUM_WARPS", 16)  # not the default (8)
    p = launch.Plan(256, [256], num_tokens=5000, interpreted=False)
    assert p.block_t * p.block_w * p.word_bytes == 4096 and p.num_warps == 16


def test_is_available_matches_mode():
    assert tk.is_available(torch.device("cpu")) == launch.INTERPRETED
    assert tk.is_available(torch.device("meta")) is False
    if launch.INTERPRETED:
        assert tk.is_available(torch.device("cuda")) is False


# --------------------------------------------------------------------------- GPU
def gpu(fn):
    """``@pytest.mark.gpu``, and skipped without CUDA even where conftest.py is not loaded."""
    fn = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")(fn)
    return pytest.mark.gpu(fn)


@gpu
@pytest.mark.parametrize("item", MATRIX, ids=[case_id(i) for i in MATRIX])
def test_matrix_gpu(item):
    op, case = item
    RUNNERS[op](case, "cuda")


@gpu
@pytest.mark.parametrize("layout", ["NHD", "HND", "MLA"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
def test_pinned_host_wire_gpu(layout, dtype):
    """Gather into and scatter from a pinned host wire, written/read through its device address."""
    run_gather(Case(layout=layout, dtype=dtype), "cuda", pinned=True)
    run_scatter(Case(layout=layout, dtype=dtype, dst_block_size=32), "cuda", pinned=True)


@gpu
def test_no_host_sync_gpu():
    """Warm calls do not synchronise the host with the device."""
    case = Case(layout="HND", dst_layout="NHD", dst_block_size=32)
    for fn in (run_gather, run_scatter, run_copy):
        fn(case, "cuda")  # warm up: compile, cache the pointer tables
    from tests.triton_cases import Dest, Source

    src, dst = Source(case, "cuda"), Dest(case, "cuda")
    wire = torch.empty(src.spec.wire_shape(case.num_tokens, 2, 2), dtype=case.dtype, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.gather_blocks(
            src.caches, src.spec, src.ids, case.num_tokens, 1, 2, (2, 0), out=wire, backend="triton"
        )
        ops.scatter_blocks(wire, dst.caches, dst.spec, dst.ids, case.num_tokens, 0, (2, 0), backend="triton")
        ops.copy_blocks(
            src.caches,
            src.spec,
            src.ids,
            dst.caches,
            dst.spec,
            dst.ids,
            case.num_tokens,
            1,
            0,
            2,
            backend="triton",
            layers=(2, 0),
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def _num_compiled() -> int:
    """Compiled variants of the Triton kernel in this process (Triton 3.x keeps them per
    device in ``device_caches``: (kernel cache, ...))."""
    from kvxfer.kernels.rows import move_rows_kernel

    caches = getattr(move_rows_kernel, "device_caches", None)
    assert caches is not None, "this Triton keeps no device_caches: update the test's probe"
    return sum(len(entry[0]) for entry in caches.values())


@gpu
def test_warmup_leaves_no_request_size_to_compile_gpu():
    """After ``ops.warmup`` no request size compiles a Triton variant on the request path: the
    token tiles come in power-of-two buckets and warm-up covers every one of them, also the
    host-wire budget's capped variants of a gather into and scatter from pinned memory."""
    spec = KVCacheSpec(2, 8, 128, 16, torch.bfloat16, "NHD")
    caches = [torch.zeros(spec.local_cache_shape(600, 8), dtype=spec.dtype, device="cuda") for _ in range(2)]
    assert ops.warmup(caches, spec, backend="triton") == "triton"
    torch.cuda.synchronize()
    before = _num_compiled()
    for n in (1, 7, 17, 24, 33, 63, 100, 1000, 4096):
        nb = spec.num_blocks_for(n)
        wire = ops.gather_blocks(caches, spec, list(range(nb)), n, backend="triton")
        ops.scatter_blocks(wire, caches, spec, list(range(300, 300 + nb)), n, backend="triton")
        pinned = torch.empty(wire.shape, dtype=wire.dtype, pin_memory=True)
        ops.gather_blocks(caches, spec, list(range(nb)), n, out=pinned, backend="triton")
        ops.scatter_blocks(pinned, caches, spec, list(range(300, 300 + nb)), n, backend="triton")
        ops.copy_blocks(
            caches, spec, list(range(nb)), caches, spec, list(range(300, 300 + nb)), n, backend="triton"
        )
    torch.cuda.synchronize()
    assert _num_compiled() == before
