"""Instructions one request's host path executes, counted by valgrind (callgrind): a figure that
does not move with the shared VM's speed, for before -> after on the engine's control path.

``bench_engine.host_cost`` (one 4K-token request per iteration by default, the id shuffle left
out so that every iteration runs the same code) is run under ``valgrind --tool=callgrind`` for
``--short`` and ``--long`` iterations; the main thread's count difference over the extra
iterations is the cost of one iteration, start-up and the engine's own threads (polling loops
whose counts follow wall time, not work) left out. It includes the harness's per-iteration
list building (a constant; see the top functions). With ``--base`` the same for another tree.

    python profiling/count_host_instructions.py [--base /tmp/base] [--batch 1] [--top 20]

Needs valgrind (``apt install valgrind``); ~1-2 minutes per tree (its two runs at once).
Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

_RUN = """
import os, sys
root = sys.argv[1]
sys.path[:0] = [root, os.path.join(root, "profiling")]
import torch
torch.set_num_threads(1)
import bench_engine
bench_engine.random.Random.shuffle = lambda self, x: None  # the same work every iteration
bench_engine.host_cost(int(sys.argv[2]), int(sys.argv[3]), 4096)
"""
_LINE = re.compile(r"\s*([\d,]+)\s+\(\s*[\d.]+%\)\s+(.*)")
# start-up work (torch's import, BLAS threads) whose counts differ run to run: not the request's
_NOISE = ("torch/lib", "fmt::", "numpy.libs", "libgomp")


def _profile(root: str, n: int, batch: int, out_dir: str) -> dict[str, int]:
    """Self instructions per function of the main thread for ``n`` iterations."""
    out = os.path.join(out_dir, f"cg.{n}")
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    cmd = ["valgrind", "--tool=callgrind", "--separate-threads=yes", f"--callgrind-out-file={out}"]
    subprocess.run(
        [*cmd, sys.executable, "-c", _RUN, root, str(n), str(batch)],
        check=True, capture_output=True, env=env, timeout=1800,
    )  # fmt: skip
    text = subprocess.run(
        ["callgrind_annotate", "--inclusive=no", "--threshold=100", f"{out}-01"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    got: dict[str, int] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if m and "PROGRAM TOTALS" not in m.group(2):
            got[m.group(2).strip()] = int(m.group(1).replace(",", ""))
    return got


def count(root: str, batch: int = 1, short: int = 100, long: int = 1100) -> dict:
    """Per-iteration instructions of ``root``'s engine path: the total and by function."""
    # both runs at once: each is mostly valgrind starting Python and torch, so on two cores this
    # halves the wall time; the main thread's counts do not depend on the timing
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(_profile, root, n, batch, tmp) for n in (short, long)]
        a, b = (r.result() for r in runs)
    n = long - short
    per = {k: (b.get(k, 0) - a.get(k, 0)) / n for k in set(a) | set(b) if not any(x in k for x in _NOISE)}
    if not per:
        raise RuntimeError(f"callgrind_annotate gave no functions for {root}: nothing to count")
    return {"tree": root, "batch": batch, "per_iteration": sum(per.values()) / batch, "functions": per}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default=".", help="the tree measured (default: this one)")
    ap.add_argument("--base", help="a tree to compare with (a git worktree)")
    ap.add_argument("--batch", type=int, default=1, help="requests per iteration (default 1)")
    ap.add_argument("--top", type=int, default=20, help="functions listed (default 20)")
    a = ap.parse_args()
    if shutil.which("valgrind") is None:
        print("valgrind is not installed (apt install valgrind): nothing counted")
        return 2
    trees = {"work": os.path.abspath(a.work)}
    if a.base:
        trees["base"] = os.path.abspath(a.base)
    res = {k: count(v, a.batch) for k, v in trees.items()}
    unit = "request" if a.batch == 1 else f"request (batches of {a.batch})"
    for k, r in res.items():
        print(f"{k}: {r['per_iteration']:,.0f} instructions per {unit}  ({r['tree']})")
    if "base" in res:
        print(f"work / base: {res['work']['per_iteration'] / res['base']['per_iteration']:.3f}")
    print(f"top functions of work, instructions per iteration (batch {a.batch}):")
    for name, v in sorted(res["work"]["functions"].items(), key=lambda x: -x[1])[: a.top]:
        print(f"  {v:10,.0f}  {name[:120]}")
    print(
        json.dumps(
            {"bench": "count_host_instructions", **{k: {**r, "functions": None} for k, r in res.items()}}
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
