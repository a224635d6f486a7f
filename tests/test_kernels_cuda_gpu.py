"""CUDA C++ kernels on a real GPU: the host-shim matrix, pinned host wires, dispatch, NVRTC.

Skipped without a CUDA device or without CuPy (the backend's launcher).
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvxfer import ops
from kvxfer.backends import cuda
from kvxfer.spec import KVCacheSpec, Layout

sys.path.insert(0, str(Path(__file__).resolve().parent / "cuda_shim"))

from cases import Case, matrix, run_case

CASES = matrix()
PINNED = [replace(c, max_blocks=0) for c in CASES if c.op in ("gather", "scatter")][::3]

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def dev():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip(
        "cupy", reason="the CUDA backend launches through CuPy (pip install cupy-cuda12x or cupy-cuda13x)"
    )
    d = torch.device("cuda", torch.cuda.current_device())
    assert cuda.is_available(d), "CUDA device and CuPy present, but the kvxfer kernels did not load"
    return d


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_gpu_matrix(dev, case):
    run_case(case, dev, cuda)


@pytest.mark.parametrize("case", PINNED, ids=[c.id for c in PINNED])
def test_gpu_pinned_host_wire(dev, case):
    run_case(case, dev, cuda, pinned_wire=True)


def test_ops_dispatch_picks_the_first_of_the_cuda_order(dev):
    """backend=None runs Triton where it is available (the built-in order), else CUDA C++, or
    the first available backend of ``$KVXFER_CUDA_BACKENDS`` when it is set."""
    from kvxfer.backends import registry

    spec = KVCacheSpec(2, 4, 64, 16, torch.bfloat16, Layout.NHD)
    caches = [torch.randn(spec.local_cache_shape(8, 4), device=dev).to(torch.bfloat16) for _ in range(2)]
    wire = ops.gather_blocks(caches, spec, [5, 2, 7], 40)
    status = registry.backend_status(dev)
    want_backend = next(n for n in registry.cuda_order() if status[n]["available"])
    if registry.CUDA_ORDER_ENV not in os.environ:
        assert want_backend == ("triton" if status["triton"]["available"] else "cuda")
    assert ops.last_backend() == want_backend
    want = ops.gather_blocks(caches, spec, [5, 2, 7], 40, backend="torch")
    assert torch.equal(wire.view(torch.uint8), want.view(torch.uint8))


def test_gpu_grid_comes_from_the_occupancy_query(dev, caplog):
    """The persistent grid is sized by the driver's answer, not the fixed fallback: on the H200 of
    2026-11-26 the query read ``.ptr`` of a RawKernel (which has none), warned, and every launch
    ran 4 blocks per SM where 5 fit."""
    import functools

    index = cuda._index(dev)
    fresh = functools.cache(cuda._blocks_per_sm.__wrapped__)
    with caplog.at_level("WARNING", logger="kvxfer.backends.cuda"):
        fit = fresh(index)
    assert not [r.getMessage() for r in caplog.records if r.name == "kvxfer.backends.cuda"]
    # the register file (64 K per SM on sm_80/sm_90) bounds it from above; granularity only lowers it
    regs = max(cuda._kernels(index)[f"kvx_{op}_w16"].num_regs for op in ("gather", "scatter", "copy"))
    assert 1 <= fit <= 65536 // (cuda.THREADS * max(regs, 1)), (fit, regs)


def test_gpu_pinned_wire_gather_and_scatter_on_a_fresh_thread(dev):
    """The staged exporter gathers into pinned host memory on a thread whose first CUDA call
    that is, after the kernels were loaded on another thread. On an H200 (2026-11-26) that
    lookup answered device pointer 0 and the gather was refused; the address lookup now binds
    the device's context first. Element value: its flat index mod 251 + 256 x layer."""
    import threading

    spec = KVCacheSpec(2, 4, 64, 16, torch.bfloat16, Layout.NHD)
    shape = spec.local_cache_shape(8, 4)  # [KV, block, token, head, dim]
    n = 1
    for d in shape:
        n *= d
    caches = [  # element value: its flat index (mod 251) + 256 * layer, exact in bf16
        (torch.arange(n).remainder(251) + 256 * i).to(torch.bfloat16).view(shape).to(dev) for i in range(2)
    ]
    blocks, num_tokens = [5, 2, 7], 40
    want = ops.gather_blocks(caches, spec, blocks, num_tokens, backend="torch").cpu()
    wire = torch.full(want.shape, -7.0, dtype=want.dtype).pin_memory()
    back = [torch.full_like(c, -7.0) for c in caches]
    errors: list[BaseException] = []

    def fresh_thread():
        try:
            ops.gather_blocks(caches, spec, blocks, num_tokens, out=wire, backend="cuda")
            ops.scatter_blocks(wire, back, spec, blocks, num_tokens, backend="cuda")
            torch.cuda.current_stream(dev).synchronize()
        except BaseException as exc:  # re-raised on the test's thread below
            errors.append(exc)

    th = threading.Thread(target=fresh_thread, name="fresh-cuda-thread")
    th.start()
    th.join(60)
    assert not th.is_alive(), "the fresh thread's gather/scatter did not finish in 60 s"
    if errors:
        raise errors[0]
    assert torch.equal(wire.view(torch.uint8), want.view(torch.uint8))
    got = ops.gather_blocks(back, spec, blocks, num_tokens, backend="torch").cpu()
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    poison = torch.tensor(-7.0, dtype=torch.bfloat16, device=dev)
    for b in back:  # blocks not listed, and block 7's tokens past the 40th, stay untouched
        assert bool((b[:, [0, 1, 3, 4, 6]] == poison).all())
        assert bool((b[:, 7, num_tokens - 32 :] == poison).all())


def test_gpu_runs_on_torch_current_stream(dev):
    """Work queued on a side stream before the gather is seen by it without any host sync."""
    case = Case(op="gather", num_tokens=300, head_dim=128, src_heads=8, num_heads=8)
    spec = KVCacheSpec(3, 8, 128, 16, torch.bfloat16, Layout.NHD)
    caches = [torch.zeros(spec.local_cache_shape(32, 8), dtype=torch.bfloat16, device=dev) for _ in range(3)]
    ids = list(range(19))
    side = ops.make_side(caches, spec, ids, case.num_tokens)
    s = torch.cuda.Stream(dev)
    with torch.cuda.stream(s):
        torch.cuda._sleep(10_000_000)
        for c in caches:
            c.fill_(3.0)
        wire = torch.empty(side.wire_view_shape(), dtype=torch.bfloat16, device=dev)
        cuda.gather(side, wire)
    s.synchronize()
    assert bool((wire == 3.0).all())


def test_gpu_nvrtc_fallback(dev, monkeypatch):
    monkeypatch.setenv("KVXFER_CUDA_FORCE_NVRTC", "1")
    cuda._kernels.cache_clear()
    try:
        run_case(
            Case(op="copy", dtype="fp16", head_dim=3, layout="HND", dst_layout="NHD", src_bs=16, dst_bs=32),
            dev,
            cuda,
        )
    finally:
        cuda._kernels.cache_clear()
