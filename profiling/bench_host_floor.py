"""The least one request's control path can cost on this machine, step by step.

``bench_engine.host_floor`` runs only the steps any design must take for a 4K-token, 32-layer
request (export, load, grant, copy, notify, poll: its docstring lists what each holds), in
straight-line code and as cold as ``bench_engine.host_cost`` runs the engine (each iteration
first shuffles two id lists). ``bench_engine.py`` prints its total beside the engine's; this
script prints each step, cold and warm (no shuffle in between), with the engine's figure from
the same run.

With ``--batch 8`` each round exports and loads 8 requests and moves them with one grant, one
ops call and one notification, as the engine batches a poll's loads; figures are per request.

    python profiling/bench_host_floor.py [--iters 400] [--batch 1]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_engine


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=400, help="timed iterations (default 400)")
    ap.add_argument("--batch", type=int, default=1, help="requests per round (default 1)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    ref = bench_engine.python_reference_us()
    cold = bench_engine.host_floor(a.iters, True, a.batch)
    warm = bench_engine.host_floor(a.iters, False, a.batch)
    engine = bench_engine.host_cost(n_iter=min(a.iters, 300), batch=a.batch)
    what = (
        "one 4K-token, 32-layer request"
        if a.batch == 1
        else f"4K-token, 32-layer requests in batches of {a.batch}, per request"
    )
    print(f"least host cost of {what}, us (medians; steps any design must take)")
    print(f"  {'step':<8} {'cold':>8} {'warm':>8}")
    for k in ("export", "load", "grant", "copy", "notify", "poll", "total"):
        print(f"  {k:<8} {cold[k + '_us']:8.1f} {warm[k + '_us']:8.1f}")
    print(
        f"  the engine's path in the same run (bench_engine.host_cost, cold): {engine['total_us']:.1f} us; "
        f"target <= {bench_engine.HOST_TARGET_US if a.batch == 1 else bench_engine.BATCH_TARGET_US:.0f} us"
    )
    print(f"  this machine now: {ref:.2f} us for a reference Python loop (sum(range(100)))")
    print(
        json.dumps(
            {
                "bench": "host_floor",
                "batch": a.batch,
                "cold": cold,
                "warm": warm,
                "engine_us": engine["total_us"],
                "python_reference_us": ref,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
