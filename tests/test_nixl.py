"""The nixl transport with both engines in one process (UCX on loopback; the default transports
and ``UCX_TLS=tcp``): direct and staged paths byte for byte, memory registered once, auto picks
it only across hosts, the side channel's auth in front of NIXL metadata, a lease ending
during a direct READ or a staged stream, a stuck exporter, and a bounded close."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvxfer import KVCacheSpec, KVTransferParams, TransferEngine, ops
from kvxfer import control as C
from kvxfer.transports import offered
from kvxfer.transports.ipc.shm import alloc_shm_caches
from kvxfer.transports.nixl.agent import nixl_status
from kvxfer.transports.pg.pipeline import StagedPipeline

from .engine_payload import check, fill, payload, poison, untouched

pytestmark = pytest.mark.skipif(bool(nixl_status()), reason=f"NIXL not importable here: {nixl_status()}")

NHD16 = KVCacheSpec(2, 4, 16, 16, torch.float16)
HND32 = KVCacheSpec(2, 4, 16, 32, torch.float16, layout="HND")
UCX_MODES = {"default": {}, "tcp": {"UCX_TLS": "tcp"}}


@pytest.fixture(params=sorted(UCX_MODES))
def ucx(request, monkeypatch):
    """UCX on loopback; ``tcp`` forces the path a cross-node link without RDMA takes."""
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.delenv("UCX_TLS", raising=False)
    for k, v in UCX_MODES[request.param].items():
        monkeypatch.setenv(k, v)
    return request.param


def _caches(spec, nb=32):
    c = [torch.empty(spec.cache_shape(nb, 1), dtype=spec.dtype) for _ in range(spec.num_layers)]
    poison(c)
    return c


def _wait(eng, want, key="recv", timeout=15.0) -> dict:
    got, seen = {}, []
    end = time.monotonic() + timeout
    while set(got) != set(want) and time.monotonic() < end:
        r = eng.poll()
        if key == "recv":
            outs = [(x, "done") for x in r.finished_recving]
            outs += [(x, "failed: " + r.errors.get(x, "")) for x in r.failed]
        else:
            outs = [(x, "done") for x in r.finished_sending] + [(x, "expired") for x in r.expired]
        for rid, what in outs:
            seen.append(rid)
            got[rid] = what
        time.sleep(0.003)
    assert len(seen) == len(set(seen)), f"reported more than once: {seen}"
    return got


def _tail(spec, ids, n):
    return {ids[-1]: n - (len(ids) - 1) * spec.block_size}


def test_direct_and_staged_exact_registered_once(ucx):
    """P (NHD, block 16) serves D1 (same layout: direct) and D2 (HND, block 32: staged), three
    rounds each: every byte lands, nothing else is touched, memory is registered once."""
    pc, d1c, d2c = _caches(NHD16), _caches(NHD16), _caches(HND32)
    pipe = StagedPipeline(buffer_bytes=16 << 10)  # 32 tokens per chunk: several per request
    p = TransferEngine(NHD16, pc, 0, 1, "P", transport="nixl", pipeline=pipe).start()
    d1 = TransferEngine(NHD16, d1c, 0, 1, "D1", transport="nixl").start()
    d2 = TransferEngine(HND32, d2c, 0, 1, "D2", transport="nixl", pipeline=pipe).start()
    try:
        regs = None
        for rnd in range(3):
            n = [37, 64, 5][rnd]
            src = [[3, 4, 5], [9, 10, 11, 12], [20]][rnd]
            fill(pc, NHD16, 0, 1, src, n, seed=rnd)
            ids1 = [[1, 2, 7], [14, 15, 16, 17], [30]][rnd]
            ids2 = [[2, 9], [3, 4], [6]][rnd]
            d1.load(f"a{rnd}", p.export(f"a{rnd}", src, n), ids1)
            d2.load(f"b{rnd}", p.export(f"b{rnd}", src, n), ids2)
            assert _wait(d1, {f"a{rnd}"}) == {f"a{rnd}": "done"}
            assert _wait(d2, {f"b{rnd}"}) == {f"b{rnd}": "done"}
            assert check(d1c, NHD16, 0, 1, ids1, n, seed=rnd)
            assert check(d2c, HND32, 0, 1, ids2, n, seed=rnd)
            assert untouched(d1c, NHD16, set(ids1), _tail(NHD16, ids1, n))
            assert untouched(d2c, HND32, set(ids2), _tail(HND32, ids2, n))
            assert _wait(p, {f"a{rnd}", f"b{rnd}"}, "send") == {f"a{rnd}": "done", f"b{rnd}": "done"}
            now = [len(e._transports["nixl"].agent._regs) for e in (p, d1, d2)]
            assert regs is None or now == regs, "memory registered again for a request"
            regs = now
            poison(d1c)
            poison(d2c)
        r1, r2 = d1.stats()["transport_reasons"]["P"], d2.stats()["transport_reasons"]["P"]
        assert r1 == "nixl: requested; paths: rank 0 direct"
        assert r2 == "nixl: requested; paths: rank 0 staged (layouts differ (NHD -> HND))"
        s1, s2 = d1.stats(), d2.stats()
        assert s1["transports"] == {"P": "nixl"} and s1["failures"] == 0 and s1["transfers"] == 3
        assert s2["staging_chunks_recv"] == 0  # the pg pipeline's counters stay untouched
        assert s2["nixl_reads"] == 2 + 2 + 1  # chunks of 32 tokens: 37, 64, 5 tokens
        assert p.stats()["nixl_notifs"] == 5  # one READ-completion notification per chunk
        assert p.stats()["blocks_held"] == 0
    finally:
        for e in (d1, d2, p):
            e.close()


def test_untouched_around_partial_blocks_direct(ucx):
    """The last block's tail slots (direct path, partial block) keep the poison."""
    pc, dc = _caches(NHD16), _caches(NHD16)
    p = TransferEngine(NHD16, pc, 0, 1, "P", transport="nixl").start()
    d = TransferEngine(NHD16, dc, 0, 1, "D", transport="nixl").start()
    try:
        fill(pc, NHD16, 0, 1, [8, 9, 10], 35, seed=4)
        d.load("x", p.export("x", [8, 9, 10], 35), [0, 1, 2])
        assert _wait(d, {"x"}) == {"x": "done"}
        assert check(dc, NHD16, 0, 1, [0, 1, 2], 35, seed=4)
        assert untouched(dc, NHD16, {0, 1, 2}, _tail(NHD16, [0, 1, 2], 35))
        # whole blocks by index (2 per layer and kv: NIXL merges adjacent ones), the partial
        # block by address (one run per layer and kv), the epochs of blocks 8..10 by index
        s = d.stats()
        assert s["nixl_descs"] == 2 * 2 * 2 + 2 * 2 + 3 and s["nixl_reads"] == 3
    finally:
        d.close()
        p.close()


