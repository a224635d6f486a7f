"""The nixl transport between spawned processes, UCX on loopback, in both UCX modes (its default
transports — shared memory / CMA between local processes — and ``UCX_TLS=tcp``, the path a
cross-node link without RDMA takes): P tp=2 -> D tp=1 and 1 -> 2, NHD <-> HND, block 16 <-> 32,
MLA, n>1, direct and staged paths, byte for byte with everything else untouched; an exporter
killed mid-transfer (direct and staged), a loader killed mid-stream, and leases expiring
mid-transfer. Every process is joined against a deadline and killed if left over."""

from __future__ import annotations

import os
import time

import pytest
import torch

from kvxfer import KVCacheSpec
from kvxfer.transports.nixl.agent import nixl_status

from .engine_payload import check, fill
from .engine_procs import _context, exporter_rank, loader_rank, run_procs
from .test_engine_procs import _aggregate, _scenario

pytestmark = pytest.mark.skipif(bool(nixl_status()), reason=f"NIXL not importable here: {nixl_status()}")

UCX_MODES = {"default": {"UCX_NET_DEVICES": "lo"}, "tcp": {"UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp"}}


def _env(sc: dict) -> None:
    """Set this (child) process's UCX environment before any NIXL agent is made."""
    os.environ.pop("UCX_TLS", None)
    os.environ.update(sc["env"])


def _hooked(sc: dict) -> None:
    """Install ``sc["hook"]`` (a test hook name) sleeping ``sc["hook_s"]`` in every engine
    this process starts."""
    if not sc.get("hook"):
        return
    from kvxfer import TransferEngine

    orig = TransferEngine.start

    def start(self):
        out = orig(self)
        self._hooks[sc["hook"]] = lambda *a: time.sleep(sc["hook_s"])
        return out

    TransferEngine.start = start


def nixl_exporter(sc, tp_rank, q_out, q_ctl, q_go):
    _env(sc)
    return exporter_rank(sc, tp_rank, q_out, q_ctl, q_go)


def nixl_loader(sc, tp_rank, q_in, q_ctl, q_go):
    _env(sc)
    _hooked(sc)
    return loader_rank(sc, tp_rank, q_in, q_ctl, q_go)


def _run(sc, deadline=90.0):
    procs = {}
    for r in range(sc["src_tp"]):
        # "go" on its own queue: on the shared one, loader rank 1 could take rank 0's "finished"
        # meant for the exporter, which then waited 30 s for it (seen once in CI)
        procs[f"P{r}"] = (nixl_exporter, (sc, r, "@queue:params", "@queue:ctl", "@queue:go"))
    for r in range(sc["dst_tp"]):
        procs[f"D{r}"] = (nixl_loader, (sc, r, "@queue:params", "@queue:ctl", "@queue:go"))
    return run_procs(procs, deadline)


F16, BF16 = torch.float16, torch.bfloat16
CASES = {
    # name: (src spec, src tp, dst spec, dst tp, path the loader ranks take)
    "tp2to1-HND16-direct": (KVCacheSpec(2, 4, 24, 16, F16, "HND"), 2, KVCacheSpec(2, 4, 24, 16, F16, "HND"), 1, "direct"),
    "tp1to2-NHD16-NHD32-staged": (KVCacheSpec(2, 4, 24, 16, BF16), 1, KVCacheSpec(2, 4, 24, 32, BF16), 2, "staged"),
    "tp2to1-NHD16-HND32-staged": (KVCacheSpec(2, 4, 24, 16, F16), 2, KVCacheSpec(2, 4, 24, 32, F16, "HND"), 1, "staged"),
    "tp1to2-HND32-NHD16-staged": (KVCacheSpec(3, 2, 16, 32, BF16, "HND"), 1, KVCacheSpec(3, 2, 16, 16, BF16), 2, "staged"),
    "tp2to2-NHD16-direct": (KVCacheSpec(2, 4, 24, 16, F16), 2, KVCacheSpec(2, 4, 24, 16, F16), 2, "direct"),
    "mla-tp2to1-16to32-staged": (KVCacheSpec(2, 1, 32, 16, BF16, use_mla=True), 2, KVCacheSpec(2, 1, 32, 32, BF16, use_mla=True), 1, "staged"),
    "mla-tp1to2-direct": (KVCacheSpec(2, 1, 32, 16, BF16, use_mla=True), 1, KVCacheSpec(2, 1, 32, 16, BF16, use_mla=True), 2, "direct"),
}  # fmt: skip


