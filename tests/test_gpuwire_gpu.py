"""GPU transports through the engine (skipped without CUDA; run on a lent GPU machine):
CUDA IPC between two processes sharing one GPU, staged pg through pinned host buffers,
stream ordering, and NCCL staging between two GPUs."""

from __future__ import annotations

import time

import pytest
import torch

from kvxfer import KVCacheSpec, TransferEngine, ops

from .engine_payload import check, fill, payload, poison, untouched
from .test_engine_procs import CASES, _aggregate, _run, _scenario

pytestmark = pytest.mark.gpu


def _gpu_scenario(case, transport, lengths, **kw):
    src, src_tp, dst, dst_tp = CASES[case]
    sc = _scenario(src, src_tp, dst, dst_tp, transport, lengths, seed=case, **kw)
    sc["device"] = "cuda:0"
    return sc, src_tp, dst_tp


def _assert_all_landed(res, sc, src_tp, dst_tp, transport):
    want = {r[0] for r in sc["requests"]}
    for r in range(dst_tp):
        d = res[f"D{r}"]
        assert d["ok"] == dict.fromkeys(want, True), [p["errors"] for p in d["polls"] if p["errors"]]
        assert d["untouched"]
        assert d["stats"]["transports"] == {"P": transport}, d["stats"]["transport_reasons"]
        assert d["stats"]["failures"] == 0
    assert sorted(_aggregate(res, "D", dst_tp)) == sorted(want)
    assert sorted(_aggregate(res, "P", src_tp)) == sorted(want)
    for r in range(src_tp):
        assert res[f"P{r}"]["stats"]["blocks_held"] == 0


@pytest.mark.parametrize("case", range(len(CASES)))
def test_cuda_ipc_between_processes_one_gpu(case):
    """P and D processes on one GPU: D maps P's cache allocations (CUDA IPC handles) and one
    copy kernel per (batch, source rank) converts TP slice, layout and block size."""
    pytest.importorskip("cupy")
    sc, src_tp, dst_tp = _gpu_scenario(case, "ipc", [1, 7, 16, 37, 100, 300])
    res = _run(sc, deadline=120)
    _assert_all_landed(res, sc, src_tp, dst_tp, "ipc")
    for r in range(dst_tp):
        assert res[f"D{r}"]["stats"]["transport_reasons"]["P"].startswith("ipc: same host, same GPU")


@pytest.mark.parametrize("case", range(len(CASES)))
def test_staged_pg_pinned_host_between_processes(case):
    """CUDA caches staged through pinned host buffers over Gloo, >= 3 chunks per long request."""
    sc, src_tp, dst_tp = _gpu_scenario(case, "pg", [300, 37, 100, 1])
    src = CASES[case][0]
    sc["staged"] = {"buffer_bytes": 72 * src.bytes_per_token(num_heads=2), "pin_memory": True}
    res = _run(sc, deadline=120)
    _assert_all_landed(res, sc, src_tp, dst_tp, "pg")
    for r in range(dst_tp):
        s = res[f"D{r}"]["stats"]
        assert s["staging_pools"] == 1 and s["staging_chunks_recv"] >= 3


@pytest.mark.multigpu
def test_staged_pg_nccl_two_gpus():
    """Device staging over NCCL: P on GPU 0, D on GPU 1 (same pair-group code as Gloo)."""
    sc, src_tp, dst_tp = _gpu_scenario(0, "pg", [300, 37, 100, 1])
    sc["staged"] = {"buffer_bytes": 72 * CASES[0][0].bytes_per_token(num_heads=2)}
    sc["device"] = "cuda:0"
    sc["dst_device"] = "cuda:1"
    res = _run(sc, deadline=120)
    _assert_all_landed(res, sc, src_tp, dst_tp, "pg")


