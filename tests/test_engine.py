"""Engines in one process (threads): n>1 prefix sharing, D->P reuse, faults, bad input."""

from __future__ import annotations

import time

import pytest
import torch

from kvxfer import KVCacheSpec, TransferEngine, ops
from kvxfer.transports.ipc.shm import alloc_shm_caches

from .engine_payload import POISON, check, fill, payload, poison, untouched

SPEC = KVCacheSpec(2, 2, 16, 8, torch.float16)


def _pair(transport="ipc", src=SPEC, dst=SPEC, lease_s=5.0, nb=64, **kw):
    shm = alloc_shm_caches(src, nb, 1)
    dshm = alloc_shm_caches(dst, nb, 1)
    poison(shm.caches)
    poison(dshm.caches)
    p = TransferEngine(src, shm.caches, 0, 1, "P", transport=transport, lease_s=lease_s, **kw).start()
    d = TransferEngine(dst, dshm.caches, 0, 1, "D", transport=transport, lease_s=lease_s, **kw).start()
    return p, d, shm, dshm


def _close(*objs):
    for o in objs:
        o.close()


def _wait(eng, want: set[str], key: str, timeout=10.0):
    """Poll until every id of ``want`` is reported on side ``key`` ("recv" or "send")."""
    got, seen = {}, []
    end = time.monotonic() + timeout
    while set(got) != want and time.monotonic() < end:
        r = eng.poll()
        if key == "recv":
            outcomes = [(rid, "done") for rid in r.finished_recving]
            outcomes += [(rid, "failed:" + r.errors.get(rid, "")) for rid in r.failed]
        else:
            outcomes = [(rid, "done") for rid in r.finished_sending] + [(rid, "expired") for rid in r.expired]
        for rid, what in outcomes:
            seen.append(rid)
            got[rid] = what
        time.sleep(0.005)
    assert len(seen) == len(set(seen)), f"reported more than once: {seen}"
    return got


@pytest.mark.parametrize("transport", ["ipc", "pg"])
def test_n3_children_share_prefix_once(transport):
    p, d, shm, dshm = _pair(transport)
    try:
        prefix, tails = 32, [5, 8, 3]  # 4 shared blocks, then each child's own block
        shared_src, shared_dst = [10, 11, 12, 13], [40, 41, 42, 43]
        params, dst = [], {}
        for i, tail in enumerate(tails):
            n = prefix + tail
            src_ids = [*shared_src, 20 + i]
            fill(shm.caches, SPEC, 0, 1, src_ids, n, seed=i)
            fill(shm.caches, SPEC, 0, 1, shared_src, prefix, seed=99)  # the common prefix
            params.append(p.export(f"c{i}", src_ids, n))
            dst[f"c{i}"] = ([*shared_dst, 50 + i], n)
        for i, prm in enumerate(params):
            d.load(f"c{i}", prm, dst[f"c{i}"][0])
        got = _wait(d, {"c0", "c1", "c2"}, "recv")
        assert got == dict.fromkeys(["c0", "c1", "c2"], "done"), got
        for i in range(3):
            ids, n = dst[f"c{i}"]
            want = payload(SPEC, i, n, range(2)).clone()
            want[:, :, :, :prefix] = payload(SPEC, 99, prefix, range(2))
            from kvxfer import ops

            out = ops.gather_blocks(dshm.caches, SPEC, ids, n)
            assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), f"c{i}"
        bpt = SPEC.bytes_per_token()
        s = d.stats()
        assert s["bytes"] == (prefix + sum(tails)) * bpt  # the prefix crossed the wire once
        assert s["dedup_bytes"] == 2 * prefix * bpt
        # NHD both sides: the whole blocks in one call (c2, ending inside a block, last), c0's
        # tail as token slots in a second
        assert s["ops_calls"] == 2
        assert _wait(p, {"c0", "c1", "c2"}, "send") == dict.fromkeys(["c0", "c1", "c2"], "done")
        assert p.stats()["blocks_held"] == 0
    finally:
        _close(p, d, shm, dshm)


