"""One-sided ipc reads of CUDA caches (skipped without CUDA and CuPy; run on a lent GPU): P in
its own process on the same GPU, D here. The copies D's ``load()`` launches land byte for byte
and P frees from the done marks; P SIGKILLed while D's copy reads its memory is reported within
the bound (done only with P's exact bytes, else failed by name), D's CUDA context survives, and a
restarted P serves again."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from kvxfer import KVCacheSpec, TransferEngine, ops

from .engine_payload import check, fill, poison
from .engine_procs import free_port_base
from .onesided_helpers import poll_until

pytestmark = pytest.mark.gpu

SRC = KVCacheSpec(4, 8, 128, 16, torch.bfloat16)
DST = KVCacheSpec(4, 8, 128, 32, torch.bfloat16, layout="HND")
BIG = 32768  # tokens of the request P dies under: 512 MiB, tens of milliseconds of copy


def _skip_without_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("cupy")


def gpu_exporter(port: int, reqs: list, q, go) -> None:
    """P on cuda:0: fills ``reqs`` ((rid, ids, n, seed)) and exports the first; exports the rest
    once told (after D mapped P: exports made before a loader maps the lease-slot table get no
    slot), handing each one's params over; then serves until killed."""
    nb = max(i for _, ids, _, _ in reqs for i in ids) + 1
    caches = [
        torch.zeros(SRC.cache_shape(nb, 1), dtype=SRC.dtype, device="cuda") for _ in range(SRC.num_layers)
    ]
    e = TransferEngine(SRC, caches, 0, 1, "P", port=port, lease_s=60.0).start()
    for _, ids, n, seed in reqs:
        fill(caches, SRC, 0, 1, ids, n, seed)
    torch.cuda.synchronize()
    for k, (rid, ids, n, _) in enumerate(reqs):
        if k == 1:
            go.get(timeout=120)
        q.put(e.export(rid, ids, n))
    end = time.monotonic() + 300
    while time.monotonic() < end:
        e.poll()
        time.sleep(0.001)


class _P:
    """P's process: ``first()``: the first request's params; ``rest()``: the others' (exported then)."""

    def __init__(self, port: int, reqs: list) -> None:
        ctx = mp.get_context("spawn")
        self.q, self.go, self.n = ctx.Queue(), ctx.Queue(), len(reqs)
        self.proc = ctx.Process(target=gpu_exporter, args=(port, reqs, self.q, self.go), daemon=True)
        self.proc.start()

    def first(self) -> dict:
        return self.q.get(timeout=120)

    def rest(self) -> list[dict]:
        self.go.put(True)
        return [self.q.get(timeout=120) for _ in range(self.n - 1)]


def _stop(proc) -> None:
    if proc.is_alive():
        proc.kill()
    proc.join(10)