@pytest.mark.parametrize("mode", sorted(UCX_MODES))
@pytest.mark.parametrize("case", sorted(CASES))
def test_transfer_between_processes(case, mode):
    src, src_tp, dst, dst_tp, path = CASES[case]
    lengths = [1, 7, 16, 37, 64, 100]
    sc = _scenario(
        src,
        src_tp,
        dst,
        dst_tp,
        "nixl",
        lengths,
        hold=dst_tp == 2 and src_tp == 1,  # D rank 1 loads only after P checked it freed nothing early
        hold_s=0.3,
        env=UCX_MODES[mode],
        staged={"buffer_bytes": 64 << 10},  # several chunks for the longer requests
        deadline_s=60.0,
    )
    res = _run(sc)
    want = {r[0] for r in sc["requests"]}
    for r in range(dst_tp):
        d = res[f"D{r}"]
        assert d["ok"] == dict.fromkeys(want, True), [p["errors"] for p in d["polls"] if p["errors"]]
        assert d["untouched"], f"D{r} wrote outside the requests' token slots"
        s = d["stats"]
        assert s["transfers"] == len(want) and s["failures"] == 0 and s["loads_pending"] == 0
        assert s["transports"] == {"P": "nixl"}
        why = s["transport_reasons"]["P"]
        assert why.startswith("nixl: requested; paths: ") and f" {path}" in why, why
        assert ("staged" in why) == (path == "staged"), why
    for r in range(src_tp):
        p = res[f"P{r}"]
        assert p["early"] == [], f"P{r} freed {p['early']} before every loader rank notified"
        assert p["stats"]["blocks_held"] == 0 and p["stats"]["expirations"] == 0
        assert sorted(rid for poll in p["polls"] for rid in poll["finished_sending"]) == sorted(want)
    assert sorted(_aggregate(res, "D", dst_tp)) == sorted(want)
    assert sorted(_aggregate(res, "P", src_tp)) == sorted(want)


@pytest.mark.parametrize("mode", sorted(UCX_MODES))
def test_n3_children_share_prefix_between_processes(mode):
    spec = KVCacheSpec(2, 4, 24, 16, BF16)
    sc = _scenario(spec, 1, spec, 1, "nixl", [1], env=UCX_MODES[mode])
    tails = [8, 13, 1]
    sc["requests"] = [(f"c{i}", 32 + t, 7, [10, 11, 20 + i]) for i, t in enumerate(tails)]  # one seed:
    sc["dst_ids"] = {f"c{i}": [40, 41, 50 + i] for i in range(3)}  # equal prefixes
    res = _run(sc)
    d = res["D0"]
    assert d["ok"] == {"c0": True, "c1": True, "c2": True} and d["untouched"]
    bpt = spec.bytes_per_token()
    assert d["stats"]["bytes"] == (32 + sum(tails)) * bpt and d["stats"]["dedup_bytes"] == 2 * 32 * bpt


@pytest.mark.parametrize("mode", sorted(UCX_MODES))
@pytest.mark.parametrize("path", ["direct", "staged"])
def test_lease_expires_mid_transfer_between_processes(path, mode):
    """D stalls inside its transfer (after its direct READ, or between the staged stream's
    chunks) with no heartbeat: P's lease ends; D fails the load (epoch check after the READ;
    the exporter's abort mid-stream), never delivers it; P reports it expired."""
    src = KVCacheSpec(2, 4, 24, 16, F16)
    dst = src if path == "direct" else KVCacheSpec(2, 4, 24, 32, F16, "HND")
    sc = _scenario(
        src,
        1,
        dst,
        1,
        "nixl",
        [128],
        env=UCX_MODES[mode],
        lease_s=0.5,
        timeout_s=8.0,
        hook="after_nixl_read" if path == "direct" else "before_recv",
        hook_s=2.0,
        staged={"buffer_bytes": 24 << 10},  # 32 tokens per chunk: 4 chunks
        deadline_s=20.0,
        hold=True,  # P stays up until D reported (its epochs are read after the data)
        hold_s=0.1,
    )
    res = _run(sc)
    d, p = res["D0"], res["P0"]
    errors = {k: v for poll in d["polls"] for k, v in poll["errors"].items()}
    assert set(errors) == {"req-0"} and d["ok"] == {}, errors
    needle = "released before or during" if path == "direct" else "aborted"
    assert needle in errors["req-0"], errors
    assert d["stats"]["transfers"] == 0 and d["stats"]["failures"] == 1
    assert [rid for poll in p["polls"] for rid in poll["expired"]] == ["req-0"]
    assert p["stats"]["blocks_held"] == 0


