"""A ``pg`` stream ends by its load's deadline however its chunks trickle in: each wait gets
what is left of the stream's one bound, not a fresh timeout per chunk (an exporter sending each
chunk just within it held the load, and the loader's worker with every load queued behind it,
for many times its deadline). And a loader that stops reading holds only its own stream at the
exporter: streams running at once each have their own staging buffers (``StagingLanes``), where
every stream of a role once leased one pool's, so one stalled loader held every other's reads."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvxfer import KVCacheSpec, TransferEngine
from kvxfer.transports import streams
from kvxfer.transports.pg.pipeline import StagedPipeline

from .engine_payload import check, fill, poison

SPEC = KVCacheSpec(2, 2, 16, 8, torch.float16)


def _caches(n: int = 32) -> list[torch.Tensor]:
    return [torch.zeros(SPEC.cache_shape(n, 1), dtype=SPEC.dtype) for _ in range(2)]


def _outcome(eng, want: set, timeout_s: float = 20.0) -> dict[str, str]:
    got: dict[str, str] = {}
    end = time.monotonic() + timeout_s
    while set(got) != want and time.monotonic() < end:
        r = eng.poll()
        got.update(dict.fromkeys(r.finished_recving, "done"))
        got.update({rid: "failed: " + r.errors.get(rid, "") for rid in r.failed})
        time.sleep(0.005)
    return got


def test_a_trickling_stream_fails_by_the_load_deadline(monkeypatch):
    pc, dc, qc = _caches(), _caches(), _caches()
    p = TransferEngine(
        SPEC, pc, 0, 1, "P", transport="pg", timeout_s=30.0, pipeline=StagedPipeline(max_chunk_tokens=8)
    )
    d = TransferEngine(
        SPEC, dc, 0, 1, "D", transport="pg", timeout_s=1.0, pipeline=StagedPipeline(max_chunk_tokens=8)
    )
    q = TransferEngine(SPEC, qc, 0, 1, "Q", transport="pg")
    real = streams.ops.gather_blocks

    def slow_gather(*a, **k):  # P's sender: each chunk 0.6 s after the last, under D's 1 s
        if threading.current_thread().name.startswith("kvxfer-P-0"):
            time.sleep(0.6)
        return real(*a, **k)

    monkeypatch.setattr(streams.ops, "gather_blocks", slow_gather)
    try:
        for e in (p, d, q):
            e.start()
        fill(pc, SPEC, 0, 1, [1, 2, 3, 4, 5, 6], 48, seed=1)
        t0 = time.monotonic()
        d.load("x", p.export("x", [1, 2, 3, 4, 5, 6], 48), [7, 8, 9, 10, 11, 12])  # 6 chunks: 3.6 s
        d.poll()
        time.sleep(0.5)
        fill(qc, SPEC, 0, 1, [1], 8, seed=3)
        # an honest exporter's load queued behind it, due at 1.5 s: it lands once x has ended
        d.load("y", q.export("y", [1], 8), [20])
        got = _outcome(d, {"x", "y"})
        x_at = time.monotonic() - t0
        assert got["x"].startswith("failed:"), got  # not landed at 3.6 s, past its deadline
        assert got["y"] == "done", got
        assert x_at < 3.0, x_at  # ended by the deadline (1 s) and its drain, not the stream's end
    finally:
        for e in (d, p, q):
            e.close()


def test_a_pair_the_exporter_evicted_is_paired_anew_within_the_load():
    """At its pair cap (one pair here) the exporter evicts the idle pair of one loader to pair
    another; that loader's next load pairs again instead of failing on the unknown pair."""
    pc = _caches()
    p = TransferEngine(SPEC, pc, 0, 1, "P", transport="pg").start()
    p._transports["pg"].senders.max_pairs = 1
    d1 = TransferEngine(SPEC, _caches(), 0, 1, "D1", transport="pg", timeout_s=5.0).start()
    d2 = TransferEngine(SPEC, _caches(), 0, 1, "D2", transport="pg", timeout_s=5.0).start()
    try:
        fill(pc, SPEC, 0, 1, [1, 2], 16, seed=1)
        for i in range(2):
            for d in (d1, d2):
                rid = f"{d.engine_id}-{i}"
                d.load(rid, p.export(rid, [1, 2], 16), [3, 4])
                assert _outcome(d, {rid}) == {rid: "done"}
    finally:
        for e in (d1, d2, p):
            e.close()