@pytest.mark.parametrize("batched", [False, True], ids=["each", "batched"])
def test_onesided_cuda_ipc_lands_exactly_and_p_frees(batched):
    """``batched``: the four loads in one ``batched_loads()`` block: one launch, one event."""
    _skip_without_cuda()
    reqs = [("warm", [0], 1, 1)]
    nxt = 1
    for i, n in enumerate([1, 17, 100, 4096]):
        k = SRC.num_blocks_for(n)
        reqs.append((f"r{i}", list(range(nxt, nxt + k))[::-1], n, 10 + i))
        nxt += k
    p = _P(free_port_base(1), reqs)
    proc = p.proc
    nb = 300
    caches = [
        torch.zeros(DST.cache_shape(nb, 1), dtype=DST.dtype, device="cuda") for _ in range(DST.num_layers)
    ]
    poison(caches)
    d = TransferEngine(DST, caches, 0, 1, "D", timeout_s=10.0).start()
    try:
        d.load("warm", p.first(), [0])
        assert poll_until([d], {"warm"}, "recv") == {"warm": "done"}
        d_ids = {}
        nxt = 1
        calls0 = d.stats()["ops_calls"]
        with d.batched_loads() if batched else contextlib.nullcontext():
            for (rid, _, n, _), prm in zip(reqs[1:], p.rest()):
                k = DST.num_blocks_for(n)
                d_ids[rid] = list(range(nxt, nxt + k))
                nxt += k
                d.load(rid, prm, d_ids[rid])
        lane = d._onesided.lane  # the native lane's launched flights (r1..r3: r0 made the target)
        events = {id(f.event) for f in d._onesided.flights}
        events |= {id(e) for e in (lane.events_of(set(d_ids)) if lane is not None else ())}
        got = poll_until([d], set(d_ids), "recv")
        calls = d.stats()["ops_calls"] - calls0
        # batched: one launch; the planner's calls (HND tails are one call each) at most one per
        # load; one event for r0 (the Python path's flight) and one for the lane's r1..r3
        n_events = 1 if lane is None else 2
        assert (calls <= len(d_ids) and len(events) == n_events) if batched else calls == len(d_ids), (
            calls,
            events,
        )
        pool = d._loader.peers.get("P").session._pool  # each event back in the pool once
        assert len({id(e) for e in pool}) == len(pool), "an event recycled twice"
        assert got == dict.fromkeys(d_ids, "done"), got
        assert d.stats()["onesided"]["loads"] == len(d_ids), d.stats()["onesided"]
        if lane is not None:  # r0 made the target (the Python path): the native lane took the others
            assert d.stats()["onesided"]["native"] == len(d_ids) - 1, d.stats()["onesided"]
        for rid, _, n, seed in reqs[1:]:
            assert check(caches, DST, 0, 1, d_ids[rid], n, seed), rid
    finally:
        d.close()
        _stop(proc)


def test_exporter_killed_while_d_reads_its_cuda_memory():
    """Step 2 of the GPU issue: P is SIGKILLed right after D's one-sided copy of a 512 MiB
    request was launched. The load is reported within its bound: done only if every byte is
    P's, else failed by name; D's CUDA context still runs kernels; a restarted P serves D."""
    _skip_without_cuda()
    port = free_port_base(1)
    k = SRC.num_blocks_for(BIG)
    p = _P(port, [("warm", [0], 1, 1), ("big", list(range(1, k + 1)), BIG, 7)])
    proc = p.proc
    kd = DST.num_blocks_for(BIG)
    caches = [
        torch.zeros(DST.cache_shape(kd + 1, 1), dtype=DST.dtype, device="cuda") for _ in range(DST.num_layers)
    ]
    d = TransferEngine(DST, caches, 0, 1, "D", timeout_s=5.0).start()
    try:
        d.load("warm", p.first(), [0])
        assert poll_until([d], {"warm"}, "recv") == {"warm": "done"}
        ids = list(range(1, kd + 1))
        d.load("big", p.rest()[0], ids)
        assert d.stats()["onesided"]["loads"] == 1  # launched: the copy reads P's memory now
        os.kill(proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        got = poll_until([d], {"big"}, "recv", timeout=15.0)
        assert "big" in got, "not reported within the bound"
        assert time.monotonic() - t0 < 12.0
        if got["big"] == "done":
            assert check(caches, DST, 0, 1, ids, BIG, 7), "reported done with bytes that are not P's"
        else:
            assert got["big"].startswith("failed: ") and len(got["big"]) > 10, got
        x = torch.ones(1024, device="cuda")  # the context still runs kernels
        assert float((x * 2).sum()) == 2048.0
        proc.join(10)
        # a restarted P at the same address: D handshakes anew and loads
        p = _P(port, [("again", [0, 1], 20, 3)])
        proc = p.proc
        d.load("again", p.first(), [0])
        got = poll_until([d], {"again"}, "recv", timeout=30.0)
        assert got == {"again": "done"}, got
        assert check(caches, DST, 0, 1, [0], 20, 3)
        out = ops.gather_blocks(caches, DST, [0], 20)
        assert out.is_cuda
    finally:
        d.close()
        _stop(proc)
