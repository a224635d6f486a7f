"""Host cost of two source trees, interleaved finely enough that a shared VM's speed drifts
cancel: before -> after for one change to the engine's per-request path.

``bench_engine.py`` run once per tree moves by +-40 % between runs on the 2-vCPU CI VM (its
reference loop takes 0.72-1.6 us within minutes), which hides changes of 5-20 %. Here one
worker process per tree imports that tree's ``kvxfer`` and ``profiling/bench_engine.py`` and
runs a short ``host_cost`` on request; rounds alternate the trees (and which goes first), so
both see the same machine within seconds. Reported: each tree's median total per request, and
the median over rounds of the per-round ratio (the figure to quote).

    git worktree add /tmp/base HEAD~1
    python profiling/compare_host_cost.py /tmp/base . [--rounds 60]

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

# (name, requests per call, batch, partial last blocks, one-sided, in one batched_loads() block)
CASES = (
    ("1x4096", 60, 1, False, False, False),
    ("8x4096", 8, 8, False, False, False),
    ("8x2K-4K", 8, 8, True, False, False),
    ("1x4096-1s", 60, 1, False, True, False),
    ("8x4096-1sb", 8, 8, False, True, True),
)

_WORKER = """
import json, os, sys
root = sys.argv[1]
sys.path[:0] = [root, os.path.join(root, "profiling")]
import torch
torch.set_num_threads(1)
import bench_engine
for line in sys.stdin:
    n, batch, unaligned, onesided, batched = line.split()
    r = bench_engine.host_cost(
        int(n), int(batch), 4096, unaligned=unaligned == "1", onesided=onesided == "1", batched=batched == "1"
    )
    print(json.dumps([r["total_us"], r["p_side_us"], r["d_side_us"]]), flush=True)
"""


def _worker(root: str) -> subprocess.Popen:
    # one hash seed for every worker: dict and set layouts (hence speed) then do not differ
    # between the two trees' processes by the luck of the seed
    env = {**os.environ, "PYTHONPATH": root, "PYTHONHASHSEED": "0"}
    return subprocess.Popen(
        [sys.executable, "-c", _WORKER, root],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=root,
        env=env,
    )


def _stop(procs: dict[str, subprocess.Popen]) -> None:
    for p in procs.values():
        if p.stdin:
            p.stdin.close()
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()


def compare(base: str, work: str, rounds: int, restarts: int = 6) -> dict:
    """Per case: each tree's median total per request and the median per-round ratio. Fresh
    worker processes every ``rounds / restarts`` rounds: a process's own layout (ASLR, allocator
    state) can make it a few % faster or slower for its whole life, which rounds alone do not
    cancel."""
    trees = {"base": os.path.abspath(base), "work": os.path.abspath(work)}
    # per tree and case: (total, P side, D side) per round
    res: dict[str, dict[str, list[list[float]]]] = {k: {c[0]: [] for c in CASES} for k in trees}
    per_proc = max(1, -(-rounds // max(1, restarts)))
    procs: dict[str, subprocess.Popen] = {}
    try:
        for r in range(rounds):
            if r % per_proc == 0:  # fresh workers, started in turn base first and work first
                _stop(procs)
                order = list(trees) if (r // per_proc) % 2 == 0 else list(trees)[::-1]
                procs = {k: _worker(trees[k]) for k in order}
            for name, n, batch, unaligned, onesided, batched in CASES:
                for k in list(trees) if r % 2 == 0 else list(trees)[::-1]:
                    p = procs[k]
                    assert p.stdin is not None and p.stdout is not None
                    p.stdin.write(f"{n} {batch} {int(unaligned)} {int(onesided)} {int(batched)}\n")
                    p.stdin.flush()
                    line = p.stdout.readline()
                    if not line:
                        raise RuntimeError(f"the {k} worker ({trees[k]}) died: run its bench_engine.py alone")
                    res[k][name].append(json.loads(line))
    finally:
        _stop(procs)
    out = {"trees": trees, "rounds": rounds, "restarts": restarts, "cases": {}}
    for name, *_ in CASES:
        base = [r[0] for r in res["base"][name]]
        work = [r[0] for r in res["work"][name]]
        ratios = [w / b for w, b in zip(work, base)]
        # per pair of worker processes: a process's layout moves its speed for its whole life,
        # so the spread of these medians is the part of the noise that more rounds do not cancel
        pairs = [statistics.median(ratios[i : i + per_proc]) for i in range(0, len(ratios), per_proc)]
        q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
        out["cases"][name] = {
            "base_us": statistics.median(base),
            "work_us": statistics.median(work),
            "ratio": statistics.median(ratios),
            "ratio_q1": q1,
            "ratio_q3": q3,
            "pair_ratios": pairs,
        }
        for i, side in ((1, "p"), (2, "d")):  # each engine's process: P and D are apart in serving
            b = [r[i] for r in res["base"][name]]
            w = [r[i] for r in res["work"][name]]
            out["cases"][name][f"{side}_base_us"] = statistics.median(b)
            out["cases"][name][f"{side}_work_us"] = statistics.median(w)
            out["cases"][name][f"{side}_ratio"] = statistics.median([x / y for x, y in zip(w, b)])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base", help="the tree before (a git worktree)")
    ap.add_argument("work", nargs="?", default=".", help="the tree after (default: this one)")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--restarts", type=int, default=6, help="fresh worker pairs over the run")
    a = ap.parse_args()
    out = compare(a.base, a.work, a.rounds, a.restarts)
    print(f"host cost per request, us (median of {a.rounds} interleaved rounds)")
    print(f"  {'case':<12}{'base':>10}{'work':>10}{'work/base':>11}{'rounds q1-q3':>15}{'worker pairs':>15}")
    for name, c in out["cases"].items():
        q = f"{c['ratio_q1']:.2f}-{c['ratio_q3']:.2f}"
        pr = f"{min(c['pair_ratios']):.2f}-{max(c['pair_ratios']):.2f}"
        print(f"  {name:<12}{c['base_us']:10.1f}{c['work_us']:10.1f}{c['ratio']:11.2f}{q:>15}{pr:>15}")
        for side in ("p", "d"):
            print(
                f"    {side.upper()} side {c[side + '_base_us']:10.1f}{c[side + '_work_us']:10.1f}"
                f"{c[side + '_ratio']:11.2f}"
            )
    print("  (work/base: median of the per-round ratios; worker pairs: min-max of each pair's median,")
    print("   the noise of process layout that more rounds do not cancel: quote a range over runs)")
    print(json.dumps({"bench": "compare_host_cost", **out}))


if __name__ == "__main__":
    main()
