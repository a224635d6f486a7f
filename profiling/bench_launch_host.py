"""Host time of one ops call on CUDA with the launch-table ring and without it.

The engine's copy of one request (``ops.copy_blocks`` between registered caches, producer-checked
ids: what a one-sided ipc load launches) is timed on the host, call after call, with the block
tables going to the device through the persistent pinned ring (:mod:`kvxfer.backends.meta_ring`)
and, in the same run, through a pinned copy and a device tensor made per call
(``KVXFER_META_RING=0``'s path). The device work is kept from piling up by a synchronize every
``--batch`` calls (outside the timed call). Prints per backend and path the median and p90 of the
call's host time, and their ratio.

    python profiling/bench_launch_host.py --calls 400            # GPU
    python profiling/bench_launch_host.py --device cpu --calls 20  # the same loop on CPU (no ring)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvxfer import KVCacheSpec, Layout, ops
from kvxfer.backends import meta_ring, registry


def time_calls(
    backend: str, device: torch.device, ring: bool, calls: int, batch: int, tokens: int, prof=None
) -> dict:
    """Host seconds of ``calls`` copies of a ``tokens``-token Llama-3-8B request (32 layers,
    8 KV heads of 128, bf16, block 16) with the ring on or off (``prof``: a profiler enabled
    around each call alone)."""
    spec = KVCacheSpec(32, 8, 128, 16, torch.bfloat16, Layout.NHD)
    per = spec.num_blocks_for(tokens)
    nb = 2 * per
    src = ops.register_caches(
        [torch.zeros(spec.cache_shape(nb, 1), dtype=spec.dtype, device=device) for _ in range(32)], spec
    )
    dst = ops.register_caches(
        [torch.zeros(spec.cache_shape(nb, 1), dtype=spec.dtype, device=device) for _ in range(32)], spec
    )
    rng = np.random.default_rng(0)
    saved = meta_ring._rings.copy()
    meta_ring._rings.clear()  # a ring made (or not) for this run's setting
    env = meta_ring.enabled
    meta_ring.enabled = lambda: ring
    out: list[float] = []
    try:
        for k in range(calls + 20):
            s_ids = ops.CheckedIds(rng.permutation(nb)[:per].astype(np.int64), nb, False)
            d_ids = ops.CheckedIds(rng.permutation(nb)[:per].astype(np.int64), nb, True)
            if prof is not None:
                prof.enable()
            t0 = time.perf_counter()
            ops.copy_blocks(src, spec, s_ids, dst, spec, d_ids, tokens, backend=backend)
            t1 = time.perf_counter()
            if prof is not None:
                prof.disable()
            if k >= 20:
                out.append(t1 - t0)
            if device.type == "cuda" and k % batch == batch - 1:
                torch.cuda.synchronize(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        stats = {str(key): r.stats() for key, r in meta_ring._rings.items() if r is not None}
    finally:
        meta_ring.enabled = env
        meta_ring._rings.clear()
        meta_ring._rings.update(saved)
    out.sort()
    return {
        "backend": backend,
        "ring": ring,
        "p50_us": statistics.median(out) * 1e6,
        "p90_us": out[int(0.9 * (len(out) - 1))] * 1e6,
        "rings": stats,
    }


def profile_calls(backend: str, device: torch.device, calls: int, tokens: int, top: int = 25) -> str:
    """Where one call's host time goes (the ring on): cProfile over ``calls`` calls, the
    ``top`` functions by own time, for the choice of what to move to native code next."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    time_calls(backend, device, True, calls, 8, tokens, prof)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backends", default="triton,cuda")
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--batch", type=int, default=8, help="calls between synchronizes")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument(
        "--profile", type=int, default=100, help="calls profiled per backend after the timing (0: none)"
    )
    a = ap.parse_args()
    device = torch.device(a.device)
    rows = []
    backends = a.backends.split(",") if device.type == "cuda" else ["cpu"]
    for backend in backends:
        status = registry.backend_status(device).get(backend, {})
        if not status.get("available"):
            print(f"# {backend}: unavailable here ({status.get('reason')})")
            continue
        for ring in (False, True, False, True):  # interleaved: the machine's drift hits both alike
            rows.append(time_calls(backend, device, ring, a.calls, a.batch, a.tokens))
    print(f"# host time of one ops.copy_blocks call, {a.tokens} tokens, 32 layers, on {device}")
    print(f"{'backend':>8} {'ring':>5} {'p50(us)':>9} {'p90(us)':>9}")
    for r in rows:
        print(f"{r['backend']:>8} {r['ring']!s:>5} {r['p50_us']:9.1f} {r['p90_us']:9.1f}")
    for backend in dict.fromkeys(r["backend"] for r in rows):
        off = [r["p50_us"] for r in rows if r["backend"] == backend and not r["ring"]]
        on = [r["p50_us"] for r in rows if r["backend"] == backend and r["ring"]]
        print(f"# {backend}: ring/no ring p50 = {min(on) / min(off):.2f} (best of two runs each)")
    print(json.dumps({"bench": "launch_host", "device": str(device), "rows": rows}))
    for backend in dict.fromkeys(r["backend"] for r in rows) if a.profile else ():
        print(f"\n# cProfile of {a.profile} calls, {backend}, ring on (own time; profiling slows every call)")
        print(profile_calls(backend, device, a.profile, a.tokens))


if __name__ == "__main__":
    main()