def test_descriptors_prepared_once_per_peer_and_released(ucx):
    """Direct reads index lists NIXL prepared at the handshake: loads reuse them (none
    prepared per READ); a restarted exporter (a new peer) gets its own while the old peer's go
    back; close releases the rest, none left to sweep."""
    pc, dc = _caches(NHD16), _caches(NHD16)
    p = TransferEngine(NHD16, pc, 0, 1, "P", transport="nixl").start()
    d = TransferEngine(NHD16, dc, 0, 1, "D", transport="nixl").start()
    agent = d._transports["nixl"].agent
    p2 = None
    try:
        for i, (src, dst, n) in enumerate([([3, 4], [5, 6], 20), ([7], [9], 16), ([1, 2, 3], [0, 1, 2], 40)]):
            fill(pc, NHD16, 0, 1, src, n, seed=i)
            d.load(f"r{i}", p.export(f"r{i}", src, n), dst)
            assert _wait(d, {f"r{i}"}) == {f"r{i}": "done"}
            assert check(dc, NHD16, 0, 1, dst, n, seed=i)
            s = d.stats()
            # the exporter's blocks and epochs, the mirror's words, this rank's blocks (shared)
            assert s["nixl_dlists"] == 4 and s["nixl_dlists_prepared"] == 4, s
        p.close()
        p2 = TransferEngine(NHD16, pc, 0, 1, "P", transport="nixl").start()  # P restarted
        fill(pc, NHD16, 0, 1, [6, 7], 30, seed=7)
        d.load("again", p2.export("again", [6, 7], 30), [10, 11])
        assert _wait(d, {"again"}) == {"again": "done"}
        assert check(dc, NHD16, 0, 1, [10, 11], 30, seed=7)
        s = d.stats()
        assert s["nixl_dlists"] == 4 and s["nixl_dlists_prepared"] == 4 + 3, s  # this rank's kept
    finally:
        d.close()
        for e in (p, p2):
            if e is not None:
                e.close()
    s = agent.stats()
    assert s["nixl_dlists"] == 0 and s["nixl_dlists_swept"] == 0, s


