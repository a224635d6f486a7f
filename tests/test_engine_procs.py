"""Engines in separate processes: P tp=2 -> D tp=1 and P tp=1 -> D tp=2 over ipc and pg,
different layouts and block sizes; byte-exact arrival, frees exactly when notified, one
report per request; an exporter killed mid-transfer."""

from __future__ import annotations

import random
import time

import pytest
import torch

from kvxfer import CompletionAggregator, KVCacheSpec
from kvxfer.completion import PollResult

from .engine_procs import exporter_rank, free_port_base, loader_rank, run_procs


def _scenario(src_spec, src_tp, dst_spec, dst_tp, transport, lengths, seed=0, **kw):
    rng = random.Random(seed)
    src_free = list(range(64))
    dst_free = list(range(64))
    rng.shuffle(src_free)
    rng.shuffle(dst_free)
    reqs, dst_ids = [], {}
    for i, n in enumerate(lengths):
        rid = f"req-{i}"
        s_ids = [src_free.pop() for _ in range(src_spec.num_blocks_for(n))]
        dst_ids[rid] = [dst_free.pop() for _ in range(dst_spec.num_blocks_for(n))]
        reqs.append((rid, n, 100 + i, s_ids))
    sc = {
        "src_spec": src_spec.to_dict(),
        "dst_spec": dst_spec.to_dict(),
        "src_tp": src_tp,
        "dst_tp": dst_tp,
        "transport": transport,
        "src_blocks": 64,
        "dst_blocks": 64,
        "requests": reqs,
        "dst_ids": dst_ids,
        "src_port": free_port_base(src_tp),
        "dst_port": free_port_base(dst_tp),
    }
    sc.update(kw)
    return sc


def _run(sc, deadline=60.0):
    procs = {}
    for r in range(sc["src_tp"]):
        procs[f"P{r}"] = (exporter_rank, (sc, r, "@queue:params", "@queue:ctl", "@queue:go"))
    for r in range(sc["dst_tp"]):
        procs[f"D{r}"] = (loader_rank, (sc, r, "@queue:params", "@queue:ctl", "@queue:go"))
    return run_procs(procs, deadline)


def _aggregate(res, prefix, tp):
    agg = CompletionAggregator(tp)
    reported: list[str] = []
    polls = [res[f"{prefix}{r}"]["polls"] for r in range(tp)]
    for i in range(max(len(p) for p in polls)):
        for r in range(tp):
            if i < len(polls[r]):
                p = polls[r][i]
                out = agg.add(
                    r,
                    PollResult(
                        set(p["finished_sending"]),
                        set(p["finished_recving"]),
                        p["failed"],
                        set(p["expired"]),
                        p["errors"],
                    ),
                )
                reported += sorted(out.finished_recving) + sorted(out.failed)
                reported += sorted(out.finished_sending) + sorted(out.expired)
    return reported


CASES = [
    # P tp=2 NHD bs=16 -> D tp=1 HND bs=8 (fp16, head_dim 24)
    (KVCacheSpec(2, 4, 24, 16, torch.float16), 2, KVCacheSpec(2, 4, 24, 8, torch.float16, layout="HND"), 1),
    # P tp=1 HND bs=8 -> D tp=2 NHD bs=12 (bf16)
    (KVCacheSpec(3, 2, 16, 8, torch.bfloat16, layout="HND"), 1, KVCacheSpec(3, 2, 16, 12, torch.bfloat16), 2),
]


