"""Engine benchmark: host-side cost per request, and CPU transfer bandwidth of ipc and pg.

1. Host cost (no data moved) for a 4K-token, 32-layer request (NHD bf16, 8 kv heads x 128,
   block 16): export() (validation, lease, params), load() (validation, bookkeeping), the
   loader's planning (plan lookup, unit lists, dedupe, chunk packing, grant/notify message
   encoding) and the exporter's bookkeeping (grant with epoch snapshot, notification count,
   release). DESIGN target: <= 50 us per request.
2. Bandwidth: batches of requests moved P -> D (engines in one process, threads) over ``ipc``
   (one copy_blocks from the mapped shm cache) and ``pg`` (gather, Gloo send/recv over
   loopback, scatter), as a fraction of a plain ``copy_`` of the same bytes in the same run.

    python profiling/bench_engine.py [--tokens 4096] [--reqs 4] [--iters 3]

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvxfer import KVCacheSpec, TransferEngine, plan_reads
from kvxfer import control as C
from kvxfer.tracker import ExportTracker
from kvxfer.transports import Item, build_chunks, dedupe_prefixes, units_of
from kvxfer.transports.shm import alloc_shm_caches


def host_cost(n_iter: int = 300) -> dict:
    spec = KVCacheSpec(32, 8, 128, 16, torch.bfloat16)
    tokens = 4096
    nb = tokens // 16 * 4
    # No data moves here: "meta" tensors give the caches their full shape and strides
    # without 2 GB of memory.
    caches = [torch.empty(spec.cache_shape(nb, 1), dtype=spec.dtype, device="meta") for _ in range(32)]
    eng = TransferEngine(spec, caches, 0, 1, "P", transport="pg").start()
    dst = TransferEngine(spec, caches, 0, 1, "D", transport="pg").start()
    ids = list(range(256))
    exp_t = ExportTracker(nb, 30.0)
    t_export = t_load = t_plan = t_book = 0.0
    try:
        for i in range(n_iter):
            rid = f"r{i}"
            t0 = time.perf_counter()
            params = eng.export(rid, ids, tokens)
            t1 = time.perf_counter()
            dst.load(rid, params, ids)
            t2 = time.perf_counter()
            # loader planning: what _run_remote/_ipc_read do before and after the copy call
            plan = plan_reads(spec, 1, spec, 1)
            reads = plan.reads(0)
            it = Item(
                rid,
                units_of(torch.tensor(params["block_ids"]), 16, tokens, 1),
                units_of(torch.tensor(ids), 16, tokens, 1),
                tokens,
            )
            dedupe_prefixes([it], 1, 1)
            chunks = build_chunks([it], 1, 1)
            C.encode(C.ReadReq("D", 0, 1, [rid]))
            C.encode(C.Notify("D", 0, 1, [rid], []))
            assert len(chunks) == 1 and reads
            t3 = time.perf_counter()
            # exporter bookkeeping: grant (epoch snapshot), notification, release
            exp_t.add(rid, torch.tensor(ids), tokens)
            ok, _ = exp_t.grant([rid])
            C.encode(C.ReadReply(ok=list(ok), epochs=[e.numpy().tobytes() for e in ok.values()], failed={}))
            exp_t.notify(rid, ("D", 0), plan.expected_notifications(0))
            t4 = time.perf_counter()
            if i >= 20:  # warm-up excluded
                t_export += t1 - t0
                t_load += t2 - t1
                t_plan += t3 - t2
                t_book += t4 - t3
            eng.abort_export(rid)
            dst._loads.finish(rid)
            with dst._lock:
                dst._incoming.clear()
    finally:
        eng.close()
        dst.close()
    n = n_iter - 20
    out = {
        "export_us": t_export / n * 1e6,
        "load_us": t_load / n * 1e6,
        "plan_us": t_plan / n * 1e6,
        "exporter_book_us": t_book / n * 1e6,
    }
    out["total_us"] = sum(out.values())
    return out


def bandwidth(transport: str, tokens: int, reqs: int, iters: int) -> dict:
    spec = KVCacheSpec(4, 8, 64, 16, torch.float16)
    per = spec.num_blocks_for(tokens)
    nb = per * reqs + 8
    src = alloc_shm_caches(spec, nb, 1, fill=1)
    dst = alloc_shm_caches(spec, nb, 1, fill=0)
    p = TransferEngine(spec, src.caches, 0, 1, "P", transport=transport, lease_s=60).start()
    d = TransferEngine(spec, dst.caches, 0, 1, "D", transport=transport, lease_s=60).start()
    nbytes = tokens * reqs * spec.bytes_per_token()
    times = []
    try:
        for it in range(iters + 1):  # first round handshakes and pairs: excluded
            params = [
                p.export(f"b{it}-{r}", list(range(r * per, (r + 1) * per)), tokens) for r in range(reqs)
            ]
            t0 = time.perf_counter()
            for r, prm in enumerate(params):
                d.load(f"b{it}-{r}", prm, list(range(r * per, (r + 1) * per)))
            done: set[str] = set()
            while len(done) < reqs:
                res = d.poll()
                assert not res.failed, res.errors
                done |= res.finished_recving
                time.sleep(0.0002)
            if it:
                times.append(time.perf_counter() - t0)
            while p.stats()["exports_live"]:
                p.poll()
                time.sleep(0.001)
        s = d.stats()
    finally:
        p.close()
        d.close()
        src.close()
        dst.close()
    # plain memcpy of the same bytes, same run
    a = torch.ones(nbytes, dtype=torch.uint8)
    b = torch.empty_like(a)
    b.copy_(a)
    mt = []
    for _ in range(iters):
        t0 = time.perf_counter()
        b.copy_(a)
        mt.append(time.perf_counter() - t0)
    best, mbest = min(times), min(mt)
    return {
        "transport": transport,
        "bytes": nbytes,
        "s": best,
        "GBps": nbytes / best / 1e9,
        "memcpy_GBps": nbytes / mbest / 1e9,
        "fraction_of_memcpy": mbest / best,
        "ops_calls": s["ops_calls"],
        "transport_used": s["transports"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reqs", type=int, default=4)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--host-iters", type=int, default=300)
    a = ap.parse_args()
    torch.set_num_threads(1)
    hc = host_cost(a.host_iters)
    bw = [bandwidth(t, a.tokens, a.reqs, a.iters) for t in ("ipc", "pg")]
    print("host-side cost per request (4096 tokens, 32 layers, 8x128 bf16, block 16):")
    for k, v in hc.items():
        print(f"  {k:<18} {v:8.1f} us")
    print(f"  target <= 50 us: {'met' if hc['total_us'] <= 50 else 'NOT met'}")
    print(f"\n{'transport':<9} {'MiB':>8} {'GB/s':>8} {'memcpy GB/s':>12} {'fraction':>9} {'ops calls':>9}")
    for r in bw:
        print(
            f"{r['transport']:<9} {r['bytes'] / 2**20:8.1f} {r['GBps']:8.2f} {r['memcpy_GBps']:12.2f} "
            f"{r['fraction_of_memcpy']:9.2f} {r['ops_calls']:9d}"
        )
    print(json.dumps({"bench": "engine", "host_cost": hc, "bandwidth": bw}))


if __name__ == "__main__":
    main()
