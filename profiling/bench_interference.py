"""What a transfer costs the model: a GEMM loop beside kvxfer's copies, kernel under SM budgets vs DMA.

A bf16 GEMM loop (``--gemm`` N: N x N x N, default 8192) runs on a compute stream; beside it,
on a loader stream, a loop of one transfer of a 4K-token Llama-3-8B request (``--ops``:
``copy``, an ipc copy between like caches, and ``gather`` into pinned host memory), moved by:

* ``kernel`` at each SM budget of ``--budgets`` (``all`` = no budget; ``ops`` ``max_sms=``,
  ``dma=False``), for each of ``--backends`` (default: the one ``backend=None`` picks). ``all``
  is no budget for the pinned gather too: the bench sets ``$KVXFER_HOST_WIRE_MAX_SMS=0``, so
  the row that the host-wire default (``ops.HOST_WIRE_MAX_SMS``, 16) gives is the ``16`` one;
* ``dma``: the copy engines (``dma=True``; one ``cuMemcpyBatchAsync`` per call), where the
  transfer is whole-block runs (else the row says why not);
* ``copy_``: a plain ``copy_`` of the same bytes (the limit), for reference.

Per row: the bytes, the transfer's time and GB/s alone and its fraction of the limit (a plain
``copy_`` of the same bytes measured in the same run: device to device for ``copy``, device to
pinned host for ``gather``); the transfer's time and fraction while the GEMM loop runs; the
GEMM's slowdown (its median time per GEMM while transfers run beside it, over its median
alone, minus 1); ``#wrong`` (bytes a verification pass against profiling/verify.py's oracle
found wrong, poisoned destinations). Only iterations that ran entirely while the other loop ran
count toward the contended times (per-iteration CUDA events, one gate holding both streams
until everything is enqueued, so host launch costs do not stretch the loops).

Targets (issue 41): a path reaching >= 0.8 of ``copy_`` while slowing the GEMM <= 5 %; DMA of
whole blocks >= 0.9 of ``copy_`` (device to device, and to pinned host).

    python profiling/bench_interference.py                 # GPU: Llama-3-8B, 4096 tokens
    python profiling/bench_interference.py --quick         # CPU plumbing: seconds

On a CPU (``--quick``, what the CPU test runs) the loops run in two threads and the numbers
mean nothing for a GPU: no SMs, no budgets (the CPU backend ignores them), and the DMA rows go
through a ``memmove`` stand-in of ``cuMemcpyBatchAsync`` (the same runs and ctypes prototype),
so the plumbing and the verification run end to end. Outputs: the table on stdout and
``bench_interference.json`` under ``--out``. Exit status 1 when a row is wrong or fails.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import threading
import time

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from kvxfer import ops
from kvxfer.backends import batch_copy, dma
from kvxfer.spec import dtype_from_name
from profiling import common, verify
from profiling.shapes import MODELS

OPS = ("copy", "gather")
BUDGETS = "all,32,16,8"
COPY_TARGET = 0.8  # fraction of copy_ a transfer path should reach beside the GEMM ...
SLOWDOWN_TARGET = 0.05  # ... while slowing it at most this much
DMA_TARGET = 0.9  # DMA of whole blocks alone, fraction of copy_
COLUMNS = [
    common.Column("layout", "layout", 7),
    common.Column("op", "op", 6),
    common.Column("path", "path", 14),
    common.Column("bytes", "bytes", 11),
    common.Column("time_us", "time(us)", 9, "{:.1f}"),
    common.Column("gbps", "GB/s", 8, "{:.2f}"),
    common.Column("pct_limit", "%copy_", 7, "{:.1f}"),
    common.Column("busy_time_us", "busy(us)", 9, "{:.1f}"),
    common.Column("busy_pct_limit", "busy%", 7, "{:.1f}"),
    common.Column("gemm_slowdown_pct", "GEMM+%", 7, "{:.1f}"),
    common.Column("wrong", "#wrong", 7),
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="CPU plumbing: tiny sizes, few iterations")
    p.add_argument("--device", default=None, help="cuda / cpu (default: cuda when present)")
    p.add_argument("--model", default="llama3-8b", help=f"one of {list(MODELS)}")
    p.add_argument("--layouts", default="NHD,HND")
    p.add_argument("--ops", default=",".join(OPS), help="comma list of copy,gather")
    p.add_argument("--tokens", type=int, default=None, help="tokens per transfer (default 4096, quick 32)")
    p.add_argument("--budgets", default=BUDGETS, help=f"kernel SM budgets, 'all' = none (default {BUDGETS})")
    p.add_argument(
        "--backends", default="", help="kernel backends (default: what backend=None picks; e.g. triton,cuda)"
    )
    p.add_argument("--no-dma", action="store_true", help="skip the DMA rows")
    p.add_argument("--gemm", type=int, default=None, help="GEMM size N (N^3; default 8192, quick 128)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=None, help="timed iterations alone (default 10, quick 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed iterations (default 3, quick 1)")
    p.add_argument(
        "--window-ms",
        type=float,
        default=None,
        help="each loop's length alone beside the other (default 300)",
    )
    p.add_argument(
        "--ids", choices=("random", "sequential"), default="random", help="block ids of the request"
    )
    p.add_argument("--out", default=common.DEFAULT_OUT, help="directory for bench_interference.json")
    p.add_argument(
        "--corrupt",
        choices=("none", "result"),
        default="none",
        help="testing the checker: break each result on purpose; every row must then be wrong",
    )
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    a.tokens = a.tokens or (32 if a.quick else 4096)
    a.gemm = a.gemm or (256 if a.quick else 8192)
    a.iters = a.iters or (2 if a.quick else 10)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.quick else 3)
    a.window_ms = a.window_ms if a.window_ms is not None else (20.0 if a.quick else 300.0)
    a.layouts = [x for x in a.layouts.split(",") if x]
    a.ops = [x for x in a.ops.split(",") if x]
    a.backends = [x for x in a.backends.split(",") if x] or [None]
    if a.model not in MODELS:
        p.error(f"--model: unknown model {a.model!r} (known: {list(MODELS)})")
    for x in a.ops:
        if x not in OPS:
            p.error(f"--ops: unknown op {x!r}")
    for x in a.layouts:
        if x not in ("NHD", "HND"):
            p.error(f"--layouts: unknown layout {x!r}")
    budgets: list[int | None] = []
    for x in a.budgets.split(","):
        if x == "all":
            budgets.append(None)
        elif x.isdigit() and int(x) > 0:
            budgets.append(int(x))
        else:
            p.error(f"--budgets: {x!r} is not 'all' or a positive int")
    a.budgets = budgets
    if a.tokens % a.block_size:
        p.error(
            f"--tokens: {a.tokens} is not a multiple of the block size {a.block_size} (DMA moves whole blocks)"
        )
    return a


# ----------------------------------------------------------------------------- the transfers
class Setup:
    """One layout's source and destination caches (registered, as an engine holds them), the
    request's block ids and the wires (device and pinned host)."""

    def __init__(self, layout: str, args, device: torch.device) -> None:
        model = MODELS[args.model]
        self.model, self.layout, self.device = model, "MLA" if model.use_mla else layout, device
        self.spec = model.spec(layout, args.block_size, dtype_from_name(args.dtype))
        self.T = args.tokens
        nb = self.spec.num_blocks_for(self.T)
        self.num_blocks = nb + nb // 8 + 1
        shape = self.spec.cache_shape(self.num_blocks, model.tp)
        dt, n_layers = self.spec.dtype, model.num_layers
        self.src = ops.register_caches(
            [torch.empty(shape, dtype=dt, device=device) for _ in range(n_layers)], self.spec
        )
        self.dst = ops.register_caches(
            [torch.empty(shape, dtype=dt, device=device) for _ in range(n_layers)], self.spec
        )
        verify.fill_random(self.src, args.seed)
        gen = torch.Generator().manual_seed(args.seed + 1)
        if args.ids == "sequential":
            self.src_ids = torch.arange(nb)
            self.dst_ids = torch.arange(nb) + (self.num_blocks - nb)
        else:
            self.src_ids = torch.randperm(self.num_blocks, generator=gen)[:nb]
            self.dst_ids = torch.randperm(self.num_blocks, generator=gen)[:nb]
        self.heads = model.moved_heads()
        wshape = self.spec.wire_shape(self.T, self.heads)
        pinned = device.type == "cuda"
        self.wire = torch.empty(wshape, dtype=self.spec.dtype, pin_memory=pinned)
        self.bytes = self.wire.numel() * self.wire.element_size()

    def op(self, op: str, path: str, budget: int | None, backend: str | None):
        """(callable doing the transfer once, the tensors it writes)."""
        s = self
        kw: dict = dict(max_sms=budget, dma=path == "dma", backend=None if path == "dma" else backend)
        if op == "copy":
            return (
                lambda: ops.copy_blocks(
                    s.src, s.spec, s.src_ids, s.dst, s.spec, s.dst_ids, s.T, num_heads=s.heads, **kw
                )
            ), list(s.dst)
        return (lambda: ops.gather_blocks(s.src, s.spec, s.src_ids, s.T, 0, s.heads, out=s.wire, **kw)), [
            s.wire
        ]

    def limit_kind(self, op: str) -> str:
        if self.device.type == "cpu":
            return "cpu"
        return "d2d" if op == "copy" else "d2h"

    def wrong(self, op: str, corrupt: str) -> int:
        """Bytes wrong after one poisoned run (the caller ran it): moved bytes that differ plus,
        for a copy, bytes outside the request that changed."""
        s, bs = self, self.spec.block_size
        if corrupt == "result":
            verify.corrupt("result", op, s.layout, s.wire, list(s.dst), s.dst_ids, bs, s.T, 0, s.num_blocks)
        if op == "gather":
            return verify.check_wire(s.wire, s.src, s.layout, s.src_ids, bs, s.T, 0)["wrong_bytes"]
        res = verify.check_copy(
            s.src, s.layout, s.src_ids, s.dst, s.layout, s.dst_ids, bs, bs, s.T, 0, 0, s.heads
        )
        return res["wrong_bytes"] + verify.clobbered_bytes(
            list(s.dst), s.layout, s.dst_ids, bs, s.T, 0, s.heads
        )