@pytest.mark.parametrize("transport", ["ipc", "pg"])
def test_d_to_p_reuse_of_finished_decode(transport):
    """P->D, D decodes more tokens, then P pulls the whole context back (both roles, one API)."""
    p, d, shm, dshm = _pair(transport, src=SPEC, dst=KVCacheSpec(2, 2, 16, 16, torch.float16, layout="HND"))
    dspec = d.spec
    try:
        fill(shm.caches, SPEC, 0, 1, [1, 2, 3], 20, seed=5)
        d.load("turn1", p.export("turn1", [1, 2, 3], 20), [7, 8])
        assert _wait(d, {"turn1"}, "recv") == {"turn1": "done"}
        # D "decodes" 17 more tokens: its context is now seed 6's payload of 37 tokens.
        fill(dshm.caches, dspec, 0, 1, [7, 8, 9], 37, seed=6)
        back = d.export("turn1-ctx", [7, 8, 9], 37)
        p.load("turn2", back, [30, 31, 32, 33, 34])
        assert _wait(p, {"turn2"}, "recv") == {"turn2": "done"}
        assert check(shm.caches, SPEC, 0, 1, [30, 31, 32, 33, 34], 37, seed=6)
        assert _wait(d, {"turn1-ctx"}, "send") == {"turn1-ctx": "done"}
        assert p.stats()["transports"] == {"D": transport}
    finally:
        _close(p, d, shm, dshm)


def test_loader_never_comes_lease_expires():
    p, d, shm, dshm = _pair("ipc", lease_s=0.3)
    try:
        p.export("lonely", [4, 5], 10)
        assert p.stats()["blocks_held"] == 2
        got = _wait(p, {"lonely"}, "send", timeout=5)
        assert got == {"lonely": "expired"}
        s = p.stats()
        assert s["blocks_held"] == 0 and s["expirations"] == 1 and s["exports_live"] == 0
    finally:
        _close(p, d, shm, dshm)


def test_late_load_after_expiry_fails_never_delivers():
    p, d, shm, dshm = _pair("ipc", lease_s=0.2)
    try:
        prm = p.export("late", [4, 5], 10)
        assert _wait(p, {"late"}, "send", timeout=5) == {"late": "expired"}
        d.load("late", prm, [1, 2])
        got = _wait(d, {"late"}, "recv")
        assert got["late"].startswith("failed:") and "released" in got["late"]
        assert bool((dshm.caches[0].view(torch.uint8) == POISON).all())
    finally:
        _close(p, d, shm, dshm)


def test_lease_ends_during_ipc_copy_reported_failed():
    """The loader stalls inside the copy (no heartbeats): P's lease ends, its block epochs move,
    and the after-copy check reports the request failed instead of delivering it."""
    p, d, shm, dshm = _pair("ipc", lease_s=0.4)
    try:
        fill(shm.caches, SPEC, 0, 1, [4, 5], 10, seed=1)
        prm = p.export("slow", [4, 5], 10)
        stalled = {}

        def stall(epochs):
            before = epochs[[4, 5]].clone()
            end = time.monotonic() + 5
            while torch.equal(epochs[[4, 5]], before) and time.monotonic() < end:
                time.sleep(0.01)
            stalled["moved"] = not torch.equal(epochs[[4, 5]], before)

        d._hooks["after_ipc_copy"] = stall
        d.load("slow", prm, [1, 2])
        got = _wait(d, {"slow"}, "recv")
        assert stalled["moved"]
        assert got["slow"].startswith("failed:") and "during the copy" in got["slow"], got
        assert d.stats()["transfers"] == 0 and d.stats()["failures"] == 1
        assert _wait(p, {"slow"}, "send") == {"slow": "expired"}
    finally:
        _close(p, d, shm, dshm)


@pytest.mark.parametrize(
    ("dst", "needle"),
    [
        (KVCacheSpec(2, 2, 32, 8, torch.float16), "head_dim differs"),
        (KVCacheSpec(3, 2, 16, 8, torch.float16), "num_layers differs"),
        (KVCacheSpec(2, 2, 16, 8, torch.bfloat16), "dtype differs"),
        (KVCacheSpec(2, 4, 16, 8, torch.float16), "num_kv_heads differs"),
    ],
)
def test_incompatible_peer_fails_naming_mismatch(dst, needle):
    p, d, shm, dshm = _pair("pg", src=SPEC, dst=dst)
    try:
        d.load("x", p.export("x", [1], 4), [1])
        got = _wait(d, {"x"}, "recv")
        assert got["x"].startswith("failed:") and needle in got["x"], got
    finally:
        _close(p, d, shm, dshm)