def test_a_slow_loader_within_its_deadline_is_not_cut_by_the_exporters_timeout(monkeypatch):
    """The exporter bounds each send on its own: a loader scattering slowly (6 chunks, 0.3 s
    each) within its own 10 s is served by an exporter whose timeout_s is 1 s."""
    pc, dc = _caches(), _caches()
    p = TransferEngine(
        SPEC, pc, 0, 1, "P", transport="pg", timeout_s=1.0, pipeline=StagedPipeline(max_chunk_tokens=8)
    )
    d = TransferEngine(
        SPEC, dc, 0, 1, "D", transport="pg", timeout_s=10.0, pipeline=StagedPipeline(max_chunk_tokens=8)
    )
    real = streams.ops.scatter_blocks

    def slow_scatter(*a, **k):
        time.sleep(0.3)
        return real(*a, **k)

    monkeypatch.setattr(streams.ops, "scatter_blocks", slow_scatter)
    try:
        p.start()
        d.start()
        fill(pc, SPEC, 0, 1, [1, 2, 3, 4, 5, 6], 48, seed=1)
        d.load("x", p.export("x", [1, 2, 3, 4, 5, 6], 48), [7, 8, 9, 10, 11, 12])
        end = time.monotonic() + 15
        got: dict[str, str] = {}
        while not got and time.monotonic() < end:
            p.poll()
            got = _outcome(d, {"x"}, 0.05)
        assert got == {"x": "done"}, got
    finally:
        d.close()
        p.close()


@pytest.mark.parametrize("max_streams", [4, 2])
def test_a_slow_loader_does_not_hold_another_loaders_stream(monkeypatch, max_streams):
    pc, sc, fc = _caches(), _caches(), _caches()
    poison(sc)
    poison(fc)
    p = TransferEngine(
        SPEC,
        pc,
        0,
        1,
        "P",
        transport="pg",
        pipeline=StagedPipeline(max_chunk_tokens=8, max_streams=max_streams),
    )
    slow = TransferEngine(
        SPEC, sc, 0, 1, "D1", transport="pg", timeout_s=20.0, pipeline=StagedPipeline(max_chunk_tokens=8)
    )
    fast = TransferEngine(SPEC, fc, 0, 1, "D2", transport="pg", timeout_s=20.0)
    real = streams.ops.scatter_blocks
    scattering, y_landed = threading.Event(), threading.Event()

    def stalled_scatter(*a, **k):  # D1's worker: stops reading until D2's load landed (or 15 s)
        if threading.current_thread().name.startswith("kvxfer-worker-D1"):
            scattering.set()
            y_landed.wait(15)
        return real(*a, **k)

    monkeypatch.setattr(streams.ops, "scatter_blocks", stalled_scatter)
    try:
        for e in (p, slow, fast):
            e.start()
        fill(pc, SPEC, 0, 1, [1, 2, 3, 4, 5, 6], 48, seed=1)
        fill(pc, SPEC, 0, 1, [7], 8, seed=2)
        slow.load("x", p.export("x", [1, 2, 3, 4, 5, 6], 48), [10, 11, 12, 13, 14, 15])
        slow.poll()
        assert scattering.wait(10)  # P's stream to D1 holds its buffers from here on, stalled
        fast.load("y", p.export("y", [7], 8), [20])
        # with one pool for every stream, y would wait for x, which waits for y: not by 8 s
        got = _outcome(fast, {"y"}, timeout_s=8.0)
        y_landed.set()
        assert got == {"y": "done"}
        assert check(fc, SPEC, 0, 1, [20], 8, seed=2)
        assert _outcome(slow, {"x"}) == {"x": "done"}
        assert check(sc, SPEC, 0, 1, [10, 11, 12, 13, 14, 15], 48, seed=1)
        assert p.stats()["staging_pools"] == 2  # a second lane, made when the streams overlapped
    finally:
        y_landed.set()
        for e in (slow, fast, p):
            e.close()


@pytest.mark.parametrize("max_sms", [None, 8])
def test_send_lanes_run_on_streams_of_their_own_only_without_an_sm_budget(monkeypatch, max_sms):
    """Lanes side by side on CUDA streams of their own would each take the engine's SM budget:
    an exporter with a budget keeps one stream for all (``own_stream`` False)."""
    asked = []
    real = StagedPipeline.send_stream

    def spy(self, *a, **k):
        asked.append(a[-1] if len(a) == 9 else k.get("own_stream"))
        return real(self, *a, **k)

    monkeypatch.setattr(StagedPipeline, "send_stream", spy)
    pc = _caches()
    p = TransferEngine(SPEC, pc, 0, 1, "P", transport="pg", max_sms=max_sms).start()
    d = TransferEngine(SPEC, _caches(), 0, 1, "D", transport="pg").start()
    try:
        fill(pc, SPEC, 0, 1, [1, 2], 16, seed=1)
        d.load("x", p.export("x", [1, 2], 16), [3, 4])
        assert _outcome(d, {"x"}) == {"x": "done"}
        assert asked == [max_sms is None]
    finally:
        d.close()
        p.close()