def test_stream_ordering_export_ready_and_load_completion():
    """The compute writing P's blocks runs on its own stream behind a long spin kernel; the
    export hands its event as ``ready``. D's load must see the written bytes (not the poison)
    and, once poll() reports it, a kernel on D's default stream reads the landed bytes."""
    from kvxfer.transports.pg.pipeline import StagedPipeline

    spec = KVCacheSpec(2, 4, 64, 16, torch.bfloat16)
    dev = torch.device("cuda", 0)
    sc = [torch.empty(spec.cache_shape(32, 1), dtype=spec.dtype, device=dev) for _ in range(2)]
    dc = [torch.empty(spec.cache_shape(32, 1), dtype=spec.dtype, device=dev) for _ in range(2)]
    poison(sc)
    poison(dc)
    # The payload reaches the GPU first: a pageable host->device copy inside the compute stream
    # would block the host until the spin ended, and the gate would never be exercised.
    wire = payload(spec, 9, 90, spec.heads_of_rank(0, 1)).to(dev)
    # One scatter before the spin: a first launch compiles (Triton JIT takes host time), and a
    # compile inside the spin outlasts it, so the gate would find the event already done (seen on
    # H200 2026-11-26 with Triton first: not_ready_grants == 0).
    ops.scatter_blocks(wire, sc, spec, [3, 4, 5, 6, 7, 8], 90)
    poison(sc)
    torch.cuda.synchronize()
    # in one process CUDA IPC is impossible; pinned-host staging over Gloo carries it
    pipe = {"buffer_bytes": 32 * spec.bytes_per_token(), "pin_memory": True}
    p = TransferEngine(spec, sc, 0, 1, "P", transport="pg", pipeline=StagedPipeline(**pipe)).start()
    d = TransferEngine(spec, dc, 0, 1, "D", transport="pg", pipeline=StagedPipeline(**pipe)).start()
    try:
        compute = torch.cuda.Stream(dev)
        with torch.cuda.stream(compute):
            torch.cuda._sleep(500_000_000)  # ~0.3 s of GPU time before the write
            ops.scatter_blocks(wire, sc, spec, [3, 4, 5, 6, 7, 8], 90)  # device work only
            ev = torch.cuda.Event()
            ev.record(compute)
        d.load("x", p.export("x", [3, 4, 5, 6, 7, 8], 90, ready=ev), [10, 11, 12, 13, 14, 15])
        end = time.monotonic() + 30
        done = False
        while not done and time.monotonic() < end:
            r = d.poll()
            assert not r.failed, r.errors
            done = "x" in r.finished_recving
            time.sleep(0.002)
        assert done
        assert check(dc, spec, 0, 1, [10, 11, 12, 13, 14, 15], 90, seed=9)
        assert p.stats()["not_ready_grants"] > 0  # the gate held the transfer back
    finally:
        d.close()
        p.close()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=["e4m3", "bf16"])
@pytest.mark.parametrize("mode", ["whole", "staged", "staged-pinned"])
def test_pg_on_one_gpu_takes_gloo_through_pinned_host(mode, dtype):
    """P and D on one GPU over ``pg`` with the default (NCCL-preferring) set-up: NCCL cannot put
    both ranks of a pair on one GPU, so the loader picks Gloo through pinned host staging and
    says why in stats()["transport_reasons"]; the bytes land exactly, the rest stays poisoned."""
    from kvxfer.transports.pg.pipeline import StagedPipeline

    spec = KVCacheSpec(2, 4, 64, 16, dtype)
    dev = torch.device("cuda", 0)
    sc = [torch.empty(spec.cache_shape(32, 1), dtype=spec.dtype, device=dev) for _ in range(2)]
    dc = [torch.empty(spec.cache_shape(32, 1), dtype=spec.dtype, device=dev) for _ in range(2)]
    poison(sc)
    poison(dc)
    fill(sc, spec, 0, 1, [3, 4, 5, 6, 7, 8], 90, seed=4)
    torch.cuda.synchronize()

    def pipe():
        if mode == "whole":
            return None
        return StagedPipeline(buffer_bytes=32 * spec.bytes_per_token(), pin_memory=mode == "staged-pinned")

    p = TransferEngine(spec, sc, 0, 1, "P", transport="pg", pipeline=pipe()).start()
    d = TransferEngine(spec, dc, 0, 1, "D", transport="pg", pipeline=pipe()).start()
    try:
        d.load("x", p.export("x", [3, 4, 5, 6, 7, 8], 90), [20, 21, 22, 23, 24, 25])
        end = time.monotonic() + 30
        done = False
        while not done and time.monotonic() < end:
            r = d.poll()
            assert not r.failed, r.errors
            done = "x" in r.finished_recving
            time.sleep(0.002)
        assert done
        why = d.stats()["transport_reasons"]["P"]
        if mode != "staged-pinned":  # that exporter offers Gloo alone: nothing to fall back from
            assert "Gloo through pinned host staging for exporter rank(s) [0]" in why, why
        assert check(dc, spec, 0, 1, [20, 21, 22, 23, 24, 25], 90, seed=4)
        assert untouched(dc, spec, {20, 21, 22, 23, 24, 25}, {25: 90 - 5 * 16})
    finally:
        p.close()
        d.close()
