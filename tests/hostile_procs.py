"""Process bodies of the hostile-client soak (tests/test_hostile_soak.py).

* :func:`hostile_exporter` — P: exports requests of random lengths from a small, reused block
  pool; a block freed (finished, expired, aborted, or P closed) is overwritten at once with
  other bytes, so a read after its release shows as wrong bytes; aborts a fifth of the requests
  at a random moment after handing out their params; closes and restarts once (same engine id
  and port). Measures its RSS and its tracker at the end.
* :func:`hostile_loader` — D: loads each request into fresh blocks (or releases it unloaded),
  checks the bytes of each load reported finished the moment it is reported, and times each
  report against its deadline.
* :func:`hostile_client` — a stranger on P's side channel: random, truncated, oversized and
  deeply nested frames, forged tokens, replayed grants and heartbeats of real params, and
  loads of tampered params through an engine of its own; with ``replay_notify`` (per second),
  replayed notifications of real params too (one id twice in a message, or from a loader rank that
  notifies nothing).
* :func:`table_stranger` — a process of P's user writing random words into P's lease-slot
  table (:func:`table_writer`), following P across its restart (the one-sided phase).
"""

from __future__ import annotations

import contextlib
import os
import random
import time

import msgspec
import torch

from .engine_payload import POISON, check, fill, poison
from .engine_procs import _spec


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0  # pragma: no cover - not Linux


def hostile_exporter(sc: dict, q_d, q_h, q_w=None, q_ready=None) -> dict:
    from kvxfer import TransferEngine
    from kvxfer.transports.ipc.shm import alloc_shm_caches

    rng = random.Random(sc["seed"])
    spec = _spec(sc["spec"])
    nb = sc["src_blocks"]
    shm = alloc_shm_caches(spec, nb, 1)

    def start():
        e = TransferEngine(
            spec, shm.caches, 0, 1, "P", transport=sc["transport"], lease_s=sc["lease_s"],
            port=sc["port"], timeout_s=sc["timeout_s"],
        ).start()  # fmt: skip
        ipc = e._transports["ipc"]
        if q_w is not None and ipc.slot_segment is not None:  # the stranger finds it in /dev/shm
            q_w.put((ipc.slot_segment.name, ipc.entry["slot_words"]))
        return e

    eng = start()
    if q_ready is not None:  # the soak starts when D's engine is up (not during its imports)
        q_ready.get(timeout=sc["deadline_s"])
    free = list(range(nb))
    held: dict[str, list[int]] = {}
    released: dict[str, float] = {}  # request -> when P released it (monotonic)
    reports: dict[str, int] = {}
    aborts: list[tuple[float, str]] = []  # (when, request)
    aborted: set[str] = set()
    exported_at: dict[str, float] = {}
    restart_t = float("inf")
    rss0 = None
    i = 0
    restarted = False
    end = time.monotonic() + sc["deadline_s"]

    def free_now(rid: str) -> None:
        ids = held.pop(rid)
        fill(shm.caches, spec, 0, 1, ids, len(ids) * spec.block_size, seed=7)  # the runner reuses them
        free.extend(ids)
        released.setdefault(rid, time.monotonic())

    def drain() -> None:
        r = eng.poll()
        for rid in r.finished_sending | r.expired:
            reports[rid] = reports.get(rid, 0) + 1
            if rid in held:
                free_now(rid)

    while (i < sc["num"] or held) and time.monotonic() < end:
        drain()
        now = time.monotonic()
        for t, rid in [a for a in aborts if a[0] <= now]:
            aborts.remove((t, rid))
            if rid in held and eng.abort_export(rid):
                aborted.add(rid)
        if not restarted and i >= sc["restart_at"]:
            # the restart begins with close(): its side channel goes first, so a load that
            # fails while close() still runs (a connection lost) is one the restart explains
            restart_t = time.monotonic()
            eng.close()  # every live export ends: released now, blocks reused
            for rid in list(held):
                free_now(rid)
            eng = start()
            restarted = True
        while i < sc["num"] and len(held) < sc["in_flight"]:
            n = rng.randint(1, sc["max_tokens"])
            need = spec.num_blocks_for(n)
            if len(free) < need:
                break
            rng.shuffle(free)
            ids = [free.pop() for _ in range(need)]
            rid, seed = f"q{i}", 100 + i
            fill(shm.caches, spec, 0, 1, ids, n, seed)
            params = eng.export(rid, ids, n)
            held[rid] = ids
            exported_at[rid] = time.monotonic()
            roll = rng.random()
            action = "release" if roll < sc["p_release"] else "load"
            q_d.put((rid, params, n, seed, action))
            q_h.put(params)
            if sc["p_release"] <= roll < sc["p_release"] + sc["p_abort"]:
                aborts.append((time.monotonic() + rng.uniform(0.0, 0.004), rid))
            i += 1
            if i == 20:
                rss0 = _rss_mb()  # warm: pools, plans and kernels made
        time.sleep(0.001)
    q_d.put(None)
    q_h.put(None)
    if q_w is not None:
        q_w.put(None)
    rss1 = _rss_mb()
    stats = eng.stats()
    exports = eng._rt.exports
    with exports.lock:  # what is still live, and how long its lease still runs (seconds)
        live = {rid: round(e.deadline - time.monotonic(), 2) for rid, e in exports._live.items()}
    eng.close()
    shm.close()
    return {
        "exported": i,
        "held": sorted(held),
        "reports": reports,
        "released": released,
        "aborted": sorted(aborted),
        "exported_at": exported_at,
        "restart_t": restart_t,
        "exports_live": stats["exports_live"],
        "live_at_end": live,
        "timed_out": bool(held) or i < sc["num"],
        "blocks_held": stats["blocks_held"],
        "rss_growth_mb": rss1 - (rss0 or rss1),
    }


