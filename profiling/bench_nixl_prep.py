"""Host cost of one nixl direct READ, for two source trees interleaved: before -> after a change
to how the READ's descriptors are made (per READ, or prepared once per peer and indexed).

One worker process per tree imports that tree's ``kvxfer`` and runs, in-process, an exporter P
and a loader D over NIXL (UCX loopback, ``UCX_NET_DEVICES=lo``, caches in CPU DRAM), both NHD
block 16 so every read takes the direct path. Timed: the loader's direct READ of a batch
(``NixlSession._direct``: its descriptors or indices, the data READ posted and waited for, the
epoch READ), wall time per call (``all``), and that time less NIXL's posting
(``nixl_agent.transfer``) and the waits (``NixlAgent.finish``, but not the releases of per-READ
descriptor lists in it): ``host``, what making the READs' descriptors costs (numpy, NIXL's
preparation, ``make_prepped_xfer`` / ``initialize_xfer``, releases). On UCX loopback the posting
moves most bytes itself, so ``all`` grows with the number of runs UCX moves, alike in both
trees (NIXL merges indexed pairs adjacent on both sides, as the old tree's coalescing did). The caches are 32 layers of one 8-wide bf16 head, so a 4096-
token request is the descriptor count of a real model (32 x 2 x 256 blocks) with 4 MiB of
bytes: the figure is the host's, not the copy's.

Cases: ``1x4096`` (one request of 4096 tokens) and ``8x2K-4K`` (8 requests of 2048-4095
tokens loaded in one poll: one READ), each with D's blocks ``contiguous`` (ids in a row on both
sides: few runs) or ``scattered`` (random ids: one run per block). Rounds alternate the trees
and which goes first, so both see the same machine within seconds; reported: each tree's
median per READ, and the median over rounds of the per-round ratio.

    git worktree add /tmp/base HEAD~1      # or any tree with kvxfer/ at its root
    python profiling/bench_nixl_prep.py /tmp/base . [--rounds 8] [--iters 20]

Needs NIXL (``pip install 'kvxfer[nixl]'``). Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CASES = (
    ("1x4096", "contiguous"),
    ("1x4096", "scattered"),
    ("8x2K-4K", "contiguous"),
    ("8x2K-4K", "scattered"),
)

_WORKER = r"""
import json, os, statistics, sys, time
root = sys.argv[1]
sys.path[:0] = [root]
import numpy as np
import torch
torch.set_num_threads(1)
from kvxfer import KVCacheSpec, TransferEngine
from kvxfer.transports.nixl import agent as A, session as S

spec = KVCacheSpec(32, 1, 8, 16, torch.bfloat16)
NB = 2 * 8 * 4096 // 16 + 64
times, hosts = [], []
acc = {"wait": 0.0, "post": 0.0, "release": 0.0, "in_finish": False}
api = A.load_nixl()
orig, orig_finish = S.NixlSession._direct, A.NixlAgent.finish
orig_post, orig_release = api.nixl_agent.transfer, api.nixl_prepped_dlist_handle.release

def finish(self, *a, **kw):
    t0 = time.perf_counter()
    acc["in_finish"] = True
    try:
        return orig_finish(self, *a, **kw)
    finally:
        acc["in_finish"] = False
        acc["wait"] += time.perf_counter() - t0

def post(self, *a, **kw):
    t0 = time.perf_counter()
    try:
        return orig_post(self, *a, **kw)
    finally:
        acc["post"] += time.perf_counter() - t0

def release(self):
    t0 = time.perf_counter()
    try:
        return orig_release(self)
    finally:
        if acc["in_finish"]:
            acc["release"] += time.perf_counter() - t0

def timed(self, st, transfer):
    acc.update(wait=0.0, post=0.0, release=0.0)
    t0 = time.perf_counter()
    try:
        return orig(self, st, transfer)
    finally:
        t = time.perf_counter() - t0
        times.append(t)
        hosts.append(t - acc["wait"] - acc["post"] + acc["release"])

A.NixlAgent.finish = finish
api.nixl_agent.transfer = post
api.nixl_prepped_dlist_handle.release = release
S.NixlSession._direct = timed
A.NixlAgent.finish = finish
caches = lambda: [torch.zeros(spec.cache_shape(NB, 1), dtype=spec.dtype) for _ in range(spec.num_layers)]
p = TransferEngine(spec, caches(), 0, 1, "P", transport="nixl").start()
d = TransferEngine(spec, caches(), 0, 1, "D", transport="nixl").start()
rng = np.random.default_rng(int(sys.argv[2]))
seq = [0]

