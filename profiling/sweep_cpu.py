"""Sweep of the native CPU backend's settings, and of the alternatives it was chosen over.

Every case is a Llama-3-8B-shaped request (32 layers, 8 kv heads x 128, bf16) moved from
16-token blocks with random block ids: gather and scatter (the pg path) for NHD and HND caches,
and copy_blocks into 32-token caches of both layouts (the ipc path). Each column is one way of
doing it, timed interleaved with the others and with a plain ``copy_`` of the same bytes on one
torch thread, round after round, so all see the same machine state; cells are
``memcpy time / op time`` (medians). Every column is checked byte for byte against the torch
reference once before timing.

Before every timed call ``--flush-mb`` MiB (default 96, beyond this machine's 32 MB L3) are
written, so each call starts cold and no column profits from data the one before left in the
cache (it did: 20-60 % in an earlier version without it); columns run in a random order each
round.

Columns (``--configs``, comma list):
  torch                      the torch reference backend
  shim                       the CUDA kernel bodies (csrc/kvx_copy.cuh) compiled by g++ -O3 through
                             the host shim (csrc/host), run serially: the code path the task
                             suggested reusing
  THREADS/STREAM/ORDER       the native backend with THREADS threads, non-temporal stores
                             on/off and the 2-D loop order auto (the backend's rule), dst or src

    python profiling/sweep_cpu.py --tokens 100 --configs torch,shim,1/off/dst,1/off/auto,1/on/auto,2/on/auto
    python profiling/sweep_cpu.py --tokens 1024 --min-kib 128,256,512   # threads threshold

Prints one table per size; ``--json PATH`` writes the cells.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from kvxfer import KVCacheSpec, Layout, ops
from kvxfer.backends import cpu
from profiling import common

ROOT = Path(__file__).resolve().parents[1]
ORDERS = {"auto": 0, "dst": 1, "src": 2}


def _spec(layout: Layout, bs: int) -> KVCacheSpec:
    return KVCacheSpec(32, 8, 128, bs, torch.bfloat16, layout)


def _shim_kernels():
    """The CUDA kernel bodies built by g++ -O3 through the host shim, as a backend object."""
    sys.path.insert(0, str(ROOT / "tests" / "cuda_shim"))
    from host_kernels import HostKernels

    out = Path(tempfile.mkdtemp(prefix="kvx_shim_O3_")) / "kvx_host.so"
    cmd = [
        "g++",
        "-std=c++17",
        "-O3",
        "-fPIC",
        "-shared",
        "-o",
        str(out),
        str(ROOT / "csrc/host/kvx_host.cpp"),
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    # 64 blocks of 256 "threads": one warp item per 32 lanes, run one after another
    return HostKernels(out, max_blocks=64)


class Setup:
    """Caches, block ids and wire of one request size."""

    def __init__(self, tokens: int, seed: int = 0) -> None:
        self.T = tokens
        g = torch.Generator().manual_seed(seed)
        self.caches: dict[tuple[Layout, int], ops.PagedCache] = {}
        self.ids: dict[int, torch.Tensor] = {}
        for bs in (16, 32):
            need = -(-tokens // bs)
            n = need + need // 8 + 2
            self.ids[bs] = torch.randperm(n, generator=g)[:need]
            for lay in (Layout.NHD, Layout.HND):
                caches = [
                    torch.empty(_spec(lay, bs).cache_shape(n, 1), dtype=torch.bfloat16) for _ in range(32)
                ]
                for c in caches:
                    c.view(torch.uint8).random_(0, 256, generator=g)
                self.caches[(lay, bs)] = ops.register_caches(caches, _spec(lay, bs))
        self.wire = torch.empty(_spec(Layout.NHD, 16).wire_shape(tokens), dtype=torch.bfloat16)
        self.wire.view(torch.uint8).random_(0, 256, generator=g)
        self.nbytes = self.wire.numel() * 2

    def cases(self) -> list[tuple[str, Callable[[str | object], Callable[[], None]], Callable[[], list]]]:
        """(name, make(column) -> callable, outputs) per case."""
        out = []
        T = self.T
        for lay in (Layout.NHD, Layout.HND):
            s = _spec(lay, 16)
            src = self.caches[(lay, 16)]

            def gather(col, s=s, src=src):
                if isinstance(col, str):
                    return lambda: ops.gather_blocks(src, s, self.ids[16], T, out=self.wire, backend=col)
                side = ops.make_side(src, s, self.ids[16], T)
                return lambda: col.gather(side, self.wire.view(side.wire_view_shape()))

            def scatter(col, s=s, src=src):
                if isinstance(col, str):
                    return lambda: ops.scatter_blocks(self.wire, src, s, self.ids[16], T, backend=col)
                side = ops.make_side(src, s, self.ids[16], T, unique_blocks=True)
                return lambda: col.scatter(self.wire.view(side.wire_view_shape()), side)

            out.append((f"gather {lay.value}", gather, lambda: [self.wire]))
            out.append((f"scatter {lay.value}", scatter, lambda src=src: list(src)))
            for dl in (Layout.NHD, Layout.HND):
                d = _spec(dl, 32)
                dst = self.caches[(dl, 32)]

                def copy(col, s=s, src=src, d=d, dst=dst):
                    if isinstance(col, str):
                        return lambda: ops.copy_blocks(
                            src, s, self.ids[16], dst, d, self.ids[32], T, backend=col
                        )
                    a = ops.make_side(src, s, self.ids[16], T)
                    b = ops.make_side(dst, d, self.ids[32], T, unique_blocks=True)
                    return lambda: col.copy(a, b)

                out.append((f"copy {lay.value}->{dl.value}/32", copy, lambda dst=dst: list(dst)))
        return out


def _column(name: str, shim) -> tuple[str | object, Callable[[], None]]:
    """(what the case makers take, a function applying the column's settings)."""
    if name == "torch":
        return "torch", lambda: None
    if name == "shim":
        return shim, lambda: None
    threads, stream, order = name.split("/")
    flags = ORDERS[order] << 1

    def apply() -> None:
        cpu.set_num_threads(int(threads))
        cpu.EXTRA_FLAGS = flags
        cpu.STREAM_MIN_BYTES = 0 if stream == "on" else 1 << 62

    return "cpu", apply


def sweep(tokens: int, configs: list[str], iters: int, min_kib: list[int], shim, flush_mb: int = 96) -> dict:
    setup = Setup(tokens)
    flush = torch.empty(max(flush_mb, 1) << 20, dtype=torch.uint8)
    rng = random.Random(0)
    cols = [(c, k) for c in configs for k in (min_kib if "/" in c else [None])]
    saved = (cpu.get_num_threads(), cpu.EXTRA_FLAGS, cpu.STREAM_MIN_BYTES, cpu.MIN_BYTES_PER_THREAD)
    a = torch.ones(setup.nbytes, dtype=torch.uint8)
    b = torch.zeros_like(a)
    try:
        fns: dict[tuple[str, str, int | None], tuple[Callable[[], None], Callable[[], None]]] = {}
        for case, make, outputs in setup.cases():
            ref = None
            for c, k in cols:
                what, apply = _column(c, shim)
                fn = make(what)

                def run(apply=apply, fn=fn, k=k) -> None:
                    apply()
                    if k is not None:
                        cpu.MIN_BYTES_PER_THREAD = k << 10
                    fn()

                run()  # warm-up and the exactness check: every column's output equals torch's
                got = [t.clone() for t in outputs()]
                if ref is None:
                    make("torch")()
                    ref = [t.clone() for t in outputs()]
                if not all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(got, ref)):
                    raise AssertionError(f"{case} / {c}: result differs from the torch reference")
                fns[(case, c, k)] = run
        times: dict = {key: [] for key in fns}
        mem: list[float] = []
        keys = [*fns, None]  # None: the memcpy
        for _ in range(iters):
            rng.shuffle(keys)
            for key in keys:
                if flush_mb:
                    flush.fill_(len(mem) & 255)
                t0 = time.perf_counter()
                if key is None:
                    b.copy_(a)
                else:
                    fns[key]()
                (mem if key is None else times[key]).append(time.perf_counter() - t0)
    finally:
        cpu.set_num_threads(saved[0])
        cpu.EXTRA_FLAGS, cpu.STREAM_MIN_BYTES, cpu.MIN_BYTES_PER_THREAD = saved[1:]
    m = statistics.median(mem)
    cells = {
        f"{case} | {c}" + (f" | {k}KiB" if k else ""): m / statistics.median(v)
        for (case, c, k), v in times.items()
    }
    return {
        "tokens": tokens,
        "bytes": setup.nbytes,
        "memcpy_gbps": setup.nbytes / m / 1e9,
        "cells": cells,
        "cols": cols,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="100", help="comma list of request sizes in tokens")
    p.add_argument("--configs", default="torch,shim,1/off/dst,1/off/auto,1/on/auto,2/on/auto")
    p.add_argument("--min-kib", default="256", help="comma list of MIN_BYTES_PER_THREAD values (KiB)")
    p.add_argument("--iters", type=int, default=11)
    p.add_argument("--flush-mb", type=int, default=96, help="MiB written before each timed call (0: none)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    if not cpu.is_available(torch.device("cpu")):
        print(f"the native CPU backend does not load: {cpu.load_error()}")
        return 1
    configs = [c for c in a.configs.split(",") if c]
    shim = _shim_kernels() if "shim" in configs else None
    meta = common.run_metadata(torch.device("cpu"))
    print(
        f"# sweep_cpu on {meta['device']}, {meta['date']}, commit {meta['git_commit']}, load {meta['loadavg_1m']}"
    )
    print(
        "# x = median time of a 1-thread copy_ of the same bytes / median time of the op (interleaved "
        f"rounds, random order, {a.flush_mb} MiB written before each call)"
    )
    results = []
    for T in (int(x) for x in a.tokens.split(",")):
        r = sweep(T, configs, a.iters, [int(x) for x in a.min_kib.split(",")], shim, a.flush_mb)
        results.append(r)
        heads = [c + (f"@{k}K" if k else "") for c, k in r["cols"]]
        width = max(12, *(len(h) + 2 for h in heads))
        print(f"# {T} tokens, {r['bytes'] / 1e6:.1f} MB, memcpy {r['memcpy_gbps']:.2f} GB/s")
        print(f"{'case':<18}" + "".join(h.rjust(width) for h in heads))
        cases = list(dict.fromkeys(k.split(" | ")[0] for k in r["cells"]))
        for case in cases:
            vals = [r["cells"][f"{case} | {c}" + (f" | {k}KiB" if k else "")] for c, k in r["cols"]]
            print(f"{case:<18}" + "".join(f"{v:.2f}x".rjust(width) for v in vals))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
