"""The exporter's records over a server's life: host time of one export and its release
(``ExportTracker.add`` then ``abort``, 256 block ids, no lease-slot table) as the released ids it
remembers (``exports.GONE_KEPT``) fill up, on both record keepers: the control module's
``ExportBook`` and the tracker's Python.

Each keeper runs ``--exports`` exports one after another; the median of each window of
``--window`` of them is printed at the counts it ends at. A cost that grows once ``GONE_KEPT``
ids were released is the remembered ids' bookkeeping.

    python profiling/bench_export_records.py                 # 250 000 exports per keeper
    python profiling/bench_export_records.py --exports 130000 --window 2000

Prints a table (exports so far, us per export and release for each keeper) and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvxfer import exports, idops
from kvxfer.completion import PollResult

NUM_BLOCKS = 1024
NUM_IDS = 256  # a 4K-token request of 16-token blocks


def run(native: bool, total: int, window: int) -> dict[int, float]:
    """Exports counted so far -> median us per export and release over the window ending there."""
    saved = exports._ctl
    if not native:
        exports._ctl = lambda: None
    try:
        t = exports.ExportTracker(NUM_BLOCKS, 30.0)
    finally:
        exports._ctl = saved
    assert (t._book is not None) is native
    ids = np.random.default_rng(0).permutation(NUM_BLOCKS)[:NUM_IDS].astype(np.int64)
    out: dict[int, float] = {}
    times: list[float] = []
    poll = PollResult()
    clock = time.perf_counter
    for k in range(total):
        rid = f"req-{k}"
        t0 = clock()
        t.add(rid, ids, 4096)
        t.abort(rid)
        times.append(clock() - t0)
        if len(times) == window:
            out[k + 1] = statistics.median(times) * 1e6
            times.clear()
            t.drain(poll)  # the reports, as a poll() takes them (outside the timed span)
            poll.finished_sending = set()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--exports", type=int, default=250_000)
    ap.add_argument("--window", type=int, default=5_000)
    a = ap.parse_args()
    assert idops.ensure(), idops.status()
    got = {"native": run(True, a.exports, a.window), "python": run(False, a.exports, a.window)}
    print(f"# us per export and release (median of {a.window}); GONE_KEPT={exports.GONE_KEPT}")
    print(f"{'exports so far':>15} {'native':>8} {'python':>8}")
    for n in got["native"]:
        print(f"{n:>15} {got['native'][n]:>8.2f} {got['python'][n]:>8.2f}")
    print(json.dumps({"bench": "export_records", "gone_kept": exports.GONE_KEPT, "us": got}))


if __name__ == "__main__":
    main()