def one(case, order):
    n_req = 1 if case == "1x4096" else 8
    lens = [4096] if n_req == 1 else [int(x) for x in rng.integers(2048, 4096, n_req)]
    need = [-(-n // 16) for n in lens]
    if order == "contiguous":
        src = np.arange(sum(need)); dst = np.arange(sum(need)) + 16
    else:
        src = rng.permutation(NB)[: sum(need)]; dst = rng.permutation(NB)[: sum(need)]
    cuts = np.cumsum([0] + need)
    rids = []
    for i, n in enumerate(lens):
        seq[0] += 1
        rid = f"r{seq[0]}"
        prm = p.export(rid, src[cuts[i]:cuts[i + 1]].tolist(), n)
        d.load(rid, prm, dst[cuts[i]:cuts[i + 1]].tolist())
        rids.append(rid)
    left, end = set(rids), time.monotonic() + 60
    while left and time.monotonic() < end:
        r = d.poll()
        left -= set(r.finished_recving)
        if r.failed:
            raise RuntimeError(f"load failed: {r.errors}")
        p.poll()
        time.sleep(0.0005)
    if left:
        raise RuntimeError(f"not loaded within 60 s: {sorted(left)}")
    for _ in range(3):
        p.poll()

t0 = time.perf_counter()
one("1x4096", "contiguous")  # the handshake (and, after the change, the preparation)
print(json.dumps({"first_ms": 1e3 * (time.perf_counter() - t0)}), flush=True)
for line in sys.stdin:
    case, order, iters = line.split()
    del times[:], hosts[:]
    for _ in range(int(iters)):
        one(case, order)
    med = lambda xs: 1e6 * statistics.median(xs)
    print(json.dumps({"host_us": med(hosts), "total_us": med(times), "reads": len(times)}), flush=True)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before", help="tree with kvxfer/ at its root (the old code)")
    ap.add_argument("after", help="tree with kvxfer/ at its root (the new code)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--iters", type=int, default=20, help="batches per case and round")
    a = ap.parse_args()
    env = dict(os.environ)
    env.setdefault("UCX_NET_DEVICES", "lo")
    env.pop("PYTHONPATH", None)
    trees = {"before": os.path.abspath(a.before), "after": os.path.abspath(a.after)}
    procs, first = {}, {}
    for k, root in trees.items():
        procs[k] = subprocess.Popen(
            [sys.executable, "-c", _WORKER, root, "1"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=root,
        )
        first[k] = json.loads(procs[k].stdout.readline())["first_ms"]
    got: dict = {(k, c): [] for k in trees for c in CASES}
    try:
        for rnd in range(a.rounds):
            order = list(trees) if rnd % 2 == 0 else list(trees)[::-1]
            for case in CASES:
                for k in order:
                    procs[k].stdin.write(f"{case[0]} {case[1]} {a.iters}\n")
                    procs[k].stdin.flush()
                    got[k, case].append(json.loads(procs[k].stdout.readline()))
    finally:
        for pr in procs.values():
            pr.stdin.close()
            pr.wait(60)
    out = {"first_load_ms": first, "rounds": a.rounds, "iters": a.iters, "cases": {}}
    med = statistics.median
    print(f"per direct READ, median us over {a.rounds} rounds x {a.iters} batches (UCX loopback, CPU DRAM)")
    print(
        "host: making the READs (descriptors or indices, preparation, releases); all: with posting and waits"
    )
    print(
        f"{'case':<22}{'host before':>13}{'host after':>12}{'ratio':>8}{'all before':>12}{'all after':>11}{'ratio':>8}"
    )
    for case in CASES:
        row = {}
        for what in ("host_us", "total_us"):
            b = [r[what] for r in got["before", case]]
            f = [r[what] for r in got["after", case]]
            row[what] = (med(b), med(f), med(x / y for x, y in zip(f, b)))
        name = f"{case[0]} {case[1]}"
        (hb, ha, hr), (tb, ta, tr) = row["host_us"], row["total_us"]
        print(f"{name:<22}{hb:>13.0f}{ha:>12.0f}{hr:>8.2f}{tb:>12.0f}{ta:>11.0f}{tr:>8.2f}")
        out["cases"][name] = {
            "host_before_us": hb,
            "host_after_us": ha,
            "host_ratio": hr,
            "all_before_us": tb,
            "all_after_us": ta,
            "all_ratio": tr,
        }
    print(f"first load (handshake included), ms: before {first['before']:.0f}, after {first['after']:.0f}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
