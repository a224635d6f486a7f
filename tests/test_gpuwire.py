"""GPU-transport wiring, proven on CPU: ipc mapper choice and its messages, the CUDA mapper
adapter (fake driver), the staged double-buffered pg pipeline over Gloo, stream-ordering gates
(no-ops on CPU, fake events), NVTX ranges of the engine's phases."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from kvxfer import KVCacheSpec, KVTransferParams, TransferEngine, ops, tracing
from kvxfer import control as C
from kvxfer.ordering import NOT_READY, StreamOrder
from kvxfer.transports import choice
from kvxfer.transports.ipc import cuda_mapper
from kvxfer.transports.ipc import offer as ipc_offer
from kvxfer.transports.ipc.cuda_ipc import publish_caches
from kvxfer.transports.ipc.shm import alloc_shm_caches
from kvxfer.transports.pg import groups as pg_groups
from kvxfer.transports.pg.pipeline import StagedPipeline

from .engine_payload import check, fill, poison, untouched
from .test_cuda_ipc import FakeDriver, carve, info

SPEC = KVCacheSpec(2, 2, 16, 8, torch.float16)


def _reply(rank=0, transports=("ipc", "pg"), hostname="h", ipc=None, pg=None):
    return C.HelloReply(
        engine_id="P",
        tp_rank=rank,
        tp_size=1,
        spec=SPEC.to_dict(),
        compat="",
        transports=list(transports),
        hostname=hostname,
        num_blocks=8,
        ipc=ipc,
        pg=pg,
    )


def _entry(mapper="cuda", **kw):
    return {"mapper": mapper, "caches": {}, "epochs": "x", "num_blocks": 8, "info": info(**kw), "why": ""}


# --------------------------------------------------------------------------- transport choice
CUDA = torch.device("cuda", 0)  # only compared by type; nothing runs on it


def test_choice_cuda_same_gpu_is_ipc_with_reason():
    local = info(pid=1, process_token="z" * 32)
    t, why = choice.choose("auto", CUDA, local, "h", [_reply(ipc=_entry())])
    assert (t, why) == ("ipc", "ipc: same host, same GPU")


@pytest.mark.parametrize(
    "peer_kw, needle",
    [
        ({"expandable_segments": True, "alloc_conf": "expandable_segments:True"}, "expandable_segments"),
        ({"pid_ns": "pid:[1]"}, "PID-namespace isolation"),
        ({"gpu_uuid": "GPU-7"}, "not visible in this process"),
        ({"host_id": "node2/boot-b"}, "different hosts"),
    ],
)
def test_choice_cuda_ipc_impossible_error_or_fallback_names_reason(peer_kw, needle):
    local = info(pid=1, process_token="z" * 32)
    replies = [_reply(ipc=_entry(**peer_kw))]
    with pytest.raises(ValueError, match=r"^transport 'ipc' was asked for but cannot be used: .*" + needle):
        choice.choose("ipc", CUDA, local, "h", replies)
    t, why = choice.choose("auto", CUDA, local, "h", replies)
    assert t == "pg" and why.startswith("pg: ipc cannot be used: ") and needle in why


def test_choice_names_each_unusable_case():
    local = info(pid=1, process_token="z" * 32)
    cases = [
        ([_reply(ipc=_entry(), hostname="other")], "not on one host"),
        (
            [_reply(transports=["pg"], ipc={"mapper": None, "why": "no CuPy here", "info": info()})],
            "no CuPy here",
        ),
        ([_reply(ipc=_entry(mapper="shm"))], "need 'cuda'"),  # CPU exporter, CUDA loader
        (
            [_reply(ipc=_entry()), _reply(1, ipc=_entry(pid=1, process_token="z" * 32))],
            "rank 1: same process",
        ),
    ]
    for replies, needle in cases:
        t, why = choice.choose("auto", CUDA, local, "h", replies)
        assert t == "pg" and needle in why, (needle, why)
    # CPU loader, CUDA exporter: the mapper kinds differ
    t, why = choice.choose("auto", torch.device("cpu"), info(gpu_uuid=None), "h", [_reply(ipc=_entry())])
    assert t == "pg" and "need 'shm'" in why
    with pytest.raises(ValueError, match="'pg' was asked for but the exporter does not offer it"):
        choice.choose("pg", CUDA, local, "h", [_reply(transports=["ipc"], ipc=_entry())])
    assert choice.choose("pg", CUDA, local, "h", [_reply(ipc=_entry())]) == ("pg", "pg: requested")


def test_choice_consults_topology_only_for_two_gpus():
    calls = []

    class Topo:
        error = None

        def by_uuid(self, u):
            return None

    def topology():
        calls.append(1)
        return Topo()

    local = info(pid=1, process_token="z" * 32)
    choice.choose("auto", CUDA, local, "h", [_reply(ipc=_entry())], topology)
    assert calls == []  # same GPU: no NVML probe
    two = [_reply(ipc=_entry(gpu_uuid="GPU-1"))]
    t, why = choice.choose("auto", CUDA, local, "h", two, topology, peer_access=lambda a, b: True)
    assert calls == [1] and t == "ipc" and "link unknown to NVML" in why
    t, why = choice.choose("auto", CUDA, local, "h", two, topology, peer_access=lambda a, b: False)
    assert t == "pg" and "no peer-to-peer" in why and calls == [1]


def _pg(backend="nccl", backends=("nccl", "gloo")):
    return {"host": "h", "port": 1, "backend": backend, "backends": list(backends), "units": [8]}


def test_pair_backend_same_gpu_takes_gloo_and_says_why():
    """NCCL cannot put both ranks of a pair on one GPU: an exporter rank on the loader's GPU is
    read over Gloo (pinned host staging); ranks on other GPUs keep NCCL."""
    local = info(gpu_uuid="GPU-a")
    same, other = _entry(gpu_uuid="GPU-a"), _entry(gpu_uuid="GPU-b")
    got, why = pg_groups.pair_backends(
        CUDA, local, [_reply(0, ipc=same, pg=_pg()), _reply(1, ipc=other, pg=_pg())]
    )
    assert got == ["gloo", "nccl"]
    assert why.startswith("Gloo through pinned host staging for exporter rank(s) [0]: they share")
    assert pg_groups.pair_backends(CUDA, local, [_reply(0, ipc=other, pg=_pg())]) == (["nccl"], "")
    # another host with a GPU of the same UUID string is not the same GPU
    elsewhere = _entry(gpu_uuid="GPU-a", host_id="another-host")
    assert pg_groups.pair_backends(CUDA, local, [_reply(0, ipc=elsewhere, pg=_pg())])[0] == ["nccl"]
    # a not-offered ipc entry still carries the info the choice needs
    no_ipc = {"mapper": None, "info": info(gpu_uuid="GPU-a"), "why": "pg only"}
    assert pg_groups.pair_backends(CUDA, local, [_reply(0, ipc=no_ipc, pg=_pg())])[0] == ["gloo"]


def test_pair_backend_same_gpu_nccl_only_is_a_clear_error():
    local = info(gpu_uuid="GPU-a")
    with pytest.raises(ValueError, match="shares GPU GPU-a with this loader and offers only NCCL"):
        pg_groups.pair_backends(
            CUDA, local, [_reply(0, ipc=_entry(gpu_uuid="GPU-a"), pg=_pg(backends=["nccl"]))]
        )


def test_pair_backend_cpu_and_gloo_exporters_unchanged():
    cpu = info(gpu_uuid=None)
    assert pg_groups.pair_backends(
        torch.device("cpu"), cpu, [_reply(ipc=_entry("shm"), pg=_pg("gloo", ["gloo"]))]
    )[0] == ["gloo"]
    # a pinned-staging exporter offers Gloo only, whatever the GPUs
    local = info(gpu_uuid="GPU-a")
    assert pg_groups.pair_backends(
        CUDA, local, [_reply(ipc=_entry(gpu_uuid="GPU-b"), pg=_pg("gloo", ["gloo"]))]
    )[0] == ["gloo"]


def test_offered_pg_backends():
    assert pg_groups.offered_pg_backends("nccl", CUDA) == ["nccl", "gloo"]
    assert pg_groups.offered_pg_backends("gloo", CUDA) == ["gloo"]
    assert pg_groups.offered_pg_backends("gloo", torch.device("cpu")) == ["gloo"]


def test_pair_request_for_a_backend_not_served_is_refused():
    """An exporter refuses a pair on a backend it does not offer, naming what it offers."""
    caches = [torch.zeros(SPEC.cache_shape(8, 1), dtype=SPEC.dtype) for _ in range(2)]
    p = TransferEngine(SPEC, caches, 0, 1, "P", transport="pg").start()
    try:
        prm = p.export("r", [1], 4)
        tok, dg = prm["token"], KVTransferParams.from_dict(prm).digest()
        rep = p._exporter.handle(C.PairReq("D", 0, "k", "nccl", "r", tok, dg))
        assert not rep.ok and "pg backend 'nccl' not served here (offers ['gloo'])" in rep.failed["*"]
        hello = p._exporter.handle(C.Hello(**p._rank.identity_fields(), request_id="r", token=tok, digest=dg))
        assert hello.pg["backends"] == ["gloo"]
    finally:
        p.close()


def test_offer_ipc_cpu(monkeypatch):
    shm = alloc_shm_caches(SPEC, 8, 1)
    try:
        o = ipc_offer.offer_ipc(shm.caches, torch.device("cpu"), 8, "P")
        assert o.offered and o.desc["mapper"] == "shm" and o.epochs.shape == (8,)
        assert o.desc["info"]["gpu_uuid"] is None and o.desc["epochs"] == o.epoch_shm.name
        o.epoch_shm.close()
        o.epoch_shm.unlink()
    finally:
        shm.close()
    plain = [torch.zeros(SPEC.cache_shape(8, 1), dtype=SPEC.dtype) for _ in range(2)]
    o = ipc_offer.offer_ipc(plain, torch.device("cpu"), 8, "P")  # read with cross-memory attach
    assert o.offered and o.desc["mapper"] == "cma" and o.desc["caches"]["pid"] == os.getpid()
    assert o.desc["caches"]["addrs"] == [c.data_ptr() for c in plain]
    o.epoch_shm.close()
    o.epoch_shm.unlink()
    monkeypatch.setenv("KVXFER_IPC_CMA", "0")
    o = ipc_offer.offer_ipc(plain, torch.device("cpu"), 8, "P")
    assert not o.offered and "not mappable" in o.desc["why"] and "KVXFER_IPC_CMA=0" in o.desc["why"]
    assert o.epochs is None
    o = ipc_offer.offer_ipc(plain, torch.device("cpu"), 8, "P", enabled=False)
    assert not o.offered and "pg only" in o.desc["why"]
    desc, why = cuda_mapper.offer(plain, "P")
    assert desc is None and "not CUDA" in why


# --------------------------------------------------------------------------- CUDA mapper adapter
def test_cuda_mapper_attach_copy_detach_with_fake_driver():
    """The mapper the engine calls for CUDA caches: attach maps the published allocations
    (shared by owners), copy_blocks reads them, detach closes only the last owner's mapping;
    the epoch array is host shared memory."""
    drv = FakeDriver()
    cache = cuda_mapper.handle_cache(drv)
    try:
        spec = KVCacheSpec(2, 4, 24, 16, torch.float16)
        src = carve(drv, spec, 6, 4, 0)
        desc = publish_caches(src, "P", driver=drv)
        ep, seg = cuda_mapper.shm.alloc_shm_array(6)
        ep[:] = torch.arange(6)
        entry = {"mapper": "cuda", "caches": desc, "epochs": seg.name, "num_blocks": 6, "info": info()}
        a, ep_a, ha = ipc_offer.attach(entry, torch.device("cpu"))
        b, _, hb = ipc_offer.attach(entry, torch.device("cpu"))
        assert len(drv.opened) == 1 and cache.num_hits == 1  # opened once, shared
        assert [t.data_ptr() for t in b] == [t.data_ptr() for t in a] == [t.data_ptr() for t in src]
        assert torch.equal(ep_a, torch.arange(6))
        dst_spec = KVCacheSpec(2, 4, 24, 8, torch.float16, layout="HND")
        dst = [torch.full(dst_spec.cache_shape(12, 1), 7.0, dtype=torch.float16) for _ in range(2)]
        ops.copy_blocks(a, spec, [4, 1], dst, dst_spec, [9, 2, 5, 0], 27)
        want = ops.gather_blocks(src, spec, [4, 1], 27)
        got = ops.gather_blocks(dst, dst_spec, [9, 2, 5, 0], 27)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        ipc_offer.detach(ha)
        assert drv.closed == []  # b still uses it
        ipc_offer.detach(hb)
        assert len(drv.closed) == 1 and len(cache) == 0
        cuda_mapper.shm.release_segment(seg)
    finally:
        cuda_mapper.handle_cache(None)  # fresh cache for other tests
        cuda_mapper._cache = None


# --------------------------------------------------------------------------- staged pipeline units
def test_staged_pipeline_config_and_chunk_agreement():
    p = StagedPipeline(buffer_bytes=4096)
    assert p.pg_backend(torch.device("cpu")) == "gloo" and p.pg_backend(CUDA) == "nccl"
    assert StagedPipeline(pin_memory=True).pg_backend(CUDA) == "gloo"
    assert p.handshake_info() == {"staging_bytes": 4096}
    with pytest.raises(ValueError, match="advertises no staging buffer size"):
        p.chunk_tokens_for({"backend": "gloo"}, 64, 1, 1)  # a peer that does not stage
    assert p.chunk_tokens_for({"staging_bytes": 2048}, 64, 8, 12) == 24  # min buffer, lcm 24
    assert (
        StagedPipeline(4096, max_chunk_tokens=10).chunk_tokens_for({"staging_bytes": 1 << 20}, 64, 1, 1) == 10
    )
    with pytest.raises(ValueError, match="fewer than one chunk unit"):
        p.chunk_tokens_for({"staging_bytes": 4096}, 64, 16, 80)
    assert p.check_chunk(SPEC, 2, 16, 8) == ""  # 256 bytes per token
    assert "staging buffers hold" in p.check_chunk(SPEC, 2, 24, 8)
    assert "multiple of the unit" in p.check_chunk(SPEC, 2, 12, 8)
    assert "positive int" in p.check_chunk(SPEC, 2, 0, 8)
    for bad in ({"buffer_bytes": 0}, {"depth": 1}, {"max_chunk_tokens": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            StagedPipeline(**bad)


# --------------------------------------------------------------------------- engines (in process)
def _wait(eng, want, timeout=15.0):
    got, seen = {}, []
    end = time.monotonic() + timeout
    while set(got) != set(want) and time.monotonic() < end:
        r = eng.poll()
        for rid in r.finished_recving:
            got[rid] = "done"
            seen.append(rid)
        for rid in r.failed:
            got[rid] = "failed:" + r.errors.get(rid, "")
            seen.append(rid)
        time.sleep(0.005)
    assert len(seen) == len(set(seen)), seen
    return got


STAGED_CASES = [
    # NHD bs=16 -> HND bs=8 (unit 1 -> unit 8), fp16 head_dim 24
    (KVCacheSpec(2, 4, 24, 16, torch.float16), KVCacheSpec(2, 4, 24, 8, torch.float16, layout="HND")),
    # HND bs=8 -> NHD bs=12 (unit 8 -> unit 1), bf16
    (KVCacheSpec(3, 2, 16, 8, torch.bfloat16, layout="HND"), KVCacheSpec(3, 2, 16, 12, torch.bfloat16)),
    # MLA bs=16 -> bs=4
    (
        KVCacheSpec(2, 1, 72, 16, torch.float16, use_mla=True),
        KVCacheSpec(2, 1, 72, 4, torch.float16, use_mla=True),
    ),
]


@pytest.mark.parametrize("case", range(len(STAGED_CASES)))
def test_staged_pg_in_process_chunks_exact_pool_reused(case):
    src, dst = STAGED_CASES[case]
    nb = 256
    sc = [torch.empty(src.cache_shape(nb, 1), dtype=src.dtype) for _ in range(src.num_layers)]
    dc = [torch.empty(dst.cache_shape(nb, 1), dtype=dst.dtype) for _ in range(dst.num_layers)]
    poison(sc)
    poison(dc)
    bpt = src.bytes_per_token()
    pp = StagedPipeline(buffer_bytes=48 * bpt)  # 48 tokens per buffer: a 200-token request is >= 5 chunks
    dp = StagedPipeline(buffer_bytes=64 * bpt)
    p = TransferEngine(src, sc, 0, 1, "P", transport="pg", pipeline=pp).start()
    d = TransferEngine(dst, dc, 0, 1, "D", transport="pg", pipeline=dp).start()
    try:
        lengths = [200, 37, 1, 96, 130]
        sfree, dfree = list(range(nb))[::-1], list(range(nb))[::2] + list(range(nb))[1::2]
        reqs = []
        for rnd in range(2):  # two polls: the pools must be reused, not reallocated
            batch = lengths if rnd == 0 else lengths[:2]
            for i, n in enumerate(batch):
                rid = f"r{rnd}-{i}"
                s_ids = [sfree.pop() for _ in range(src.num_blocks_for(n))]
                d_ids = [dfree.pop() for _ in range(dst.num_blocks_for(n))]
                fill(sc, src, 0, 1, s_ids, n, seed=10 * rnd + i)
                d.load(rid, p.export(rid, s_ids, n), d_ids)
                reqs.append((rid, n, 10 * rnd + i, d_ids))
            new = {f"r{rnd}-{i}" for i in range(len(batch))}
            got = _wait(d, new)
            assert got == dict.fromkeys(new, "done"), got
            if rnd == 0:
                ptrs = [pl._storage.data_ptr() for pl in (*pp.pools(), *dp.pools())]
        for rid, n, seed, d_ids in reqs:
            assert check(dc, dst, 0, 1, d_ids, n, seed), rid
        used = {b for r in reqs for b in r[3]}
        tails = {r[3][-1]: r[1] - (len(r[3]) - 1) * dst.block_size for r in reqs}
        assert untouched(dc, dst, used, tails)
        ds, ps = d.stats(), p.stats()
        assert ds["staging_pools"] == 1 and ps["staging_pools"] == 1  # one pool each, made once
        assert [pl._storage.data_ptr() for pl in (*pp.pools(), *dp.pools())] == ptrs
        assert ds["staging_chunks_recv"] == ps["staging_chunks_sent"] >= 3 + 2
        assert ds["transfers"] == len(reqs)
        pool = dp.pools()[0]
        assert pool.num_free == pool.num_buffers and pool.num_leases == ds["staging_streams"]
    finally:
        d.close()
        p.close()


def test_ends_with_different_buffers_agree_on_chunks():
    """Exporter and loader cut the same chunks from min(buffers): a 40-token request through a
    20-token exporter buffer and a 64-token loader buffer lands exactly in 2+ chunks."""
    sc = [torch.empty(SPEC.cache_shape(32, 1), dtype=SPEC.dtype) for _ in range(2)]
    dc = [torch.empty(SPEC.cache_shape(32, 1), dtype=SPEC.dtype) for _ in range(2)]
    poison(dc)
    pp = StagedPipeline(buffer_bytes=20 * SPEC.bytes_per_token())
    dp = StagedPipeline(buffer_bytes=64 * SPEC.bytes_per_token())
    p = TransferEngine(SPEC, sc, 0, 1, "P", transport="pg", pipeline=pp).start()
    d = TransferEngine(SPEC, dc, 0, 1, "D", transport="pg", pipeline=dp).start()
    try:
        fill(sc, SPEC, 0, 1, [6, 7, 8, 9, 10], 40, seed=2)
        d.load("b", p.export("b", [6, 7, 8, 9, 10], 40), [11, 12, 13, 14, 15])
        assert _wait(d, {"b"}) == {"b": "done"}
        assert check(dc, SPEC, 0, 1, [11, 12, 13, 14, 15], 40, 2)
        assert untouched(dc, SPEC, {11, 12, 13, 14, 15}, {15: 40 - 4 * 8})
        assert d.stats()["staging_chunks_recv"] >= 2 and p.stats()["staging_chunks_sent"] >= 2
    finally:
        d.close()
        p.close()


def test_exporter_without_staging_is_refused_by_name():
    """A peer that does not advertise its staging buffers (an incompatible kvxfer) is refused
    at the handshake, naming why; nothing is moved."""
    sc = [torch.empty(SPEC.cache_shape(32, 1), dtype=SPEC.dtype) for _ in range(2)]
    dc = [torch.zeros(SPEC.cache_shape(32, 1), dtype=SPEC.dtype) for _ in range(2)]
    p = TransferEngine(SPEC, sc, 0, 1, "P", transport="pg").start()
    p.pipeline.handshake_info = dict  # advertises nothing
    d = TransferEngine(SPEC, dc, 0, 1, "D", transport="pg").start()
    try:
        d.load("a", p.export("a", [3, 4, 5], 20), [1, 2, 3])
        got = _wait(d, {"a"})
        assert got["a"].startswith("failed:") and "advertises no staging buffers" in got["a"], got
        assert bool((dc[0] == 0).all())
    finally:
        d.close()
        p.close()


# --------------------------------------------------------------------------- stream ordering (CPU)
class FakeEvent:
    """An event whose completion the test decides (``query()`` only, like torch.cuda.Event)."""

    def __init__(self):
        self.done = False
        self.queries = 0

    def query(self):
        self.queries += 1
        return self.done


def test_stream_order_is_a_noop_on_cpu():
    o = StreamOrder(torch.device("cpu"))
    assert o.stream() is None and o.stream("send") is None
    with o.on_stream():
        pass
    o.wait_done(0.0)  # returns at once, nothing recorded
    o.mark("x", None)
    assert o.num_pending() == 0 and o.not_ready(["x"]) == [] and o.num_waits == 0
    with pytest.raises(ValueError, match="ready: expected CUDA events or streams"):
        o.mark("x", 5)
    with pytest.raises(ValueError, match=r"stream: expected a torch\.cuda\.Stream"):
        o.set_compute_stream("s")


@pytest.mark.parametrize("transport", ["ipc", "pg"])
def test_export_waits_for_ready_event(transport):
    """No loader reads the blocks until the event handed to export completed; then the load
    lands exactly. (On CPU the event is a fake with query(); on GPU it is a CUDA event.)"""
    shm, dshm = alloc_shm_caches(SPEC, 16, 1), alloc_shm_caches(SPEC, 16, 1)
    poison(dshm.caches)
    p = TransferEngine(SPEC, shm.caches, 0, 1, "P", transport=transport, timeout_s=5.0).start()
    d = TransferEngine(SPEC, dshm.caches, 0, 1, "D", transport=transport, timeout_s=5.0).start()
    try:
        ev = FakeEvent()
        params = p.export("x", [2, 3], 12, ready=ev)
        d.load("x", params, [5, 6])
        end = time.monotonic() + 0.4
        while time.monotonic() < end:
            r = d.poll()
            assert not r.finished_recving and not r.failed, "loaded before the compute finished"
            time.sleep(0.01)
        assert ev.queries > 0 and p.stats()["not_ready_grants"] > 0
        assert untouched(dshm.caches, SPEC, set(), {})
        fill(shm.caches, SPEC, 0, 1, [2, 3], 12, seed=4)  # "the compute" writes, then completes
        ev.done = True
        assert _wait(d, {"x"}) == {"x": "done"}
        assert check(dshm.caches, SPEC, 0, 1, [5, 6], 12, seed=4)
    finally:
        d.close()
        p.close()
        shm.close()
        dshm.close()


def test_never_ready_export_fails_bounded_naming_why():
    shm, dshm = alloc_shm_caches(SPEC, 16, 1), alloc_shm_caches(SPEC, 16, 1)
    p = TransferEngine(SPEC, shm.caches, 0, 1, "P", transport="ipc", timeout_s=0.5).start()
    d = TransferEngine(SPEC, dshm.caches, 0, 1, "D", transport="ipc", timeout_s=0.5).start()
    try:
        d.load("x", p.export("x", [2], 5, ready=[FakeEvent()]), [1])
        got = _wait(d, {"x"}, timeout=5)
        assert got["x"].startswith("failed:") and NOT_READY in got["x"]
    finally:
        d.close()
        p.close()
        shm.close()
        dshm.close()


def test_timed_out_copy_is_reported_only_after_it_completed():
    """A wait for the load's GPU work that runs out must not fail the request (the runner
    would recompute into blocks the copy may still write) nor notify P (P would free blocks the
    copy may still read) while the work may run: both happen once the work has completed."""
    from kvxfer.ordering import FenceTimeout

    shm, dshm = alloc_shm_caches(SPEC, 16, 1), alloc_shm_caches(SPEC, 16, 1)
    p = TransferEngine(SPEC, shm.caches, 0, 1, "P", transport="ipc", timeout_s=2.0).start()
    d = TransferEngine(SPEC, dshm.caches, 0, 1, "D", transport="ipc", timeout_s=2.0).start()
    ev = FakeEvent()

    def stuck(timeout_s, role="load"):
        raise FenceTimeout(f"transfer stream: CUDA work not complete within {timeout_s}s", ev)

    d._rt.order.wait_done = stuck  # the copy is "still running" on the GPU
    try:
        d.load("x", p.export("x", [2, 3], 12), [4, 5])
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            r, rp = d.poll(), p.poll()
            assert r.empty() and rp.empty(), (r, rp)
            time.sleep(0.01)
        assert ev.queries > 0 and p.stats()["exports_live"] == 1
        ev.done = True
        got = _wait(d, {"x"}, timeout=5)
        assert got["x"].startswith("failed:") and "reported once the GPU work completed" in got["x"]
        end = time.monotonic() + 5
        sent = set()
        while "x" not in sent and time.monotonic() < end:
            sent |= p.poll().finished_sending
            time.sleep(0.01)
        assert sent == {"x"}  # the failed notification released P's blocks, after the work
    finally:
        d.close()
        p.close()
        shm.close()
        dshm.close()


# --------------------------------------------------------------------------- reasons and NVTX
def test_stats_report_transport_reason(monkeypatch):
    shm, dshm = alloc_shm_caches(SPEC, 16, 1), alloc_shm_caches(SPEC, 16, 1)
    plain = [torch.zeros(SPEC.cache_shape(16, 1), dtype=SPEC.dtype) for _ in range(2)]
    p1 = TransferEngine(SPEC, shm.caches, 0, 1, "P1").start()
    monkeypatch.setenv("KVXFER_IPC_CMA", "0")  # P2 offers no cross-memory attach
    p2 = TransferEngine(SPEC, plain, 0, 1, "P2").start()
    monkeypatch.delenv("KVXFER_IPC_CMA")
    p3 = TransferEngine(SPEC, plain, 0, 1, "P3").start()
    d = TransferEngine(SPEC, dshm.caches, 0, 1, "D").start()
    try:
        d.load("a", p1.export("a", [1], 4), [1])
        d.load("b", p2.export("b", [1], 4), [2])
        d.load("c", p3.export("c", [3], 4), [3])
        assert set(_wait(d, {"a", "b", "c"}).values()) == {"done"}
        s = d.stats()
        assert s["transports"] == {"P1": "ipc", "P2": "pg", "P3": "ipc"}
        assert s["transport_reasons"] == {
            "P1": "ipc: shared memory on one host",
            "P2": "pg: ipc cannot be used: the exporter's caches are not mappable (not in shm; "
            "cross-memory attach turned off (KVXFER_IPC_CMA=0))",
            "P3": "ipc: cross-memory attach on one host",
        }
    finally:
        for e in (d, p1, p2, p3):
            e.close()
        shm.close()
        dshm.close()


class FakeNvtx:
    def __init__(self):
        self.ranges: list[str] = []
        self._lock = threading.Lock()

    def push_range(self, msg, color=None, domain=None):
        with self._lock:
            self.ranges.append(msg)

    def pop_range(self, domain=None):
        pass


def test_nvtx_ranges_name_phase_and_request():
    fake = FakeNvtx()
    tracing.set_enabled(True, nvtx_module=fake)
    shm, dshm = alloc_shm_caches(SPEC, 64, 1), alloc_shm_caches(SPEC, 64, 1)
    engines = []
    try:
        pp = StagedPipeline(buffer_bytes=16 * SPEC.bytes_per_token())
        p = TransferEngine(SPEC, shm.caches, 0, 1, "P", pipeline=pp).start()
        d_ipc = TransferEngine(SPEC, dshm.caches, 0, 1, "Di", transport="ipc").start()
        dc = [torch.zeros(SPEC.cache_shape(64, 1), dtype=SPEC.dtype) for _ in range(2)]
        d_pg = TransferEngine(SPEC, dc, 0, 1, "Dp", transport="pg", pipeline=StagedPipeline(16 * 512)).start()
        engines = [d_ipc, d_pg, p]
        d_ipc.load("i1", p.export("i1", [1, 2], 10), [3, 4])
        d_pg.load("g1", p.export("g1", list(range(10, 15)), 40), list(range(5)))
        assert _wait(d_ipc, {"i1"}) == {"i1": "done"} and _wait(d_pg, {"g1"}) == {"g1": "done"}
        names = set(fake.ranges)
        for want in ("kvxfer.handshake P", "kvxfer.copy i1", "kvxfer.gather g1", "kvxfer.send g1",
                     "kvxfer.recv g1", "kvxfer.scatter g1"):  # fmt: skip
            assert want in names, (want, sorted(names))
        assert sum(r == "kvxfer.send g1" for r in fake.ranges) >= 3  # one per chunk
    finally:
        tracing.set_enabled(None)
        tracing._state["nvtx"] = None
        for e in engines:
            e.close()
        shm.close()
        dshm.close()
