"""The least one request's control path can cost on this machine: the steps no design can skip,
in straight-line code, timed in the same (cold) conditions as ``bench_engine.py``'s host cost.

``bench_engine.py`` measures the engine's own path for a 4K-token, 32-layer request (target
<= 50 us). This script runs only what any engine must do for such a request, with kvxfer's own
pieces where they are the irreducible step and no structure around them (no trackers, threads,
plans, metrics, tracing or failure handling):

  export   check the 256 block ids (one C conversion and a bound), the request's HMAC token,
           hold the ids under a lease (a dict), the params dict for the caller
  load     validate the params (one ``msgspec.convert``) and the local ids; queue the load
  grant    a lease request encoded, decoded by the exporter, the lease looked up and its
           blocks' epochs snapshot, the reply encoded and decoded (the socket hop left out)
  copy     one ``ops.copy_blocks`` with ids already checked (``ops.CheckedIds``) into a null
           kernel, then the epoch re-check (one gather of 256 epochs, a byte compare)
  notify   a notification encoded and decoded, the lease dropped and its blocks' epochs bumped
           (one fancy-indexed add), the acknowledgement encoded and decoded
  poll     each side reports the request done (a set each)

Each iteration first shuffles two 264-id lists, as ``bench_engine.py`` does (its requests'
block ids), so the code runs as cold as it does there; medians over iterations, with the
engine's figure from ``bench_engine.host_cost`` in the same run for comparison, and the
warm figure (the same steps back to back, no shuffle in between).

    python profiling/bench_host_floor.py [--iters 400]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_engine

from kvxfer import KVCacheSpec, ops
from kvxfer import control as C
from kvxfer.auth import _KeyedSha256 as HmacKey  # what EngineSecret.token runs
from kvxfer.engine_types import check_block_ids
from kvxfer.params import KVTransferParams, params_dict

TOKENS = 4096


def floor(n_iter: int, cold: bool) -> dict:
    """Medians (us) of each step and of the whole, per request."""
    spec = KVCacheSpec(32, 8, 128, 16, torch.bfloat16)
    per = spec.num_blocks_for(TOKENS)
    nb = per + 8
    src_shm, src = bench_engine._aliased_shm_caches(spec, nb)
    dst_shm, dst = bench_engine._aliased_shm_caches(spec, nb)
    saved = bench_engine.use_null_backend()
    try:
        sc, dc = ops.register_caches(src, spec), ops.register_caches(dst, spec)
        key = HmacKey(os.urandom(32))
        epochs = np.zeros(nb, dtype=np.int64)
        live: dict[str, tuple[np.ndarray, float, str]] = {}
        queued: list = []
        rng = random.Random(0)
        steps: dict[str, list[float]] = {k: [] for k in ("export", "load", "grant", "copy", "notify", "poll")}
        copies0 = bench_engine._NullKernel.copies
        for i in range(n_iter + 20):
            src_ids, dst_ids = list(range(nb)), list(range(nb))
            if cold or i == 0:
                rng.shuffle(src_ids)
                rng.shuffle(dst_ids)
            rid = f"r{i}"
            t0 = time.perf_counter()
            # export
            ids = check_block_ids(src_ids[:per], per, nb, TOKENS)
            token = key.token(rid)
            live[rid] = (ids, time.monotonic() + 600, token)
            params = params_dict(rid, "P", "127.0.0.1", 5555, 1, ids.tolist(), TOKENS, token)
            t1 = time.perf_counter()
            # load
            p = KVTransferParams.from_dict(params)
            local = check_block_ids(dst_ids[:per], per, nb, TOKENS)
            queued.append((rid, p, local))
            t2 = time.perf_counter()
            # grant (the exporter's side in the middle)
            rid, p, local = queued.pop()
            req = C.decode(C.encode(C.ReadReq("D", 0, 1, [p.request_id], [p.token])))
            lease = live[req.request_ids[0]]
            assert req.tokens[0] == lease[2]
            reply = C.decode(
                C.encode(C.ReadReply(ok=req.request_ids, epochs=[epochs[lease[0]].tobytes()], failed={}))
            )
            snapshot = reply.epochs[0]
            t3 = time.perf_counter()
            # copy and epoch re-check
            src_arr = p.block_id_array().view(np.int64)
            ops.copy_blocks(  # the engine's planner hands ops a new (writable) id array
                sc,
                spec,
                ops.CheckedIds(src_arr.copy(), nb, False),
                dc,
                spec,
                ops.CheckedIds(local, nb, True),
                TOKENS,
            )
            assert epochs[src_arr].tobytes() == snapshot
            t4 = time.perf_counter()
            # notify (the exporter's side in the middle)
            note = C.decode(C.encode(C.Notify("D", 0, 1, [rid], [], [p.token])))
            held = live.pop(note.request_ids[0])
            epochs[held[0]] += 1
            ack = C.decode(C.encode(C.Ack(failed={})))
            assert not ack.failed
            t5 = time.perf_counter()
            # poll on both sides
            done_d, done_p = {rid}, {note.request_ids[0]}
            assert done_d == done_p
            t6 = time.perf_counter()
            if i >= 20:
                for k, a, b in zip(steps, (t0, t1, t2, t3, t4, t5), (t1, t2, t3, t4, t5, t6)):
                    steps[k].append(b - a)
        # every copy reached the null kernel (the data movement is what is left out, nothing else)
        assert bench_engine._NullKernel.copies - copies0 == n_iter + 20, (
            "copies did not reach the null kernel"
        )
        out = {f"{k}_us": statistics.median(v) * 1e6 for k, v in steps.items()}
        out["total_us"] = statistics.median([sum(x) for x in zip(*steps.values())]) * 1e6
        return out
    finally:
        src_shm.close()
        dst_shm.close()
        bench_engine.restore_backends(saved)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=400, help="timed iterations (default 400)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    ref = bench_engine.python_reference_us()
    cold, warm = floor(a.iters, True), floor(a.iters, False)
    engine = bench_engine.host_cost(n_iter=min(a.iters, 300), batch=1)
    print("least host cost of one 4K-token, 32-layer request, us (medians; steps any design must take)")
    print(f"  {'step':<8} {'cold':>8} {'warm':>8}")
    for k in ("export", "load", "grant", "copy", "notify", "poll", "total"):
        print(f"  {k:<8} {cold[k + '_us']:8.1f} {warm[k + '_us']:8.1f}")
    print(
        f"  the engine's path in the same run (bench_engine.host_cost, cold): {engine['total_us']:.1f} us; "
        f"target <= {bench_engine.HOST_TARGET_US:.0f} us"
    )
    print(f"  this machine now: {ref:.2f} us for a reference Python loop (sum(range(100)))")
    print(
        json.dumps(
            {
                "bench": "host_floor",
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
