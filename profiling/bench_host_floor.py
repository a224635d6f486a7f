"""The least one request's control path can cost on this machine, step by step.

:func:`host_floor` runs only the steps any design must take for a 4K-token, 32-layer
request (export, load, grant, copy, notify, poll: its docstring lists what each holds), in
straight-line code and as cold as ``bench_engine.host_cost`` runs the engine (each iteration
first shuffles two id lists). ``bench_engine.py`` prints its total beside the engine's; this
script prints each step, cold and warm (no shuffle in between), with the engine's figure from
the same run.

With ``--batch 8`` each round exports and loads 8 requests and moves them with one grant, one
ops call and one notification, as the engine batches a poll's loads; figures are per request.
Then the same for one one-sided request (:func:`onesided_floor`), per side, beside the engine's
one-sided path.

    python profiling/bench_host_floor.py [--iters 400] [--batch 1]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Iterator

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine_harness import NullKernel, aliased_shm_caches, restore_backends, use_null_backend

from kvxfer import KVCacheSpec, idops, ops
from kvxfer import control as C
from kvxfer.auth import EngineSecret, content_digest
from kvxfer.engine_types import check_block_ids
from kvxfer.params import KVTransferParams, params_dict

FLOOR_TOKENS = 4096


@contextlib.contextmanager
def _null_caches(spec: KVCacheSpec, num_blocks: int) -> Iterator[tuple]:
    """Two caches of ``num_blocks`` blocks in shared memory, with the copy kernels replaced by
    the null kernel (:func:`use_null_backend`) until the block ends: yields (src, dst)."""
    src_shm, src = aliased_shm_caches(spec, num_blocks)
    dst_shm, dst = aliased_shm_caches(spec, num_blocks)
    saved = use_null_backend()
    try:
        yield src, dst
    finally:
        src_shm.close()
        dst_shm.close()
        restore_backends(saved)


def host_floor(n_iter: int, cold: bool = True, batch: int = 1) -> dict:
    """The least one request's control path can cost here: only the steps any design must take
    for a 4K-token, 32-layer request, in straight-line code with kvxfer's own pieces where they
    are the irreducible step, and no structure around them (no trackers, threads, plans,
    metrics, tracing or failure handling):

      export  check the 256 block ids, the export's content digest and token, hold the ids
              under a lease (a dict, the blocks' refcounts), the params dict for the caller (its
              ids: the caller's list, when it holds plain ints, as ``export()`` hands it out)
      load    validate the params (one ``msgspec.convert``) and the local ids, the params'
              content digest; queue the load
      grant   a lease request encoded, decoded by the exporter, the lease looked up, its token
              and digest compared and its blocks' epochs snapshot, the reply encoded and
              decoded (the socket hop left out)
      copy    one prepared copy (``PreparedCopy.run_bounded``, the engine's entry for ids
              checked at export and load) into the null kernel, then the epoch re-check of the
              256 blocks
      notify  a notification encoded and decoded, the lease dropped (refcounts down, epochs of
              blocks no longer held bumped), the acknowledgement encoded and decoded
      poll    each side reports the request done

    The id, refcount and epoch steps are :mod:`kvxfer.idops`'s, as in the engine (native when
    it loads). ``batch`` requests per round: export and load each, then one grant message,
    one ops call over all their ids (one epoch check) and one notification for all of them,
    as a loader batches a poll's loads. ``cold``: each round first shuffles two id lists, as
    :func:`host_cost` does. Medians (us) of each step and of the whole, per request."""
    spec = KVCacheSpec(32, 8, 128, 16, torch.bfloat16)
    per = spec.num_blocks_for(FLOOR_TOKENS)
    nb = per * batch + 8
    with _null_caches(spec, nb) as (src, dst):
        copy = ops.PreparedCopy(ops.register_caches(src, spec), ops.register_caches(dst, spec))
        key = EngineSecret("floor", 0, 0)  # a random secret, no key file
        epochs = np.zeros(nb, dtype=np.int64)
        refcount = np.zeros(nb, dtype=np.int32)
        idops.ensure()
        live: dict[str, tuple[np.ndarray, float, str]] = {}
        rng = random.Random(0)
        steps: dict[str, list[float]] = {k: [] for k in ("export", "load", "grant", "copy", "notify", "poll")}
        copies0 = NullKernel.copies
        tokens = FLOOR_TOKENS * batch
        for i in range(n_iter + 20):
            src_ids, dst_ids = list(range(nb)), list(range(nb))
            if cold or i == 0:
                rng.shuffle(src_ids)
                rng.shuffle(dst_ids)
            rids = [f"r{i}-{k}" for k in range(batch)]
            t0 = time.perf_counter()
            # export
            params = []
            for k, rid in enumerate(rids):
                listed = src_ids[k * per : (k + 1) * per]
                ids = check_block_ids(listed, per, nb, FLOOR_TOKENS, unique=True)
                digest = content_digest(FLOOR_TOKENS, ids)
                token = key.token(rid, bytes(8), digest)
                idops.hold(refcount, ids)
                live[rid] = (ids, time.monotonic() + 600, token, digest)
                listed = listed if idops.exact_ints(listed) else ids.tolist()  # plain ints: the list itself
                params.append(params_dict(rid, "P", "127.0.0.1", 5555, 1, listed, FLOOR_TOKENS, token))
            t1 = time.perf_counter()
            # load
            queued = []
            for k, (rid, prm) in enumerate(zip(rids, params)):
                p = KVTransferParams.from_dict(prm)
                local = check_block_ids(dst_ids[k * per : (k + 1) * per], per, nb, FLOOR_TOKENS, unique=True)
                p.digest()
                queued.append((rid, p, local))
            t2 = time.perf_counter()
            # grant (the exporter's side in the middle)
            req = C.decode(
                C.encode(
                    C.ReadReq(
                        "D",
                        0,
                        1,
                        [p.request_id for _, p, _ in queued],
                        [p.token for _, p, _ in queued],
                        digests=[p.digest() for _, p, _ in queued],
                    )
                )
            )
            leases = [live[r] for r in req.request_ids]
            assert all(
                t == lease[2] and d == lease[3] for t, d, lease in zip(req.tokens, req.digests, leases)
            )
            reply = C.decode(
                C.encode(
                    C.ReadReply(
                        ok=req.request_ids,
                        epochs=[idops.snapshot(epochs, lease[0]) for lease in leases],
                        failed={},
                    )
                )
            )
            snapshots = reply.epochs  # int64 bytes, as idops.moved takes them
            t3 = time.perf_counter()
            # copy and epoch re-check
            src_arrs = [p.block_id_array().view(np.int64) for _, p, _ in queued]
            if batch == 1:
                copy.run_bounded(src_arrs[0], queued[0][2], tokens)
            else:  # whole 4K-token requests: their ids end to end are one request's
                copy.run_bounded(np.concatenate(src_arrs), np.concatenate([q[2] for q in queued]), tokens)
            assert not idops.moved(epochs, src_arrs, snapshots)
            t4 = time.perf_counter()
            # notify (the exporter's side in the middle)
            note = C.decode(C.encode(C.Notify("D", 0, 1, rids, [], [p.token for _, p, _ in queued])))
            for r in note.request_ids:
                idops.release(refcount, epochs, live.pop(r)[0])
            ack = C.decode(C.encode(C.Ack(failed={})))
            assert not ack.failed
            t5 = time.perf_counter()
            # poll on both sides
            done_d, done_p = set(rids), set(note.request_ids)
            assert done_d == done_p
            t6 = time.perf_counter()
            if i >= 20:
                for k, a, b in zip(steps, (t0, t1, t2, t3, t4, t5), (t1, t2, t3, t4, t5, t6)):
                    steps[k].append((b - a) / batch)
        # every copy reached the null kernel (the data movement is what is left out, nothing else)
        assert NullKernel.copies - copies0 == n_iter + 20, "copies did not reach the null kernel"
        out = {f"{k}_us": statistics.median(v) * 1e6 for k, v in steps.items()}
        out["total_us"] = statistics.median([sum(x) for x in zip(*steps.values())]) * 1e6
        return out


def onesided_floor(n_iter: int, cold: bool = True) -> dict:
    """The least one one-sided request can cost here, per side: the steps of
    :func:`host_floor` a one-sided read keeps, plus the lease-slot table's, in straight-line code
    with kvxfer's own native pieces and nothing around them (no trackers, peers, flights,
    metrics, notifications, tracing or failure handling):

      export  (P) as :func:`host_floor`'s, and the export's slot opened in the table (its
              binding, one native write)
      load    (D) the params dict checked with its digest (one native call), the local ids, the
              binding, the slot read with the blocks' epochs snapshot (one native call), one
              prepared copy of the whole request into the null kernel
      check   (D) the slot and epochs re-checked after the copy, the done mark written
      free    (P) the done marks taken from the table, the lease dropped (refcounts down, epochs
              bumped), the slot closed

    ``cold`` as for :func:`host_floor`. Medians (us) of each step, of each side and of the
    whole."""
    from kvxfer.transports.ipc.slots import HEADER, SLOT, ExporterSlots, SlotView, binder

    spec = KVCacheSpec(32, 8, 128, 16, torch.bfloat16)
    per = spec.num_blocks_for(FLOOR_TOKENS)
    nb = per + 8
    with _null_caches(spec, nb) as (src, dst):
        copy = ops.PreparedCopy(ops.register_caches(src, spec), ops.register_caches(dst, spec))
        key = EngineSecret("floor", 0, 0)
        epochs = np.zeros(nb, dtype=np.int64)
        refcount = np.zeros(nb, dtype=np.int32)
        assert idops.ensure(), idops.status()
        table = np.zeros(HEADER + 64 * SLOT, dtype=np.int64)
        exporter = ExporterSlots(table, "floor")
        view = SlotView(table)
        bind = binder()
        live: dict[str, tuple[np.ndarray, int]] = {}
        rng = random.Random(0)
        steps: dict[str, list[float]] = {k: [] for k in ("export", "load", "check", "free")}
        copies0 = NullKernel.copies
        for i in range(n_iter + 20):
            src_ids, dst_ids = list(range(nb)), list(range(nb))
            if cold or i == 0:
                rng.shuffle(src_ids)
                rng.shuffle(dst_ids)
            rid = f"r{i}"
            t0 = time.perf_counter()
            # export (P)
            listed = src_ids[:per]
            ids = check_block_ids(listed, per, nb, FLOOR_TOKENS, unique=True)
            digest = content_digest(FLOOR_TOKENS, ids)
            token = key.token(rid, bytes(8), digest)
            idops.hold(refcount, ids)
            slot = exporter.open(rid, token, digest, time.monotonic() + 600, True, False)
            live[rid] = (ids, slot)
            listed = listed if idops.exact_ints(listed) else ids.tolist()
            prm = params_dict(rid, "P", "127.0.0.1", 5555, 1, listed, FLOOR_TOKENS, token)
            t1 = time.perf_counter()
            # load (D)
            p = KVTransferParams.from_dict(prm)
            local = check_block_ids(dst_ids[:per], per, nb, FLOOR_TOKENS, unique=True)
            b0, b1 = bind(p.token, p.digest(), p.request_id)
            now_ns = time.monotonic_ns()
            src_arr = p.block_id_array().view(np.int64)
            got = view.read(b0, b1, now_ns, 2_000_000_000, now_ns + 5_000_000_000, epochs, src_arr)
            assert type(got) is tuple, got
            copy.run_bounded(src_arr, local, FLOOR_TOKENS)
            t2 = time.perf_counter()
            # check (D)
            k, g, snap = got
            assert not view.check(k, g, epochs, src_arr, snap, time.monotonic_ns(), 2_000_000_000)
            assert view.mark_done(k, g, 0, 1)
            t3 = time.perf_counter()
            # free (P)
            done = exporter.take_done()
            for r, _ in done:
                held, slot = live.pop(r)
                exporter.close(slot)
                idops.release(refcount, epochs, held)
            t4 = time.perf_counter()
            assert [r for r, _ in done] == [rid], done
            if i >= 20:
                for name, a, b in zip(steps, (t0, t1, t2, t3), (t1, t2, t3, t4)):
                    steps[name].append(b - a)
        assert NullKernel.copies - copies0 == n_iter + 20, "copies did not reach the null kernel"
        out = {f"{k}_us": statistics.median(v) * 1e6 for k, v in steps.items()}
        out["p_side_us"] = statistics.median([a + b for a, b in zip(steps["export"], steps["free"])]) * 1e6
        out["d_side_us"] = statistics.median([a + b for a, b in zip(steps["load"], steps["check"])]) * 1e6
        out["total_us"] = statistics.median([sum(x) for x in zip(*steps.values())]) * 1e6
        return out


def main(argv=None) -> int:
    import bench_engine  # it imports this module: the engine's figure of the same run

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=400, help="timed iterations (default 400)")
    ap.add_argument("--batch", type=int, default=1, help="requests per round (default 1)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    ref = bench_engine.python_reference_us()
    cold = host_floor(a.iters, True, a.batch)
    warm = host_floor(a.iters, False, a.batch)
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
    one = {"cold": onesided_floor(a.iters, True), "warm": onesided_floor(a.iters, False)}
    one_engine = bench_engine.host_cost(n_iter=min(a.iters, 300), onesided=True)
    print(
        "least host cost of one one-sided 4K-token request, us (medians; P: export + free, D: load + check)"
    )
    print(f"  {'step':<8} {'cold':>8} {'warm':>8}")
    for k in ("export", "load", "check", "free", "p_side", "d_side"):
        print(f"  {k:<8} {one['cold'][k + '_us']:8.1f} {one['warm'][k + '_us']:8.1f}")
    print(
        f"  the engine's one-sided path in the same run (cold): P {one_engine['p_side_us']:.1f} us, "
        f"D {one_engine['d_side_us']:.1f} us; target <= {bench_engine.ONESIDED_TARGET_US:.0f} us per side "
        "(scaled to the reference loop)"
    )
    print(f"  this machine now: {ref:.2f} us for a reference Python loop (sum(range(100)))")
    print(
        json.dumps(
            {
                "bench": "host_floor",
                "batch": a.batch,
                "cold": cold,
                "warm": warm,
                "onesided": one,
                "onesided_engine": {k: one_engine[f"{k}_side_us"] for k in ("p", "d")},
                "engine_us": engine["total_us"],
                "python_reference_us": ref,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
