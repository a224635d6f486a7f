"""One-sided ipc reads (kvxfer.transports.ipc.onesided): byte-exact through the caller's copy
across TP ratios, layouts, block sizes, dtypes, MLA, n>1 and partial loads, and every way the
path can go wrong (a release during the copy, a compute not done, an exporter that died or a
loader that did, a slot reused, params forged or altered). Each test also checks that the
one-sided path, not the messaged one, did the work (``stats()["onesided"]``)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from kvxfer import KVCacheSpec, KVTransferParams, TransferEngine, idops, ops
from kvxfer.transports.ipc import onesided as onesided_mod
from kvxfer.transports.ipc import slots as slots_mod
from kvxfer.transports.ipc import target as target_mod
from kvxfer.transports.ipc.onesided import LEASE_LEFT_S
from kvxfer.transports.ipc.shm import alloc_shm_caches

from .engine_procs import check, fill, free_port_base, payload, poison, untouched

F16 = KVCacheSpec(2, 2, 16, 8, torch.float16)


# ----------------------------------------------------------------------------- helpers
class Ranks:
    """``tp`` engine ranks of one engine in this process, over shared-memory caches."""

    def __init__(self, spec: KVCacheSpec, tp: int, name: str, nb: int = 48, **kw) -> None:
        self.spec, self.tp, self.name = spec, tp, name
        port = free_port_base(tp)
        self.shm = [alloc_shm_caches(spec, nb, tp) for _ in range(tp)]
        for s in self.shm:
            poison(s.caches)
        self.engines = []
        try:
            for r in range(tp):
                kw.setdefault("lease_s", 30.0)
                e = TransferEngine(spec, self.shm[r].caches, r, tp, name, port=port if tp > 1 else 0, **kw)
                self.engines.append(e.start())
        except BaseException:
            self.close()
            raise

    def __getitem__(self, r: int) -> TransferEngine:
        return self.engines[r]

    def caches(self, r: int):
        return self.shm[r].caches

    def export(self, rid: str, ids: list[int], n: int, seed: int, **kw) -> dict:
        """Fill and export ``rid`` on every rank; the params (checked equal on every rank)."""
        params = []
        for r, e in enumerate(self.engines):
            fill(self.caches(r), self.spec, r, self.tp, ids, n, seed)
            params.append(e.export(rid, ids, n, **kw))
        assert all(p == params[0] for p in params)
        return params[0]

    def onesided(self) -> list[int]:
        return [e.stats()["onesided"]["loads"] for e in self.engines]

    def native(self) -> list[int]:
        """Per rank, the one-sided loads the native lane looked up (``LoadBook.begin``)."""
        return [e.stats()["onesided"]["native"] for e in self.engines]

    def close(self) -> None:
        for e in self.engines:
            e.close()
        for s in self.shm:
            s.close()


def poll_until(engines, want: set[str], side: str, timeout: float = 10.0) -> dict[str, str]:
    """Poll every engine of ``engines`` until each of them reported every id of ``want`` on
    ``side`` ("recv" or "send"); per id the outcomes ("done", "failed: why", "expired") of all
    ranks, which must agree. Each rank reports an id once."""
    got: list[dict[str, str]] = [{} for _ in engines]
    end = time.monotonic() + timeout
    while any(set(g) != want for g in got) and time.monotonic() < end:
        for e, g in zip(engines, got):
            r = e.poll()
            if side == "recv":
                out = {rid: "done" for rid in r.finished_recving}
                out.update({rid: "failed: " + r.errors.get(rid, "") for rid in r.failed})
            else:
                out = {rid: "done" for rid in r.finished_sending}
                out.update(dict.fromkeys(r.expired, "expired"))
            for rid, what in out.items():
                assert rid not in g, f"{rid} reported twice"
                g[rid] = what
        time.sleep(0.001)
    merged: dict[str, str] = {}
    for g in got:
        for rid, what in g.items():
            if merged.setdefault(rid, what) != what:
                merged[rid] = f"ranks disagree: {merged[rid]} / {what}"
    return merged


def warm(p: Ranks, d: Ranks) -> None:
    """One request through the messaged path: D handshakes and maps P (the one-sided path needs
    both); not counted as one-sided."""
    prm = p.export("warm", [0], 1, seed=1)
    for e in d.engines:
        e.load("warm", prm, [0])
    assert poll_until(d.engines, {"warm"}, "recv") == {"warm": "done"}
    assert poll_until(p.engines, {"warm"}, "send") == {"warm": "done"}
    assert d.onesided() == [0] * d.tp


@contextlib.contextmanager
def warmed(src: KVCacheSpec = F16, dst: KVCacheSpec = F16):
    """A single-rank P and D, D warmed (handshaken and mapped: :func:`warm`); both closed after."""
    p = Ranks(src, 1, "P")
    try:
        d = Ranks(dst, 1, "D")
        try:
            warm(p, d)
            yield p, d
        finally:
            d.close()
    finally:
        p.close()


def tokens_hold(caches, spec, tp_rank, tp_size, ids, n, seed, lo, hi) -> bool:
    """Tokens ``[lo, hi)`` of request ``seed`` (this rank's heads) are in ``ids``, bytewise."""
    got = ops.gather_blocks(caches, spec, ids, n)
    want = payload(spec, seed, n, spec.heads_of_rank(tp_rank, tp_size))
    return torch.equal(got[..., lo:hi, :].view(torch.uint8), want[..., lo:hi, :].view(torch.uint8))


# ------------------------------------------------------------------- byte-exact, any shape
CASES = {
    "nhd16-hnd32-fp16-1:1": (KVCacheSpec(2, 4, 16, 16, torch.float16), 1, KVCacheSpec(2, 4, 16, 32, torch.float16, layout="HND"), 1),
    "hnd32-nhd16-bf16-2:1": (KVCacheSpec(3, 4, 16, 32, torch.bfloat16, layout="HND"), 2, KVCacheSpec(3, 4, 16, 16, torch.bfloat16), 1),
    "nhd8-nhd12-fp8-1:2": (KVCacheSpec(2, 4, 32, 8, torch.float8_e4m3fn), 1, KVCacheSpec(2, 4, 32, 12, torch.float8_e4m3fn), 2),
    "fp32-1:4": (KVCacheSpec(2, 4, 8, 16, torch.float32), 1, KVCacheSpec(2, 4, 8, 16, torch.float32, layout="HND"), 4),
    "bf16-4:1": (KVCacheSpec(2, 4, 16, 16, torch.bfloat16, layout="HND"), 4, KVCacheSpec(2, 4, 16, 8, torch.bfloat16), 1),
    "fp16-2:3": (KVCacheSpec(2, 6, 8, 16, torch.float16), 2, KVCacheSpec(2, 6, 8, 32, torch.float16, layout="HND"), 3),
    "replicated-1:4": (KVCacheSpec(2, 2, 16, 16, torch.float16), 1, KVCacheSpec(2, 2, 16, 16, torch.float16), 4),
    "mla-1:2": (KVCacheSpec(2, 1, 48, 16, torch.bfloat16, use_mla=True), 1, KVCacheSpec(2, 1, 48, 32, torch.bfloat16, use_mla=True), 2),
}  # fmt: skip


@pytest.mark.parametrize("batched", [False, True], ids=["each", "batched"])
@pytest.mark.parametrize("case", list(CASES))
def test_onesided_lands_exactly_and_frees_by_done_marks(case, batched):
    """Requests of odd lengths (partial last blocks on both sides) land byte for byte through the
    caller's copy on every loader rank, blocks no request names keep their poison, and every
    exporter rank frees each request once every loader rank it expects has landed it, not
    before. ``batched``: each rank's loads in one ``batched_loads()`` block, launched together
    (fewer ops calls than loads)."""
    src, src_tp, dst, dst_tp = CASES[case]

    def load_all(e, reqs):
        with e.batched_loads() if batched else contextlib.nullcontext():
            for rid, (_, _, prm, d_ids) in reqs.items():
                e.load(rid, prm, d_ids)
            if batched:  # held until the block ends
                assert e.stats()["onesided"]["in_flight"] == 0
        assert e.stats()["onesided"]["in_flight"] == len(reqs)

    p, d = Ranks(src, src_tp, "P"), None
    try:
        d = Ranks(dst, dst_tp, "D")
        warm(p, d)
        for e in d.engines:  # notifications dropped: only the done marks free the blocks
            e._hooks["notify"] = lambda addr, msg: None
        lengths = [1, 7, 16, 33, 64, 100]
        s_next, d_next = 1, 1
        reqs = {}
        for i, n in enumerate(lengths):
            s_ids = list(range(s_next, s_next + src.num_blocks_for(n)))[::-1]
            d_ids = list(range(d_next, d_next + dst.num_blocks_for(n)))
            s_next += len(s_ids)
            d_next += len(d_ids)
            reqs[f"r{i}"] = (n, 100 + i, p.export(f"r{i}", s_ids, n, seed=100 + i), d_ids)
        # every loader rank but the last loads: no exporter rank that waits for it may free
        calls0 = [e.stats()["ops_calls"] for e in d.engines]
        for r in range(dst_tp - 1):
            load_all(d[r], reqs)
        if dst_tp > 1:
            assert poll_until(d.engines[:-1], set(reqs), "recv") == dict.fromkeys(reqs, "done")
            # an exporter rank the last loader rank notifies must not have freed anything yet
            waits_last = [
                s for s in range(src_tp) if type(p[s]._exporter.expected_from(dst_tp, dst_tp - 1)) is int
            ]
            assert waits_last, "the plan has the last loader rank notify no exporter rank"
            early = poll_until([p[s] for s in waits_last], set(reqs), "send", timeout=0.3)
            assert early == {}, f"freed before the last loader rank landed: {early}"
        load_all(d[dst_tp - 1], reqs)
        assert poll_until(d.engines[-1:], set(reqs), "recv") == dict.fromkeys(reqs, "done")  # the others did
        assert d.onesided() == [len(reqs)] * dst_tp, [e.stats()["onesided"] for e in d.engines]
        # the first load made the target (the Python path); the native lane read the others,
        # batched or not
        assert d.native() == [len(reqs) - 1] * dst_tp, d.native()
        calls = [e.stats()["ops_calls"] - c0 for e, c0 in zip(d.engines, calls0)]
        for e, c in zip(d.engines, calls):
            peer = e._loader.peers.get("P")
            each = len(reqs) * sum(
                len(peer.reads_by_rank[s]) for s in peer.src_ranks
            )  # a call per load and read
            if batched:  # the batch planner's calls for the six loads together: fewer
                assert 0 < c < each, (c, each)
            else:
                assert c == each, (c, each)
        for r in range(dst_tp):
            used: set[int] = {0}
            for n, seed, _, d_ids in reqs.values():
                assert check(d.caches(r), dst, r, dst_tp, d_ids, n, seed), f"D{r} request seed {seed}"
                used |= set(d_ids)
            tails = {ids[-1]: n - (len(ids) - 1) * dst.block_size for n, _, _, ids in reqs.values()}
            assert untouched(d.caches(r), dst, used, tails), f"D{r} wrote outside the requests"
        assert poll_until(p.engines, set(reqs), "send") == dict.fromkeys(reqs, "done")
        for e in p.engines:
            assert e.stats()["blocks_held"] == 0 and e.stats()["exports_live"] == 0
    finally:
        p.close()
        if d is not None:
            d.close()


def test_onesided_n_children_and_partial_loads():
    """n>1 children sharing prefix blocks, and loads of only the tokens a prefix hit lacks
    (``num_computed_tokens``): the held prefix is not written, the rest lands exactly."""
    src, dst = (
        KVCacheSpec(2, 2, 16, 8, torch.bfloat16),
        KVCacheSpec(2, 2, 16, 16, torch.bfloat16, layout="HND"),
    )
    p, d = Ranks(src, 1, "P"), Ranks(dst, 1, "D")
    try:
        warm(p, d)
        # n=3 children: 4 shared blocks of prefix (32 tokens), a tail each
        prefix = [10, 11, 12, 13]
        fill(p.caches(0), src, 0, 1, [*prefix, 14], 37, seed=7)  # the prefix's payload is seed 7's
        params = {}
        for i, (tail_blk, tail) in enumerate([(14, 5), (15, 8), (16, 3)]):
            rid = f"c{i}"
            params[rid] = (p[0].export(rid, [*prefix, tail_blk], 32 + tail), 32 + tail)
        d_ids = {"c0": [1, 2, 3], "c1": [4, 5, 6], "c2": [7, 8, 9]}
        for rid, (prm, _) in params.items():
            d[0].load(rid, prm, d_ids[rid])
        assert poll_until(d.engines, set(params), "recv") == dict.fromkeys(params, "done")
        assert tokens_hold(d.caches(0), dst, 0, 1, d_ids["c0"], 37, 7, 0, 37)
        for rid in ("c1", "c2"):  # their prefix tokens are seed 7's
            assert tokens_hold(d.caches(0), dst, 0, 1, d_ids[rid], params[rid][1], 7, 0, 32)
        # a partial load: D holds tokens [0, 32) already (another seed's), pulls [32, 50)
        fill(p.caches(0), src, 0, 1, [20, 21, 22, 23, 24, 25, 26], 50, seed=9)
        prm = p[0].export("part", [20, 21, 22, 23, 24, 25, 26], 50)
        fill(d.caches(0), dst, 0, 1, [30, 31, 32, 33], 50, seed=99)
        d[0].load("part", prm, [30, 31, 32, 33], num_computed_tokens=32)
        assert poll_until(d.engines, {"part"}, "recv") == {"part": "done"}
        assert tokens_hold(d.caches(0), dst, 0, 1, [30, 31, 32, 33], 50, 99, 0, 32), (
            "the held prefix was written"
        )
        assert tokens_hold(d.caches(0), dst, 0, 1, [30, 31, 32, 33], 50, 9, 32, 50)
        assert d.onesided() == [4]
        assert poll_until(p.engines, {*params, "part"}, "send") == dict.fromkeys([*params, "part"], "done")
    finally:
        p.close()
        d.close()


def test_wait_reports_a_onesided_load_without_polling():
    with warmed() as (p, d):
        prm = p.export("a", [3, 4], 12, seed=3)
        d[0].load("a", prm, [5, 6])
        r = d[0].wait(["a"], 5.0)
        assert r.finished_recving == {"a"} and d.onesided() == [1]
        assert check(d.caches(0), F16, 0, 1, [5, 6], 12, 3)
        with pytest.raises(ValueError, match="timeout_s"):
            d[0].wait(["a"], -1)


@pytest.mark.parametrize("dst_bs", [16, 32])
@pytest.mark.parametrize("layouts", ["NHD-NHD", "HND-HND", "NHD-HND", "HND-NHD"])
def test_batched_loads_take_two_ops_calls_for_six_requests(layouts, dst_bs):
    """Six requests with partial last blocks, loaded in one batch, are one ops call of whole
    blocks and one of token slots (the tails), where each load alone is one call: on a GPU,
    two launches for the step instead of six. vLLM's layout (NHD), and HND on either side,
    whose tails only the kernels can address as slots (``token_slots``)."""
    s_lay, d_lay = layouts.split("-")
    src = KVCacheSpec(2, 4, 16, 16, torch.bfloat16, layout=s_lay)
    dst = KVCacheSpec(2, 4, 16, dst_bs, torch.bfloat16, layout=d_lay)
    p, d = Ranks(src, 1, "P", nb=80), Ranks(dst, 1, "D", nb=80)
    try:
        warm(p, d)
        reqs, s_next, d_next = {}, 1, 1
        for i, n in enumerate([1, 17, 100, 300, 64, 33]):
            s_ids = list(range(s_next, s_next + src.num_blocks_for(n)))[::-1]
            d_ids = list(range(d_next, d_next + dst.num_blocks_for(n)))
            s_next, d_next = s_next + len(s_ids), d_next + len(d_ids)
            reqs[f"q{i}"] = (n, 40 + i, p.export(f"q{i}", s_ids, n, seed=40 + i), d_ids)
        calls0 = d[0].stats()["ops_calls"]
        with d[0].batched_loads():
            for rid, (_, _, prm, d_ids) in reqs.items():
                d[0].load(rid, prm, d_ids)
        assert poll_until(d.engines, set(reqs), "recv") == dict.fromkeys(reqs, "done")
        assert d[0].stats()["ops_calls"] - calls0 == 2 and d.onesided() == [6], (
            d[0].stats()["ops_calls"] - calls0,
            d[0].stats()["onesided"],
        )
        used: set[int] = {0}
        for n, seed, _, d_ids in reqs.values():
            assert check(d.caches(0), dst, 0, 1, d_ids, n, seed), seed
            used |= set(d_ids)
        tails = {ids[-1]: n - (len(ids) - 1) * dst.block_size for n, _, _, ids in reqs.values()}
        assert untouched(d.caches(0), dst, used, tails), "D wrote outside the requests"
    finally:
        p.close()
        d.close()


def test_batched_loads_nest_launch_on_error_and_split_at_the_cpu_bound(monkeypatch):
    """A batch launches once, when its outermost block ends, also when the block raises; on CPU
    caches (the caller copies) a batch over ``CPU_COPY_MAX_BYTES`` launches what it held before
    it takes the next load. Every load lands exactly, partial ones included."""
    with warmed() as (p, d):
        e, os_ = d[0], d[0]._onesided
        reqs = {
            f"b{i}": (p.export(f"b{i}", [1 + 2 * i, 2 + 2 * i], 12, seed=20 + i), [20 + 2 * i, 21 + 2 * i])
            for i in range(5)
        }
        per_load = 12 * F16.bytes_per_token()
        monkeypatch.setattr(onesided_mod, "CPU_COPY_MAX_BYTES", int(1.5 * per_load))
        with pytest.raises(RuntimeError, match="the step failed"), e.batched_loads():
            with e.batched_loads():  # nested: its end launches nothing
                e.load("b0", reqs["b0"][0], reqs["b0"][1])
            assert os_.stats()["in_flight"] == 0
            e.load("b1", reqs["b1"][0], reqs["b1"][1])  # over the bound: b0 is launched first
            assert os_.stats()["in_flight"] == 1
            raise RuntimeError("the step failed")
        assert os_.stats()["in_flight"] == 2  # b1 launched on the way out
        # b0 made the target (the Python path's flight), the native lane held b1: launched alike
        assert os_.stats()["native"] == 1
        monkeypatch.setattr(onesided_mod, "CPU_COPY_MAX_BYTES", 16 << 20)
        fill(d.caches(0), F16, 0, 1, [28, 29], 12, seed=99)
        with e.batched_loads():
            for rid in ("b2", "b3"):
                e.load(rid, reqs[rid][0], reqs[rid][1])
            e.load("b4", reqs["b4"][0], [28, 29], num_computed_tokens=8)  # holds tokens [0, 8)
        assert poll_until(d.engines, set(reqs), "recv") == dict.fromkeys(reqs, "done")
        assert d.onesided() == [5]
        for i in range(4):
            assert check(d.caches(0), F16, 0, 1, reqs[f"b{i}"][1], 12, 20 + i), f"b{i}"
        assert tokens_hold(d.caches(0), F16, 0, 1, [28, 29], 12, 99, 0, 8), "the held prefix was written"
        assert tokens_hold(d.caches(0), F16, 0, 1, [28, 29], 12, 24, 8, 12)
        assert poll_until(p.engines, set(reqs), "send") == dict.fromkeys(reqs, "done")


def test_a_batch_whose_mapping_was_dropped_fails_its_loads_by_name():
    """The remote's mapping is dropped (the ipc transport forgot a remote) between a held load's
    lookup and the batch's launch: nothing is copied, the load fails naming it, P is told."""
    with warmed() as (p, d):
        prm = p.export("x", [3, 4], 12, seed=5)
        before = torch.cat([c.view(torch.uint8).flatten() for c in d.caches(0)])
        with d[0].batched_loads():
            d[0].load("x", prm, [6, 7])
            d[0]._loader.peers.get("P").session.close()  # what forgetting a remote does
        got = poll_until(d.engines, {"x"}, "recv")
        assert got["x"].startswith("failed") and "mapping was dropped before the launch" in got["x"], got
        assert torch.equal(torch.cat([c.view(torch.uint8).flatten() for c in d.caches(0)]), before)
        assert poll_until(p.engines, {"x"}, "send") == {"x": "done"}  # the failure notification frees it


# ---------------------------------------------------------------------------- what goes wrong
@pytest.mark.parametrize("when", ["hook", "before_poll"])
def test_release_during_the_copy_fails_the_load_never_delivers(when):
    """P aborts the export while D's one-sided copy runs (after it, before the check) and its
    runner reuses the blocks: D reports the load failed, naming the release. ``hook``: in the
    test hook after the copy (the check a step per view); ``before_poll``: between ``load()``,
    which copied, and the ``poll()`` whose one native call checks and marks."""
    with warmed() as (p, d):
        prm = p.export("x", [3, 4], 12, seed=3)

        def release_and_reuse(epochs=None):
            p[0].abort_export("x")
            fill(p.caches(0), F16, 0, 1, [3, 4], 12, seed=99)

        if when == "hook":
            d[0]._hooks["after_ipc_copy"] = release_and_reuse
        d[0].load("x", prm, [5, 6])
        if when == "before_poll":
            release_and_reuse()
        got = poll_until(d.engines, {"x"}, "recv")
        assert got["x"].startswith("failed:") and "released before or during the copy" in got["x"], got
        assert d.onesided() == [1]
        assert d[0].stats()["transfers"] == 1 and d[0].stats()["failures"] == 1  # the warm one landed


def test_slot_reused_by_a_new_export_fails_the_load():
    """The export ends and a new export of the same id takes its place during the copy: the
    slot's generation moved, the load fails; the new export's params then load one-sided."""
    with warmed() as (p, d):
        prm = p.export("x", [3, 4], 12, seed=3)
        again = {}

        def reexport(epochs):
            d[0]._hooks.pop("after_ipc_copy")
            p[0].abort_export("x")
            again["prm"] = p.export("x", [3, 4], 12, seed=4)

        d[0]._hooks["after_ipc_copy"] = reexport
        d[0].load("x", prm, [5, 6])
        got = poll_until(d.engines, {"x"}, "recv")
        assert got["x"].startswith("failed:"), got
        assert again["prm"]["token"] != prm["token"]
        d[0].load("x", again["prm"], [5, 6])
        assert poll_until(d.engines, {"x"}, "recv") == {"x": "done"}
        assert check(d.caches(0), F16, 0, 1, [5, 6], 12, 4)
        assert d.onesided() == [2]


class Gate:
    """A ready event (``query()``) the test opens."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_compute_not_done_is_never_read_onesided():
    """An export whose ready event has not completed is not read one-sided: the load takes the
    messaged path, which waits for the gate; once P saw it complete, the next load is one-sided."""
    with warmed() as (p, d):
        gate = Gate()
        prm = p.export("g", [3, 4], 12, seed=3, ready=gate)
        d[0].load("g", prm, [5, 6])
        assert d.onesided() == [0] and d[0].stats()["onesided"]["fallbacks"]["not ready"] == 1
        assert poll_until(d.engines, {"g"}, "recv", timeout=0.3) == {}
        gate.done = True
        assert poll_until(d.engines, {"g"}, "recv") == {"g": "done"}
        assert check(d.caches(0), F16, 0, 1, [5, 6], 12, 3)
        gate2 = Gate()
        prm2 = p.export("h", [7, 8], 12, seed=5, ready=gate2)
        gate2.done = True
        p[0].poll()  # P sees the gate open: the slot's ready flag is set
        d[0].load("h", prm2, [9, 10])
        assert d.onesided() == [1]
        assert poll_until(d.engines, {"h"}, "recv") == {"h": "done"}
        assert check(d.caches(0), F16, 0, 1, [9, 10], 12, 5)


def test_layerwise_export_takes_the_messaged_path():
    with warmed() as (p, d):
        prm = p.export("s", [3, 4], 12, seed=3, streaming=True)
        d[0].load("s", prm, [5, 6])
        assert d[0].stats()["onesided"]["fallbacks"]["layer-wise export"] == 1
        p[0].mark_ready("s", range(F16.num_layers))
        assert poll_until(d.engines, {"s"}, "recv") == {"s": "done"}
        assert check(d.caches(0), F16, 0, 1, [5, 6], 12, 3)


def test_forged_and_altered_params_are_never_read_onesided():
    """A forged token finds no slot, nor do params whose ids were changed: both take the
    messaged path, where the exporter refuses them by name; D's blocks keep their poison."""
    with warmed() as (p, d):
        prm = p.export("x", [3, 4], 12, seed=3)
        forged = dict(prm, token="0" * 16 + "f" * 32)
        altered = dict(prm, block_ids=[3, 5])
        d[0].load("x", forged, [5, 6])
        got = poll_until(d.engines, {"x"}, "recv")
        assert got["x"].startswith("failed:") and "unauthorized" in got["x"], got
        d[0].load("x", altered, [5, 6])
        got = poll_until(d.engines, {"x"}, "recv")
        assert got["x"].startswith("failed:") and "refused" in got["x"], got
        assert d.onesided() == [0] and d[0].stats()["onesided"]["fallbacks"]["no live slot"] == 2
        assert untouched(d.caches(0), F16, {0}, {0: 1})
        # the failed load was notified with the export's token: P freed it (as a release)
        assert poll_until(p.engines, {"x"}, "send") == {"x": "done"}
        prm = p.export("y", [3, 4], 12, seed=4)
        d[0].load("y", prm, [5, 6])  # real params load one-sided
        assert poll_until(d.engines, {"y"}, "recv") == {"y": "done"} and d.onesided() == [1]
        assert check(d.caches(0), F16, 0, 1, [5, 6], 12, 4)


def test_params_altered_to_reach_another_exports_slot_are_refused_by_name():
    """A D that holds only B's params loads (a) block ids B never exported, with the token
    re-derived so that the old binding (token MAC XOR content digest) equals B's slot's, and
    (b) B's params under another request id. The one-sided path used to read both, report
    them done and free B; now neither finds a slot, and each fails naming ``unauthorized``, as
    the messaged path refuses it: D's blocks keep their poison, B stays exported, and B's own
    params then load one-sided."""
    with warmed() as (p, d):
        prm = p.export("B", [3, 4], 12, seed=3)
        fill(p.caches(0), F16, 0, 1, [9, 10], 12, seed=66)  # blocks no export holds
        alt = dict(prm, block_ids=[9, 10])
        dg_b = KVTransferParams.from_dict(prm).digest()
        dg_x = KVTransferParams.from_dict(alt).digest()
        mac = int(prm["token"][-32:], 16) ^ int.from_bytes(dg_b, "little") ^ int.from_bytes(dg_x, "little")
        alt["token"] = prm["token"][:16] + f"{mac:032x}"
        d[0].load("alt", alt, [5, 6])
        d[0].load("renamed", dict(prm, request_id="B-other"), [7, 8])
        got = poll_until(d.engines, {"alt", "renamed"}, "recv")
        for rid in ("alt", "renamed"):
            assert got[rid].startswith("failed:") and "unauthorized" in got[rid], got
        assert d.onesided() == [0]
        assert untouched(d.caches(0), F16, {0}, {0: 1})
        assert poll_until(p.engines, {"B"}, "send", timeout=0.5) == {}  # B was not freed
        assert p[0].stats()["exports_live"] == 1
        d[0].load("B", prm, [5, 6])
        assert poll_until(d.engines, {"B"}, "recv") == {"B": "done"} and d.onesided() == [1]
        assert check(d.caches(0), F16, 0, 1, [5, 6], 12, 3)
        assert poll_until(p.engines, {"B"}, "send") == {"B": "done"}


@pytest.mark.parametrize("how", ["each", "batched", "messaged-first"])
def test_the_same_params_twice_in_one_batch_are_refused_as_the_messaged_path_refuses_them(how):
    """The same params loaded under two local ids before a poll: the first lands, the second
    fails naming it ("loaded twice in one batch", the messaged path's words), writes nothing,
    and P releases and reports the export once. (The one-sided path read both, and their done
    marks and the notification naming the id twice made P release it without reporting it.)
    ``messaged-first``: the first load is queued for the messaged path (its export not ready
    yet), the second would have been one-sided."""
    with warmed() as (p, d):
        gate = Gate() if how == "messaged-first" else None
        prm = p.export("x", [3, 4], 12, seed=3, ready=gate)
        with d[0].batched_loads() if how == "batched" else contextlib.nullcontext():
            d[0].load("x1", prm, [5, 6])
            if gate is not None:
                gate.done = True
                p[0].poll()  # the slot's ready flag is set: a second load could go one-sided
            d[0].load("x2", prm, [7, 8])
        got = poll_until(d.engines, {"x1", "x2"}, "recv")
        assert got["x1"] == "done", got
        assert got["x2"].startswith("failed:") and "'x' is loaded twice in one batch" in got["x2"], got
        assert check(d.caches(0), F16, 0, 1, [5, 6], 12, 3)
        assert untouched(d.caches(0), F16, {0, 5, 6}, {0: 1, 6: 4})
        assert poll_until(p.engines, {"x"}, "send") == {"x": "done"}
        assert poll_until(p.engines, {"other"}, "send", timeout=0.3) == {}  # not reported again
        assert p[0].stats()["blocks_held"] == 0
        assert d.onesided() == [0 if how == "messaged-first" else 1]


def _record_notifications(monkeypatch, engine: TransferEngine) -> list:
    """The notifications ``engine``'s loader sends from now on, as (when, done request ids,
    failed request ids), each still sent."""
    sent: list = []
    real = engine._loader.notify_ids

    def notify_ids(peer, done, failed):
        sent.append((time.monotonic(), [r for r, _ in done], [r for r, _ in failed]))
        real(peer, done, failed)

    monkeypatch.setattr(engine._loader, "notify_ids", notify_ids)
    return sent


@pytest.mark.parametrize("marks", ["native", "python"])
def test_a_landed_loads_marks_free_it_and_its_notification_is_deferred(marks, monkeypatch):
    """With the native module a landed one-sided load's done marks free it, and its notification
    goes ``MARK_GRACE_S`` later, one message for every load of the window. With the Python
    fallback (whose ring stores two loaders can collide on) each is notified at once."""
    if marks == "native":
        assert idops.ensure(), idops.status()
    else:
        monkeypatch.setattr(slots_mod, "_native", lambda: None)
    with warmed() as (p, d):
        sent = _record_notifications(monkeypatch, d[0])
        landed = {}
        for k in range(3):
            prm = p.export(f"a{k}", [3 + 2 * k, 4 + 2 * k], 12, seed=3 + k)
            landed[f"a{k}"] = time.monotonic()  # before the load: it lands, and is marked, after
            d[0].load(f"a{k}", prm, [20 + 2 * k, 21 + 2 * k])
            assert poll_until(d.engines, {f"a{k}"}, "recv") == {f"a{k}": "done"}
            assert poll_until(p.engines, {f"a{k}"}, "send") == {f"a{k}": "done"}
            assert check(d.caches(0), F16, 0, 1, [20 + 2 * k, 21 + 2 * k], 12, 3 + k)
        if marks == "native":
            assert not sent, "notified before the grace: the marks freed the blocks"
        end = time.monotonic() + 5.0
        while sum(len(x[1]) for x in sent) < 3 and time.monotonic() < end:
            d[0].poll()
            time.sleep(0.01)
        got = {rid: t for t, done, _ in sent for rid in done}
        assert sorted(got) == ["a0", "a1", "a2"] and not [x for x in sent if x[2]], sent
        st = d[0].stats()["onesided"]
        assert st["loads"] == 3, st
        if marks == "native":
            assert st["deferred"] == 3 and len(sent) <= 3, (st, sent)
            assert all(got[r] - landed[r] >= onesided_mod.MARK_GRACE_S for r in got), (got, landed)
        else:
            assert st["deferred"] == 0 and len(sent) == 3, (st, sent)
        assert p[0].stats()["blocks_held"] == 0


def test_a_steady_stream_of_marked_loads_is_notified_in_few_messages(monkeypatch):
    """Loads landing one after another for several grace periods: their deferred notifications
    go in at most one message per ``MARK_GRACE_S`` (not one per load as each one's grace ends),
    each at least the grace after its load landed."""
    assert idops.ensure(), idops.status()
    grace = onesided_mod.MARK_GRACE_S
    with warmed() as (p, d):
        sent = _record_notifications(monkeypatch, d[0])
        landed = {}
        t0 = time.monotonic()
        k = 0
        while time.monotonic() - t0 < 4 * grace:
            rid = f"s{k}"
            prm = p.export(rid, [3, 4], 12, seed=3 + k % 50)
            landed[rid] = time.monotonic()
            d[0].load(rid, prm, [20, 21])
            assert poll_until(d.engines, {rid}, "recv") == {rid: "done"}
            assert poll_until(p.engines, {rid}, "send") == {rid: "done"}
            k += 1
            time.sleep(0.002)
        end = time.monotonic() + 5.0
        while sum(len(x[1]) for x in sent) < k and time.monotonic() < end:
            d[0].poll()
            time.sleep(0.005)
        elapsed = time.monotonic() - t0
        got = {rid: t for t, done, _ in sent for rid in done}
        assert sorted(got) == sorted(landed) and not [x for x in sent if x[2]], (len(got), k)
        assert k >= 20, f"only {k} loads in {4 * grace:.2f} s: too few to tell one message per load"
        assert len(sent) <= elapsed / grace + 1, (len(sent), k, elapsed)
        assert all(got[r] - landed[r] >= grace for r in got)
        assert d[0].stats()["onesided"]["deferred"] == k


def test_a_mark_the_exporter_never_counts_is_freed_by_the_deferred_notification(monkeypatch):
    """A landed load's done mark that the exporter does not count (here P reads no marks at all:
    as if a stranger had overwritten them in the table) holds the blocks only until the
    deferred notification arrives, ``MARK_GRACE_S`` after the mark; close() sends the
    notifications still in their grace."""
    assert idops.ensure(), idops.status()
    monkeypatch.setattr(slots_mod.ExporterSlots, "marked", lambda self: False)
    with warmed() as (p, d):
        prm = p.export("a", [3, 4], 12, seed=3)
        d[0].load("a", prm, [5, 6])
        t0 = time.monotonic()
        assert poll_until(d.engines, {"a"}, "recv") == {"a": "done"}
        assert poll_until(p.engines, {"a"}, "send", timeout=0.05) == {}  # the mark is not counted
        freed, end = set(), time.monotonic() + 5.0
        while "a" not in freed and time.monotonic() < end:  # D's polls notify once the grace ended
            d[0].poll()
            freed |= p[0].poll().finished_sending
            time.sleep(0.005)
        assert freed == {"a"}
        assert time.monotonic() - t0 >= onesided_mod.MARK_GRACE_S
        assert d[0].stats()["onesided"]["deferred"] == 1
        assert p[0].stats()["blocks_held"] == 0
        # in its grace when D closes: notified by close()
        prm = p.export("b", [7, 8], 12, seed=4)
        d[0].load("b", prm, [9, 10])
        assert poll_until(d.engines, {"b"}, "recv") == {"b": "done"}
        d[0].close()
        assert d[0].stats()["onesided"]["deferred"] == 2
        assert poll_until(p.engines, {"b"}, "send") == {"b": "done"}


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_done_mark_frees_without_the_notification_and_the_notification_without_the_mark(monkeypatch, native):
    """P frees from the done mark alone (the notification lost), and from the notification alone
    (the mark not written): either record is enough, and neither frees twice."""
    with warmed() as (p, d):
        d[0]._hooks["notify"] = lambda addr, msg: None  # notifications dropped
        prm = p.export("a", [3, 4], 12, seed=3)
        d[0].load("a", prm, [5, 6])
        assert poll_until(d.engines, {"a"}, "recv") == {"a": "done"}
        assert poll_until(p.engines, {"a"}, "send") == {"a": "done"}
        del d[0]._hooks["notify"]
        if native:
            answer_landings(d, 3)  # the one native call: landed, a rank not marked
        else:
            python_slot_reads(d)
            monkeypatch.setattr(slots_mod.SlotView, "mark_done", lambda *a: None)
        prm = p.export("b", [7, 8], 12, seed=4)
        d[0].load("b", prm, [9, 10])
        assert poll_until(d.engines, {"b"}, "recv") == {"b": "done"}
        assert poll_until(p.engines, {"b"}, "send") == {"b": "done"}
        assert d.onesided() == [2]


def test_loader_that_never_completes_is_freed_at_lease_end():
    """D launches a one-sided copy and stops (never polls again: no mark, no notification): P
    frees the blocks when the lease ends."""
    p, d = Ranks(F16, 1, "P", lease_s=1.0), Ranks(F16, 1, "D", timeout_s=0.3)
    try:
        warm(p, d)
        prm = p.export("a", [3, 4], 12, seed=3)
        d[0].load("a", prm, [5, 6])
        assert d.onesided() == [1]
        t0 = time.monotonic()
        assert poll_until(p.engines, {"a"}, "send", timeout=5.0) == {"a": "expired"}
        assert 0.5 < time.monotonic() - t0 < 3.0
    finally:
        p.close()
        d.close()


def test_short_lease_takes_the_messaged_path():
    """A lease shorter than the load's timeout is not read one-sided (the grant renews it)."""
    p, d = Ranks(F16, 1, "P", lease_s=1.0), Ranks(F16, 1, "D", timeout_s=2.0)
    try:
        warm(p, d)
        prm = p.export("a", [3, 4], 12, seed=3)
        d[0].load("a", prm, [5, 6])
        assert d[0].stats()["onesided"]["fallbacks"]["lease too short"] == 1
        assert poll_until(d.engines, {"a"}, "recv") == {"a": "done"}
        assert check(d.caches(0), F16, 0, 1, [5, 6], 12, 3)
    finally:
        p.close()
        d.close()


def test_lease_as_long_as_the_timeout_is_read_onesided():
    """The connector's defaults (lease 30 s, timeout 30 s): an export loaded a moment after it
    was made has a little less than the timeout left, and is still read one-sided (the read
    needs ``min(timeout, LEASE_LEFT_S)``: a copy takes milliseconds)."""
    assert LEASE_LEFT_S < 8.0
    p, d = Ranks(F16, 1, "P", lease_s=8.0), Ranks(F16, 1, "D", timeout_s=8.0)
    try:
        warm(p, d)
        prm = p.export("a", [3, 4], 12, seed=3)
        time.sleep(0.05)  # the router's hop: the lease has less than the timeout left
        d[0].load("a", prm, [5, 6])
        assert d.onesided() == [1], d[0].stats()["onesided"]
        assert poll_until(d.engines, {"a"}, "recv") == {"a": "done"}
        assert check(d.caches(0), F16, 0, 1, [5, 6], 12, 3)
    finally:
        p.close()
        d.close()


def test_closed_exporter_is_not_read_onesided():
    p, d = Ranks(F16, 1, "P"), Ranks(F16, 1, "D", timeout_s=1.0)
    try:
        warm(p, d)
        prm = p.export("a", [3, 4], 12, seed=3)
        p[0].close()
        d[0].load("a", prm, [5, 6])
        assert d.onesided() == [0]
        got = poll_until(d.engines, {"a"}, "recv", timeout=5.0)
        assert got["a"].startswith("failed:"), got
        assert untouched(d.caches(0), F16, {0}, {0: 1})
    finally:
        p.close()
        d.close()


# ------------------------------------------------------------------ an exporter that dies
def exporter_proc(port: int, q) -> None:
    """P in its own process: exports "warm" and "a", hands their params over, then waits to be
    killed."""
    shm = alloc_shm_caches(F16, 16, 1)
    e = TransferEngine(F16, shm.caches, 0, 1, "P", port=port, lease_s=30.0).start()
    for rid, ids, seed in (("warm", [0], 1), ("a", [3, 4], 3)):
        fill(shm.caches, F16, 0, 1, ids, 12 if rid == "a" else 1, seed)
        q.put(e.export(rid, ids, 12 if rid == "a" else 1))
    time.sleep(120)


def test_exporter_killed_is_a_named_failure_not_a_hang(monkeypatch):
    """P is SIGKILLed after D mapped it: its heartbeat stops, D no longer reads it one-sided,
    and the load fails by its deadline with the reason; D's process goes on."""
    monkeypatch.setattr(target_mod, "_STALE_NS", int(0.2e9))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port_base(1)
    proc = ctx.Process(target=exporter_proc, args=(port, q), daemon=True)
    proc.start()
    dshm = alloc_shm_caches(F16, 16, 1)
    poison(dshm.caches)
    d = TransferEngine(F16, dshm.caches, 0, 1, "D", timeout_s=1.0).start()
    try:
        warm_prm, prm = q.get(timeout=60), q.get(timeout=60)
        d.load("warm", warm_prm, [0])
        assert poll_until([d], {"warm"}, "recv") == {"warm": "done"}
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        time.sleep(0.4)  # past the (shortened) heartbeat bound
        t0 = time.monotonic()
        d.load("a", prm, [5, 6])
        assert d.stats()["onesided"]["fallbacks"]["exporter closed or silent"] == 1
        got = poll_until([d], {"a"}, "recv", timeout=10.0)
        assert got["a"].startswith("failed:"), got
        assert time.monotonic() - t0 < 5.0
        assert untouched(dshm.caches, F16, {0}, {0: 1})
    finally:
        d.close()
        dshm.close()
        if proc.is_alive():
            proc.kill()
        proc.join(10)


def test_large_cpu_copy_goes_to_the_worker(monkeypatch):
    """On CPU caches load() copies one-sided only up to CPU_COPY_MAX_BYTES (it runs in the
    caller's thread); a larger load takes the messaged path and lands the same."""
    with warmed() as (p, d):
        per_token = F16.bytes_per_token()
        monkeypatch.setattr(onesided_mod, "CPU_COPY_MAX_BYTES", 12 * per_token)
        small = p.export("small", [3, 4], 12, seed=3)
        big = p.export("big", [5, 6], 13, seed=4)
        d[0].load("small", small, [7, 8])
        d[0].load("big", big, [9, 10])
        assert d[0].stats()["onesided"]["fallbacks"]["CPU copy too large for the caller"] == 1
        assert poll_until(d.engines, {"small", "big"}, "recv") == {"small": "done", "big": "done"}
        assert d.onesided() == [1]
        assert check(d.caches(0), F16, 0, 1, [7, 8], 12, 3) and check(d.caches(0), F16, 0, 1, [9, 10], 13, 4)


def test_exporter_closing_after_the_copy_fails_the_load_as_released():
    """P closes between D's one-sided copy and D's check: its exports were released first, so the
    load fails naming the release (as the messaged path does), never done."""
    with warmed() as (p, d):
        prm = p.export("a", [3, 4], 12, seed=3)
        d[0].load("a", prm, [5, 6])
        assert d.onesided() == [1]
        p[0].close()
        got = poll_until(d.engines, {"a"}, "recv")
        assert got["a"].startswith("failed:") and "released before or during the copy" in got["a"], got


# ------------------------------------------------------------- words a stranger wrote in the table
def table_of(p: Ranks, r: int = 0):
    """Exporter rank ``r``'s lease-slot table as it maps it: the memory any process of the same
    user can map (``/dev/shm/kvx_ls_*``) and write."""
    return p[r]._transports["ipc"].slots.t


def python_slot_reads(d: Ranks) -> None:
    """D's slot views take the Python steps (as with ``KVXFER_NATIVE_CTL=0``), and so do its
    one-sided targets (a step per view, not one native call over all of them)."""
    for e in d.engines:
        for peer in e._loader.peers.all():
            for v in peer.session.slot_views:
                if v is not None:
                    v.ctl = None
            if peer.session.onesided is not None:
                peer.session.onesided.ctl = None
                peer.session.onesided.lane = None  # no native lane either


class NativeLanding:
    """The native module, but its ``onesided_land`` answers ``code`` (what the one call over
    every source rank returns) without reading or writing a table."""

    def __init__(self, mod, code: int) -> None:
        self.mod, self.code = mod, code

    def __getattr__(self, name: str):
        return getattr(self.mod, name)

    def onesided_land(self, *args) -> int:
        return self.code


def answer_landings(d: Ranks, code: int) -> None:
    """D's one-sided targets land loads through :class:`NativeLanding` answering ``code``."""
    for e in d.engines:
        for peer in e._loader.peers.all():
            t = e._onesided._target(peer)  # made at the first one-sided load, else now
            assert t is not None and t.ctl is not None, "no native one-sided target"
            t.ctl = NativeLanding(t.ctl, code)
            t.lane = None  # Target.land's call, not the native lane's


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_table_words_a_stranger_wrote_never_crash_d_nor_leak_p(native):
    """Done counts a stranger wrote into P's table (negative: D's native mark wrote outside the
    mapping, SIGSEGV; at int64's end: D's Python mark raised out of poll()) and generations
    near 2**63 in every slot (P read them back, raised on release and leaked the blocks): D's
    loads land exactly and its poll() raises nothing; P releases and reports every export once
    and holds no block after."""
    with warmed() as (p, d):
        if not native:
            python_slot_reads(d)
        t = table_of(p)
        for k, count in enumerate([-(2**62), 2**63 - 1, -1, -(2**63)]):
            t[slots_mod.H_DONE] = count
            rid = f"c{k}"
            prm = p.export(rid, [3, 4], 12, seed=10 + k)
            d[0].load(rid, prm, [5, 6])
            assert poll_until(d.engines, {rid}, "recv") == {rid: "done"}
            assert check(d.caches(0), F16, 0, 1, [5, 6], 12, 10 + k)
            assert poll_until(p.engines, {rid}, "send") == {rid: "done"}
        assert d.onesided() == [4]
        t[slots_mod.H_DONE] = 0
        prms = {f"g{k}": p.export(f"g{k}", [7 + 2 * k, 8 + 2 * k], 12, seed=20 + k) for k in range(3)}
        rows = t[slots_mod.HEADER :].reshape(-1, slots_mod.SLOT)
        rows[:, slots_mod.S_GEN] = 2**63 - 2  # even: a stable slot's, but out of range
        assert p[0].abort_export("g0")
        for k in (1, 2):  # their slots' generations are out of range: the messaged path loads them
            d[0].load(f"g{k}", prms[f"g{k}"], [20 + 2 * k, 21 + 2 * k])
        assert poll_until(d.engines, {"g1", "g2"}, "recv") == {"g1": "done", "g2": "done"}
        for k in (1, 2):
            assert check(d.caches(0), F16, 0, 1, [20 + 2 * k, 21 + 2 * k], 12, 20 + k)
        assert poll_until(p.engines, set(prms), "send") == dict.fromkeys(prms, "done")
        assert p[0].stats()["blocks_held"] == 0 and p[0].stats()["exports_live"] == 0
        fallbacks = d[0].stats()["onesided"]["fallbacks"]
        assert fallbacks.get("table word out of range") == 2, fallbacks


def test_poll_reads_the_slot_table_only_while_an_export_is_live(monkeypatch):
    """poll() of an engine with no live export (a decode engine) does not tick its lease-slot
    table: there is no ready flag to set nor mark to count. With one live, it does, and the
    export's mark still frees it at P's poll."""
    from kvxfer.transports.ipc import leases

    by_poll: list[bool] = []  # per tick from poll() (not the server thread's beat): export live
    real = leases.LeaseSlots.tick

    def tick(self, beat, expected):
        if not beat:
            by_poll.append(not self._exports.idle())
        return real(self, beat, expected)

    with warmed() as (p, d):
        monkeypatch.setattr(leases.LeaseSlots, "tick", tick)
        for _ in range(3):
            d[0].poll()
            p[0].poll()
        assert by_poll == []
        prm = p.export("t", [3, 4], 12, seed=3)
        d[0].load("t", prm, [5, 6])
        assert poll_until(d.engines, {"t"}, "recv") == {"t": "done"}
        assert poll_until(p.engines, {"t"}, "send") == {"t": "done"}  # freed by its mark
        assert by_poll and all(by_poll), by_poll


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_an_exporter_seen_stopped_after_the_copy_fails_the_load_naming_what_was_seen(monkeypatch, native):
    """The check after a copy found the exporter closed or silent, and a second read finds it
    alive again (a stranger overwrote a header word, the exporter's beat restored it): the load
    fails, and its reason says what the check saw, not a bare "stopped"."""
    with warmed() as (p, d):
        if native:
            answer_landings(d, 2)  # the one native call: source 0's exporter stopped
        else:
            python_slot_reads(d)
            monkeypatch.setattr(slots_mod.SlotView, "check", lambda self, *a: 2)
        prm = p.export("s", [3, 4], 12, seed=3)
        d[0].load("s", prm, [5, 6])
        got = poll_until(d.engines, {"s"}, "recv")
        assert got["s"].startswith("failed:") and "no heartbeat when checked after the copy" in got["s"], got
        assert d[0].stats()["onesided"]["loads"] == 1
        monkeypatch.undo()
        assert poll_until(p.engines, {"s"}, "send") == {"s": "done"}  # notified failed: freed