def test_agent_reads_by_index_refuses_released_lists_sweeps_at_close(ucx, caplog):
    """Two agents on loopback: a READ by indices into prepared lists moves exactly the indexed
    blocks, beside a transfer by address in the same finish (the rest keeps its poison); a
    released list is refused by name; a list its owner never released is swept at close,
    counted and logged."""
    import numpy as np

    from kvxfer.transports.nixl.agent import NixlAgent, NixlError
    from kvxfer.transports.nixl.descs import descs

    blk, nb = 512, 64
    src = torch.randint(0, 256, (nb * blk,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    dst = torch.full((nb * blk,), 0x5A, dtype=torch.uint8)
    a, b = NixlAgent("t/a"), NixlAgent("t/b")
    try:
        b.start_pump("t-b-pump")
        a.register([dst], "dst")
        b.register([src], "src")
        a.add_remote(b.metadata(), expect="t/b")
        lens = np.full(nb, blk, dtype=np.uint64)

        def blocks(t):
            return np.uint64(t.data_ptr()) + np.arange(nb, dtype=np.uint64) * np.uint64(blk)

        local = a.prep(descs(blocks(dst), lens, 0), "DRAM", "dst blocks")
        remote = a.prep(descs(blocks(src), lens, 0), "DRAM", "src blocks", agent="t/b")
        s_idx, d_idx = np.array([5, 6, 40], np.int32), np.array([0, 1, 63], np.int32)
        one = np.array([100], dtype=np.uint64)
        by_addr = a.start_read(
            descs(np.array([dst.data_ptr() + 10 * blk + 3], np.uint64), one, 0), "DRAM", "t/b",
            descs(np.array([src.data_ptr() + 20 * blk + 7], np.uint64), one, 0), "DRAM",
        )  # fmt: skip
        a.finish([a.start_prepped(local, d_idx, remote, s_idx), by_addr], time.monotonic() + 10, "test READ")
        want = torch.full_like(dst, 0x5A)
        for s, d in zip(s_idx.tolist(), d_idx.tolist()):
            want[d * blk : (d + 1) * blk] = src[s * blk : (s + 1) * blk]
        want[10 * blk + 3 : 10 * blk + 103] = src[20 * blk + 7 : 20 * blk + 107]
        assert torch.equal(dst, want)
        st = a.stats()
        assert st["nixl_dlists"] == 2 and st["nixl_reads"] == 2 and st["nixl_descs"] == 3 + 1, st
        a.release_prep(remote)
        a.release_prep(remote)  # idempotent
        with pytest.raises(NixlError, match="released"):
            a.start_prepped(local, d_idx, remote, s_idx)
        assert a.stats()["nixl_dlists"] == 1
        with caplog.at_level("WARNING", logger="kvxfer.transports.nixl.agent"):
            a.close()
        assert "not released by their owner (dst blocks)" in caplog.text
        st = a.stats()
        assert st["nixl_dlists"] == 0 and st["nixl_dlists_swept"] == 1, st
    finally:
        a.close()
        b.close()


def test_n3_children_share_prefix_once(ucx):
    p_c, d_c = _caches(NHD16, 64), _caches(NHD16, 64)
    p = TransferEngine(NHD16, p_c, 0, 1, "P", transport="nixl").start()
    d = TransferEngine(NHD16, d_c, 0, 1, "D", transport="nixl").start()
    try:
        prefix, tails = 32, [5, 16, 3]
        params, dst = [], {}
        for i, tail in enumerate(tails):
            n = prefix + tail
            src_ids = [10, 11, 20 + i]
            fill(p_c, NHD16, 0, 1, src_ids, n, seed=i)
            fill(p_c, NHD16, 0, 1, [10, 11], prefix, seed=99)
            params.append(p.export(f"c{i}", src_ids, n))
            dst[f"c{i}"] = ([40, 41, 50 + 2 * i], n)
        for i, prm in enumerate(params):
            d.load(f"c{i}", prm, dst[f"c{i}"][0])
        assert _wait(d, {"c0", "c1", "c2"}) == dict.fromkeys(["c0", "c1", "c2"], "done")
        for i in range(3):
            ids, n = dst[f"c{i}"]
            want = payload(NHD16, i, n, range(4)).clone()
            want[:, :, :, :prefix] = payload(NHD16, 99, prefix, range(4))
            got = ops.gather_blocks(d_c, NHD16, ids, n)
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"c{i}"
        bpt = NHD16.bytes_per_token()
        assert d.stats()["bytes"] == (prefix + sum(tails)) * bpt  # the prefix crossed once
        assert d.stats()["dedup_bytes"] == 2 * prefix * bpt
        assert _wait(p, {"c0", "c1", "c2"}, "send") == dict.fromkeys(["c0", "c1", "c2"], "done")
    finally:
        d.close()
        p.close()


def test_auto_picks_nixl_across_hosts_never_on_one(ucx):
    """auto: a loader on another host (simulated identity) that offers NIXL gets nixl, with the
    reason; on one host ipc does the job and the exporter never even makes a NIXL agent."""
    shm = alloc_shm_caches(NHD16, 16, 1)
    dc = _caches(NHD16)
    p = TransferEngine(NHD16, shm.caches, 0, 1, "P").start()
    near = TransferEngine(NHD16, _caches(NHD16), 0, 1, "Dnear").start()
    far = TransferEngine(NHD16, dc, 0, 1, "Dfar")
    object.__setattr__(far._rank, "identity", "another-host/boot-x")  # as if on another host
    far.start()
    try:
        fill(shm.caches, NHD16, 0, 1, [1, 2], 20, seed=1)
        near.load("n", p.export("n", [1, 2], 20), [3, 4])
        assert _wait(near, {"n"}) == {"n": "done"}
        assert (
            near.stats()["transports"] == {"P": "ipc"}
            and p._transports["nixl"].agent is None
            and near._transports["nixl"].agent is None
        )
        far.load("f", p.export("f", [1, 2], 20), [5, 6])
        assert _wait(far, {"f"}) == {"f": "done"}
        assert check(dc, NHD16, 0, 1, [5, 6], 20, seed=1)
        why = far.stats()["transport_reasons"]["P"]
        assert far.stats()["transports"] == {"P": "nixl"}
        assert why == (
            "nixl: ipc cannot be used: not on one host; both sides offer NIXL (UCX); paths: rank 0 direct"
        )
        assert p._transports["nixl"].agent is not None  # made on the far loader's handshake
    finally:
        for e in (far, near, p):
            e.close()
        shm.close()


def test_auto_loader_of_a_nixl_only_exporter_on_one_host(ucx):
    """An exporter configured for nixl offers nothing else: an auto loader on its host takes
    nixl (and says why) rather than failing for want of a common transport."""
    pc, dc = _caches(NHD16), _caches(HND32)
    p = TransferEngine(NHD16, pc, 0, 1, "P", transport="nixl").start()
    d = TransferEngine(HND32, dc, 0, 1, "D").start()
    try:
        assert offered(p._transports) == ["nixl"]
        fill(pc, NHD16, 0, 1, [1, 2], 20, seed=3)
        d.load("x", p.export("x", [1, 2], 20), [4])
        assert _wait(d, {"x"}) == {"x": "done"}
        assert check(dc, HND32, 0, 1, [4], 20, seed=3)
        why = d.stats()["transport_reasons"]["P"]
        assert why.startswith("nixl: the exporter offers no other transport") and "rank 0 staged" in why
    finally:
        d.close()
        p.close()


def test_nixl_metadata_only_for_token_holders(ucx):
    """No token, no NIXL metadata; a forged token opens no pair or stream; garbage
    notifications are dropped; the rightful loader still gets its bytes."""
    pc, dc = _caches(NHD16), _caches(NHD16)
    p = TransferEngine(NHD16, pc, 0, 1, "P", transport="nixl").start()
    try:
        fill(pc, NHD16, 0, 1, [2], 6, seed=3)
        prm = p.export("victim", [2], 6)
        ident = dict(p._rank.identity_fields(), engine_id="E", transports=["nixl"])
        forged = "f" * 48
        for hello in (
            C.Hello(**ident, transport="nixl"),
            C.Hello(**ident, request_id="victim", token=forged, transport="nixl"),
        ):
            rep = p._exporter.handle(hello)
            assert isinstance(rep, C.ErrorReply) and "unauthorized" in rep.error
        dg = KVTransferParams.from_dict(prm).digest()
        rep = p._exporter.handle(
            C.Hello(**ident, request_id="victim", token=prm["token"], transport="nixl", digest=dg)
        )
        assert rep.nixl["agent"] == p._transports["nixl"].agent.name and rep.nixl["md"]
        rep = p._exporter.handle(C.NixlPairReq("E", 0, "x", b"junk", 5.0, "victim", forged))
        assert not rep.ok and "unauthorized" in rep.failed["*"]
        rep = p._exporter.handle(C.NixlPairReq("E", 0, "x", b"junk", 5.0, "victim", prm["token"], dg))
        assert not rep.ok and "NIXL" in rep.failed["*"]  # authorized, but not metadata
        rep = p._exporter.handle(
            C.SendReq("E", 0, "x#k", ["victim"], [forged], 0, 4, 16, [(b"", 6, 0, 0)], 16)
        )
        assert not rep.ok and "unauthorized" in rep.failed["*"]
        d = TransferEngine(NHD16, dc, 0, 1, "D", transport="nixl").start()
        try:
            d._transports["nixl"].agent.send_notif  # noqa: B018 - the loader's agent exists
            d.load("victim", prm, [9])
            assert _wait(d, {"victim"}) == {"victim": "done"}
            assert check(dc, NHD16, 0, 1, [9], 6, seed=3)
        finally:
            d.close()
    finally:
        p.close()


def test_lease_ends_during_direct_read_reported_failed(ucx):
    """D stalls after its READ (no heartbeat): P's lease ends, the block epochs move, and the
    epoch READ after the data READ fails the load instead of delivering it."""
    pc, dc = _caches(NHD16), _caches(NHD16)
    p = TransferEngine(NHD16, pc, 0, 1, "P", transport="nixl", lease_s=0.5).start()
    d = TransferEngine(NHD16, dc, 0, 1, "D", transport="nixl", lease_s=0.5, timeout_s=8.0).start()
    try:
        fill(pc, NHD16, 0, 1, [4, 5], 20, seed=1)
        prm = p.export("slow", [4, 5], 20)
        released = threading.Event()

        def stall():
            end = time.monotonic() + 5
            while p._rt.exports.lookup("slow") is not None and time.monotonic() < end:
                time.sleep(0.01)
            released.set() if p._rt.exports.lookup("slow") is None else None

        d._hooks["after_nixl_read"] = stall
        d.load("slow", prm, [1, 2])
        got = _wait(d, {"slow"})
        assert released.is_set()
        assert got["slow"].startswith("failed:") and "released before or during" in got["slow"], got
        assert d.stats()["transfers"] == 0 and d.stats()["failures"] == 1
        assert untouched(dc, NHD16, {1, 2}, {})  # only the failed load's blocks were written
        assert _wait(p, {"slow"}, "send") == {"slow": "expired"}
    finally:
        d.close()
        p.close()


def test_lease_ends_during_staged_stream_fails_at_once(ucx):
    """A request released while its staged stream runs (the loader parked between chunks, no
    heartbeat): the exporter's next gather finds it gone and aborts; the loader fails the load
    at once (not at its deadline) and never scatters a chunk of released blocks as valid."""
    pc, dc = _caches(NHD16, 64), _caches(HND32, 64)
    pipe = StagedPipeline(buffer_bytes=16 << 10)  # 32 tokens per chunk: 4 chunks
    p = TransferEngine(NHD16, pc, 0, 1, "P", transport="nixl", lease_s=0.5, pipeline=pipe).start()
    d = TransferEngine(
        HND32, dc, 0, 1, "D", transport="nixl", lease_s=0.5, timeout_s=20.0, pipeline=pipe
    ).start()
    try:
        ids = list(range(10, 18))
        fill(pc, NHD16, 0, 1, ids, 128, seed=2)
        prm = p.export("s", ids, 128)

        def park():
            end = time.monotonic() + 5
            while p._rt.exports.lookup("s") is not None and time.monotonic() < end:
                time.sleep(0.01)

        d._hooks["before_recv"] = park
        t0 = time.monotonic()
        d.load("s", prm, [0, 1, 2, 3])
        got = _wait(d, {"s"}, timeout=25)
        assert got["s"].startswith("failed:") and "aborted" in got["s"], got
        assert time.monotonic() - t0 < 10.0  # far before the 20 s deadline
        assert _wait(p, {"s"}, "send") == {"s": "expired"}
        # The loader answered the abort with "no READ running": the exporter's staging buffers
        # are free at once (not held for the loader's 20 s bound), so the next stream runs now.
        del d._hooks["before_recv"]
        fill(pc, NHD16, 0, 1, [30, 31], 32, seed=7)
        t0 = time.monotonic()
        d.load("t", p.export("t", [30, 31], 32), [9])
        assert _wait(d, {"t"}, timeout=25) == {"t": "done"}
        assert time.monotonic() - t0 < 5.0
        assert check(dc, HND32, 0, 1, [9], 32, seed=7)
    finally:
        d.close()
        p.close()


def test_stuck_exporter_fails_by_the_deadline_and_close_is_bounded(ucx):
    """The exporter's sender is parked (never gathers): the staged load fails by its deadline
    naming it; the loader's close() returns within its bound."""
    from kvxfer.engine import CLOSE_TIMEOUT_S

    pc, dc = _caches(NHD16), _caches(HND32)
    p = TransferEngine(NHD16, pc, 0, 1, "P", transport="nixl").start()
    d = TransferEngine(HND32, dc, 0, 1, "D", transport="nixl", timeout_s=1.5).start()
    gate = threading.Event()
    p._hooks["before_send"] = lambda: gate.wait(20)
    try:
        d.load("x", p.export("x", [1, 2], 20), [3])
        t0 = time.monotonic()
        got = _wait(d, {"x"}, timeout=10)
        assert got["x"].startswith("failed:") and "deadline" in got["x"], got
        assert time.monotonic() - t0 < 1.5 + 1.0
        assert bool((dc[0].view(torch.uint8)[:, 3] == 0x5A).all())  # nothing scattered
        t0 = time.monotonic()
        d.close()
        assert time.monotonic() - t0 < CLOSE_TIMEOUT_S
    finally:
        gate.set()
        d.close()
        p.close()


def test_restarted_exporter_is_read_anew(ucx):
    """P restarts at the same port (a new incarnation, a new NIXL agent): D's next load
    handshakes with it at once, loads the new agent's metadata and lands the NEW bytes."""
    from kvxfer.ports import free_port_base

    port = free_port_base(1)
    d_c = _caches(NHD16)
    d = TransferEngine(NHD16, d_c, 0, 1, "D", transport="nixl", timeout_s=5.0).start()
    p1c, p2c = _caches(NHD16), _caches(NHD16)
    p1 = TransferEngine(NHD16, p1c, 0, 1, "P", transport="nixl", port=port).start()
    try:
        fill(p1c, NHD16, 0, 1, [3, 4], 20, seed=1)
        d.load("a", p1.export("a", [3, 4], 20), [5, 6])
        assert _wait(d, {"a"}) == {"a": "done"}
        old_agent = p1._transports["nixl"].agent.name
        p1.close()
        p2 = TransferEngine(NHD16, p2c, 0, 1, "P", transport="nixl", port=port).start()
        try:
            fill(p2c, NHD16, 0, 1, [3, 4], 20, seed=2)  # same blocks, other bytes
            t0 = time.monotonic()
            d.load("b", p2.export("b", [3, 4], 20), [7, 8])
            assert _wait(d, {"b"}) == {"b": "done"}
            assert time.monotonic() - t0 < 4.0
            assert check(d_c, NHD16, 0, 1, [7, 8], 20, seed=2)
            assert (
                p2._transports["nixl"].agent.name != old_agent
                and old_agent not in d._transports["nixl"].agent._remotes
            )
        finally:
            p2.close()
    finally:
        d.close()
        p1.close()


# --------------------------------------------------------------------------- streaming, partial loads
# The layer-wise streaming and partial-load scenarios of tests/test_streaming.py, run over nixl
# (called through the module, so pytest does not collect them twice).
STREAM_CASES = [
    (("NHD", 16), ("HND", 8), 1),  # staged
    (("HND", 8), ("NHD", 16), 2),  # staged, TP 2 -> 1
    (("HND", 16), ("HND", 16), 2),  # direct, TP 2 -> 1 (HND head slices)
    (("NHD", 16), ("NHD", 16), 1),  # direct
]


@pytest.mark.parametrize("groups", [[1] * 6, [3, 3]], ids=["by-1", "by-3"])
@pytest.mark.parametrize(
    ("src", "dst", "src_tp"),
    STREAM_CASES,
    ids=["nhd16-hnd8", "tp2-hnd8-nhd16", "tp2-hnd16-direct", "nhd16-direct"],
)
def test_layer_groups_stream_over_nixl(ucx, groups, src, dst, src_tp):
    from . import test_streaming

    test_streaming.test_layer_groups_stream_and_finish_with_the_last("nixl", groups, src, dst, src_tp)


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        (("NHD", 16), ("NHD", 16)),
        (("HND", 16), ("NHD", 8)),
        (("HND", 32), ("HND", 16)),
        (("HND", 16), ("HND", 16)),
    ],
    ids=["nhd16-direct", "hnd16-nhd8", "hnd32-hnd16", "hnd16-direct"],
)
@pytest.mark.parametrize("which", ["one-block", "all-but-one"])
def test_partial_load_over_nixl(ucx, src, dst, which):
    from . import test_streaming

    test_streaming.test_partial_load_pulls_only_the_missing_tokens("nixl", src, dst, which)