def memmove_copier() -> batch_copy.BatchCopier:
    """A stand-in of ``cuMemcpyBatchAsync`` for CPU plumbing runs: the same ctypes prototype, each
    run a ``memmove`` (what a copy engine would do to those bytes; nothing about its speed)."""

    def call(dsts, srcs, sizes, count, attrs, idxs, num_attrs, stream):
        for i in range(count):
            ctypes.memmove(dsts[i], srcs[i], sizes[i])
        return 0

    fn = batch_copy.PROTOTYPES[2](call)
    copier = batch_copy.BatchCopier(fn, 2, "memmove stand-in (CPU plumbing)", ("cpu",))
    copier._keep = fn  # the callback must outlive every call
    return copier


# ----------------------------------------------------------------------------- the loops
def gemm_fn(n: int, device: torch.device):
    dt = torch.bfloat16
    a = torch.randn(n, n, device=device).to(dt)
    b = torch.randn(n, n, device=device).to(dt)
    c = torch.empty(n, n, device=device, dtype=dt)
    return lambda: torch.matmul(a, b, out=c)


def _gpu_pair(copy_fn, gemm, k: int, m: int, host_s: float, device: torch.device):
    """Run ``k`` transfers on a loader stream and ``m`` GEMMs on a compute stream, both released
    at once by one gate meant to outlast the enqueue. Returns each loop's per-iteration
    ``(start, end)`` in seconds from the gate, and whether the gate did outlast the enqueue
    (else the host's launch costs may have paced the loops)."""
    loader, compute, gate = (torch.cuda.Stream(device) for _ in range(3))

    def ev() -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=True)

    base, opened, ev_c, ev_g = ev(), ev(), [ev() for _ in range(k + 1)], [ev() for _ in range(m + 1)]
    torch.cuda.synchronize(device)
    spin_s = max(3 * host_s, 1e-3)
    with torch.cuda.stream(gate):
        opened.record()
        torch.cuda._sleep(int(2e9 * spin_s))  # cycles at <= 2 GHz: at least spin_s
        base.record()
    t0 = time.perf_counter()
    for stream, events, fn, n in ((loader, ev_c, copy_fn, k), (compute, ev_g, gemm, m)):
        stream.wait_event(base)
        with torch.cuda.stream(stream):
            events[0].record()
            for i in range(n):
                fn()
                events[i + 1].record()
    enqueue_s = time.perf_counter() - t0
    torch.cuda.synchronize(device)
    held = enqueue_s < opened.elapsed_time(base) / 1e3

    def spans(evs: list) -> list[tuple[float, float]]:
        return [
            (base.elapsed_time(evs[i]) / 1e3, base.elapsed_time(evs[i + 1]) / 1e3)
            for i in range(len(evs) - 1)
        ]

    return spans(ev_c), spans(ev_g), held


