"""A request as a set of attention groups: time per request and bytes, against one group.

Two engines in one process (threads), CPU caches in shared memory, a Gemma-3-like model of 12
layers (fp16, 4 kv heads x 64, block 16): as six KV cache groups (5 sliding-window groups of
2 layers, window ``--window``, and 1 full-attention group), and as one group of the same 12
layers (what vLLM moves with its hybrid allocator off: every layer, every token). Per prompt
length and transport: the median time from ``load()`` to the load reported finished, and the
bytes the load moved (from ``stats()``), over ``--iters`` requests.

    python profiling/bench_groups.py [--lengths 512,2048,8192] [--window 1024] [--iters 5]

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvxfer import KVCacheSpec, TransferEngine
from kvxfer.groups.attention import AttentionGroup
from kvxfer.transports.ipc.shm import alloc_shm_caches

LAYERS, HEADS, HD, BS = 12, 4, 64, 16


def _groups(window: int) -> list[AttentionGroup]:
    """Layers 0-9 in 5 sliding groups of 2 (layer j of group g is ``2g + j``), 10-11 full."""
    return [AttentionGroup((2 * g, 2 * g + 1), window=window) for g in range(5)] + [AttentionGroup((10, 11))]


def _lists(groups, n: int, nb_used: int) -> tuple[list[list[int]], int]:
    need = -(-n // BS)
    out = []
    for g in groups:
        dead = g.live_first(n) // BS
        out.append([0] * dead + list(range(nb_used, nb_used + need - dead)))
        nb_used += need
    return out, nb_used


def _one(transport: str, grouped: bool, n: int, window: int, iters: int) -> dict:
    spec = KVCacheSpec(LAYERS, HEADS, HD, BS, torch.float16)
    need = -(-n // BS)
    nb = (6 if grouped else 1) * need * (iters + 1) + 8
    ps, ds = alloc_shm_caches(spec, nb, 1), alloc_shm_caches(spec, nb, 1)
    groups = _groups(window) if grouped else None
    kw = {"transport": transport, "lease_s": 30.0, "groups": groups, "onesided": False}
    p = TransferEngine(spec, ps.caches, 0, 1, "P", **kw).start()
    d = TransferEngine(spec, ds.caches, 0, 1, "D", **kw).start()
    times, moved = [], []
    try:
        used_p = used_d = 1
        for i in range(iters + 1):  # the first: handshake, pairing (not counted)
            if grouped:
                pl, used_p = _lists(groups, n, used_p)
                dl, used_d = _lists(groups, n, used_d)
            else:
                pl, dl = list(range(used_p, used_p + need)), list(range(used_d, used_d + need))
                used_p, used_d = used_p + need, used_d + need
            params = p.export(f"r{i}", pl, n)
            before = d.stats()["bytes"]
            t0 = time.perf_counter()
            d.load(f"r{i}", params, dl)
            res = d.wait([f"r{i}"], 30.0)
            dt = time.perf_counter() - t0
            assert f"r{i}" in res.finished_recving, res.errors
            if i:
                times.append(dt)
                moved.append(d.stats()["bytes"] - before)
            p.poll()
    finally:
        d.close()  # first: its last notification is acknowledged by P
        p.close()
        ps.close()
        ds.close()
    return {"ms": statistics.median(times) * 1e3, "bytes": int(statistics.median(moved))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="512,2048,8192")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--transports", default="ipc,pg")
    a = ap.parse_args(argv)
    rows = []
    print("| transport | prompt tokens | groups: ms | one group: ms | groups: MiB | one group: MiB |")
    print("|---|---|---|---|---|---|")
    for t in a.transports.split(","):
        for n in (int(x) for x in a.lengths.split(",")):
            g = _one(t, True, n, a.window, a.iters)
            o = _one(t, False, n, a.window, a.iters)
            rows.append({"transport": t, "tokens": n, "groups": g, "one": o})
            print(
                f"| {t} | {n} | {g['ms']:.2f} | {o['ms']:.2f} | {g['bytes'] / 2**20:.2f} | {o['bytes'] / 2**20:.2f} |"
            )
    print(json.dumps({"window": a.window, "iters": a.iters, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