def hostile_loader(sc: dict, q_in, q_ready=None) -> dict:
    from kvxfer import TransferEngine

    spec = _spec(sc["spec"])
    caches = [
        torch.empty(spec.cache_shape(sc["dst_blocks"], 1), dtype=spec.dtype) for _ in range(spec.num_layers)
    ]
    poison(caches)
    eng = TransferEngine(
        spec, caches, 0, 1, "D", transport=sc["transport"], lease_s=sc["lease_s"], timeout_s=sc["timeout_s"]
    ).start()
    if q_ready is not None:
        q_ready.put(True)
    loads: dict[str, tuple] = {}  # rid -> (dst ids, n, seed, load time)
    reports: dict[str, list] = {}  # rid -> [("done" | reason, when), ...]
    wrong: list[str] = []
    next_dst = 0
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
            rid, params, n, seed, action = msg
            if action == "release":
                eng.release(params)
                continue
            need = spec.num_blocks_for(n)
            dst = list(range(next_dst, next_dst + need))
            next_dst += need
            eng.load(rid, params, dst)
            loads[rid] = (dst, n, seed, time.monotonic())
        r = eng.poll()
        t = time.monotonic()
        for rid in r.finished_recving:
            dst, n, seed, _ = loads[rid]
            if not check(caches, spec, 0, 1, dst, n, seed):  # at once: nothing may change it later
                wrong.append(rid)
            reports.setdefault(rid, []).append(("done", t))
        for rid in r.failed:
            reports.setdefault(rid, []).append((r.errors.get(rid, "?"), t))
        time.sleep(0.001)
    stats = eng.stats()
    eng.close()
    return {
        "loads": {rid: v[3] for rid, v in loads.items()},
        "reports": reports,
        "wrong": wrong,
        "notify_failures": stats.get("notify_failures", 0),
        "onesided": stats["onesided"].get("loads", 0),
        "fallbacks": stats["onesided"].get("fallbacks", {}),
    }


def _frames(rng: random.Random, params: list[dict], spec_dict: dict):
    """One hostile frame: (kind, payload bytes)."""
    from kvxfer import KVTransferParams
    from kvxfer import control as C

    kind = rng.choice(["random", "truncated", "nested", "forged", "replayed", "bounds"])
    tok = lambda: os.urandom(24).hex()  # noqa: E731
    ident = dict(
        engine_id="H", tp_rank=0, tp_size=1, spec=spec_dict, compat="", transports=["ipc", "pg"], hostname="h"
    )
    if kind == "random":
        return kind, os.urandom(rng.randint(0, 2048))
    if kind == "truncated":
        whole = C.encode(C.Hello(**ident, request_id="q1", token=tok(), digest=os.urandom(16)))
        return kind, whole[: rng.randint(0, len(whole) - 1)]
    if kind == "nested":
        head = C.encode(C.Heartbeat("H", 0, [], []))  # a map of 5 fields: make it 6
        return kind, bytes([head[0] + 1]) + head[1:] + b"\xa4junk" + b"\x81\xa1a" * rng.randint(
            500, 5000
        ) + b"\x80"
    if kind == "bounds":  # fields past their bounds: a 2M-rank loader, a 64 KB engine id
        field = rng.choice([("tp_size", 2_000_000), ("engine_id", "e" * (64 << 10))])
        msg = {
            "type": "Notify",
            "engine_id": "H",
            "tp_rank": 0,
            "tp_size": 1,
            "request_ids": ["q1"],
            "failed": [],
        }
        return kind, msgspec.msgpack.encode({**msg, "tokens": [tok()], field[0]: field[1]})
    if kind == "forged" or not params:
        rids = [f"q{rng.randint(0, 400)}" for _ in range(rng.randint(0, 8))]
        toks = [tok() for _ in rids]
        msg = rng.choice(
            [
                C.ReadReq(
                    "H",
                    0,
                    rng.randint(1, 256),
                    rids,
                    toks,
                    wait_s=rng.uniform(0, 5),
                    digests=[os.urandom(16)] * len(rids),
                ),
                C.Notify("H", 0, rng.randint(1, 256), rids, [], toks),
                C.Heartbeat("H", 0, rids, toks),
                C.PairReq("H", 0, "h/0/x", "gloo", rids[0] if rids else "", tok()),
                C.SendReq("H", 0, "h/0/x", rids, toks, 0, 1, 16, [(b"\0" * 8, 16, 0, 0)], 16),
                C.Hello(**ident, request_id=rids[0] if rids else "", token=tok()),
            ]
        )
        return "forged", C.encode(msg)
    p = KVTransferParams.from_dict(rng.choice(params))  # replayed: what a legit loader sends
    msg = rng.choice(
        [
            C.ReadReq("H", 0, 1, [p.request_id], [p.token], digests=[p.digest()]),
            C.Heartbeat("H", 0, [p.request_id], [p.token]),
            C.ReadReq("H", 0, 1, [p.request_id], [p.token], digests=[os.urandom(16)]),  # tampered
        ]
    )
    return "replayed", C.encode(msg)


