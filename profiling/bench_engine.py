"""Engine benchmark: host-side cost per request, and CPU transfer bandwidth of ipc and pg.

1. Host cost of the engine's own code for 4K-token, 32-layer requests (NHD bf16, 8 kv heads
   x 128, block 16), on its ``ipc`` path: P.export(), D.load(), then the batch D's worker runs
   after poll() (``_run_batch``: lease grant round trip, unit choice and chunk packing, the
   prepared copies' calls, epoch check, notification), P's handlers for
   those messages (grant with epoch snapshot, notification count, release) and poll() on both
   sides. Messages are msgspec-encoded and decoded as on the wire, but delivered in-thread
   (the zmq hop is latency, not host work); the copy kernel is replaced by a no-op (data
   movement is measured in part 2). Medians per request over iterations; one request per
   batch (the DESIGN case, target <= 50 us), 8 whole-block requests per batch, and 8
   requests with partial last blocks.
   Beside it, :func:`bench_host_floor.host_floor`: the least any design's path for such a
   request costs here, timed the same way (the steps every design must take, straight-line).
2. Bandwidth: batches of requests moved P -> D (engines in one process, threads) over ``ipc``
   (one copy_blocks from the mapped shm cache) and ``pg`` (gather, Gloo send/recv over
   loopback, scatter), as a fraction of a plain ``copy_`` of the same bytes in the same run.

    python profiling/bench_engine.py [--host-only] [--host-iters 300] [--tokens 4096] [--reqs 4] [--iters 3]

Prints a table and one JSON line.
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

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common
from bench_host_floor import FLOOR_TOKENS, host_floor, onesided_floor
from engine_harness import Loopback, NullKernel, aliased_shm_caches, restore_backends, use_null_backend

from kvxfer import KVCacheSpec, TransferEngine, ops
from kvxfer.prepared import PreparedCopy
from kvxfer.transports.ipc import onesided as onesided_mod
from kvxfer.transports.ipc.shm import alloc_shm_caches


def host_cost(
    n_iter: int = 300,
    batch: int = 1,
    tokens: int = 4096,
    unaligned: bool = False,
    onesided: bool = False,
    batched: bool = False,
    idle_s: float = 0.0,
) -> dict:
    """Host cost per request of the engine's real ipc path, driven synchronously in this thread.

    ``onesided``: the one-sided path (kvxfer.transports.ipc.onesided): ``load()`` finds the
    lease slots and launches the copy, D's ``poll()`` checks it and marks done, P's ``poll()``
    counts the done mark and frees; the notifications D sends (deferred by 0.1 s and coalesced,
    or at once for the handshaking first load and for marks without the control module's
    compare-and-swap) are answered after P's poll and counted on P's side (a coalesced one in
    the iteration that sends it: the medians leave it out, the means hold it). The copy
    kernel being a no-op, the CPU bound on one-sided copies (``CPU_COPY_MAX_BYTES``: on CPU caches
    the copy runs in ``load()``) is lifted: this is the host part of the GPU path. Else the
    messaged path (one-sided reads off). ``batched``: the loads in one ``batched_loads()``
    block (one-sided: one launch for the batch, as the vLLM worker loads a step's requests).
    ``idle_s``: the thread sleeps that long before each caller's step (export, load, the
    loader's batch, each poll), outside the timed spans: every step then runs as it does
    between a server's scheduler steps, its code and data out of the CPU's caches.

    Per iteration: P.export() of ``batch`` requests, D.load() of each, then the loader's batch
    exactly as its worker runs it after ``poll()`` (``_run_batch``: lease grant round trip,
    epoch checks, unit lists, dedupe, chunk packing, the ops calls, notification), the exporter's handlers for those messages (grant, notify, release), and
    ``poll()`` on both sides (which must report every request finished). Only the copy kernel
    and the socket hop are left out.
    """
    spec = KVCacheSpec(32, 8, 128, 16, torch.bfloat16)
    per = spec.num_blocks_for(tokens)
    nb = per * batch + 8
    rng = random.Random(0)
    src_shm, src = aliased_shm_caches(spec, nb)
    dst_shm, dst_c = aliased_shm_caches(spec, nb)
    saved = use_null_backend()
    cpu_bound = onesided_mod.CPU_COPY_MAX_BYTES
    onesided_mod.CPU_COPY_MAX_BYTES = 1 << 62
    p = TransferEngine(spec, src, 0, 1, "P", transport="ipc", lease_s=600).start()
    d = TransferEngine(spec, dst_c, 0, 1, "D", transport="ipc", lease_s=600, onesided=onesided).start()
    d._loader.client.close()
    loop = d._loader.client = Loopback(p)
    notes: list = []  # one-sided: notifications answered after P's poll (the notifier's are late)
    if onesided:
        d._hooks["notify"] = lambda addr, msg: notes.append((addr, msg))
    else:
        d._hooks["notify"] = lambda addr, msg: loop.call(addr, msg, d.timeout_s)  # answered in this thread
    t: dict[str, list[float]] = {k: [] for k in ("export", "load", "loader", "exporter", "poll")}
    side: dict[str, list[float]] = {"P": [], "D": []}
    in_ops: list[float] = []
    ops_s = [0.0]
    # the ops calls a request's path makes: ops.copy_blocks (through the module) and the prepared
    # copies' calls (the session's and the one-sided lane's); a call inside another counts once
    entries = [(ops, "copy_blocks"), *((PreparedCopy, m) for m in ("run", "run_bounded", "batch"))]
    real = [(owner, name, owner.__dict__[name]) for owner, name in entries]
    inside = [False]

    def timed(fn):
        def call(*args, **kw):
            if inside[0]:
                return fn(*args, **kw)
            inside[0] = True
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                ops_s[0] += time.perf_counter() - t0
                inside[0] = False

        return call

    for owner, name, fn in real:
        setattr(owner, name, timed(fn))
    n_warm = 20  # profiling/host_steps.py leaves out as many (its WARMUP)
    copies0 = NullKernel.copies
    try:
        for i in range(n_iter + n_warm):
            src_ids = list(range(nb))
            dst_ids = list(range(nb))
            rng.shuffle(src_ids)
            rng.shuffle(dst_ids)
            lens = [rng.randint(tokens // 2, tokens) if unaligned else tokens for _ in range(batch)]
            rids = [f"r{i}-{k}" for k in range(batch)]
            ex0, op0 = loop.exporter_s, ops_s[0]
            idle(idle_s)
            t0 = time.perf_counter()
            params = [
                p.export(rid, src_ids[k * per : (k + 1) * per], n)
                for k, (rid, n) in enumerate(zip(rids, lens))
            ]
            s_export = time.perf_counter() - t0
            idle(idle_s)
            t0 = time.perf_counter()
            with d.batched_loads() if batched else contextlib.nullcontext():
                for k, (rid, prm) in enumerate(zip(rids, params)):
                    d.load(rid, prm, dst_ids[k * per : (k + 1) * per])
            s_load = time.perf_counter() - t0
            with d._loader.lock:  # what poll() hands the worker
                work, d._loader.incoming = d._loader.incoming, []
            for it in work:
                it.deadline = time.monotonic() + d.timeout_s
            s_loader = 0.0
            if work:  # one-sided: only the first load (handshake, mappings) takes the worker's path
                idle(idle_s)
                t0 = time.perf_counter()
                d._loader._run_batch(work)
                s_loader = time.perf_counter() - t0
            ex3 = loop.exporter_s
            idle(idle_s)
            t0 = time.perf_counter()
            rd = d.poll()
            s_dpoll = time.perf_counter() - t0
            idle(idle_s)
            t0 = time.perf_counter()
            rp = p.poll()
            for addr, msg in notes:
                loop.call(addr, msg, d.timeout_s)
            notes.clear()
            if rp.finished_sending != set(rids):  # the handshaking first load: freed by the notification
                rp.finished_sending |= p.poll().finished_sending
            s_ppoll = time.perf_counter() - t0
            assert rd.finished_recving == set(rids) and not rd.failed, (rd, rd.errors)
            assert rp.finished_sending == set(rids), rp
            if i >= n_warm:
                ex = loop.exporter_s - ex0
                late = loop.exporter_s - ex3  # handlers of the notifications answered after P's poll
                s_loader -= ex - late  # the grant's handler ran inside the loader's batch
                s_ppoll -= late
                for k, v in zip(t, (s_export, s_load, s_loader, ex, s_dpoll + s_ppoll)):
                    t[k].append(v / batch)
                # what each engine's process pays (P and D are separate processes in serving)
                side["P"].append((s_export + ex + s_ppoll) / batch)
                side["D"].append((s_load + s_loader + s_dpoll) / batch)
                in_ops.append((ops_s[0] - op0) / batch)
        assert d.stats()["transports"] == {"P": "ipc"}
        if onesided:
            got = d.stats()["onesided"]
            assert got["loads"] >= (n_iter + n_warm - 1) * batch, got
        # the copies reached the null kernel (not a real backend): the data movement is left out
        assert NullKernel.copies - copies0 >= n_iter + n_warm, "copies did not reach the null kernel"
    finally:
        p.close()
        d.close()
        src_shm.close()
        dst_shm.close()
        for owner, name, fn in real:
            setattr(owner, name, fn)
        restore_backends(saved)
        onesided_mod.CPU_COPY_MAX_BYTES = cpu_bound
    # Medians over iterations: this machine is shared, and preemption only ever adds time.
    # total = median of the per-iteration sums; means are reported alongside.
    out = {f"{k}_us": statistics.median(v) * 1e6 for k, v in t.items()}
    totals = [sum(x) for x in zip(*t.values())]
    out["total_us"] = statistics.median(totals) * 1e6
    out["mean_total_us"] = statistics.mean(totals) * 1e6
    out["ops_checks_us"] = statistics.median(in_ops) * 1e6  # part of loader_us
    # per process: P = export() + exporter handlers + P's poll(); D = load() + loader batch + D's poll()
    out["p_side_us"] = statistics.median(side["P"]) * 1e6
    out["d_side_us"] = statistics.median(side["D"]) * 1e6
    return out


def idle(seconds: float) -> None:
    """Sleep ``seconds`` (none for 0): the pause a server's step puts between two calls."""
    if seconds:
        time.sleep(seconds)


def warm_vs_cold(n_iter: int = 400) -> dict:
    """The same ``ops.copy_blocks`` call the engine makes for one 4K-token request (ids checked
    already, null kernel), timed in a tight loop (warm) and after 0.5 ms of other Python each
    time (a spin on ``perf_counter``, as a scheduler step would run in between): how much of the
    host cost above is this machine running the engine's code cold rather than the code's
    length. Medians in us."""
    spec = KVCacheSpec(32, 8, 128, 16, torch.bfloat16)
    src_shm, src = aliased_shm_caches(spec, 300)
    dst_shm, dst = aliased_shm_caches(spec, 300)
    saved = use_null_backend()
    try:
        sc, dc = ops.register_caches(src, spec), ops.register_caches(dst, spec)
        perm = list(range(300))
        random.Random(1).shuffle(perm)
        a = torch.tensor(perm[:256]).numpy()
        b = torch.tensor(perm[44:300]).numpy()

        def call() -> None:
            ops.copy_blocks(
                sc, spec, ops.CheckedIds(a, 300, False), dc, spec, ops.CheckedIds(b, 300, True), 4096
            )

        out = {}
        for mode in ("warm", "cold"):
            for _ in range(20):
                call()
            ts = []
            for _ in range(n_iter):
                if mode == "cold":
                    t = time.perf_counter()
                    while time.perf_counter() - t < 0.0005:
                        pass
                t0 = time.perf_counter()
                call()
                ts.append(time.perf_counter() - t0)
            out[f"{mode}_us"] = statistics.median(ts) * 1e6
        return out
    finally:
        src_shm.close()
        dst_shm.close()
        restore_backends(saved)


def bandwidth(transport: str, tokens: int, reqs: int, iters: int) -> dict:
    spec = KVCacheSpec(4, 8, 64, 16, torch.float16)
    per = spec.num_blocks_for(tokens)
    nb = per * reqs + 8
    src = alloc_shm_caches(spec, nb, 1, fill=1)
    dst = alloc_shm_caches(spec, nb, 1, fill=0)
    p = TransferEngine(spec, src.caches, 0, 1, "P", transport=transport, lease_s=60).start()
    d = TransferEngine(spec, dst.caches, 0, 1, "D", transport=transport, lease_s=60).start()
    nbytes = tokens * reqs * spec.bytes_per_token()
    times = []
    try:
        for it in range(iters + 1):  # first round handshakes and pairs: excluded
            params = [
                p.export(f"b{it}-{r}", list(range(r * per, (r + 1) * per)), tokens) for r in range(reqs)
            ]
            t0 = time.perf_counter()
            for r, prm in enumerate(params):
                d.load(f"b{it}-{r}", prm, list(range(r * per, (r + 1) * per)))
            done: set[str] = set()
            while len(done) < reqs:
                res = d.poll()
                assert not res.failed, res.errors
                done |= res.finished_recving
                time.sleep(0.0002)
            if it:
                times.append(time.perf_counter() - t0)
            while p.stats()["exports_live"]:
                p.poll()
                time.sleep(0.001)
        s = d.stats()
    finally:
        p.close()
        d.close()
        src.close()
        dst.close()
    # plain memcpy of the same bytes, same run
    a = torch.ones(nbytes, dtype=torch.uint8)
    b = torch.empty_like(a)
    b.copy_(a)
    mt = []
    for _ in range(iters):
        t0 = time.perf_counter()
        b.copy_(a)
        mt.append(time.perf_counter() - t0)
    best, mbest = min(times), min(mt)
    out = {
        "transport": transport,
        "bytes": nbytes,
        "s": best,
        "GBps": nbytes / best / 1e9,
        "memcpy_GBps": nbytes / mbest / 1e9,
        "fraction_of_memcpy": mbest / best,
        "ops_calls": s["ops_calls"],
        "transport_used": s["transports"],
    }
    if transport == "pg":  # the link itself: what no pg transfer here can beat
        lbest = common.gloo_loopback_s(nbytes, iters)
        out["link_GBps"], out["fraction_of_link"] = nbytes / lbest / 1e9, lbest / best
    return out


def floor_vs_engine(n_iter: int, rounds: int = 6, batch: int = 1) -> dict:
    """:func:`host_floor` and :func:`host_cost` of ``batch`` requests at a time in alternating
    short rounds (this VM's speed moves by up to 2x within a run, so a ratio of two separate
    runs means little): the floor's medians and the median per-round ratio engine / floor."""
    n = max(n_iter // rounds // batch, 20)
    ratios, runs = [], []
    for _ in range(rounds):
        engine = host_cost(n, batch, FLOOR_TOKENS)["total_us"]
        runs.append(host_floor(n, batch=batch))
        ratios.append(engine / runs[-1]["total_us"])
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    out["engine_ratio"], out["rounds"] = statistics.median(ratios), rounds
    return out


def onesided_floor_vs_engine(n_iter: int, rounds: int = 6) -> dict:
    """:func:`onesided_floor` and the engine's one-sided :func:`host_cost` in alternating short
    rounds, as :func:`floor_vs_engine`: the floor's medians and, per side, the median per-round
    ratio engine / floor."""
    n = max(n_iter // rounds, 20)
    ratios: dict[str, list[float]] = {"p": [], "d": []}
    runs = []
    for _ in range(rounds):
        engine = host_cost(n, 1, FLOOR_TOKENS, onesided=True)
        runs.append(onesided_floor(n))
        for k in ratios:
            ratios[k].append(engine[f"{k}_side_us"] / runs[-1][f"{k}_side_us"])
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    out["p_ratio"], out["d_ratio"] = statistics.median(ratios["p"]), statistics.median(ratios["d"])
    out["rounds"] = rounds
    return out


HOST_TARGET_US = 50.0  # DESIGN.md: host cost of one 4K-token request
BATCH_TARGET_US = 25.0  # issue 17: per request, in batches of 8
ONESIDED_TARGET_US = 30.0  # issue 40: one-sided, one 4K-token request
MESSAGED_TARGET_US = 50.0  # issue 57: messaged, one 4K-token request, both sides, at the reference below
REFERENCE_US = 0.75  # the reference loop on an idle 2-core CI VM: issue 57's targets are set at it
# Issue 17's CPU data-path targets (fractions of a plain memcpy of the same bytes) are set for
# the ops (bench_ops --quick prints them); here they are held against the whole transfer,
# engine, Gloo and staging included, which is stricter.
BW_TARGETS = {"ipc": 0.6, "pg": 0.5}


def python_reference_us() -> float:
    """Best of 5 x 2000 runs of a fixed Python loop, in us: how fast this (shared) machine runs
    interpreter code right now. Host-cost figures move with it by up to 2x between runs on
    the CI VM; the ratio to it is what compares across runs."""
    import timeit

    return min(timeit.repeat("sum(range(100))", number=2000, repeat=5)) / 2000 * 1e6


PHASES = (
    ("export_us", "export()            validate, lease, params dict"),
    ("load_us", "load()              validate params + local ids, queue"),
    ("loader_us", "loader batch        grant msgs, epoch checks, units, chunks, ops checks, notify"),
    ("exporter_us", "exporter handlers   grant (epoch snapshot, renew), notify, release"),
    ("poll_us", "poll() x2           drain finished/failed on both sides"),
)

SIDES = (  # P and D run in separate processes: what each one's GIL pays per request
    ("p_side_us", "  on P (exporter): export() + handlers + its poll()"),
    ("d_side_us", "  on D (loader): load() + loader batch + its poll()"),
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reqs", type=int, default=4)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--host-iters", type=int, default=300)
    ap.add_argument("--host-only", action="store_true", help="skip the bandwidth runs")
    ap.add_argument(
        "--idle-ms",
        type=float,
        default=10.0,
        help="the one-request cases again with this pause before each caller's step, as between a "
        "server's steps (default 10; 0 leaves them out)",
    )
    a = ap.parse_args()
    torch.set_num_threads(1)
    cases = {
        "1x4096": host_cost(a.host_iters, 1, 4096),
        "8x4096": host_cost(max(a.host_iters // 8, 10), 8, 4096),
        "8x2K-4K": host_cost(max(a.host_iters // 8, 10), 8, 4096, unaligned=True),
        "1x4096-1s": host_cost(a.host_iters, 1, 4096, onesided=True),
        "8x4096-1s": host_cost(max(a.host_iters // 8, 10), 8, 4096, onesided=True),
        "8x4096-1sb": host_cost(max(a.host_iters // 8, 10), 8, 4096, onesided=True, batched=True),
    }
    idle_s = a.idle_ms / 1e3
    if idle_s > 0:  # each step after a pause: its code and data no longer in the CPU's caches
        n_idle = max(a.host_iters // 3, 10)
        tag = f"@{a.idle_ms:g}ms"
        cases["1x4096" + tag] = host_cost(n_idle, 1, 4096, idle_s=idle_s)
        cases["1x4096-1s" + tag] = host_cost(n_idle, 1, 4096, onesided=True, idle_s=idle_s)
    target = cases["1x4096"]["total_us"]
    print("host-side cost per request, us, median over iterations (32 layers, 8x128 bf16, block 16;")
    print("ipc path through the engine's own code; copy kernel and socket hop excluded)")
    names = list(cases)
    w = max(11, max(len(n) for n in names) + 1)
    print(f"  {'phase':<80}" + "".join(f"{n:>{w}}" for n in names))
    for key, label in PHASES:
        print(f"  {label:<80}" + "".join(f"{cases[n][key]:{w}.1f}" for n in names))
        if key == "loader_us":
            label = "  of which the ops calls (validation, PagedSide, dispatch; kernel no-op)"
            print(f"  {label:<80}" + "".join(f"{cases[n]['ops_checks_us']:{w}.1f}" for n in names))
    print(f"  {'total per request (median)':<80}" + "".join(f"{cases[n]['total_us']:{w}.1f}" for n in names))
    print(
        f"  {'total per request (mean)':<80}" + "".join(f"{cases[n]['mean_total_us']:{w}.1f}" for n in names)
    )
    for key, label in SIDES:
        print(f"  {label:<80}" + "".join(f"{cases[n][key]:{w}.1f}" for n in names))
    batched = cases["8x4096"]["total_us"]
    for what, got, goal in (
        ("DESIGN target <= 50 us for one 4K-token request", target, HOST_TARGET_US),
        ("issue 17 target <= 25 us per request in batches of 8", batched, BATCH_TARGET_US),
    ):
        verdict = "met" if got <= goal else "NOT met"
        print(f"  {what}: {verdict} ({got:.1f} us, {got / goal:.2f}x)")
    floor = floor_vs_engine(a.host_iters)
    print(
        f"  least any design's path costs here (host_floor: only the steps every design takes, as cold): "
        f"{floor['total_us']:.1f} us; the engine's one request is {floor['engine_ratio']:.1f}x that "
        f"(median of {floor['rounds']} interleaved rounds)"
    )
    floor8 = floor_vs_engine(a.host_iters, batch=8)
    print(
        f"  the same in batches of 8 (one grant, one ops call, one notification for all): "
        f"{floor8['total_us']:.1f} us per request, of which export() + load() {floor8['export_us'] + floor8['load_us']:.1f} us; "
        f"the engine is {floor8['engine_ratio']:.1f}x that"
    )
    print("  (8x2K-4K: requests of 2048..4096 tokens, last block partial; -1s: the one-sided path,")
    print("   where load() launches the copy and poll() checks it: its 'loader batch' is empty, and")
    print("   its exporter handlers are the deferred notifications, coalesced; -1sb: the eight")
    print("   one-sided loads in one batched_loads() block, launched together; @N ms: each caller's")
    print("   step after an N ms pause, as between a server's steps, its code and data out of the caches)")
    one = cases["1x4096-1s"]
    sides = {k: one[f"{k.lower()}_side_us"] for k in ("P", "D")}
    per = ", ".join(
        f"{k} {v:.1f} us {'met' if v <= ONESIDED_TARGET_US else 'NOT met'}" for k, v in sides.items()
    )
    verdict = "met" if one["total_us"] <= ONESIDED_TARGET_US else "NOT met"
    print(
        f"  issue 40 target <= {ONESIDED_TARGET_US:.0f} us for a one-sided 4K-token request: per side {per}; "
        f"both sides together {verdict} ({one['total_us']:.1f} us; messaged {target:.1f} us)"
    )
    f1 = onesided_floor_vs_engine(a.host_iters)
    print(
        f"  least a one-sided request costs here (onesided_floor: the same native steps in straight-line "
        f"code, as cold): P {f1['p_side_us']:.1f} us, D {f1['d_side_us']:.1f} us; the engine is "
        f"P {f1['p_ratio']:.1f}x, D {f1['d_ratio']:.1f}x that (median of {f1['rounds']} interleaved rounds)"
    )
    ref = python_reference_us()
    print(
        f"  this machine now: {ref:.2f} us for a reference Python loop (sum(range(100)); ~0.75 us on an idle "
        "2-core CI VM): scale the figures above by it to compare runs"
    )
    k = REFERENCE_US / ref
    scaled = {"factor": k, "p_onesided_us": sides["P"] * k, "d_onesided_us": sides["D"] * k}
    scaled.update(messaged_us=target * k, messaged_floor_us=floor["total_us"] * k)
    per = ", ".join(
        f"{s} {scaled[f'{s.lower()}_onesided_us']:.1f} us {'met' if scaled[f'{s.lower()}_onesided_us'] <= ONESIDED_TARGET_US else 'NOT met'}"
        for s in ("P", "D")
    )
    verdict = "met" if scaled["messaged_us"] <= MESSAGED_TARGET_US else "NOT met"
    print(
        f"  issue 57 targets, the figures scaled to the {REFERENCE_US} us reference (x{k:.2f}): one-sided "
        f"<= {ONESIDED_TARGET_US:.0f} us per side: {per}; messaged <= {MESSAGED_TARGET_US:.0f} us: {verdict} "
        f"({scaled['messaged_us']:.1f} us; host_floor {scaled['messaged_floor_us']:.1f} us)"
    )
    wc = warm_vs_cold()
    print(
        f"  the engine's ops.copy_blocks call of one request: {wc['warm_us']:.1f} us in a tight loop, "
        f"{wc['cold_us']:.1f} us after 0.5 ms of other Python ({wc['cold_us'] / wc['warm_us']:.1f}x):"
    )
    print("  a spin evicts little; the @N ms columns are the cost after a pause:")
    warm_ref, idle_ref = common.idle_reference_us(max(idle_s, 0.01))
    print(
        f"  the reference loop after {max(idle_s, 0.01) * 1e3:g} ms idle: {idle_ref:.1f} us, back to back "
        f"{warm_ref:.2f} us ({idle_ref / warm_ref:.0f}x): what a pause costs this machine's caches now"
    )
    bw = [] if a.host_only else [bandwidth(t, a.tokens, a.reqs, a.iters) for t in ("ipc", "pg")]
    if bw:
        print(
            f"\n{'transport':<9} {'MiB':>8} {'GB/s':>8} {'memcpy GB/s':>12} {'fraction':>9} {'ops calls':>9}"
        )
    for r in bw:
        goal = BW_TARGETS[r["transport"]]
        r["target"], r["met"] = goal, r["fraction_of_memcpy"] >= goal
        line = (
            f"{r['transport']:<9} {r['bytes'] / 2**20:8.1f} {r['GBps']:8.2f} {r['memcpy_GBps']:12.2f} "
            f"{r['fraction_of_memcpy']:9.2f} {r['ops_calls']:9d}   end to end against memcpy (the ops' "
            f"target >= {goal:.2f} held to the whole transfer): " + ("met" if r["met"] else "NOT met")
        )
        if "link_GBps" in r:
            line += (
                f"; the Gloo link itself (raw send, same bytes, this run): {r['link_GBps']:.2f} GB/s, "
                f"the transfer reaches {r['fraction_of_link']:.2f} of it"
            )
        print(line)
    targets = {
        "host_1x_us": HOST_TARGET_US,
        "host_batch8_us": BATCH_TARGET_US,
        "python_reference_us": ref,
        "idle_reference_us": [warm_ref, idle_ref],
        "scaled_to_reference": scaled,
    }
    print(
        json.dumps(
            {
                "bench": "engine",
                "host_cost": cases,
                "floor": floor,
                "floor_batch8": floor8,
                "floor_onesided": f1,
                "warm_vs_cold": wc,
                "bandwidth": bw,
                "targets": targets,
            }
        )
    )


if __name__ == "__main__":
    main()
