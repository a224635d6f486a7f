"""One-sided ipc reads (kvxfer.transports.ipc.onesided) byte-exact through the caller's copy
across TP ratios, layouts, block sizes, dtypes, MLA, n>1 and partial loads; batched loads (two
ops calls for six requests, launched once when the outermost block ends, split at the CPU
bound), a batch whose mapping was dropped, and a CPU copy too large for the caller (the
messaged path, landing the same). Each test also checks that the one-sided path, not the
messaged one, did the work (``stats()["onesided"]``)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from kvxfer import KVCacheSpec, ops
from kvxfer.transports.ipc import onesided as onesided_mod

from .engine_payload import check, fill, payload, untouched
from .onesided_helpers import F16, Ranks, poll_until, warm, warmed


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
