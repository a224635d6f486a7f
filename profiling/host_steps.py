"""Where one request's host time goes, step by step: ``bench_engine``'s host-cost loop with the
engine's steps wrapped in timers.

Each step below (a function or method of kvxfer, named as it is in the code) is timed on every
call, and its median per call is printed. With ``--idle-ms N`` the loop pauses N ms before each
caller's step, as a server's step puts a pause between two calls: every step then runs with
its code and data out of the CPU's caches, as a request's steps do in a server, and the
table says which steps that costs most (``bench_engine``'s ``@N ms`` columns give the
phases). A wrapper costs ~0.2 us per call back to back, more after a pause; the steps nest
(``load`` holds ``load_native``, which holds ``LoadBook.begin``), so their times do not add up.

    python profiling/host_steps.py                      # one-sided path, after 10 ms pauses
    python profiling/host_steps.py --idle-ms 0          # back to back
    python profiling/host_steps.py --path messaged --iters 100

Prints a table (step, calls, median us per call) and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_engine

from kvxfer import auth, completion, engine, exporter, exports, idops, loader, metrics, ops, params, planner
from kvxfer.transports.ipc import lane, onesided, session, slots

# the loads tracker in C (completion.native_load_book) and its one-sided native lane, when built
_BOOK = idops.native().LoadBook if idops.ensure() else None

# (owner, attribute, side): the steps of one request on the loader's (D) and exporter's (P) side;
# a one-sided load takes the native lane (load_native, LoadBook.begin / complete) or, without
# the control module and for the first load of a peer, the Python path (try_load ... _report)
STEPS = (
    (engine.TransferEngine, "export", "P"),
    (exports.ExportTracker, "export_plain", "P"),  # the export's one native call, or None
    (auth.EngineSecret, "export_token", "P"),  # the Python path's (params_for, groups, streaming)
    (exports.ExportTracker, "add", "P"),
    (engine.TransferEngine, "load", "D"),
    (onesided.OneSided, "load_native", "D"),
    *(((_BOOK, "begin", "D"),) if _BOOK is not None else ()),
    (params.KVTransferParams, "from_dict", "D"),
    (engine, "check_block_ids", "D"),  # load()'s Python path (an export's: engine_args)
    (completion.LoadTracker, "add", "D"),
    (onesided.OneSided, "try_load", "D"),
    (params.KVTransferParams, "digest", "D"),
    (slots, "binder", "P+D"),  # what it returns (the binding's hash), taken once, called per request
    (ops.PreparedCopy, "run_bounded", "D"),
    (engine.TransferEngine, "_poll_into", "P+D"),
    (onesided.OneSided, "complete", "D"),
    (lane.NativeLane, "complete", "D"),
    *(((_BOOK, "complete", "D"),) if _BOOK is not None else ()),
    (onesided.OneSided, "_land", "D"),
    (onesided.OneSided, "_report", "D"),
    (loader.Loader, "_run_batch", "D"),  # the messaged path's batch, P's handlers in it
    (planner.Planner, "check", "D"),
    (loader, "ask_grants", "D"),
    (exporter.Exporter, "_handle_read", "P"),
    (exports.ExportTracker, "grant", "P"),
    (loader.Loader, "_read_rank", "D"),
    (session.IpcSession, "start_whole", "D"),  # a lone whole load: nothing planned
    (planner.Planner, "plan", "D"),
    (session.IpcSession, "start", "D"),
    (session.IpcSession, "copy", "D"),
    (ops, "copy_blocks", "D"),
    (session.IpcCompletion, "wait", "D"),
    (planner, "stale_loads", "D"),
    (loader.Loader, "_complete", "D"),
    (loader.Loader, "notify_ids", "D"),  # the one-sided path's (its marks' deferred notifications)
    (loader.Loader, "_send_notify", "D"),  # every notification message
    (exporter.Exporter, "_handle_notify", "P"),
    (exports.ExportTracker, "notify_many", "P"),
    (completion.LoadTracker, "finish_one", "D"),
    (metrics.Metrics, "record_load", "P+D"),
    (metrics.Metrics, "record_loads", "D"),
    (exporter.Exporter, "tick", "P+D"),
    (exports.ExportTracker, "take_marks", "P"),  # the native book's done marks (count_marks without it)
    (exports.ExportTracker, "count_marks", "P"),
    (exports.ExportTracker, "drain", "P+D"),
    (completion.LoadTracker, "drain", "P+D"),
)


WARMUP = 20  # bench_engine.host_cost's untimed requests
# Factories: the engine takes a function from them once and calls it per request; the function
# they return is timed, labelled "<factory>()".
MADE = {(slots, "binder")}


def _wrap(owner, name: str, calls: list[float], exports: list[int]):
    """Replace ``owner.name`` by a timer around it, which keeps the calls made once
    ``WARMUP`` requests were exported (``exports[0]``: exports so far); returns what to put back."""
    raw = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    fn = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
    perf = time.perf_counter
    counts = owner is engine.TransferEngine and name == "export"

    def timed(*args, **kwargs):
        if counts:
            exports[0] += 1
        t0 = perf()
        try:
            return fn(*args, **kwargs)
        finally:
            if exports[0] > WARMUP:
                calls.append(perf() - t0)

    setattr(owner, name, type(raw)(timed) if isinstance(raw, (classmethod, staticmethod)) else timed)
    return raw


def _wrap_made(owner, name: str, calls: list[float], exports: list[int]):
    """Replace the factory ``owner.name`` by one whose functions are timed as :func:`_wrap`
    times a step; returns what to put back."""
    raw = getattr(owner, name)
    perf = time.perf_counter

    def made(*a, **k):
        fn = raw(*a, **k)

        def timed(*args, **kwargs):
            t0 = perf()
            try:
                return fn(*args, **kwargs)
            finally:
                if exports[0] > WARMUP:
                    calls.append(perf() - t0)

        return timed

    setattr(owner, name, made)
    return raw


def _label(owner, name: str) -> str:
    made = "()" if (owner, name) in MADE else ""
    return f"{owner.__name__.removeprefix('kvxfer.')}.{name}{made}"


def measure(path: str, iters: int, idle_s: float) -> dict[str, list[float]]:
    """Per step, the seconds of each call over ``iters`` requests of 4K tokens (``bench_engine``'s
    host-cost loop on ``path``: onesided or messaged), its warm-up requests left out."""
    calls: dict[str, list[float]] = {}
    saved = []
    exports = [0]
    for owner, name, _ in STEPS:
        calls[_label(owner, name)] = got = []
        wrap = _wrap_made if (owner, name) in MADE else _wrap
        saved.append((owner, name, wrap(owner, name, got, exports)))
    try:
        bench_engine.host_cost(iters, 1, 4096, onesided=path == "onesided", idle_s=idle_s)
    finally:
        for owner, name, raw in reversed(saved):
            setattr(owner, name, raw)
    return calls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", choices=("onesided", "messaged"), default="onesided")
    ap.add_argument("--iters", type=int, default=60, help="timed requests (default 60)")
    ap.add_argument("--idle-ms", type=float, default=10.0, help="pause before each caller's step (0: none)")
    a = ap.parse_args(argv)
    if a.iters < 1 or a.idle_ms < 0:
        ap.error("--iters must be >= 1 and --idle-ms >= 0")
    got = measure(a.path, a.iters, a.idle_ms / 1e3)
    warm, idle = bench_engine.common.idle_reference_us()
    print(
        f"# host time per call of each step, {a.path} path, 4K-token requests, {a.iters} requests, "
        f"{a.idle_ms:g} ms pause before each caller's step; the reference loop {warm:.2f} us back to "
        f"back, {idle:.1f} us after 10 ms idle"
    )
    print(f"{'step':<36} {'side':>5} {'calls':>6} {'median us':>10}")
    rows = []
    for owner, name, side in STEPS:
        key = _label(owner, name)
        ts = got[key]
        med = statistics.median(ts) * 1e6 if ts else None
        rows.append({"step": key, "side": side, "calls": len(ts), "median_us": med})
        print(f"{key:<36} {side:>5} {len(ts):6d} " + (f"{med:10.2f}" if ts else f"{'-':>10}"))
    print(json.dumps({"bench": "host_steps", "path": a.path, "idle_ms": a.idle_ms, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
