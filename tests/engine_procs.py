"""Engines in processes for the engine tests: free ports, processes joined on a deadline (from a
forkserver that preloads torch and kvxfer), and the process bodies: an exporting and a loading
rank, the soak's exporter and loaders, and the faults soak's (an exporter that crashes and is
restarted, loaders that drop messages). The payloads they write and check are
``tests/engine_payload.py``'s.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback

import torch

from kvxfer.ports import free_port_base  # noqa: F401  (re-exported for tests)
from kvxfer.spec import KVCacheSpec

from .engine_payload import check, fill, poison, untouched


def _entry(fn, args, q, name):
    try:
        q.put((name, "ok", fn(*args)))
    except BaseException as e:
        q.put((name, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


_CTX = None


def _context():
    """A forkserver context that preloads torch and kvxfer once: each child then starts in
    milliseconds instead of re-importing torch (seconds on a loaded 2-core CI runner)."""
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(
            ["torch", "kvxfer.engine", "kvxfer.transports.pg.groups", "tests.engine_procs"]
        )
    return _CTX


def run_procs(specs: dict, deadline_s: float = 60.0, ctx=None) -> dict:
    """Run ``{name: (fn, args)}`` each in its own spawned process; join against one deadline.

    ``args`` may contain ``"@queue:<key>"`` placeholders replaced by shared queues. Returns
    ``{name: result}``; raises AssertionError naming every process that failed or hung
    (leftovers are killed).
    """
    ctx = ctx or _context()
    out_q = ctx.Queue()
    queues: dict[str, object] = {}

    def sub(a):
        if isinstance(a, str) and a.startswith("@queue:"):
            return queues.setdefault(a, ctx.Queue())
        return a

    procs = {}
    for name, (fn, args) in specs.items():
        p = ctx.Process(target=_entry, args=(fn, tuple(sub(a) for a in args), out_q, name), daemon=True)
        p.start()
        procs[name] = p
    results: dict = {}
    errors: list[str] = []
    end = time.monotonic() + deadline_s
    while len(results) + len(errors) < len(procs) and time.monotonic() < end:
        try:
            name, status, val = out_q.get(timeout=0.2)
        except Exception:
            dead = [n for n, p in procs.items() if not p.is_alive() and n not in results]
            if dead and out_q.empty():
                # a process died without reporting (killed on purpose, or crashed)
                for n in dead:
                    if n not in results and not any(e.startswith(n + ":") for e in errors):
                        results[n] = ("died", procs[n].exitcode)
            continue
        if status == "ok":
            results[name] = val
        else:
            errors.append(f"{name}: {val}")
    hung = [n for n in procs if n not in results and not any(e.startswith(n + ":") for e in errors)]
    for p in procs.values():
        p.join(timeout=max(0.0, min(2.0, end - time.monotonic())))
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    if errors or hung:
        raise AssertionError("; ".join(errors + [f"{n}: did not finish within {deadline_s}s" for n in hung]))
    return results


# --------------------------------------------------------------------------- process bodies
def _spec(d: dict) -> KVCacheSpec:
    return KVCacheSpec.from_dict(d)


def _pipeline(sc: dict):
    """``sc["staged"]``: kwargs of a StagedPipeline (chunked, double-buffered pg); else None."""
    if sc.get("staged") is None:
        return None
    from kvxfer.transports.pg.pipeline import StagedPipeline

    return StagedPipeline(**sc["staged"])


def _caches(spec: KVCacheSpec, num_blocks: int, tp: int, device: str, shared: bool):
    """(caches, owner to close): shm caches on CPU when ``shared``, else plain tensors (CUDA
    ones from torch's allocator, exportable over CUDA IPC)."""
    if device == "cpu" and shared:
        from kvxfer.transports.ipc.shm import alloc_shm_caches

        shm = alloc_shm_caches(spec, num_blocks, tp)
        return shm.caches, shm
    shape = spec.cache_shape(num_blocks, tp)
    return [torch.empty(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)], None


def _result(r) -> dict:
    return {
        "finished_sending": sorted(r.finished_sending),
        "finished_recving": sorted(r.finished_recving),
        "failed": {k: list(v) for k, v in r.failed.items()},
        "expired": sorted(r.expired),
        "errors": dict(r.errors),
    }


def exporter_rank(sc: dict, tp_rank: int, q_out, q_ctl, q_go=None) -> dict:
    """One exporting rank: fill and export ``sc["requests"]``, poll until all are released.

    ``sc["requests"]``: list of (request_id, num_tokens, seed, src_block_ids). Rank 0 puts
    the params list on ``q_out`` (once per loader rank). With ``sc["hold"]`` the rank waits
    for "check" on ``q_ctl``, polls ``hold_s`` seconds recording what was released early,
    then puts "go" on ``q_go`` (default ``q_ctl``; a separate queue, so a waiting loader
    cannot take the "check" meant for the exporter).
    """
    import os

    from kvxfer import TransferEngine

    spec = _spec(sc["src_spec"])
    tp = sc["src_tp"]
    device = sc.get("device", "cpu")
    # plain_src: plain CPU tensors, which ipc reads with cross-memory attach
    caches, shm = _caches(spec, sc["src_blocks"], tp, device, shared=not sc.get("plain_src"))
    poison(caches)
    eng = TransferEngine(
        spec,
        caches,
        tp_rank,
        tp,
        "P",
        transport=sc["transport"],
        lease_s=sc.get("lease_s", 10.0),
        port=sc["src_port"],
        timeout_s=sc.get("timeout_s"),
        pipeline=_pipeline(sc),
    ).start()
    if sc.get("die_before_send"):
        eng._hooks["before_send"] = lambda: os._exit(3)
    params = []
    for rid, n, seed, ids in sc["requests"]:
        fill(caches, spec, tp_rank, tp, ids, n, seed)
        params.append(eng.export(rid, ids, n))
    if tp_rank == 0:
        for _ in range(sc["dst_tp"]):
            q_out.put(params)
    want = {r[0] for r in sc["requests"]}
    seen: list[dict] = []
    released: set[str] = set()
    early: list[str] = []
    end = time.monotonic() + sc.get("deadline_s", 30.0)
    if sc.get("hold"):
        q_ctl.get(timeout=30)  # first loader rank finished
        t_hold = time.monotonic() + sc.get("hold_s", 0.5)
        while time.monotonic() < t_hold:
            r = eng.poll()
            early += sorted(r.finished_sending | r.expired)
            seen.append(_result(r))
            released |= r.finished_sending | r.expired
            time.sleep(0.01)
        (q_go or q_ctl).put("go")
    while released != want and time.monotonic() < end:
        r = eng.poll()
        seen.append(_result(r))
        released |= r.finished_sending | r.expired
        time.sleep(0.005)
    stats = eng.stats()
    eng.close()
    if shm is not None:
        shm.close()
    return {"params": params, "polls": seen, "early": early, "stats": stats}


def loader_rank(sc: dict, tp_rank: int, q_in, q_ctl, q_go=None) -> dict:
    """One loading rank: load every request into ``dst_block_ids``, poll until all reported,
    then check every landed request byte for byte and that nothing else was touched."""
    from kvxfer import TransferEngine

    spec = _spec(sc["dst_spec"])
    tp = sc["dst_tp"]
    device = sc.get("dst_device", sc.get("device", "cpu"))
    caches, _ = _caches(spec, sc["dst_blocks"], tp, device, shared=False)
    poison(caches)
    eng = TransferEngine(
        spec,
        caches,
        tp_rank,
        tp,
        "D",
        transport=sc["transport"],
        lease_s=sc.get("lease_s", 10.0),
        port=sc["dst_port"],
        timeout_s=sc.get("timeout_s"),
        pipeline=_pipeline(sc),
    ).start()
    params = q_in.get(timeout=30)
    if sc.get("hold") and tp_rank == 1:
        (q_go or q_ctl).get(timeout=30)  # wait until the exporter checked it did not free early
    for p, (rid, _n, _seed, _ids) in zip(params, sc["requests"]):
        eng.load(rid, p, sc["dst_ids"][rid])
    want = {r[0] for r in sc["requests"]}
    seen: list[dict] = []
    got: set[str] = set()
    end = time.monotonic() + sc.get("deadline_s", 30.0)
    while got != want and time.monotonic() < end:
        r = eng.poll()
        seen.append(_result(r))
        got |= r.finished_recving | set(r.failed)
        time.sleep(0.005)
    if sc.get("hold") and tp_rank == 0:
        q_ctl.put("check")
    ok = {}
    used: set[int] = set()
    tails: dict[int, int] = {}
    done = set().union(*[set(s["finished_recving"]) for s in seen]) if seen else set()
    for rid, n, seed, _ in sc["requests"]:
        ids = sc["dst_ids"][rid]
        if rid in done:
            ok[rid] = check(caches, spec, tp_rank, tp, ids, n, seed)
            used |= set(ids)
            tails[ids[-1]] = n - (len(ids) - 1) * spec.block_size
    clean = untouched(caches, spec, used, tails)
    stats = eng.stats()
    eng.close()
    return {"polls": seen, "ok": ok, "untouched": clean, "stats": stats}


# --------------------------------------------------------------------------------- soak
def soak_exporter(sc: dict, q_d0, q_d1) -> dict:
    """P (tp=1): export ``sc["num"]`` random-length requests from a small, reused block pool;
    abort some at random; tell the loaders; free blocks on finished/expired reports."""
    import random

    from kvxfer import TransferEngine
    from kvxfer.transports.ipc.shm import alloc_shm_caches

    rng = random.Random(sc["seed"])
    spec = _spec(sc["src_spec"])
    nb = sc["src_blocks"]
    shm = alloc_shm_caches(spec, nb, 1)
    eng = TransferEngine(
        spec, shm.caches, 0, 1, "P", transport=sc["transport"], lease_s=sc["lease_s"], port=sc["src_port"]
    ).start()
    free = list(range(nb))
    held: dict[str, list[int]] = {}
    reports: dict[str, int] = {}
    aborted, skipped = set(), set()
    next_dst = 0
    i = 0
    end = time.monotonic() + sc["deadline_s"]

    def drain():
        r = eng.poll()
        for rid in r.finished_sending | r.expired:
            reports[rid] = reports.get(rid, 0) + 1
            free.extend(held.pop(rid))

    while (i < sc["num"] or held) and time.monotonic() < end:
        drain()
        while i < sc["num"]:
            n = rng.randint(1, sc["max_tokens"])
            need = spec.num_blocks_for(n)
            if len(free) < need:
                break
            rng.shuffle(free)
            ids = [free.pop() for _ in range(need)]
            rid = f"s{i}"
            seed = 1000 + i
            fill(shm.caches, spec, 0, 1, ids, n, seed)
            params = eng.export(rid, ids, n)
            held[rid] = ids
            dst_ids = list(range(next_dst, next_dst + -(-n // sc["dst_block_size"])))
            next_dst += len(dst_ids)
            skip = rng.random() < sc["p_skip"]  # the loader never comes: lease expiry
            if skip:
                skipped.add(rid)
            msg = (rid, params, dst_ids, n, seed, skip)
            q_d0.put(msg)
            q_d1.put(msg)
            if rng.random() < sc["p_abort"]:  # the client went away: abort, blocks freed now
                eng.abort_export(rid)
                aborted.add(rid)
            i += 1
        time.sleep(0.002)
    q_d0.put(None)
    q_d1.put(None)
    stats = eng.stats()
    eng.close()
    shm.close()
    return {
        "reports": reports,
        "aborted": sorted(aborted),
        "skipped": sorted(skipped),
        "free": len(free),
        "held": sorted(held),
        "stats": stats,
        "exported": i,
    }


def soak_loader(sc: dict, tp_rank: int, q_in) -> dict:
    from kvxfer import TransferEngine

    spec = _spec(sc["dst_spec"])
    caches = [
        torch.empty(spec.cache_shape(sc["dst_blocks"], 2), dtype=spec.dtype) for _ in range(spec.num_layers)
    ]
    poison(caches)
    eng = TransferEngine(
        spec, caches, tp_rank, 2, "D", transport=sc["transport"], lease_s=sc["lease_s"], port=sc["dst_port"]
    ).start()
    loaded: dict[str, tuple] = {}
    polls: list[dict] = []
    reported: set[str] = set()
    ended = False
    end = time.monotonic() + sc["deadline_s"]
    while (not ended or reported != set(loaded)) and time.monotonic() < end:
        while True:
            try:
                msg = q_in.get_nowait()
            except Exception:
                break
            if msg is None:
                ended = True
                break
            rid, params, dst_ids, n, seed, skip = msg
            if not skip:
                eng.load(rid, params, dst_ids)
                loaded[rid] = (dst_ids, n, seed)
        r = eng.poll()
        polls.append(_result(r))
        reported |= r.finished_recving | set(r.failed)
        time.sleep(0.002)
    done = set().union(*[set(p["finished_recving"]) for p in polls])
    bad = [rid for rid in done if not check(caches, spec, tp_rank, 2, *loaded[rid])]
    stats = eng.stats()
    eng.close()
    return {"polls": polls, "loaded": sorted(loaded), "bad": bad, "stats": stats, "ended": ended}


# --------------------------------------------------------------------------- faults soak
def _install_faults(sc: dict, who: int) -> None:
    """Drop a share of the acknowledged messages (notifications, heartbeats, acks) in this
    process: the engine must retry them, never lose a request or report it twice."""
    from kvxfer import control as C

    C.set_fault_injector(
        C.FaultInjector(
            drop=sc["drop"],
            seed=sc["seed"] + who,
            only=lambda m: isinstance(m, (C.Notify, C.Heartbeat, C.Ack)),
        )
    )


def fault_exporter(sc: dict, part: str, q_d0, q_d1, q_ctl) -> dict:
    """P for the faults soak. ``part="first"`` exports requests [0, kill_at) and then dies
    without closing anything (a crash: SIGKILL-like ``os._exit``), after telling the test its
    shared-memory segments; ``part="second"`` is the restarted P (same engine id, same port),
    started when told, exporting [kill_at, num)."""
    import os
    import random

    from kvxfer import TransferEngine
    from kvxfer.transports.ipc.shm import alloc_shm_caches

    _install_faults(sc, 100 if part == "first" else 200)
    rng = random.Random(sc["seed"] + (0 if part == "first" else 1))
    spec = _spec(sc["src_spec"])
    nb = sc["src_blocks"]
    lo, hi = (0, sc["kill_at"]) if part == "first" else (sc["kill_at"], sc["num"])
    if part == "second":
        assert q_ctl.get(timeout=sc["deadline_s"]) == "go"
    shm = alloc_shm_caches(spec, nb, 1)
    eng = TransferEngine(
        spec,
        shm.caches,
        0,
        1,
        "P",
        transport="auto",
        lease_s=sc["lease_s"],
        timeout_s=sc["timeout_s"],
        port=sc["src_port"],
    ).start()
    if part == "first":
        ipc = eng._transports["ipc"]
        made = [s.name for s in (ipc.segment, ipc.slot_segment) if s is not None]
        q_ctl.put(("segments", [shm.name, *made]))
    free = list(range(nb))
    held: dict[str, list[int]] = {}
    reports: dict[str, int] = {}
    aborted: set[str] = set()
    i = lo
    end = time.monotonic() + sc["deadline_s"]

    def drain():
        r = eng.poll()
        for rid in r.finished_sending | r.expired:
            reports[rid] = reports.get(rid, 0) + 1
            free.extend(held.pop(rid))

    while (i < hi or held) and time.monotonic() < end:
        drain()
        while i < hi and len(held) < sc["in_flight"]:
            n = rng.randint(1, sc["max_tokens"])
            need = spec.num_blocks_for(n)
            if len(free) < need:
                break
            rng.shuffle(free)
            ids = [free.pop() for _ in range(need)]
            rid = f"s{i}"
            fill(shm.caches, spec, 0, 1, ids, n, 1000 + i)
            params = eng.export(rid, ids, n)
            held[rid] = ids
            msg = (rid, params, n, 1000 + i)
            (q_d0 if i % 2 == 0 else q_d1).put(msg)
            if rng.random() < sc["p_abort"]:
                eng.abort_export(rid)  # the client went away: the loader must not get stale bytes
                aborted.add(rid)
            i += 1
        if part == "first" and i >= hi:
            time.sleep(0.05)  # some loads are in flight now
            for q in (q_d0, q_d1, q_ctl):
                q.close()
                q.join_thread()
            os._exit(9)  # crash: nothing closed, nothing released
        time.sleep(0.002)
    q_d0.put(None)
    q_d1.put(None)
    stats = eng.stats()
    eng.close()
    shm.close()
    return {
        "reports": reports,
        "aborted": sorted(aborted),
        "free": len(free),
        "held": sorted(held),
        "stats": stats,
        "exported": i - lo,
        "threads_left": _engine_threads(),
    }


def _engine_threads() -> int:
    """kvxfer's threads still alive in this process (the queue feeders of the test are not)."""
    import threading

    return sum(t.name.startswith("kvxfer-") for t in threading.enumerate())


def fault_loader(sc: dict, who: int, q_in) -> dict:
    """D for the faults soak: loads what it is sent (ipc for D0, pg for D1), polls like a
    scheduler, checks every delivered request byte for byte, and times each load."""

    from kvxfer import TransferEngine

    _install_faults(sc, who)
    spec = _spec(sc["dst_spec"])
    nb = sc["dst_blocks"]
    caches = [torch.empty(spec.cache_shape(nb, 1), dtype=spec.dtype) for _ in range(spec.num_layers)]
    poison(caches)
    eng = TransferEngine(
        spec,
        caches,
        0,
        1,
        f"D{who}",
        transport="ipc" if who == 0 else "pg",
        lease_s=sc["lease_s"],
        timeout_s=sc["timeout_s"],
    ).start()
    free = list(range(nb))
    loads: dict[str, tuple] = {}  # rid -> (dst ids, n, seed, t_load)
    reports: dict[str, list[str]] = {}
    bad: list[str] = []
    late: list[tuple[str, float]] = []
    ended = False
    end = time.monotonic() + sc["deadline_s"]
    while (not ended or len(reports) < len(loads)) and time.monotonic() < end:
        while True:
            try:
                msg = q_in.get_nowait()
            except Exception:
                break
            if msg is None:
                ended = True
                break
            rid, params, n, seed = msg
            need = spec.num_blocks_for(n)
            if len(free) < need:
                raise AssertionError("soak: D's block pool is too small")
            ids = [free.pop() for _ in range(need)]
            eng.load(rid, params, ids)
            loads[rid] = (ids, n, seed, time.monotonic())
        r = eng.poll()
        t = time.monotonic()
        for rid in r.finished_recving | set(r.failed):
            reports.setdefault(rid, []).append("done" if rid in r.finished_recving else "failed")
            ids, n, seed, t0 = loads[rid]
            if t - t0 > sc["timeout_s"] + sc["poll_slack_s"]:
                late.append((rid, round(t - t0, 3)))
            if rid in r.finished_recving and not check(caches, spec, 0, 1, ids, n, seed):
                bad.append(rid)
            free.extend(ids)
        time.sleep(0.002)
    stats = eng.stats()
    eng.close()
    return {
        "loads": sorted(loads),
        "reports": reports,
        "bad": bad,
        "late": late,
        "stats": stats,
        "ended": ended,
        "threads_left": _engine_threads(),
    }
