"""Benchmark kvxfer's gather / scatter / copy for every available backend.

For each model shape (profiling/shapes.py), layout, destination, op, backend and request size
one row: bytes moved, median time, GB/s, the limit measured in the same run (a plain
``copy_`` of the same bytes: device->device, device->pinned host for a gather into pinned
memory, pinned host->device for a scatter from it, host->host on CPU) and ``#wrong``, the
bytes a verification pass against an independent oracle (profiling/verify.py) found wrong:
moved bytes that differ plus bytes outside the request that changed. Exit status 1 when any
row is wrong or fails.

``copy`` rows go to each destination of ``--copy-to``: the source's own spec (``same``) and
block-32 caches of both layouts (what the ipc transport does between engines of different
block sizes and layouts). On a CPU the run ends with the CPU data-path targets (issue 17) and
whether each backend meets them: ipc (``copy`` 16 -> 32) >= 0.6x and pg (gather + scatter
through a wire) >= 0.5x of a plain copy of the same bytes, on Llama-3-8B rows.

    python profiling/bench_ops.py --quick                     # CPU/CI: seconds
    python profiling/bench_ops.py --backends triton,cuda      # GPU: the full sweep

Outputs: the table on stdout, ``bench_ops.json`` and ``bench_ops.png`` under ``--out`` (the PNG
only when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from kvxfer import ops
from kvxfer.spec import dtype_from_name
from profiling import common, verify
from profiling.shapes import MODELS, ModelShape

FULL_SIZES = [128 << i for i in range(9)]  # 128 ... 32768 tokens
QUICK_SIZES = [32, 100]  # 100 = 6 full blocks of 16 + a partial one
OPS = ("gather", "scatter", "copy")
COPY_TO = "same,NHD/32,HND/32"
# CPU data-path targets (issue 17), as fractions of a plain copy_ of the same bytes in the run.
TARGET_MODEL = "llama3-8b"
IPC_TARGET = 0.6  # copy_blocks cache -> cache, block 16 -> 32, same layout and NHD <-> HND
PG_TARGET = 0.5  # gather + scatter through a wire: bytes / (t_gather + t_scatter)
COLUMNS = [
    common.Column("model", "model", 16),
    common.Column("layout", "layout", 6),
    common.Column("dest", "dest", 7),
    common.Column("op", "op", 7),
    common.Column("to", "to", 7),
    common.Column("backend", "backend", 7),
    common.Column("tokens", "tokens", 6),
    common.Column("bytes", "bytes", 11),
    common.Column("time_us", "time(us)", 10, "{:.1f}"),
    common.Column("host_us", "host(us)", 8, "{:.1f}"),
    common.Column("gbps", "GB/s", 8, "{:.2f}"),
    common.Column("limit_gbps", "limit GB/s", 10, "{:.2f}"),
    common.Column("pct_limit", "%limit", 7, "{:.1f}"),
    common.Column("wrong", "#wrong", 7),
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, few iterations (CI on CPU)")
    p.add_argument(
        "--backends", default="torch,triton,cuda,cpu", help="comma list; unavailable ones are skipped"
    )
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list of {list(MODELS)}")
    p.add_argument("--layouts", default="NHD,HND", help="comma list of NHD,HND (MLA models use their own)")
    p.add_argument("--ops", default=",".join(OPS), help="comma list of gather,scatter,copy")
    p.add_argument(
        "--dest", default=None, help="comma list of device,pinned (default: both on GPU, device on CPU)"
    )
    p.add_argument("--sizes", default=None, help="comma list of token counts (default 128..32768)")
    p.add_argument(
        "--copy-to",
        default=COPY_TO,
        help="comma list of copy destinations: 'same' (the source's spec) or LAYOUT/BLOCK_SIZE "
        f"(MLA models keep MLA); default {COPY_TO}",
    )
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=None, help="timed iterations (default 20, quick 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed iterations (default 5, quick 1)")
    p.add_argument("--flush-l2-mb", type=int, default=0, help="overwrite N MiB before each timed run (GPU)")
    p.add_argument("--device", default=None, help="cuda / cpu (default: cuda when present)")
    p.add_argument("--out", default=common.DEFAULT_OUT, help="directory for bench_ops.json/.png")
    p.add_argument(
        "--corrupt",
        choices=("none", "result", "untouched"),
        default="none",
        help="testing the checker: break each result on purpose; every row must then be wrong",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: 1 with --quick, robust on shared CI cores; else torch's)",
    )
    a = p.parse_args(argv)
    a.iters = a.iters or (3 if a.quick else 20)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.quick else 5)
    a.sizes = [int(x) for x in a.sizes.split(",")] if a.sizes else (QUICK_SIZES if a.quick else FULL_SIZES)
    for field in ("backends", "models", "layouts", "ops", "copy_to"):
        setattr(a, field, [x for x in getattr(a, field).split(",") if x])
    for x in a.copy_to:
        lay, _, bs = x.partition("/")
        if x != "same" and (lay not in ("NHD", "HND") or not bs.isdigit() or int(bs) < 1):
            p.error(f"--copy-to: {x!r} is not 'same' or LAYOUT/BLOCK_SIZE (e.g. HND/32)")
    for m in a.models:
        if m not in MODELS:
            p.error(f"--models: unknown model {m!r} (known: {list(MODELS)})")
    for x in a.ops:
        if x not in OPS:
            p.error(f"--ops: unknown op {x!r}")
    for x in a.layouts:
        if x not in ("NHD", "HND"):
            p.error(f"--layouts: unknown layout {x!r}")
    return a


class Group:
    """Buffers of one (model, layout) on one device, sized for the largest request."""

    def __init__(self, model: ModelShape, layout: str, args, device: torch.device) -> None:
        self.model, self.layout, self.device = model, layout, device
        self.spec = model.spec(
            layout if layout != "MLA" else "NHD", args.block_size, dtype_from_name(args.dtype)
        )
        max_blocks = self.spec.num_blocks_for(max(args.sizes))
        self.num_blocks = max_blocks + max_blocks // 8 + 1  # slack: some blocks the request never uses
        shape = self.spec.cache_shape(self.num_blocks, model.tp)
        src = [torch.empty(shape, dtype=self.spec.dtype, device=device) for _ in range(model.num_layers)]
        # Validated once, as an engine holds them (ops.register_caches), so each call skips the
        # per-layer checks.
        register = getattr(ops, "register_caches", lambda caches, spec: caches)
        self.src = register(src, self.spec)
        self.dst = register([torch.empty_like(c) for c in src], self.spec)
        verify.fill_random(self.src, args.seed)
        self.heads = model.moved_heads()
        self.src_head = model.slice_start
        # A sliced read lands at another head of the destination rank, as in a TP mismatch.
        self.dst_head = (model.heads_on_rank() - self.heads) if model.slice_heads else 0
        numel = max(args.sizes) * model.num_layers * self.spec.num_kv * self.heads * model.head_dim
        self.wire_buf = {"device": torch.empty(numel, dtype=self.spec.dtype, device=device)}
        gen = torch.Generator().manual_seed(args.seed + 1)
        self.src_perm = torch.randperm(self.num_blocks, generator=gen)
        self.dst_perm = torch.randperm(self.num_blocks, generator=gen)

    def copy_target(self, to: str, args) -> tuple[str, int]:
        """(layout, block size) of copy destination ``to`` ('same' or LAYOUT/BLOCK_SIZE)."""
        if to == "same":
            return self.layout, self.spec.block_size
        lay, _, bs = to.partition("/")
        return ("MLA" if self.layout == "MLA" else lay), int(bs)

    def dst_side(self, to: str, args) -> tuple:
        """(caches, spec, layout, block permutation, num_blocks) of copy destination ``to``; one
        extra destination is kept at a time (GPU memory), the source-spec one always."""
        layout, bs = self.copy_target(to, args)
        if (layout, bs) == (self.layout, self.spec.block_size):
            return self.dst, self.spec, self.layout, self.dst_perm, self.num_blocks
        key = (layout, bs)
        if getattr(self, "_variant", (None,))[0] != key:
            self._variant = (None,)  # free the previous one first
            spec = self.model.spec(layout if layout != "MLA" else "NHD", bs, self.spec.dtype)
            needed = spec.num_blocks_for(max(args.sizes))
            num_blocks = needed + needed // 8 + 1
            caches = [
                torch.empty(spec.cache_shape(num_blocks, self.model.tp), dtype=spec.dtype, device=self.device)
                for _ in range(self.model.num_layers)
            ]
            register = getattr(ops, "register_caches", lambda caches, spec: caches)
            perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(args.seed + 2))
            self._variant = (key, (register(caches, spec), spec, layout, perm, num_blocks))
        return self._variant[1]

    def wire(self, dest: str, num_tokens: int) -> torch.Tensor:
        if dest not in self.wire_buf:
            buf = self.wire_buf["device"]
            self.wire_buf[dest] = torch.empty(buf.numel(), dtype=buf.dtype, pin_memory=True)
        shape = self.spec.wire_shape(num_tokens, self.heads)
        n = 1
        for s in shape:
            n *= s
        return self.wire_buf[dest][:n].view(shape)


def run_row(
    g: Group,
    op: str,
    backend: str,
    dest: str,
    T: int,
    args,
    limits: common.CopyLimit,
    flush,
    to: str = "same",
) -> dict:
    spec, hs, nh, dh = g.spec, g.src_head, g.heads, g.dst_head
    nb = spec.num_blocks_for(T)
    src_ids, dst_ids = g.src_perm[:nb].clone(), g.dst_perm[:nb].clone()
    dst, d_spec, d_layout, d_num_blocks = g.dst, spec, g.layout, g.num_blocks
    if op == "copy":
        dst, d_spec, d_layout, d_perm, d_num_blocks = g.dst_side(to, args)
        dst_ids = d_perm[: d_spec.num_blocks_for(T)].clone()
    wire = g.wire(dest, T)
    if op == "gather":

        def fn():
            ops.gather_blocks(g.src, spec, src_ids, T, hs, nh, out=wire, backend=backend)

        targets = [wire]
    elif op == "scatter":
        data = torch.empty_like(wire, device=g.device)  # random on the device: fast for pinned wires
        verify.fill_random([data], args.seed + T)
        wire.copy_(data)
        del data

        def fn():
            ops.scatter_blocks(wire, g.dst, spec, dst_ids, T, head_start=dh, backend=backend)

        targets = g.dst
    else:

        def fn():
            ops.copy_blocks(g.src, spec, src_ids, dst, d_spec, dst_ids, T, hs, dh, nh, backend=backend)

        targets = dst
    row = {
        "model": g.model.name,
        "layout": g.layout,
        "dest": dest,
        "op": op,
        "to": "wire" if op == "gather" else f"{d_layout}/{d_spec.block_size}",
        "dst_layout": d_layout,
        "dst_block_size": d_spec.block_size,
        "backend": backend,
        "tokens": T,
        "bytes": wire.numel() * wire.element_size(),
        "heads": nh,
        "layers": spec.num_layers,
        "head_dim": spec.head_dim,
        "block_size": spec.block_size,
        "dtype": args.dtype,
    }
    name = f"{op}:{backend}:{g.model.name}:{g.layout}:{dest}:{T}tok"
    # Verification pass: poison the destination, run once, compare with the oracle.
    verify.poison(targets)
    with common.nvtx_range(f"verify:{name}"):
        fn()
        common.synchronize(g.device)
    if ops.last_backend() != backend:
        raise RuntimeError(f"ops ran backend {ops.last_backend()!r}, not {backend!r}")
    if args.corrupt != "none":
        verify.corrupt(args.corrupt, op, d_layout, wire, dst, dst_ids, d_spec.block_size, T, dh, d_num_blocks)
    if op == "gather":
        res = verify.check_wire(wire, g.src, g.layout, src_ids, spec.block_size, T, hs)
        res["clobbered_bytes"] = 0
    else:
        if op == "scatter":
            res = verify.check_wire(wire, g.dst, g.layout, dst_ids, spec.block_size, T, dh)
        else:
            res = verify.check_copy(
                g.src,
                g.layout,
                src_ids,
                dst,
                d_layout,
                dst_ids,
                spec.block_size,
                d_spec.block_size,
                T,
                hs,
                dh,
                nh,
            )
        res["clobbered_bytes"] = verify.clobbered_bytes(dst, d_layout, dst_ids, d_spec.block_size, T, dh, nh)
    row.update(res)
    row["wrong"] = res["wrong_bytes"] + res["clobbered_bytes"]
    # Timing, and the limit of the same bytes measured in this run.
    if g.device.type == "cpu":
        kind = "cpu"
    else:
        kind = "d2d" if dest == "device" else ("d2h" if op == "gather" else "h2d")
    limit_fn = limits.fn(row["bytes"], kind)
    iters, warmup = args.iters, args.warmup
    if g.device.type == "cpu" and backend not in ("torch", "cpu") and args.quick:
        iters, warmup = 1, 0  # an interpreted kernel (TRITON_INTERPRET=1): correctness, not speed
    host: list[float] = []
    with common.nvtx_range(f"bench:{name}"):
        # GPU time with the call's host work hidden behind a spin (the kernels' bandwidth); the
        # host work (validation, planning, launch) is reported apart as host_us.
        seconds, limit_s = common.time_fns(
            [fn, limit_fn],
            g.device,
            iters,
            warmup,
            flush,
            names=[f"op:{name}", f"limit:{kind}:{row['bytes']}B"],
            hide_host=True,
            host_out=host,
        )
    row.update(
        host_us=host[0] * 1e6,
        time_us=seconds * 1e6,
        gbps=row["bytes"] / seconds / 1e9,
        limit_kind=kind,
        limit_us=limit_s * 1e6,
        limit_gbps=row["bytes"] / limit_s / 1e9,
    )
    row["pct_limit"] = 100.0 * row["gbps"] / row["limit_gbps"]
    return row


def usable_backends(names: list[str], device: torch.device, quiet_write) -> list[str]:
    """The requested backends that resolve on ``device``; the others are skipped with a note."""
    out = []
    for b in names:
        try:
            ops.resolve_backend(device, b)
        except ValueError as e:
            quiet_write(f"# note: skipping backend {b!r}: {e}")
            continue
        if b == "torch" and device.type == "cuda" and importlib.util.find_spec("cupy") is None:
            # The reference views CUDA cache memory through CuPy (kvxfer/backends/addrspace.py).
            quiet_write(
                "# note: skipping backend 'torch' on CUDA: it needs cupy (pip install cupy-cuda12x or cupy-cuda13x, matching torch.version.cuda)"
            )
            continue
        out.append(b)
    return out


def plan_rows(args, device: torch.device, backends: list[str], write) -> list[tuple]:
    dests = (
        args.dest.split(",") if args.dest else (["device", "pinned"] if device.type == "cuda" else ["device"])
    )
    if device.type != "cuda" and "pinned" in dests:
        write("# note: --dest pinned needs a GPU; skipping it")
        dests = [d for d in dests if d != "pinned"]
    # An interpreter launch costs ~0.5 s per MB moved (measured: Triton 3.9, 2 shared cores), so
    # the interpreted backends get the selected model with the fewest bytes per token (head
    # slices only if nothing else is selected).
    whole = [m for m in args.models if MODELS[m].slice_heads is None] or args.models
    interpreted_model = min(whole, key=lambda m: MODELS[m].bytes_per_token())
    plan = []
    for mname in args.models:
        model = MODELS[mname]
        for layout in model.layouts(args.layouts):
            for dest in dests:
                for op in args.ops:
                    if op == "copy" and dest != "device":
                        continue  # copy_blocks moves cache to cache on one device: no host destination
                    targets = _copy_targets(model, layout, args) if op == "copy" else ["same"]
                    for to in targets:
                        for b in backends:
                            sizes = args.sizes
                            if device.type == "cpu" and b not in ("torch", "cpu"):
                                # Interpreted kernels (TRITON_INTERPRET=1) are slow: one tiny size, one model.
                                if mname != interpreted_model or to != targets[0]:
                                    continue
                                sizes = sizes[:1]
                            plan.extend((mname, layout, dest, op, b, T, to) for T in sizes)
    return plan


def _copy_targets(model: ModelShape, layout: str, args) -> list[str]:
    """``--copy-to`` for one source: MLA destinations differ only by block size (deduplicated),
    and a target equal to the source's own spec is the 'same' row."""
    out: list[str] = []
    seen: set[tuple[str, int]] = set()
    for to in args.copy_to:
        if to == "same":
            key = (layout, args.block_size)
        else:
            lay, _, bs = to.partition("/")
            key = ("MLA" if layout == "MLA" else lay, int(bs))
        if key == (layout, args.block_size):
            to = "same"
        if key not in seen:
            seen.add(key)
            out.append(to)
    return out