def _cpu_pair(copy_fn, gemm, k: int, m: int):
    """The same on CPU: the GEMM loop in a thread (torch releases the GIL, as the CPU backend
    does), the transfers on this one, both started by one barrier."""
    start = threading.Barrier(2)
    g: list[tuple[float, float]] = []

    def loop():
        start.wait()
        for _ in range(m):
            t0 = time.perf_counter()
            gemm()
            g.append((t0, time.perf_counter()))

    th = threading.Thread(target=loop, daemon=True)
    th.start()
    start.wait()
    c = []
    for _ in range(k):
        t0 = time.perf_counter()
        copy_fn()
        c.append((t0, time.perf_counter()))
    th.join()
    return c, g, True


def inside(items: list[tuple[float, float]], other: list[tuple[float, float]]) -> list[float]:
    """Durations of the ``items`` that ran entirely while the ``other`` loop ran."""
    if not items or not other:
        return []
    lo, hi = other[0][0], other[-1][1]
    return [b - a for a, b in items if a >= lo and b <= hi]


# Iterations per loop at most: a stream holds only so many pending launches before the host blocks
# (and the gate would open while it still enqueues); a transfer is 1-3 launches and an event.
MAX_ITERS = 128


def contended(copy_fn, gemm, t_copy: float, t_gemm: float, host_s: float, args, device):
    """(median transfer seconds beside the GEMMs, median GEMM seconds beside the transfers,
    how many of each counted, whether the gate outlasted the enqueue). The transfers set the
    window (``--window-ms``, at most ``MAX_ITERS`` of them); the GEMM loop is made ~20 % longer
    so every transfer has GEMMs beside it, and the GEMMs inside the transfers' window count."""
    k = min(MAX_ITERS, max(3, round(args.window_ms / 1e3 / max(t_copy, 1e-9))))
    m = min(MAX_ITERS, max(3, round(1.2 * k * t_copy / max(t_gemm, 1e-9)) + 2))
    if device.type == "cuda":
        c, g, held = _gpu_pair(copy_fn, gemm, k, m, k * host_s + m * 20e-6, device)
    else:
        c, g, held = _cpu_pair(copy_fn, gemm, k, m)
    ci, gi = inside(c, g), inside(g, c)
    busy = statistics.median(ci) if ci else None
    return busy, (statistics.median(gi) if gi else None), len(ci), len(gi), held


