"""How far a leaner Python one-sided path could go: the engine's own one-sided request (P and D,
bench_engine.host_cost(onesided=True)) against the same request with D's load() and poll()
(lean_d), or P's export() and free path (lean_p), replaced by the leanest Python that still does
a request's bookkeeping: the params checked, the local ids checked, the tracker entry, one
record per flight, the slot read and the landing (the same native calls), the copy through the
target's prepared copies, the done mark, the metrics, the deferred notification; without the
engine's layers and the branches the general path needs (groups, batches, hooks, tracing, CUDA
events). Monkeypatches the engine's internals: a measurement of this tree (98f563a), not code to
keep. The floor (bench_host_floor.onesided_floor: the same native steps in straight-line
code, no records) in the same rounds. Rounds interleaved; medians per side, and scaled to the 0.75 us reference loop.

    python profiling/results/2026-11-29-cpu-python-ceiling/lean_paths.py [--rounds 5] [--iters 100]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "profiling")]

import torch  # noqa: E402

import bench_engine  # noqa: E402
import bench_host_floor  # noqa: E402
from kvxfer import engine as E  # noqa: E402
from kvxfer import exporter as X  # noqa: E402
from kvxfer.engine_types import LoadItem, check_block_ids  # noqa: E402
from kvxfer.metrics import now  # noqa: E402
from kvxfer.params import KVTransferParams, params_dict  # noqa: E402
from kvxfer.transports.ipc import onesided as O  # noqa: E402
from kvxfer.transports.ipc import target as T  # noqa: E402
from kvxfer.transports.ipc.session import IpcSession  # noqa: E402

REAL = {
    "load": E.TransferEngine.load,
    "complete": O.OneSided.complete,
    "export": E.TransferEngine.export,
    "tick": X.Exporter.tick,
}


class Rec:
    __slots__ = ("b0", "b1", "item", "key", "reads", "t", "t0")


def lean_load(self, request_id, params, block_ids, num_computed_tokens=0, *, computed_tokens=None):
    if not self._open:
        self._check_started()
    if type(request_id) is not str or not request_id:
        raise ValueError("request_id")
    os_ = self._onesided
    p = KVTransferParams.from_dict(params)
    if type(p) is list or num_computed_tokens or os_ is None or os_._batches:
        return REAL["load"](self, request_id, params, block_ids, num_computed_tokens, computed_tokens=computed_tokens)
    n = p.num_tokens
    ids = check_block_ids(block_ids, -(-n // self.spec.block_size), self.num_blocks, n, unique=True)
    peer = os_._peer(p.engine_id)
    s = peer.session if peer is not None else None
    t = s.onesided if type(s) is IpcSession else None
    if t is None or t.plain is None or not peer.serves(p):
        return REAL["load"](self, request_id, params, block_ids, num_computed_tokens, computed_tokens=computed_tokens)
    now_ns = time.monotonic_ns()
    item = LoadItem(request_id, p, ids, now_ns * 1e-9 + self.timeout_s, 0)
    got = t.ctl.onesided_read(
        t.tables, t.epochs, item.src_ids, n, peer.spec.block_size, peer.num_blocks,
        p.token, p.digest(), request_id, now_ns, T._STALE_NS, now_ns + 5_000_000_000,
    )  # fmt: skip
    if type(got) is int:
        return REAL["load"](self, request_id, params, block_ids, num_computed_tokens, computed_tokens=computed_tokens)
    key = (p.engine_id, p.request_id)
    if key in os_._active or os_._queued(key):
        raise RuntimeError("loaded twice")
    t0 = now()
    self._rt.loads.add(request_id, ids, t0)
    r = Rec()
    r.item, r.t, r.reads, r.b0, r.b1, r.t0, r.key = item, t, got[2], got[0], got[1], t0, key
    with s.lock:
        for c in t.plain:
            c.run_bounded(item.src_ids, ids, n)
    os_._active.add(key)
    os_.loads += 1
    os_.flights.append(r)


def lean_complete(self):
    marked = self._marked
    if marked:
        now_s = time.monotonic()
        if marked[0][0] <= now_s and now_s >= self._next_notify:
            self._notify_marked(False)
    if not self.flights:
        return
    if any(type(r) is not Rec for r in self.flights):
        return REAL["complete"](self)
    flights, self.flights = self.flights, []
    now_ns = time.monotonic_ns()
    rank = self.rank
    for r in flights:
        t = r.t
        got = t.ctl.onesided_land(
            t.tables, t.epochs, r.item.src_ids, r.reads, t.mark_tables, r.b0, r.b1,
            rank.tp_rank, rank.tp_size, now_ns, T._STALE_NS,
        )  # fmt: skip
        assert not got, got
        self._active.discard(r.key)
    tn = now()
    lat = self.rt.loads.finish_many([r.item.request_id for r in flights], tn)
    for r, x in zip(flights, lat):
        self.rt.metrics.record_load(r.t0, tn, r.t.per_token * r.item.num_tokens, len(r.t.plain), x)
    g = time.monotonic() + O.MARK_GRACE_S
    for r in flights:
        marked.append((g, r.t.peer, r.item))


def lean_export(self, request_id, block_ids, num_tokens, ready=None, *, streaming=False, token=None, computed_tokens=None):
    if not self._open:
        self._check_started()
    if (
        type(request_id) is not str or not request_id or type(num_tokens) is not int or num_tokens < 1
        or streaming or token is not None or self.groups is not None
    ):  # fmt: skip
        return REAL["export"](self, request_id, block_ids, num_tokens, ready, streaming=streaming, token=token, computed_tokens=computed_tokens)
    need = -(-num_tokens // self.spec.block_size)
    block_ids = block_ids[:need]
    ids = check_block_ids(block_ids, need, self.num_blocks, num_tokens, unique=True)
    tok, digest, gen = self._export_token(request_id, ids, num_tokens, None, None)
    rt = self._rt
    gated = rt.order.mark(request_id, ready)
    rt.exports.add(request_id, ids, num_tokens, 0, tok, digest, gen, not gated, None)
    return params_dict(request_id, self.engine_id, self.host, self.port, self.tp_size, block_ids, num_tokens, tok)


def lean_tick(self, beat=True):
    if not beat and not self.rt.exports._live:
        return
    for t in self._tickers:
        lv = t.leases
        if lv is None:
            continue
        if lv._unready or beat:
            return REAL["tick"](self, beat)
        slots = lv.slots
        if not slots.marked():
            return
        ex = self.rt.exports
        with ex.lock:
            live, done = ex._live, []
            for rid, mk in slots.take_done():
                e = live.get(rid)
                if e is not None and not e.notified_by and len(mk) == 1 and mk[0][1] == 1:
                    done.append(rid)
            if done:
                done = ex._release_many(done)
                ex._finished.update(done)
                ex.finished_exports += len(done)


VARIANTS = {
    "engine": {},
    "lean_d": {(E.TransferEngine, "load"): lean_load, (O.OneSided, "complete"): lean_complete},
    "lean_p": {(E.TransferEngine, "export"): lean_export, (X.Exporter, "tick"): lean_tick},
}


def run(variant: str, iters: int) -> dict:
    if variant == "floor":  # bench_host_floor.onesided_floor: the native steps in straight-line code
        return bench_host_floor.onesided_floor(iters)
    patch = VARIANTS[variant]
    for (cls, name), fn in patch.items():
        setattr(cls, name, fn)
    try:
        return bench_engine.host_cost(iters, 1, 4096, onesided=True)
    finally:
        for (cls, name), _ in patch.items():
            setattr(cls, name, REAL["complete" if name == "complete" else name])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=100)
    a = ap.parse_args()
    torch.set_num_threads(1)
    refs, rows = [], {k: [] for k in (*VARIANTS, "floor")}
    for _ in range(a.rounds):
        refs.append(bench_engine.python_reference_us())
        for k in rows:
            rows[k].append(run(k, a.iters))
    ref = statistics.median(refs)
    print(f"one one-sided 4K-token request, us per side (medians of {a.rounds} interleaved rounds of {a.iters});")
    print(f"reference loop {ref:.2f} us (scaled columns: x 0.75 / ref)")
    print(f"  {'variant':<8} {'P':>7} {'D':>7} {'load':>7} {'P sc.':>7} {'D sc.':>7}  P/engine D/engine")
    base = {s: statistics.median(x[f"{s}_side_us"] for x in rows["engine"]) for s in "pd"}
    for k, v in rows.items():
        p = statistics.median(x["p_side_us"] for x in v)
        d = statistics.median(x["d_side_us"] for x in v)
        ld = statistics.median(x["load_us"] for x in v)
        print(
            f"  {k:<8} {p:7.1f} {d:7.1f} {ld:7.1f} {p * 0.75 / ref:7.1f} {d * 0.75 / ref:7.1f}"
            f"  {p / base['p']:8.2f} {d / base['d']:9.2f}"
        )


if __name__ == "__main__":
    main()