def test_explicit_ipc_unavailable_is_an_error_not_a_fallback(monkeypatch):
    monkeypatch.setenv("KVXFER_IPC_CMA", "0")  # plain CPU caches cannot be read with ipc then
    src_caches = [torch.zeros(SPEC.cache_shape(16, 1), dtype=SPEC.dtype) for _ in range(2)]  # not shm
    p = TransferEngine(SPEC, src_caches, 0, 1, "P", transport="auto").start()
    dc = [torch.zeros(SPEC.cache_shape(16, 1), dtype=SPEC.dtype) for _ in range(2)]
    d = TransferEngine(SPEC, dc, 0, 1, "D", transport="ipc").start()
    try:
        d.load("x", p.export("x", [1], 4), [1])
        got = _wait(d, {"x"}, "recv")
        assert "transport 'ipc' was asked for but cannot be used" in got["x"], got
    finally:
        _close(p, d)


@pytest.mark.parametrize("cma", ["on", "off", "denied"])
def test_auto_on_plain_cpu_caches(cma, monkeypatch):
    """Plain CPU caches (not in shm): ``auto`` reads them with ipc through cross-memory attach,
    or takes pg when that is turned off (``KVXFER_IPC_CMA=0``) or the kernel does not let this
    process read the exporter's (the probe at the handshake), saying why."""
    from kvxfer.transports.ipc import cma as cma_mod

    if cma == "off":
        monkeypatch.setenv("KVXFER_IPC_CMA", "0")
    if cma == "denied":  # what Yama's ptrace_scope 1 answers: EPERM on the probe
        monkeypatch.setattr(cma_mod, "probe", lambda desc: "cross-memory attach not permitted here (EPERM)")
    src_caches = [torch.zeros(SPEC.cache_shape(16, 1), dtype=SPEC.dtype) for _ in range(2)]
    p = TransferEngine(SPEC, src_caches, 0, 1, "P").start()
    dc = [torch.zeros(SPEC.cache_shape(16, 1), dtype=SPEC.dtype) for _ in range(2)]
    d = TransferEngine(SPEC, dc, 0, 1, "D").start()
    try:
        fill(src_caches, SPEC, 0, 1, [3], 6, seed=2)
        d.load("x", p.export("x", [3], 6), [9])
        assert _wait(d, {"x"}, "recv") == {"x": "done"}
        assert check(dc, SPEC, 0, 1, [9], 6, seed=2)
        s = d.stats()
        assert s["transports"] == {"P": "ipc" if cma == "on" else "pg"}
        why = {"on": "cross-memory attach on one host", "off": "KVXFER_IPC_CMA=0", "denied": "not permitted"}
        assert why[cma] in s["transport_reasons"]["P"], s["transport_reasons"]
    finally:
        _close(p, d)


def test_malformed_params_raise_naming_field():
    p, d, shm, dshm = _pair("ipc")
    try:
        good = p.export("x", [1, 2], 12)
        for field, bad, needle in [
            ("port", "80", "port"),
            ("block_ids", [1, -2], "block_ids"),
            ("num_tokens", 0, "num_tokens"),
            ("engine_id", "", "engine_id"),
            ("tp_size", 0, "tp_size"),
        ]:
            with pytest.raises(ValueError, match=needle):
                d.load("y", {**good, field: bad}, [1, 2])
        missing = dict(good)
        del missing["host"]
        with pytest.raises(ValueError, match="host"):
            d.load("y", missing, [1, 2])
        with pytest.raises(ValueError, match="block_ids"):
            d.load("y", good, [1])  # too few local blocks
        with pytest.raises(ValueError, match="block_ids"):
            d.load("y", good, [3, 3])
        with pytest.raises(ValueError, match="block_ids"):
            p.export("z", [1, 999], 12)
        with pytest.raises(ValueError, match="already exported"):
            p.export("x", [1, 2], 12)
        # block list inconsistent with the exporter's block size: reported failed, not raised
        d.load("w", {**good, "block_ids": [1, 2, 3]}, [1, 2])
        got = _wait(d, {"w"}, "recv")
        assert "differ from the export" in got["w"], got  # the exporter refuses altered params
        assert d.stats()["loads_pending"] == 0
    finally:
        _close(p, d, shm, dshm)