# ----------------------------------------------------------------------------- rows
def run_row(setup: Setup, op: str, path: str, budget, backend, args, limits, gemm, t_gemm: float) -> dict:
    row = {
        "model": args.model,
        "layout": setup.layout,
        "op": op,
        "path": path if path != "kernel" else f"{backend or 'kernel'}@{budget or 'all'}",
        "kind": path,
        "budget": budget,
        "backend": backend,
        "tokens": setup.T,
        "bytes": setup.bytes,
    }
    kind = setup.limit_kind(op)
    limit_fn = limits.fn(setup.bytes, kind)
    if path == "copy_":
        fn, targets = limit_fn, []
        row["wrong"] = 0
    else:
        fn, targets = setup.op(op, path, budget, backend)
        verify.poison(targets)
        try:
            fn()
        except ValueError as e:  # dma=True where the transfer is not whole-block runs
            row["na"] = str(e)
            return row
        common.synchronize(setup.device)
        ran = ops.last_backend()
        if (path == "dma") != (ran == "dma"):
            raise RuntimeError(f"{path} row ran {ran!r}")
        row["ran"] = ran
        row["wrong"] = setup.wrong(op, args.corrupt)
    host: list[float] = []
    t, t_lim = common.time_fns(
        [fn, limit_fn], setup.device, args.iters, args.warmup, names=[f"op:{row['path']}", f"limit:{kind}"],
        hide_host=True, host_out=host,
    )  # fmt: skip
    busy, g_busy, nc, ng, held = contended(fn, gemm, t, t_gemm, host[0], args, setup.device)
    row.update(
        limit_kind=kind,
        time_us=t * 1e6,
        host_us=host[0] * 1e6,
        gbps=setup.bytes / t / 1e9,
        limit_us=t_lim * 1e6,
        pct_limit=100.0 * t_lim / t,
        busy_time_us=None if busy is None else busy * 1e6,
        busy_pct_limit=None if busy is None else 100.0 * t_lim / busy,
        gemm_us=t_gemm * 1e6,
        gemm_busy_us=None if g_busy is None else g_busy * 1e6,
        gemm_slowdown_pct=None if g_busy is None else 100.0 * (g_busy / t_gemm - 1.0),
        counted=(nc, ng),
        gate_held=held,
    )
    return row