# --------------------------------------------------------------------------- entitlement
@pytest.mark.parametrize("dst_spec", [NHD16, HND32], ids=["direct", "staged"])
def test_nixl_serves_only_the_export_the_params_open(ucx, dst_spec):
    """Over nixl (direct READs and the staged stream alike) params with another request's block
    ids, blocks nobody exported or more tokens are refused by name and write nothing; an
    earlier export's params do not open a later export of the id; a staged send request that
    names blocks its tokens do not open is refused before anything is gathered. The true
    params land."""
    pc, dc = _caches(NHD16), _caches(dst_spec)
    pipe = StagedPipeline(buffer_bytes=16 << 10)
    p = TransferEngine(NHD16, pc, 0, 1, "P", transport="nixl", pipeline=pipe).start()
    d = TransferEngine(dst_spec, dc, 0, 1, "D", transport="nixl", pipeline=pipe, timeout_s=3.0).start()
    try:
        fill(pc, NHD16, 0, 1, [2, 3], 20, seed=1)
        fill(pc, NHD16, 0, 1, [20, 21], 32, seed=2)
        a = p.export("A", [2, 3], 20)
        p.export("B", [20, 21], 32)
        old = p.export("R", [6], 8)
        p.abort_export("R")
        p.export("R", [6], 8)
        bad = {
            "b-blocks": (dict(a, block_ids=[20, 21]), [5, 6]),
            "never": (dict(a, block_ids=[25, 26]), [7, 8]),
            "longer": (dict(a, num_tokens=32), [9, 10]),
            "earlier": (old, [11]),
        }
        per = dst_spec.block_size
        for name, (prm, ids) in bad.items():
            d.load(name, prm, ids[: -(-prm["num_tokens"] // per)])
        d.load("A", a, [12, 13][: -(-20 // per)])
        got = _wait(d, [*bad, "A"])
        for name in bad:
            assert got[name].startswith("failed:") and "export" in got[name], got
        assert got["A"] == "done", got
        a_ids = [12, 13][: -(-20 // per)]
        assert check(dc, dst_spec, 0, 1, a_ids, 20, seed=1)
        assert untouched(dc, dst_spec, set(a_ids), _tail(dst_spec, a_ids, 20))
        if dst_spec is HND32:  # the staged path: P checks what a stream would read
            ident = d._transports["nixl"].agent.name
            key = f"{ident}#feed"
            assert key.rpartition("#")[0] in p._transports["nixl"].peers  # D paired for its staged reads
            c = p.export("C", [2, 3], 20)  # A was loaded and released; C holds its blocks
            raw = torch.tensor([20, 21], dtype=torch.int64).numpy().tobytes()
            rep = p._exporter.handle(
                C.SendReq("D", 0, key, ["C"], [c["token"]], 0, 4, 16, [(raw, 32, 0, 0)], 32)
            )
            assert not rep.ok and "refused" in rep.failed["*"] and "block 20" in rep.failed["*"], rep
    finally:
        d.close()
        p.close()