# --------------------------------------------------------------------------- peers killed
def dying_exporter(sc, q_out, q_ctl):
    """P: export, hand out the params, then die (no close, like a crash) when told to."""
    _env(sc)
    from kvxfer import TransferEngine

    from .engine_procs import _caches, _spec

    spec = _spec(sc["src_spec"])
    caches, _ = _caches(spec, sc["src_blocks"], 1, "cpu", shared=False)
    eng = TransferEngine(
        spec, caches, 0, 1, "P", transport="nixl", port=sc["src_port"], pipeline=_pipe(sc)
    ).start()
    params = []
    for rid, n, seed, ids in sc["requests"]:
        fill(caches, spec, 0, 1, ids, n, seed)
        params.append(eng.export(rid, ids, n))
    q_out.put(params)
    end = time.monotonic() + 30
    while time.monotonic() < end:
        eng.poll()
        try:
            if q_ctl.get(timeout=0.005) == "die":
                os._exit(7)
        except Exception:
            pass
    return "not told to die"


def _pipe(sc):
    from kvxfer.transports.pg.pipeline import StagedPipeline

    return StagedPipeline(**sc["staged"])


def loader_killing_its_exporter(sc, q_in, q_ctl):
    """D: load; right before reading (direct READ, or the staged stream's first chunk, which
    P already gathered) tell P to die, give it time to go, then read from the dead peer."""
    _env(sc)
    from kvxfer import TransferEngine

    from .engine_procs import _caches, _spec

    spec = _spec(sc["dst_spec"])
    caches, _ = _caches(spec, sc["dst_blocks"], 1, "cpu", shared=False)
    eng = TransferEngine(
        spec, caches, 0, 1, "D", transport="nixl", timeout_s=sc["timeout_s"], pipeline=_pipe(sc)
    ).start()

    def kill_peer():
        q_ctl.put("die")
        time.sleep(1.0)

    eng._hooks["before_nixl_read" if sc["path"] == "direct" else "before_recv"] = kill_peer
    params = q_in.get(timeout=30)
    for p, (rid, *_rest) in zip(params, sc["requests"]):
        eng.load(rid, p, sc["dst_ids"][rid])
    t0 = time.monotonic()
    failed, done = {}, set()
    end = t0 + 30
    while len(failed) + len(done) < len(params) and time.monotonic() < end:
        r = eng.poll()
        failed.update({k: r.errors.get(k, "") for k in r.failed})
        done |= r.finished_recving
        time.sleep(0.005)
    took = time.monotonic() - t0
    eng.close()
    return {"failed": failed, "done": sorted(done), "took": took}


@pytest.mark.parametrize("mode", sorted(UCX_MODES))
@pytest.mark.parametrize("path", ["direct", "staged"])
def test_exporter_killed_mid_transfer(path, mode):
    """P is killed (no close) after D's lease grant and, staged, once P accepted the stream: D
    reports the loads failed at once (NIXL reports the peer gone on the READ, or on the ping a
    quiet stream sends), not at its deadline; no hang."""
    src = KVCacheSpec(2, 4, 24, 16, F16)
    dst = src if path == "direct" else KVCacheSpec(2, 4, 24, 32, F16, "HND")
    sc = _scenario(
        src, 1, dst, 1, "nixl", [96, 40], env=UCX_MODES[mode], timeout_s=8.0, path=path,
        staged={"buffer_bytes": 24 << 10},
    )  # fmt: skip
    res = run_procs(
        {
            "P0": (dying_exporter, (sc, "@queue:params", "@queue:ctl")),
            "D0": (loader_killing_its_exporter, (sc, "@queue:params", "@queue:ctl")),
        },
        60,
    )
    assert res["P0"] == ("died", 7)
    d = res["D0"]
    assert set(d["failed"]) == {"req-0", "req-1"} and d["done"] == [], d
    assert all("disconnect" in why for why in d["failed"].values()), d
    assert d["took"] < 1.0 + 3.0, d  # the hook's 1 s, then at once: far below the 8 s deadline