def plan(args, device) -> list[tuple]:
    out = []
    for layout in args.layouts:
        for op in args.ops:
            for backend in args.backends:
                out.extend((layout, op, "kernel", b, backend) for b in args.budgets)
            if not args.no_dma:
                out.append((layout, op, "dma", None, None))
            out.append((layout, op, "copy_", None, None))
    return out


def summary(rows: list[dict], write, device: torch.device) -> dict:
    """The targets, judged on the rows of a GPU run (reported, not asserted)."""
    if device.type != "cuda":
        write("# targets: judged on a GPU run only (this is a CPU plumbing run)")
        return {}
    timed = [r for r in rows if r.get("busy_pct_limit") is not None and r.get("kind") != "copy_"]
    ok = [
        r for r in timed
        if r["busy_pct_limit"] >= 100 * COPY_TARGET and r["gemm_slowdown_pct"] is not None
        and r["gemm_slowdown_pct"] <= 100 * SLOWDOWN_TARGET
    ]  # fmt: skip
    dma_rows = [r for r in rows if r.get("kind") == "dma" and "pct_limit" in r]
    out = {
        "paths_meeting_copy_and_slowdown_target": sorted({(r["op"], r["layout"], r["path"]) for r in ok}),
        "dma_fraction_min": min((r["pct_limit"] for r in dma_rows), default=None),
    }
    met = ", ".join(f"{o}/{lay}/{p}" for o, lay, p in out["paths_meeting_copy_and_slowdown_target"])
    write(
        f"# targets: >= {COPY_TARGET:.0%} of copy_ beside the GEMM while slowing it <= {SLOWDOWN_TARGET:.0%}: "
        + (met or "none")
    )
    if dma_rows:
        write(f"# DMA alone: min {out['dma_fraction_min']:.1f} % of copy_ (target >= {DMA_TARGET:.0%})")
    not_held = [r["path"] for r in timed if not r.get("gate_held", True)]
    if not_held:
        write(
            f"# note: the host still enqueued when the loops started for {not_held}: launch costs may pace them"
        )
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ[ops.HOST_WIRE_ENV] = "0"  # "all" means no budget for host wires too (module doc)
    device = common.pick_device(args.device)
    if args.quick:
        torch.set_num_threads(1)
    write = common.table_writer()
    meta = common.run_metadata(device)
    notes = []
    if device.type == "cpu":
        batch_copy.install_copier(memmove_copier())
        notes.append(
            "CPU plumbing run: no SMs and no copy engines; budgets do nothing to the CPU backend and the dma "
            "rows use a memmove stand-in of cuMemcpyBatchAsync. These numbers say nothing about a GPU."
        )
    gemm = gemm_fn(args.gemm, device)
    t_gemm = common.time_fns([gemm], device, max(args.iters, 3), args.warmup)[0]
    flops = 2 * args.gemm**3 / t_gemm / 1e12
    table = common.Table(COLUMNS, write)
    table.header(
        [
            f"kvxfer bench_interference  device: {meta['device']}  date: {meta['date']}  torch {meta['torch']}"
            f"  commit {meta['git_commit']}",
            f"command: {meta['command']}",
            f"{args.model}, {args.tokens} tokens, {args.dtype}, block {args.block_size}, ids {args.ids}; GEMM bf16 "
            f"{args.gemm}^3 alone {t_gemm * 1e6:.1f} us ({flops:.1f} TFLOP/s); dma path: {dma.status(device)}",
            "time/GB/s/%copy_ = the transfer alone (median of "
            f"{args.iters}); busy/busy% = beside the GEMM loop; GEMM+% = the GEMM's slowdown beside the transfers",
            "%copy_ = a plain copy_ of the same bytes in this run (copy: device->device; gather: device->pinned host)",
            *notes,
        ]
    )
    rows, failed, limits = [], 0, common.CopyLimit(device)
    setup = None
    for layout, op, path, budget, backend in common.progress(plan(args, device), "bench_interference"):
        if setup is None or setup.layout != layout:
            setup = None
            setup = Setup(layout, args, device)
        try:
            row = run_row(setup, op, path, budget, backend, args, limits, gemm, t_gemm)
        except Exception as e:  # reported, and fails the run
            row = {
                "layout": layout,
                "op": op,
                "path": path,
                "budget": budget,
                "error": f"{type(e).__name__}: {e}",
            }
            write(f"# ERROR {layout}/{op}/{path}/{budget}: {row['error']}")
            failed += 1
        rows.append(row)
        if "na" in row:
            write(f"# {layout} {op} {row['path']}: n/a ({row['na']})")
        elif "error" not in row:
            table.row(row)
            failed += row["wrong"] != 0
    t_gemm_end = common.time_fns([gemm], device, max(args.iters, 3), args.warmup)[0]
    write(
        f"# GEMM alone at the end: {t_gemm_end * 1e6:.1f} us ({100 * (t_gemm_end / t_gemm - 1):+.1f} % drift)"
    )
    targets = summary(rows, write, device)
    wrong_rows = sum(1 for r in rows if r.get("wrong"))
    write(
        f"# rows: {len(rows)}  wrong rows: {wrong_rows}  errors: {sum('error' in r for r in rows)}  "
        f"n/a: {sum('na' in r for r in rows)}  {'OK' if failed == 0 else 'FAILED'}"
    )
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_interference.json")
    common.write_json(
        path,
        meta,
        rows,
        gemm={"n": args.gemm, "alone_us": t_gemm * 1e6, "alone_end_us": t_gemm_end * 1e6, "tflops": flops},
        targets=targets,
        model=MODELS[args.model].source,
        limit_kinds=common.LIMIT_KINDS,
        dma_rule={
            "small_budget_sms": dma.SMALL_BUDGET_SMS,
            "large_copy_bytes": dma.LARGE_COPY_BYTES,
            "min_run_bytes": dma.MIN_RUN_BYTES,
        },
    )
    write(f"# wrote {path}")
    if device.type == "cpu":
        batch_copy.install_copier(None)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