def hostile_client(sc: dict, q_params, q_stop) -> dict:
    """Send hostile frames to P's side channel until told to stop; load tampered params through
    an engine of its own. Counts what was sent and how the tampered loads ended."""
    import zmq

    from kvxfer import KVTransferParams, TransferEngine
    from kvxfer import control as C

    rng = random.Random(sc["seed"] + 1)
    spec = _spec(sc["spec"])
    params: list[dict] = []
    ctx = zmq.Context()
    addr = f"tcp://127.0.0.1:{sc['port']}"

    def sock():
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 1000)
        s.connect(addr)
        return s

    s = sock()
    caches = [torch.empty(spec.cache_shape(64, 1), dtype=spec.dtype) for _ in range(spec.num_layers)]
    poison(caches)
    h = TransferEngine(spec, caches, 0, 1, "H", transport=sc["transport"], timeout_s=1.0).start()
    sent: dict[str, int] = {}
    tampered: dict[str, str] = {}
    mid = 0
    oversized = 0
    end = time.monotonic() + sc["deadline_s"]
    t_start = time.monotonic()
    stopped = False
    while not stopped and time.monotonic() < end:
        while True:
            try:
                got = q_params.get_nowait()
            except Exception:
                break
            if got is None:
                stopped = True
                break
            params.append(got)
        if not q_stop.empty():
            break
        due = int((time.monotonic() - t_start) * sc["hostile_rate"]) - sum(sent.values())
        for _ in range(max(0, min(due, 256))):  # paced: hostile_rate frames per second
            kind, raw = _frames(rng, params[-50:], spec.to_dict())
            mid += 1
            try:
                s.send_multipart([mid.to_bytes(8, "little"), raw], zmq.NOBLOCK)
            except zmq.Again:
                s.close(0)
                s = sock()
            sent[kind] = sent.get(kind, 0) + 1
            while s.poll(0):
                s.recv_multipart()  # replies: drained, ignored
        if oversized < 2 and rng.random() < 0.01:  # a frame over the bound: P drops the peer
            big = sock()
            big.send_multipart([b"\0" * 8, b"\0" * (65 << 20)])
            big.close(0)
            oversized += 1
            sent["oversized"] = sent.get("oversized", 0) + 1
        due = int((time.monotonic() - t_start) * sc.get("replay_notify", 0)) - sent.get("notify", 0)
        for _ in range(min(due, 8) if params else 0):  # paced: replay_notify per second
            # a replayed notification of real params (a token holder releasing them early):
            # the same id twice in one message, or from a loader rank that notifies nothing
            p = KVTransferParams.from_dict(rng.choice(params[-5:]))
            k, (tp, rank) = rng.choice([1, 2]), rng.choice([(1, 0), (1, 0), (4, 3)])
            msg = C.Notify("H", rank, tp, [p.request_id] * k, [], [p.token] * k)
            mid += 1
            with contextlib.suppress(zmq.Again):
                s.send_multipart([mid.to_bytes(8, "little"), C.encode(msg)], zmq.NOBLOCK)
            sent["notify"] = sent.get("notify", 0) + 1
        if params and rng.random() < 0.3 and len(tampered) < 40:
            p = dict(rng.choice(params[-20:]))
            how = rng.choice(["block_ids", "num_tokens", "token"])
            if how == "block_ids":
                p["block_ids"] = [(b + 1) % sc["src_blocks"] for b in p["block_ids"]]
            elif how == "num_tokens":
                p["num_tokens"] = (
                    p["num_tokens"] + 1 if p["num_tokens"] % spec.block_size else p["num_tokens"] - 1
                )
            else:
                p["token"] = p["token"][:-4] + "beef"
            rid = f"t{len(tampered)}-{how}"
            if p["num_tokens"] >= 1:
                h.load(rid, p, list(range(spec.num_blocks_for(p["num_tokens"]))))
                tampered[rid] = "pending"
        r = h.poll()
        for rid in r.finished_recving:
            tampered[rid] = "DONE"
        for rid in r.failed:
            tampered[rid] = "failed"
        time.sleep(0.001)
    end = time.monotonic() + 3.0
    while "pending" in tampered.values() and time.monotonic() < end:
        r = h.poll()
        for rid in r.finished_recving:
            tampered[rid] = "DONE"
        for rid in r.failed:
            tampered[rid] = "failed"
        time.sleep(0.01)
    written = not all(bool((c.view(torch.uint8) == POISON).all()) for c in caches)
    h.close()
    s.close(0)
    ctx.term()
    return {"sent": sent, "tampered": tampered, "written": written}