def _fmt_x(frac: float) -> str:
    return f"{frac:.2f}x"


def cpu_targets(rows: list[dict], backends: list[str], write) -> dict:
    """The CPU data-path targets on ``TARGET_MODEL`` rows of the largest size in the run.

    ipc: every ``copy`` row from block 16 to another block size (same layout and across
    layouts), the smallest fraction of the limit counts. pg: every gather and scatter row (the
    ops the pg transport runs), the smallest counts; printed alongside, and judged against the
    same figure, the stricter whole-path reading: per layout a gather and a scatter of the same
    request back to back, bytes / (t_gather + t_scatter) over the limit's bytes / t_limit
    (= 1 / (1/f_gather + 1/f_scatter)), the smaller layout.
    Returns ``{backend: {"ipc": {...}, "pg": {...}}}`` (also written to the JSON).
    """
    sel = [
        r for r in rows if r.get("model") == TARGET_MODEL and r.get("dest") == "device" and "pct_limit" in r
    ]
    if not sel:
        write(f"# targets: no {TARGET_MODEL} rows timed in this run (--models {TARGET_MODEL} to see them)")
        return {}
    T = max(r["tokens"] for r in sel)
    nbytes = next(r["bytes"] for r in sel if r["tokens"] == T)
    write(
        f"# CPU data-path targets (issue 17) on {TARGET_MODEL} rows, {T} tokens ({nbytes / 1e6:.1f} MB); "
        "x = fraction of a plain copy_ of the same bytes in this run"
    )
    out: dict = {}
    for b in backends:
        rb = [r for r in sel if r["backend"] == b and r["tokens"] == T]
        ipc = [r for r in rb if r["op"] == "copy" and r["dst_block_size"] != r["block_size"]]
        res: dict = {}
        if ipc:
            worst = min(r["pct_limit"] for r in ipc) / 100
            parts = "  ".join(f"{r['layout']}->{r['to']} {_fmt_x(r['pct_limit'] / 100)}" for r in ipc)
            met = worst >= IPC_TARGET
            res["ipc"] = {"fraction": worst, "target": IPC_TARGET, "met": met, "rows": len(ipc)}
            write(
                f"#   ipc  {b:<6} copy 16->32: min {_fmt_x(worst)} (target >= {IPC_TARGET:.2f}x) "
                f"{'met' if met else 'NOT met'}   [{parts}]"
            )
        pg, ops_rows = [], [r for r in rb if r["op"] in ("gather", "scatter")]
        for layout in sorted({r["layout"] for r in rb}):
            g = [r for r in rb if r["layout"] == layout and r["op"] == "gather"]
            s = [r for r in rb if r["layout"] == layout and r["op"] == "scatter"]
            if g and s:
                fg, fs = g[0]["pct_limit"] / 100, s[0]["pct_limit"] / 100
                pg.append((layout, 1 / (1 / fg + 1 / fs), fg, fs))
        if ops_rows:
            worst = min(r["pct_limit"] for r in ops_rows) / 100
            met = worst >= PG_TARGET
            parts = "  ".join(f"{r['layout']} {r['op']} {_fmt_x(r['pct_limit'] / 100)}" for r in ops_rows)
            res["pg"] = {"fraction": worst, "target": PG_TARGET, "met": met, "rows": len(ops_rows)}
            write(
                f"#   pg   {b:<6} gather, scatter: min {_fmt_x(worst)} (target >= {PG_TARGET:.2f}x) "
                f"{'met' if met else 'NOT met'}   [{parts}]"
            )
        if pg:
            path = min(x[1] for x in pg)
            res.setdefault("pg", {}).update(path_fraction=path, path_met=path >= PG_TARGET)
            parts = "  ".join(f"{lay} {_fmt_x(c)}" for lay, c, _, _ in pg)
            write(
                f"#        {b:<6} gather then scatter, whole path: min {_fmt_x(path)} "
                f"({'met' if path >= PG_TARGET else 'NOT met'} on this stricter reading)   [{parts}]"
            )
        if res:
            out[b] = res
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    device = common.pick_device(args.device)
    if args.threads or args.quick:
        torch.set_num_threads(args.threads or 1)
    write = common.table_writer()
    meta = common.run_metadata(device)
    backends = usable_backends(args.backends, device, write)
    plan = plan_rows(args, device, backends, write)
    table = common.Table(COLUMNS, write)
    table.header(
        [
            f"kvxfer bench_ops  device: {meta['device']}  date: {meta['date']}  torch {meta['torch']}"
            f"  triton {meta['triton']}  commit {meta['git_commit']}",
            f"command: {meta['command']}",
            f"dtype {args.dtype}, block {args.block_size}, median of {args.iters} after {args.warmup} warmup;"
            " limit = plain copy_ of the same bytes in this run; #wrong = wrong + clobbered bytes",
            "time = GPU time of the call (on CUDA its host work is hidden behind a spin kernel);"
            " host = CPU time of the call (validation, planning, launch)",
            *_cpu_threads_note(device, backends),
        ]
    )
    rows, group, failed, broken = [], None, 0, set()
    limits = common.CopyLimit(device)
    flush = common.l2_flusher(device, args.flush_l2_mb)
    with common.profiled(device, "sweep"):
        for mname, layout, dest, op, b, T, to in common.progress(plan, "bench_ops"):
            if (b, op, dest) in broken:
                continue
            if group is None or (group.model.name, group.layout) != (mname, layout):
                group = None  # free the previous buffers first
                group = Group(MODELS[mname], layout, args, device)
            try:
                row = run_row(group, op, b, dest, T, args, limits, flush, to)
            except Exception as e:  # a backend that fails is reported, and fails the run
                row = {
                    "model": mname,
                    "layout": layout,
                    "dest": dest,
                    "op": op,
                    "to": to,
                    "backend": b,
                    "tokens": T,
                    "error": f"{type(e).__name__}: {e}",
                }
                write(f"# ERROR {op}/{b}/{mname}/{layout}/{dest}/{T}/{to}: {row['error']}")
                write(f"# note: skipping the remaining {op}/{b}/{dest} rows after this error")
                broken.add((b, op, dest))
                failed += 1
            rows.append(row)
            if "error" not in row:
                table.row(row)
                failed += row["wrong"] != 0
    wrong_rows = sum(1 for r in rows if r.get("wrong"))
    write(
        f"# rows: {len(rows)}  wrong rows: {wrong_rows}  errors: {sum('error' in r for r in rows)}  "
        f"{'OK' if failed == 0 else 'FAILED'}"
    )
    for b in backends:
        pcts = [r["pct_limit"] for r in rows if r.get("backend") == b and "pct_limit" in r]
        if pcts:
            write(
                f"# {b}: %limit min {min(pcts):.1f}  median {sorted(pcts)[len(pcts) // 2]:.1f}  "
                f"max {max(pcts):.1f}"
            )
    targets = cpu_targets(rows, backends, write) if device.type == "cpu" else {}
    os.makedirs(args.out, exist_ok=True)
    json_path, png_path = os.path.join(args.out, "bench_ops.json"), os.path.join(args.out, "bench_ops.png")
    sources = {m: MODELS[m].source for m in args.models}
    common.write_json(json_path, meta, rows, models=sources, limit_kinds=common.LIMIT_KINDS, targets=targets)
    drawn = common.plot_bandwidth(
        rows,
        png_path,
        f"kvxfer bench_ops on {meta['device']} ({meta['date']})",
        lambda r: f"{r['op']} -> {r['dest']}",
        lambda r: f"{r['backend']} {r['model']} {r['layout']} {r.get('to', '')}",
        write,
    )
    write(f"# wrote {json_path}" + (f" and {png_path}" if drawn else ""))
    return 1 if failed else 0


def _cpu_threads_note(device: torch.device, backends: list[str]) -> list[str]:
    """Header line: threads of the CPU backend and of the limit's copy_ (CPU runs only)."""
    if device.type != "cpu":
        return []
    note = f"limit copy_ runs on {torch.get_num_threads()} torch thread(s)"
    if "cpu" in backends:
        from kvxfer.backends import cpu

        note += f"; backend cpu uses up to {cpu.get_num_threads()} threads (KVXFER_CPU_THREADS)"
    return [note]


if __name__ == "__main__":
    sys.exit(main())