@pytest.mark.parametrize("transport", ["ipc", "pg", "ipc-cma"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_transfer_between_processes(case, transport):
    """``ipc-cma``: P's caches are plain tensors, which ipc reads with cross-memory attach."""
    src, src_tp, dst, dst_tp = CASES[case]
    lengths = [1, 7, 8, 16, 37, 64, 100]
    hold = dst_tp == 2  # D rank 1 loads only after P checked it freed nothing early
    cma = transport == "ipc-cma"
    transport = "ipc" if cma else transport
    sc = _scenario(src, src_tp, dst, dst_tp, transport, lengths, hold=hold, hold_s=0.4, plain_src=cma)
    res = _run(sc)
    want = {r[0] for r in sc["requests"]}
    params = [res[f"P{r}"]["params"] for r in range(src_tp)]
    assert all(p == params[0] for p in params), "export params differ between ranks"
    for r in range(dst_tp):
        d = res[f"D{r}"]
        assert d["ok"] == {rid: True for rid in want}, [p["errors"] for p in d["polls"] if p["errors"]]
        assert d["untouched"], f"D{r} wrote outside the requests' token slots"
        assert d["stats"]["transfers"] == len(want) and d["stats"]["failures"] == 0
        assert d["stats"]["transports"] == {"P": transport}
        if transport == "ipc":
            how = "cross-memory attach" if cma else "shared memory"
            assert d["stats"]["transport_reasons"]["P"] == f"ipc: {how} on one host"
        assert d["stats"]["loads_pending"] == 0
    for r in range(src_tp):
        p = res[f"P{r}"]
        assert p["early"] == [], f"P{r} freed {p['early']} before every loader rank notified"
        assert p["stats"]["blocks_held"] == 0 and p["stats"]["expirations"] == 0
        sent = [rid for poll in p["polls"] for rid in poll["finished_sending"]]
        assert sorted(sent) == sorted(want)
    # D's aggregator reports each request exactly once, P's too.
    assert sorted(_aggregate(res, "D", dst_tp)) == sorted(want)
    assert sorted(_aggregate(res, "P", src_tp)) == sorted(want)


def test_exporter_killed_mid_transfer():
    """P dies after gathering, before sending: D reports failed within its bound, no hang."""
    src = KVCacheSpec(2, 2, 16, 16, torch.float16)
    sc = _scenario(
        src, 1, src, 1, "pg", [40, 20], die_before_send=True, lease_s=3.0, timeout_s=1.5, deadline_s=8.0
    )
    res = _run(sc, deadline=40)
    assert res["P0"] == ("died", 3)
    d = res["D0"]
    failed = {rid for poll in d["polls"] for rid in poll["failed"]}
    assert failed == {"req-0", "req-1"}
    assert d["stats"]["transfers"] == 0
    blocks = {rid: ids for poll in d["polls"] for rid, ids in poll["failed"].items()}
    assert blocks["req-0"] == sc["dst_ids"]["req-0"]


def test_exporter_killed_before_grant_ipc():
    """With ipc, a dead exporter never grants the lease: failed, never copied."""
    src = KVCacheSpec(2, 2, 16, 16, torch.float16)
    sc = _scenario(src, 1, src, 1, "ipc", [40], lease_s=3.0, timeout_s=1.5, deadline_s=8.0)
    sc["exporter_exit_after_export"] = True
    procs = {
        "P0": (exporter_rank_then_die, (sc, 0, "@queue:params", "@queue:ctl")),
        "D0": (loader_rank, (sc, 0, "@queue:params", "@queue:ctl")),
    }
    res = run_procs(procs, 40)
    assert res["P0"] == ("died", 4)
    d = res["D0"]
    assert {rid for poll in d["polls"] for rid in poll["failed"]} == {"req-0"}
    assert d["untouched"]


def exporter_rank_then_die(sc, tp_rank, q_out, q_ctl):
    import os

    from kvxfer import TransferEngine
    from kvxfer.transports.ipc.shm import alloc_shm_caches

    from .engine_payload import fill
    from .engine_procs import _spec

    spec = _spec(sc["src_spec"])
    shm = alloc_shm_caches(spec, sc["src_blocks"], 1)
    eng = TransferEngine(
        spec, shm.caches, 0, 1, "P", transport="ipc", lease_s=3.0, port=sc["src_port"]
    ).start()
    params = []
    for rid, n, seed, ids in sc["requests"]:
        fill(shm.caches, spec, 0, 1, ids, n, seed)
        params.append(eng.export(rid, ids, n))
    eng.close()  # the side channel is gone; shm is left behind as a crash would
    q_out.put(params)
    q_out.close()
    q_out.join_thread()  # flush before dying
    os._exit(4)


def stuck_loader(spec_d: dict, params: dict, q_out) -> None:
    """D1: loads over pg, then stops right before receiving (as a hung or dying peer would)."""
    import time as _time

    from kvxfer import TransferEngine

    from .engine_procs import _spec

    spec = _spec(spec_d)
    caches = [torch.zeros(spec.cache_shape(160, 1), dtype=spec.dtype) for _ in range(spec.num_layers)]
    eng = TransferEngine(spec, caches, 0, 1, "D1", transport="pg", timeout_s=30.0).start()

    def park():
        q_out.put("receiving")
        _time.sleep(120)

    eng._hooks["before_recv"] = park
    eng.load("a", params, list(range(spec.num_blocks_for(params["num_tokens"]))))
    end = _time.monotonic() + 120
    while _time.monotonic() < end:
        eng.poll()
        _time.sleep(0.01)


def test_loader_killed_mid_send_exporter_keeps_serving():
    """P sends a 16 MiB wire to D1 over a Gloo pair; D1 dies before receiving it. P's send
    fails within its bound, the broken pair is aborted, P's lease frees the blocks, and P goes
    on serving another loader's new request byte for byte (nothing takes P's process down)."""
    from kvxfer import TransferEngine

    from .engine_payload import check, fill
    from .engine_procs import _context

    spec = KVCacheSpec(2, 8, 128, 16, torch.bfloat16)  # 8 KiB per token of wire
    nb = 160
    p_caches = [torch.zeros(spec.cache_shape(nb, 1), dtype=spec.dtype) for _ in range(2)]
    p = TransferEngine(spec, p_caches, 0, 1, "P", transport="pg", timeout_s=2.0, lease_s=3.0).start()
    ctx = _context()
    q = ctx.Queue()
    ids_a = list(range(128))
    fill(p_caches, spec, 0, 1, ids_a, 2048, seed=1)
    params_a = p.export("a", ids_a, 2048)
    d1 = ctx.Process(target=stuck_loader, args=(spec.to_dict(), params_a, q), daemon=True)
    d1.start()
    d2 = None
    try:
        assert q.get(timeout=60) == "receiving"
        d1.kill()
        d1.join(10)
        assert not d1.is_alive()
        ids_b = list(range(128, 131))
        fill(p_caches, spec, 0, 1, ids_b, 40, seed=2)
        params_b = p.export("b", ids_b, 40)
        d_caches = [torch.zeros(spec.cache_shape(16, 1), dtype=spec.dtype) for _ in range(2)]
        d2 = TransferEngine(spec, d_caches, 0, 1, "D2", transport="pg", timeout_s=5.0).start()
        d2.load("b", params_b, [7, 8, 9])
        end = time.monotonic() + 20
        done, p_seen = None, {"finished_sending": set(), "expired": set()}
        while time.monotonic() < end and (done is None or "a" not in p_seen["expired"]):
            r = d2.poll()
            assert not r.failed, r.errors
            if "b" in r.finished_recving:
                done = time.monotonic()
            rp = p.poll()
            p_seen["finished_sending"] |= rp.finished_sending
            p_seen["expired"] |= rp.expired
            time.sleep(0.01)
        assert done is not None, "P stopped serving after its peer died"
        assert check(d_caches, spec, 0, 1, [7, 8, 9], 40, seed=2)
        assert "b" in p_seen["finished_sending"] and p_seen["expired"] == {"a"}, p_seen
        assert p.stats()["blocks_held"] == 0
        assert not [k for k in p._transports["pg"].senders if k.startswith("D1/")]  # the broken pair is gone
    finally:
        if d1.is_alive():
            d1.kill()
        if d2 is not None:
            d2.close()
        p.close()
