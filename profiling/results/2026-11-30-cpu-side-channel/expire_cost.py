"""ExportTracker.expire() per call with N live exports (what the exporter's server thread runs
after each batch of messages it serves, and every tick), for each source tree given, in one run:

    python expire_cost.py /tmp/wt-base /work/main

Each tree runs in its own child process (its kvxfer, its control module when built)."""

import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, statistics, sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
from kvxfer import idops
from kvxfer.exports import ExportTracker
out = {"native": idops.native() is not None}
t = ExportTracker(20_000, 600.0)
for n in (0, 100, 1000, 10000):
    while t.num_live() < n:
        k = t.num_live()
        t.add(f"r{k}", np.array([2 * k, 2 * k + 1]), 32)
    ts = []
    for _ in range(400):
        t0 = time.perf_counter(); t.expire(); ts.append(time.perf_counter() - t0)
    out[n] = statistics.median(ts) * 1e6
print(json.dumps(out))
"""

rows = {}
for rnd in range(3):
    for tree in sys.argv[1:] if rnd % 2 == 0 else sys.argv[:0:-1]:
        r = subprocess.run([sys.executable, "-c", CHILD, os.path.abspath(tree)], capture_output=True, text=True, check=True)
        rows.setdefault(tree, []).append(json.loads(r.stdout))
for tree, runs in rows.items():
    med = {k: statistics.median(x[k] for x in runs) for k in ("0", "100", "1000", "10000")}
    print(f"{tree}: control module {runs[0]['native']}; expire() us per call by live exports: "
          + ", ".join(f"{k}: {v:.1f}" for k, v in med.items()))