def parked_loader(sc, params, q_out):
    """D1: a staged load that stops right before reading (as a hung or dying peer would)."""
    _env(sc)
    from kvxfer import TransferEngine

    from .engine_procs import _caches, _spec

    spec = _spec(sc["dst_spec"])
    caches, _ = _caches(spec, 64, 1, "cpu", shared=False)
    eng = TransferEngine(
        spec, caches, 0, 1, "D1", transport="nixl", timeout_s=30.0, pipeline=_pipe(sc)
    ).start()

    def park():
        q_out.put("receiving")
        time.sleep(120)

    eng._hooks["before_recv"] = park
    eng.load("a", params, list(range(spec.num_blocks_for(params["num_tokens"]))))
    end = time.monotonic() + 120
    while time.monotonic() < end:
        eng.poll()
        time.sleep(0.01)


@pytest.mark.parametrize("mode", sorted(UCX_MODES))
def test_loader_killed_mid_stream_exporter_keeps_serving(mode, monkeypatch):
    """D1 dies mid staged stream (P gathered and announced chunks, waits for their READs): P's
    stream ends within its bound, P's lease frees the blocks, and P serves another loader's
    new request byte for byte."""
    from kvxfer import TransferEngine
    from kvxfer.transports.pg.pipeline import StagedPipeline

    for k in ("UCX_TLS", "UCX_NET_DEVICES"):
        monkeypatch.delenv(k, raising=False)
    for k, v in UCX_MODES[mode].items():
        monkeypatch.setenv(k, v)
    src, dst = KVCacheSpec(2, 4, 24, 16, F16), KVCacheSpec(2, 4, 24, 32, F16, "HND")
    staged = {"buffer_bytes": 24 << 10}
    pc = [torch.zeros(src.cache_shape(64, 1), dtype=src.dtype) for _ in range(2)]
    p = TransferEngine(
        src, pc, 0, 1, "P", transport="nixl", timeout_s=2.0, lease_s=3.0, pipeline=StagedPipeline(**staged)
    ).start()
    ctx = _context()
    q = ctx.Queue()
    d1 = d2 = None
    try:
        fill(pc, src, 0, 1, list(range(8)), 128, seed=1)
        params_a = p.export("a", list(range(8)), 128)
        sc = {"env": UCX_MODES[mode], "dst_spec": dst.to_dict(), "staged": staged}
        d1 = ctx.Process(target=parked_loader, args=(sc, params_a, q), daemon=True)
        d1.start()
        assert q.get(timeout=60) == "receiving"
        time.sleep(0.2)
        d1.kill()
        d1.join(10)
        assert not d1.is_alive()
        fill(pc, src, 0, 1, [20, 21, 22], 40, seed=2)
        params_b = p.export("b", [20, 21, 22], 40)
        dc = [torch.zeros(dst.cache_shape(16, 1), dtype=dst.dtype) for _ in range(2)]
        d2 = TransferEngine(dst, dc, 0, 1, "D2", transport="nixl", timeout_s=8.0).start()
        d2.load("b", params_b, [7, 8])
        end = time.monotonic() + 25
        done, seen = None, {"finished_sending": set(), "expired": set()}
        while time.monotonic() < end and (done is None or "a" not in seen["expired"]):
            r = d2.poll()
            assert not r.failed, r.errors
            if "b" in r.finished_recving:
                done = time.monotonic()
            rp = p.poll()
            seen["finished_sending"] |= rp.finished_sending
            seen["expired"] |= rp.expired
            time.sleep(0.01)
        assert done is not None, "P stopped serving after its peer died"
        assert check(dc, dst, 0, 1, [7, 8], 40, seed=2)
        assert "b" in seen["finished_sending"] and seen["expired"] == {"a"}, seen
        assert p.stats()["blocks_held"] == 0
    finally:
        if d1 is not None and d1.is_alive():
            d1.kill()
        if d2 is not None:
            d2.close()
        p.close()