def test_engine_constructor_validates():
    caches = [torch.zeros(SPEC.cache_shape(8, 1), dtype=SPEC.dtype) for _ in range(2)]
    with pytest.raises(ValueError, match="transport"):
        TransferEngine(SPEC, caches, 0, 1, "E", transport="rdma")
    with pytest.raises(ValueError, match="lease_s"):
        TransferEngine(SPEC, caches, 0, 1, "E", lease_s=0)
    half = [torch.zeros(SPEC.cache_shape(8, 2), dtype=SPEC.dtype) for _ in range(2)]
    with pytest.raises(ValueError, match="port"):
        TransferEngine(SPEC, half, 0, 2, "E")  # tp 2 needs a base port
    with pytest.raises(ValueError, match="caches"):
        TransferEngine(SPEC, caches[:1], 0, 1, "E")
    with pytest.raises(ValueError, match="tp_rank"):
        TransferEngine(SPEC, half, 3, 2, "E", port=30000)


def test_block_ids_of_any_int_kind_and_bad_ones_named():
    """Lists, tuples, numpy arrays and int tensors are accepted (extra ids ignored, the caller's
    array copied); floats, negative, out-of-range and too few ids raise naming block_ids."""
    import numpy as np

    p, d, shm, dshm = _pair("ipc")
    try:
        fill(shm.caches, SPEC, 0, 1, [4, 5], 12, seed=3)
        src = np.array([4, 5, 6])
        prm = p.export("a", src, 12)
        src[:] = 0  # the exporter kept its own copy
        assert prm["block_ids"] == [4, 5] and all(type(x) is int for x in prm["block_ids"])
        assert p.export("b", torch.tensor([7, 8], dtype=torch.int32), 12)["block_ids"] == [7, 8]
        prm_c = p.export("c", (9, 10, 11), 12)
        assert prm_c["block_ids"] == [9, 10]
        # a list of plain ints is handed out as a copy of the ids checked and held; a list with
        # numpy ints becomes plain ints (JSON-safe), never the caller's objects; bools are not
        # ids (params refuse them too), wherever they sit
        mine = [12, 13, 14]
        prm_d = p.export("d", mine, 12)
        mine[0] = 99
        assert prm_d["block_ids"] == [12, 13] and prm_d["block_ids"] is not mine
        got = p.export("e15", [np.int64(15), 16], 12)["block_ids"]
        assert got == [15, 16] and all(type(x) is int for x in got), got
        for bad in ([1.5, 2.0], [1, -2], [1, 64], np.array([1.0, 2.0]), [3], [1, "2"], [2**70, 1],
                    [17, True], [True, 4], (False, 9), np.array([True, False])):  # fmt: skip
            with pytest.raises(ValueError, match="block_ids"):
                p.export("z", bad, 12)
            with pytest.raises(ValueError, match="block_ids"):
                d.load("z", prm, bad)
        for rep in (np.array([3, 3]), [3, 3], [3, 3, 9], (3, 3)):  # arrays sort, lists use a set
            with pytest.raises(ValueError, match="repeated"):
                d.load("z", prm, rep)
        d.load("a", prm, [20, 21, 20])  # only the ids the tokens need count: the extra may repeat
        d.load("c", prm_c, torch.tensor([30, 31], dtype=torch.int32))
        assert _wait(d, {"a", "c"}, "recv") == {"a": "done", "c": "done"}
        assert check(dshm.caches, SPEC, 0, 1, [20, 21], 12, seed=3)
        assert d.stats()["loads_pending"] == 0
    finally:
        _close(p, d, shm, dshm)


