"""Benchmark how a batch of requests that end inside a block moves: all its tokens as token
slots in one ops call, or its whole blocks in one call and only the tails as slots.

A decode engine's poll hands the loader several loads at once, and real prompt lengths end
inside a block. :func:`kvxfer.transports.plan_batch` packs such a batch into ops calls two
ways:

* ``slots``: one call through the block-size-1 view of NHD caches (``split_tails=False``,
  what the staged streams did before protocol 3): every token is its own unit, one id per
  token and side;
* ``split``: one call over the requests' whole blocks and a second over their tails as token
  slots (``split_tails=True``, what the ipc read and the streams take now);
* ``blocks``: no token-slot view at all, so every request that ends inside a block sends its
  tail in a call of its own (what an HND destination did before caches could be registered
  with ``token_slots``: no tensor view re-blocks HND).

For each backend and destination block size one row per plan: ids passed, host time of the
plan and of the ops calls, the calls' time (on a GPU the kernels' alone: host work hidden by a
spin, see :func:`profiling.common.time_fns`), GB/s, the fraction of a plain ``copy_`` of the
same bytes timed in the same rounds, and ``#wrong``: bytes of the requests that differ from
the source (independent oracle, :mod:`profiling.verify`) plus bytes outside them that changed.

Llama-3-8B rows (8 kv heads x 128, bf16), NHD block 16 at the source, 8 requests of
2K-4K tokens (32 layers on a GPU; 4 on a CPU unless ``--layers``), into NHD blocks of 16 and
32 and HND blocks of 16 (``--to``; an HND destination's slots go through the kernels).

    python profiling/bench_batching.py --quick        # CPU/CI: seconds
    python profiling/bench_batching.py                # GPU: cuda and triton

Prints the table and writes ``bench_batching.json`` under ``--out``; exit status 1 when any
row is wrong.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import torch

from kvxfer import KVCacheSpec, ops
from kvxfer.batching import BatchPlan, Item, plan_batch
from kvxfer.views import cache_views
from profiling import common, verify
from profiling.bench_ops import usable_backends

COLUMNS = [
    common.Column("to", "to", 7),
    common.Column("backend", "backend", 7),
    common.Column("plan", "plan", 6),
    common.Column("calls", "calls", 5),
    common.Column("ids", "ids", 7),
    common.Column("tokens", "tokens", 7),
    common.Column("bytes", "bytes", 11),
    common.Column("plan_us", "plan(us)", 8, "{:.1f}"),
    common.Column("host_us", "host(us)", 8, "{:.1f}"),
    common.Column("time_us", "time(us)", 10, "{:.1f}"),
    common.Column("gbps", "GB/s", 8, "{:.2f}"),
    common.Column("frac", "x copy_", 7, "{:.2f}"),
    common.Column("wrong", "#wrong", 7),
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short requests, 4 layers, few iterations (CI)")
    p.add_argument("--backends", default="cuda,triton,cpu,torch", help="comma list; unavailable ones skipped")
    p.add_argument(
        "--to", default="16,32,HND16", help="comma list of destinations: block size, NHD or HND prefix (NHD)"
    )
    p.add_argument("--reqs", type=int, default=8)
    p.add_argument("--tokens", default=None, help="MIN,MAX tokens per request (default 2048,4096)")
    p.add_argument("--layers", type=int, default=None, help="default 32 on a GPU, 4 on a CPU")
    p.add_argument("--iters", type=int, default=None, help="timed rounds (default 20, quick 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed rounds (default 3, quick 1)")
    p.add_argument("--device", default=None, help="cuda / cpu (default: cuda when present)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=common.DEFAULT_OUT)
    args = p.parse_args(argv)
    lo, hi = (int(x) for x in (args.tokens or ("100,400" if args.quick else "2048,4096")).split(","))
    if not 1 <= lo <= hi:
        p.error(f"--tokens: need 1 <= MIN <= MAX, got {lo},{hi}")
    args.token_range = (lo, hi)
    args.dests = []  # (layout, block size) per --to entry
    for dest in args.to.split(","):
        lay = "HND" if dest.upper().startswith("HND") else "NHD"
        bs = dest.upper().removeprefix(lay)
        if not bs.isdigit() or int(bs) < 1:
            p.error(f"--to: {dest!r} is not a block size with an optional NHD or HND prefix (e.g. HND16)")
        args.dests.append((lay, int(bs)))
    args.iters = args.iters or (3 if args.quick else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    return args


def _requests(args, src_spec: KVCacheSpec, dst_spec: KVCacheSpec) -> tuple[list[Item], int, int]:
    """``--reqs`` requests on shuffled blocks of both sides; (items, source blocks, dest blocks)."""
    rng = random.Random(args.seed)
    lens = [rng.randint(*args.token_range) for _ in range(args.reqs)]
    ns = [src_spec.num_blocks_for(n) for n in lens]
    nd = [dst_spec.num_blocks_for(n) for n in lens]
    src_nb, dst_nb = sum(ns) + 4, sum(nd) + 4  # spare blocks: must stay untouched
    sp, dp = rng.sample(range(src_nb), src_nb), rng.sample(range(dst_nb), dst_nb)
    items, s0, d0 = [], 0, 0
    for i, n in enumerate(lens):
        src = np.array(sp[s0 : s0 + ns[i]], dtype=np.int64)
        dst = np.array(dp[d0 : d0 + nd[i]], dtype=np.int64)
        items.append(Item(f"r{i}", src, dst, n))
        s0, d0 = s0 + ns[i], d0 + nd[i]
    return items, src_nb, dst_nb


def _runner(bp: BatchPlan, sviews: dict, dviews: dict, backend: str):
    """The ops calls of ``bp``, as the ipc read makes them (ids checked by the planner)."""
    calls = []
    for c in bp.calls:
        su, du = bp.units(c)
        sv, dv = sviews[su], dviews[du]
        # registered views: their unit count (blocks, or token slots)
        s_ids = ops.CheckedIds(c.src, sv.caches.info.num_blocks, False)
        d_ids = ops.CheckedIds(c.dst, dv.caches.info.num_blocks, True)
        calls.append((sv.caches, sv.spec, s_ids, dv.caches, dv.spec, d_ids, c.num_tokens))

    def run() -> None:
        for sc, ss, si, dc, ds, di, n in calls:
            ops.copy_blocks(sc, ss, si, dc, ds, di, n, backend=backend)

    return run


def _wrong_bytes(items, src, src_spec, dst, dst_spec, dst_layout: str) -> int:
    """Bytes of the requests that differ from the source, plus bytes outside them that are no
    longer poison (re-poisons the requests' rows to count those)."""
    heads = src_spec.num_kv_heads
    wrong = 0
    for it in items:
        ids_s, ids_d = torch.from_numpy(it.src), torch.from_numpy(it.dst)
        wrong += verify.check_copy(
            src, "NHD", ids_s, dst, dst_layout, ids_d, src_spec.block_size, dst_spec.block_size,
            it.num_tokens, 0, 0, heads,
        )["wrong_bytes"]  # fmt: skip
    requests = [(torch.from_numpy(it.dst), it.num_tokens) for it in items]
    return wrong + verify.clobbered_bytes_of(dst, dst_layout, requests, dst_spec.block_size, 0, heads)


def _plan_us(items, src_units, dst_units, src_bs, dst_bs, split: bool, iters: int) -> float:
    ts = []
    for _ in range(max(iters, 5)):
        t0 = time.perf_counter()
        plan_batch(items, src_bs, src_units, dst_bs, dst_units, split)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def main(argv=None) -> int:
    args = parse_args(argv)
    device = common.pick_device(args.device)
    write = common.table_writer()
    layers = args.layers or (32 if device.type == "cuda" else 4)
    src_spec = KVCacheSpec(layers, 8, 128, 16, torch.bfloat16)
    backends = usable_backends(args.backends.split(","), device, write)
    meta = common.run_metadata(device)
    table = common.Table(COLUMNS, write)
    table.header(
        [
            f"{meta['device']}; torch {meta.get('torch')}; commit {meta.get('git_commit')}",
            f"{args.reqs} requests of {args.token_range[0]}-{args.token_range[1]} tokens, "
            f"{layers} layers x 8 heads x 128 bf16, NHD block 16 -> --to",
            "slots: every token a unit in one call; split: whole blocks in one call, tails as slots; "
            "blocks: no slot view, a call per tail",
        ]
    )
    limits = common.CopyLimit(device)
    rows, bad = [], 0
    for lay, to in args.dests:
        dst_spec = KVCacheSpec(layers, 8, 128, to, torch.bfloat16, layout=lay)
        items, src_nb, dst_nb = _requests(args, src_spec, dst_spec)
        src = [
            torch.empty(src_spec.cache_shape(src_nb, 1), dtype=torch.bfloat16, device=device)
            for _ in range(layers)
        ]
        dst = [
            torch.empty(dst_spec.cache_shape(dst_nb, 1), dtype=torch.bfloat16, device=device)
            for _ in range(layers)
        ]
        verify.fill_random(src, args.seed)
        sviews = {v.unit: v for v in cache_views(src, src_spec)}
        dviews = {v.unit: v for v in cache_views(dst, dst_spec)}
        tokens = sum(it.num_tokens for it in items)
        nbytes = tokens * src_spec.bytes_per_token()
        for backend in backends:
            plans = {
                name: plan_batch(items, 16, list(sviews), to, list(dviews), split)
                for name, split in (("slots", False), ("split", True))
            }
            plans["blocks"] = plan_batch(items, 16, [16], to, [to], True)
            fns = [_runner(bp, sviews, dviews, backend) for bp in plans.values()]
            wrong = {}
            for name, fn in zip(plans, fns):  # verification pass: poison, run once, compare
                verify.poison(dst)
                fn()
                common.synchronize(device)
                if ops.last_backend() != backend:
                    raise RuntimeError(f"ops ran backend {ops.last_backend()!r}, not {backend!r}")
                wrong[name] = _wrong_bytes(items, src, src_spec, dst, dst_spec, lay)
            limit = limits.fn(nbytes, "d2d" if device.type == "cuda" else "cpu")
            host: list[float] = []
            times = common.time_fns(
                [*fns, limit], device, args.iters, args.warmup, names=[*plans, "copy_"],
                hide_host=device.type == "cuda", host_out=host,
            )  # fmt: skip
            for k, (name, bp) in enumerate(plans.items()):
                row = {
                    "to": f"{lay}/{to}",
                    "backend": backend,
                    "plan": name,
                    "calls": len(bp.calls),
                    "ids": sum(c.src.size + c.dst.size for c in bp.calls),
                    "tokens": tokens,
                    "bytes": nbytes,
                    "plan_us": _plan_us(
                        items,
                        [16] if name == "blocks" else list(sviews),
                        [to] if name == "blocks" else list(dviews),
                        16,
                        to,
                        name != "slots",
                        args.iters,
                    ),
                    "host_us": host[k] * 1e6,
                    "time_us": times[k] * 1e6,
                    "gbps": nbytes / times[k] / 1e9,
                    "frac": times[-1] / times[k],
                    "limit_gbps": nbytes / times[-1] / 1e9,
                    "wrong": wrong[name],
                    "layers": layers,
                }
                bad += row["wrong"] != 0
                rows.append(row)
                table.row(row)
        del src, dst, sviews, dviews
    path = os.path.join(args.out, "bench_batching.json")
    common.write_json(path, meta, rows)
    write(f"# wrote {path}")
    if bad:
        write(f"# {bad} rows WRONG")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