def table_writer(name: str, words: int, seed: int, seconds: float, q_stop=None) -> dict:
    """A stranger of the exporter's user: maps its lease-slot table by name (what any such
    process can find in ``/dev/shm``) and writes random words into every field, in bursts
    (30 ms on, 30 ms off) for ``seconds`` or until ``q_stop`` holds an item: header words,
    ring entries and every word of the slots (live ones half the time), each an extreme
    (0, +-1, int64's ends, ...), a random int64, a small int, or, into a live slot, a done
    mark forged for its current generation with its ring entry (which frees that export
    early). Returns how many words it wrote, by field."""
    import numpy as np

    from kvxfer.transports.ipc import slots as S
    from kvxfer.transports.ipc.shm import attach_array, detach

    table, h = attach_array(name, words)
    t = table.numpy()
    n = (words - S.HEADER) // S.SLOT
    rows = t[S.HEADER :].reshape(n, S.SLOT)
    rng = random.Random(seed)
    extremes = [0, 1, -1, 2, 3, -9, -57, 511, 512, 2**31, 2**62, 2**63 - 1, -(2**62), -(2**63)]
    wrote: dict[str, int] = {}
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end and (q_stop is None or q_stop.empty()):
            burst = time.monotonic() + 0.03
            while time.monotonic() < burst:
                live = np.flatnonzero(rows[:, S.S_FLAGS] & S.LIVE)
                for _ in range(32):
                    r = rng.random()
                    kind = rng.random()
                    if kind < 0.4:
                        v = rng.choice(extremes)
                    elif kind < 0.7:
                        v = rng.getrandbits(64) - (1 << 63)
                    else:
                        v = rng.randint(-1000, 1000)
                    if r < 0.2:
                        k = rng.randrange(8)
                        field = f"header{k}"
                        t[k] = v
                    elif r < 0.3:
                        field = "ring"
                        t[S.H_RING + rng.randrange(S.RING)] = v
                    else:
                        i = int(rng.choice(live)) if live.size and rng.random() < 0.5 else rng.randrange(n)
                        w = rng.randrange(S.SLOT)
                        if w >= S.S_DONE and rng.random() < 0.3:  # a done mark forged for this export
                            g = int(rows[i, S.S_GEN])
                            if 0 <= g < 2**54:  # a mark of it fits int64
                                v = g * S.DONE_TP + 1
                                c = int(t[S.H_DONE])
                                if 0 <= c < 2**62:
                                    t[S.H_RING + c % S.RING] = i
                                    t[S.H_DONE] = c + 1
                            w = S.S_DONE
                        field = f"slot{w}" if w < S.S_DONE else "slot.done"
                        rows[i, w] = v
                    wrote[field] = wrote.get(field, 0) + 1
                time.sleep(0.0002)
            time.sleep(0.03)
    finally:
        del t, rows, table
        detach(h)
    return wrote


def table_stranger(sc: dict, q_w) -> dict:
    """The table writer of the soak's one-sided phase: writes P's current lease-slot table
    (:func:`table_writer`, in slices of 0.3 s) and moves to the new one when P restarts, until P
    says it ended (None) or the deadline. Returns the words written by field."""
    total: dict[str, int] = {}
    current = None
    end = time.monotonic() + sc["deadline_s"]
    while time.monotonic() < end:
        try:
            while True:  # the newest table P published, or P's end
                got = q_w.get(timeout=0.05) if current is None else q_w.get_nowait()
                if got is None:
                    return total
                current = got
        except Exception:
            pass
        if current is None:
            continue
        try:
            wrote = table_writer(current[0], current[1], sc["seed"] * 1000 + sum(total.values()), 0.3)
        except FileNotFoundError:  # that start of P closed (its table unlinked): wait for the next
            current = None
            continue
        for k, v in wrote.items():
            total[k] = total.get(k, 0) + v
    return total