@pytest.mark.parametrize("transport", ["ipc", "pg"])
def test_batch_of_ragged_loads_with_disjoint_blocks_lands_and_overlapping_ones_are_refused(transport):
    """Loads of one poll share ops calls (token slots when their last blocks are partial); when
    their local blocks are disjoint the ops skip the cross-load repeat check, so it must be
    exact; loads that name one local block twice within a batch are refused, naming it, and
    nothing lands for them. The blocks no load names stay poisoned."""
    p, d, shm, dshm = _pair(transport)
    try:
        lens = {"a": 13, "b": 21, "c": 7}  # partial last blocks (block size 8)
        src = {"a": [1, 2], "b": [3, 4, 5], "c": [6]}
        dst = {"a": [40, 41], "b": [42, 43, 44], "c": [45]}
        for rid, n in lens.items():
            fill(shm.caches, SPEC, 0, 1, src[rid], n, seed=len(rid) + n)
        prm = {rid: p.export(rid, src[rid], n) for rid, n in lens.items()}
        for rid in lens:
            d.load(rid, prm[rid], dst[rid])
        assert _wait(d, set(lens), "recv") == dict.fromkeys(lens, "done")
        for rid, n in lens.items():
            assert check(dshm.caches, SPEC, 0, 1, dst[rid], n, seed=len(rid) + n), rid
        untouched = [b for b in range(64) if b not in {x for ids in dst.values() for x in ids}]
        for c in dshm.caches:
            assert bool((c[:, untouched].view(torch.uint8) == POISON).all())
        # two partial loads holding one cached prefix block (60, not written) and disjoint rest
        fill(shm.caches, SPEC, 0, 1, [12, 13, 14], 20, seed=5)
        fill(shm.caches, SPEC, 0, 1, [15, 16, 17], 20, seed=6)
        pq, pr = p.export("q", [12, 13, 14], 20), p.export("r", [15, 16, 17], 20)
        d.load("q", pq, [60, 46, 47], num_computed_tokens=8)
        d.load("r", pr, [60, 48, 49], num_computed_tokens=8)
        assert _wait(d, {"q", "r"}, "recv") == {"q": "done", "r": "done"}
        for ids, seed in (([60, 46, 47], 5), ([60, 48, 49], 6)):
            got = ops.gather_blocks(dshm.caches, SPEC, ids, 20)
            want = payload(SPEC, seed, 20, range(SPEC.num_kv_heads))
            assert torch.equal(got[..., 8:, :].view(torch.uint8), want[..., 8:, :].view(torch.uint8))
        for c in dshm.caches:
            assert bool((c[:, 60].view(torch.uint8) == POISON).all())
        # one batch naming local block 50 in two loads: refused before anything is written there
        fill(shm.caches, SPEC, 0, 1, [10, 11], 16, seed=7)
        pa, pb = p.export("x", [10], 8), p.export("y", [11], 8)
        d.load("x", pa, [50])
        d.load("y", pb, [50])
        got = _wait(d, {"x", "y"}, "recv")
        assert all(v.startswith("failed:") and "repeated" in v for v in got.values()), got
        for c in dshm.caches:
            assert bool((c[:, 50].view(torch.uint8) == POISON).all())
    finally:
        _close(p, d, shm, dshm)


@pytest.mark.parametrize("transport", ["ipc", "pg"])
@pytest.mark.parametrize(
    ("dst", "ipc_calls"),
    [
        (KVCacheSpec(2, 2, 16, 8, torch.float16), 2),  # blocks, then the tails as token slots
        (KVCacheSpec(2, 2, 16, 32, torch.float16), 2),
        (KVCacheSpec(2, 2, 16, 8, torch.float16, layout="HND"), 2),  # HND slots: through the kernels
    ],
    ids=["nhd16-nhd8", "nhd16-nhd32", "nhd16-hnd8"],
)
def test_ragged_batch_across_block_sizes_lands_exactly(transport, dst, ipc_calls):
    """One batch of loads whose lengths end inside a block, between block sizes that differ:
    the loader moves their whole blocks in one call and only their tails as token slots (HND
    included: its caches are registered with ``token_slots``); every load
    lands byte for byte, the tail slots of partial blocks and every block no load names stay
    poisoned."""
    src = KVCacheSpec(2, 2, 16, 16, torch.float16)
    p, d, shm, dshm = _pair(transport, src=src, dst=dst)
    try:
        lens = {"a": 37, "b": 64, "c": 5, "e": 90}
        src_ids, dst_ids, s0, d0 = {}, {}, 3, 60
        for rid, n in lens.items():
            src_ids[rid] = list(range(s0, s0 + src.num_blocks_for(n)))
            dst_ids[rid] = list(range(d0, d0 - dst.num_blocks_for(n), -1))  # descending, apart
            s0, d0 = s0 + src.num_blocks_for(n) + 1, d0 - dst.num_blocks_for(n) - 1
            fill(shm.caches, src, 0, 1, src_ids[rid], n, seed=ord(rid))
        prm = {rid: p.export(rid, src_ids[rid], n) for rid, n in lens.items()}
        for rid in lens:
            d.load(rid, prm[rid], dst_ids[rid])
        assert _wait(d, set(lens), "recv") == dict.fromkeys(lens, "done")
        for rid, n in lens.items():
            assert check(dshm.caches, dst, 0, 1, dst_ids[rid], n, seed=ord(rid)), rid
        used = {b for ids in dst_ids.values() for b in ids}
        tails = {
            ids[-1]: n - (len(ids) - 1) * dst.block_size for ids, n in zip(dst_ids.values(), lens.values())
        }
        assert untouched(dshm.caches, dst, used, tails)
        if transport == "ipc":
            assert d.stats()["ops_calls"] == ipc_calls
    finally:
        _close(p, d, shm, dshm)
