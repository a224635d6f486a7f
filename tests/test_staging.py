"""Staging pool, chunk planner and the double-buffered pipeline (CPU; real Gloo between 2 processes)."""

from __future__ import annotations

import itertools
import math
import multiprocessing as mp
import queue
import random
import threading
import time
import traceback
from datetime import timedelta

import pytest
import torch

from kvxfer.spec import KVCacheSpec, Layout
from kvxfer.staging import (
    Chunk,
    StagingPool,
    host_fences,
    ops_gatherer,
    ops_scatterer,
    pipelined_recv,
    pipelined_send,
    plan_chunks,
    wire_viewer,
)

POISON = 0xA5
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# --------------------------------------------------------------------------- payloads
def make_cache(spec: KVCacheSpec, num_blocks: int, heads_local: int, rank: int, device="cpu") -> list:
    """Per-layer caches whose bytes encode (rank, layer, kv, block, token offset, head, byte)."""
    es = spec.element_size
    shape = spec.local_cache_shape(num_blocks, heads_local)
    out = []
    for layer in range(spec.num_layers):
        idx = [torch.arange(n, dtype=torch.int64) for n in (*shape[:-1], shape[-1] * es)]
        if spec.use_mla:
            blk, tok, byte = idx
            code = blk.view(-1, 1, 1) * 13 + tok.view(1, -1, 1) * 3 + byte.view(1, 1, -1)
        elif spec.layout is Layout.NHD:
            kv, blk, tok, head, byte = idx
            code = (
                kv.view(-1, 1, 1, 1, 1) * 101
                + blk.view(1, -1, 1, 1, 1) * 13
                + tok.view(1, 1, -1, 1, 1) * 3
                + head.view(1, 1, 1, -1, 1) * 7
                + byte.view(1, 1, 1, 1, -1)
            )
        else:
            kv, blk, head, tok, byte = idx
            code = (
                kv.view(-1, 1, 1, 1, 1) * 101
                + blk.view(1, -1, 1, 1, 1) * 13
                + tok.view(1, 1, 1, -1, 1) * 3
                + head.view(1, 1, -1, 1, 1) * 7
                + byte.view(1, 1, 1, 1, -1)
            )
        code = (code + rank * 37 + layer * 29) % 251
        out.append(code.to(torch.uint8).view(spec.dtype).to(device))
    return out


def poisoned(spec: KVCacheSpec, num_blocks: int, heads_local: int, device="cpu") -> list:
    shape = spec.local_cache_shape(num_blocks, heads_local)
    nbytes_last = shape[-1] * spec.element_size
    return [
        torch.full((*shape[:-1], nbytes_last), POISON, dtype=torch.uint8).view(spec.dtype).to(device)
        for _ in range(spec.num_layers)
    ]


def as_tokens(cache: torch.Tensor, spec: KVCacheSpec) -> torch.Tensor:
    """[kv, blocks, bs, heads, bytes] uint8 view of one layer, whatever the layout (MLA: kv=heads=1)."""
    u = cache.view(torch.uint8) if cache.element_size() == 1 else cache.contiguous().view(torch.uint8)
    if spec.use_mla:
        return u.unsqueeze(0).unsqueeze(3)
    return u if spec.layout is Layout.NHD else u.transpose(2, 3)


def expected_dst(src, src_spec, src_ids, dst, dst_spec, dst_ids, num_tokens, src_h0, dst_h0, num_heads):
    """Independent oracle (plain advanced indexing, not kvxfer.ops): dst with the request copied in."""
    out = [c.clone() for c in dst]
    t = torch.arange(num_tokens)
    sb, so = torch.as_tensor(src_ids)[t // src_spec.block_size], t % src_spec.block_size
    db, do = torch.as_tensor(dst_ids)[t // dst_spec.block_size], t % dst_spec.block_size
    for layer in range(src_spec.num_layers):
        s, d = as_tokens(src[layer], src_spec), as_tokens(out[layer], dst_spec)
        rows = s[:, sb, so][:, :, src_h0 : src_h0 + num_heads]
        if dst_spec.use_mla:
            out[layer][db, do] = rows[0, :, 0].view(dst_spec.dtype)
        elif dst_spec.layout is Layout.NHD:
            out[layer].view(torch.uint8)[:, db, do, dst_h0 : dst_h0 + num_heads] = rows
        else:
            ou = out[layer].view(torch.uint8)
            ou.transpose(2, 3)[:, db, do, dst_h0 : dst_h0 + num_heads] = rows
        del d
    return out


def bytes_equal(a: list, b: list) -> bool:
    return all(torch.equal(x.cpu().view(torch.uint8), y.cpu().view(torch.uint8)) for x, y in zip(a, b))


# --------------------------------------------------------------------------- chunk planner
def test_plan_mixed_block_sizes_partial_last():
    # 16 (P) vs 32 (D): unit 32; 100 tokens fit a buffer -> chunks of 96.
    plan = plan_chunks(250, 16, 32, bytes_per_token=10, buffer_bytes=1000)
    assert plan.chunk_tokens == 96 and len(plan) == 3
    c = list(plan)
    assert c[1] == Chunk(1, 96, 96, 6, 6, 3, 3)
    assert c[2] == Chunk(2, 192, 58, 12, 4, 6, 2)  # 58 tokens: 4 blocks of 16, 2 of 32 (partial)
    assert plan[-1] == c[2]
    with pytest.raises(IndexError):
        plan[3]


@pytest.mark.parametrize("seed", range(40))
def test_plan_tiles_request(seed):
    rng = random.Random(seed)
    sbs, dbs = rng.choice([1, 5, 12, 16, 32, 48]), rng.choice([3, 16, 20, 32, 64])
    unit = math.lcm(sbs, dbs)
    bpt = rng.randint(1, 50)
    buf = rng.randint(unit * bpt, 6 * unit * bpt)
    T = rng.randint(0, 2000)
    plan = plan_chunks(T, sbs, dbs, bpt, buf)
    src_blocks, dst_blocks, t = [], [], 0
    for i, ch in enumerate(plan):
        assert ch.index == i and ch.token_start == t and ch.num_tokens > 0
        assert ch.num_tokens * bpt <= buf
        if i < len(plan) - 1:
            assert ch.num_tokens % unit == 0
        src_blocks += list(ch.src_blocks(list(range(10_000))))
        dst_blocks += list(ch.dst_blocks(list(range(10_000))))
        t += ch.num_tokens
    assert t == T
    assert src_blocks == list(range(-(-T // sbs))) and dst_blocks == list(range(-(-T // dbs)))
    assert plan.max_chunk_bytes <= buf


def test_plan_small_request_single_chunk_and_errors():
    # 5 tokens fit even though a full lcm unit (96) would not: one (last) chunk.
    plan = plan_chunks(5, 12, 32, bytes_per_token=100, buffer_bytes=600)
    assert [(c.token_start, c.num_tokens, c.src_num_blocks, c.dst_num_blocks) for c in plan] == [(0, 5, 1, 1)]
    assert len(plan_chunks(0, 16, 16, 8, 64)) == 0
    with pytest.raises(ValueError, match=r"lcm\(12, 32\) = 96"):
        plan_chunks(500, 12, 32, bytes_per_token=100, buffer_bytes=600)
    with pytest.raises(ValueError, match="max_chunk_tokens"):
        plan_chunks(500, 16, 16, bytes_per_token=1, buffer_bytes=10_000, max_chunk_tokens=8)
    assert (
        plan_chunks(500, 16, 16, bytes_per_token=1, buffer_bytes=10_000, max_chunk_tokens=40).chunk_tokens
        == 32
    )
    for bad in (
        dict(num_tokens=-1),
        dict(src_block_size=0),
        dict(bytes_per_token=True),
        dict(buffer_bytes=1.5),
    ):
        kw = (
            dict(num_tokens=10, src_block_size=16, dst_block_size=16, bytes_per_token=4, buffer_bytes=64)
            | bad
        )
        with pytest.raises(ValueError, match=next(iter(bad))):
            plan_chunks(**kw)


# --------------------------------------------------------------------------- pool
def test_pool_one_allocation_reused():
    pool = StagingPool(4, 1000)
    ptrs = [b.data_ptr() for b in pool.buffers]
    assert all(p % 256 == 0 for p in ptrs)
    assert all(b.numel() == 1000 and b.dtype == torch.uint8 for b in pool.buffers)
    base = pool._storage.data_ptr()
    end = base + pool._storage.numel()
    assert all(base <= p and p + 1000 <= end for p in ptrs)
    assert sorted(ptrs) == ptrs and all(b - a >= 1000 for a, b in itertools.pairwise(ptrs))  # disjoint
    seen = set()
    for _ in range(5):
        with pool.lease(2) as slots:
            seen |= {s.data_ptr() for s in slots}
            assert pool.num_free == 2
    assert seen <= set(ptrs) and pool.num_free == 4 and pool.num_leases == 5


def test_pool_bounded_wait_and_errors():
    pool = StagingPool(3, 64)
    held = pool.acquire(2)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="not free within"):
        pool.acquire(2, timeout_s=0.2)
    assert time.monotonic() - t0 < 5
    # all-or-none: a waiter gets both buffers once they are released from another thread
    threading.Timer(0.1, pool.release, args=(held,)).start()
    got = pool.acquire(3, timeout_s=10)
    assert sorted(got) == [0, 1, 2]
    pool.release(got)
    with pytest.raises(ValueError, match="not leased"):
        pool.release([0])
    with pytest.raises(ValueError, match="pool of 3"):
        pool.acquire(4)
    with pytest.raises(ValueError, match="num_buffers"):
        StagingPool(0, 64)
    with pytest.raises(ValueError, match="pin_memory"):
        StagingPool(2, 64, device="meta", pin_memory=True)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA"):
            StagingPool(2, 64, pin_memory=True)


def test_wire_viewer_checks_size():
    spec = KVCacheSpec(2, 4, 8, 16, torch.bfloat16)
    view = wire_viewer(spec, num_heads=2)
    plan = plan_chunks(40, 16, 16, spec.bytes_per_token(2), 2048)
    buf = torch.empty(2048, dtype=torch.uint8)
    w = view(plan[0], buf)
    assert w.shape == (2, 2, 2, plan[0].num_tokens, 8) and w.dtype == torch.bfloat16 and w.is_contiguous()
    assert w.data_ptr() == buf.data_ptr()
    with pytest.raises(ValueError, match=r"needs \d+ bytes"):
        view(plan[0], buf[:100])


# --------------------------------------------------------------------------- pipeline ordering (fakes)
class FakeWork:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait(self):
        self.log.append(("wait", self.name))


class FakeFence:
    def __init__(self, log, s):
        self.log, self.s = log, s

    def record(self):
        self.log.append(("record", self.s))

    def wait(self):
        self.log.append(("fence", self.s))


def _plan4():
    return plan_chunks(64, 16, 16, bytes_per_token=1, buffer_bytes=16)


def test_send_overlaps_gather_with_previous_send():
    log = []
    slots = [torch.zeros(16, dtype=torch.uint8) for _ in range(2)]
    n = pipelined_send(
        _plan4(),
        slots,
        lambda c, s: s[: c.num_tokens],
        lambda c, b: log.append(("gather", c.index, b.data_ptr())),
        lambda c, b: (log.append(("send", c.index, b.data_ptr())), FakeWork(log, c.index))[1],
    )
    assert n == 4
    p = [s.data_ptr() for s in slots]
    assert log == [
        ("gather", 0, p[0]),
        ("send", 0, p[0]),
        ("gather", 1, p[1]),
        ("send", 1, p[1]),  # gather 1 while send 0 is in flight
        ("wait", 0),
        ("gather", 2, p[0]),
        ("send", 2, p[0]),  # slot 0 reused only after send 0
        ("wait", 1),
        ("gather", 3, p[1]),
        ("send", 3, p[1]),
        ("wait", 2),
        ("wait", 3),
    ]


def test_recv_posts_ahead_and_reuses_after_scatter():
    log = []
    slots = [torch.zeros(16, dtype=torch.uint8) for _ in range(2)]
    fences = [FakeFence(log, s) for s in range(2)]
    pipelined_recv(
        _plan4(),
        slots,
        lambda c, s: s[: c.num_tokens],
        lambda c, b: (log.append(("recv", c.index)), FakeWork(log, c.index))[1],
        lambda c, b: log.append(("scatter", c.index)),
        fences,
    )
    assert log == [
        ("fence", 0),
        ("recv", 0),
        ("fence", 1),
        ("recv", 1),
        ("wait", 0),
        ("scatter", 0),
        ("record", 0),
        ("fence", 0),
        ("recv", 2),
        ("wait", 1),
        ("scatter", 1),
        ("record", 1),
        ("fence", 1),
        ("recv", 3),
        ("wait", 2),
        ("scatter", 2),
        ("record", 0),
        ("wait", 3),
        ("scatter", 3),
        ("record", 1),
    ]


def test_send_fence_before_transport_and_drain_on_error():
    log = []
    slots = [torch.zeros(16, dtype=torch.uint8) for _ in range(2)]

    def gather(c, b):
        if c.index == 2:
            raise RuntimeError("gather failed")
        log.append(("gather", c.index))

    with pytest.raises(RuntimeError, match="gather failed"):
        pipelined_send(
            _plan4(),
            slots,
            lambda c, s: s[: c.num_tokens],
            gather,
            lambda c, b: (log.append(("send", c.index)), FakeWork(log, c.index))[1],
            [FakeFence(log, s) for s in range(2)],
        )
    assert log == [
        ("gather", 0),
        ("record", 0),
        ("fence", 0),
        ("send", 0),
        ("gather", 1),
        ("record", 1),
        ("fence", 1),
        ("send", 1),
        ("wait", 0),
        ("wait", 1),  # the failed chunk's slot was freed, the other send drained
    ]


def test_pipeline_argument_errors():
    plan = _plan4()
    one = [torch.zeros(16, dtype=torch.uint8)]
    with pytest.raises(ValueError, match="at least 2"):
        pipelined_send(plan, one, None, None, None)
    small = [torch.zeros(8, dtype=torch.uint8)] * 2
    with pytest.raises(ValueError, match="smallest buffer has 8"):
        pipelined_recv(plan, small, None, None, None)
    with pytest.raises(ValueError, match="one per slot"):
        pipelined_send(plan, one * 2, None, None, None, fences=[FakeFence([], 0)])
    assert host_fences(2, "cpu", "cpu") is None


# --------------------------------------------------------------------------- end to end (threads)
CASES = [
    # (src spec kwargs, src tp, src rank, dst spec kwargs, dst tp, dst rank, T, max_chunk_tokens)
    (dict(layout="NHD", block_size=16), 1, 0, dict(layout="HND", block_size=32), 2, 1, 150, 64),
    (dict(layout="HND", block_size=12), 2, 0, dict(layout="NHD", block_size=20), 1, 0, 133, 60),
    (dict(layout="NHD", block_size=16), 4, 3, dict(layout="NHD", block_size=16), 4, 3, 40, 16),
]


def _spec(kw, dtype=torch.bfloat16, heads=4, head_dim=72, layers=3, mla=False):
    return KVCacheSpec(
        layers, 1 if mla else heads, head_dim, kw["block_size"], dtype, Layout(kw["layout"]), use_mla=mla
    )


def _setup(case, dtype, mla=False, seed=0):
    from kvxfer.plan import plan_reads

    skw, stp, srank, dkw, dtp, drank, T, cap = case
    sspec, dspec = _spec(skw, dtype, mla=mla), _spec(dkw, dtype, mla=mla)
    read = next(r for r in plan_reads(sspec, stp, dspec, dtp).reads(drank) if r.src_rank == srank)
    g = torch.Generator().manual_seed(seed)
    nsb, ndb = sspec.num_blocks_for(T) + 3, dspec.num_blocks_for(T) + 3
    sids = torch.randperm(nsb, generator=g)[: sspec.num_blocks_for(T)]
    dids = torch.randperm(ndb, generator=g)[: dspec.num_blocks_for(T)]
    src = make_cache(sspec, nsb, sspec.heads_per_rank(stp), srank)
    dst = poisoned(dspec, ndb, dspec.heads_per_rank(dtp))
    plan = plan_chunks(
        T,
        sspec.block_size,
        dspec.block_size,
        sspec.bytes_per_token(read.num_heads),
        buffer_bytes=1 << 20,
        max_chunk_tokens=cap,
    )
    want = expected_dst(
        src, sspec, sids, dst, dspec, dids, T, read.src_head_start, read.dst_head_start, read.num_heads
    )
    return sspec, dspec, read, sids, dids, src, dst, plan, want


class QueueWork:
    def __init__(self, q, buf):
        self.q, self.buf = q, buf

    def wait(self):
        self.buf.copy_(self.q.get(timeout=30))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_pipeline_threads_byte_exact(case, dtype):
    sspec, dspec, read, sids, dids, src, dst, plan, want = _setup(CASES[case], dtype)
    assert len(plan) >= 2 or CASES[case][6] <= CASES[case][7]
    q: queue.Queue = queue.Queue()
    pool_s, pool_d = StagingPool(2, plan.max_chunk_bytes), StagingPool(3, plan.max_chunk_bytes)
    sender = threading.Thread(
        target=lambda: pipelined_send(
            plan,
            pool_s.buffers,
            wire_viewer(sspec, read.num_heads),
            ops_gatherer(src, sspec, sids, read.src_head_start, read.num_heads, backend="torch"),
            lambda c, b: q.put(b.clone()),
        )
    )
    sender.start()
    n = pipelined_recv(
        plan,
        pool_d.buffers,
        wire_viewer(dspec, read.num_heads),
        lambda c, b: QueueWork(q, b),
        ops_scatterer(dst, dspec, dids, read.dst_head_start, backend="torch"),
    )
    sender.join(30)
    assert not sender.is_alive() and n == len(plan)
    assert not bytes_equal(
        dst, poisoned(dspec, dst[0].shape[1], dst[0].shape[3 if dspec.layout is Layout.NHD else 2])
    )
    assert bytes_equal(dst, want)


def test_pipeline_threads_mla():
    case = (dict(layout="NHD", block_size=16), 2, 0, dict(layout="NHD", block_size=24), 1, 0, 100, 48)
    sspec, dspec, _read, sids, dids, src, dst, plan, want = _setup(case, torch.float16, mla=True)
    assert len(plan) == 3
    q: queue.Queue = queue.Queue()
    slots = StagingPool(2, plan.max_chunk_bytes).buffers
    pipelined_send(
        plan,
        slots,
        wire_viewer(sspec),
        ops_gatherer(src, sspec, sids, backend="torch"),
        lambda c, b: q.put(b.clone()),
    )
    pipelined_recv(
        plan,
        StagingPool(2, plan.max_chunk_bytes).buffers,
        wire_viewer(dspec),
        lambda c, b: QueueWork(q, b),
        ops_scatterer(dst, dspec, dids, backend="torch"),
    )
    assert bytes_equal(dst, want)


# --------------------------------------------------------------------------- real Gloo, 2 processes
def _gloo_worker(rank: int, port: int, errq) -> None:
    try:
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=30))
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        opts._timeout = timedelta(seconds=30)
        pg = dist.ProcessGroupGloo(dist.PrefixStore("pair", store), rank, 2, opts)
        peer = 1 - rank
        for ci, (case, dtype, depth) in enumerate(
            [(CASES[0], torch.bfloat16, 2), (CASES[1], torch.float8_e5m2, 3), (CASES[2], torch.float16, 2)]
        ):
            sspec, dspec, read, sids, dids, src, dst, plan, want = _setup(case, dtype, seed=ci)
            tag = 1000 * (ci + 1)
            if rank == 0:
                pool = StagingPool(depth, plan.max_chunk_bytes)
                with pool.lease(depth) as slots:
                    n = pipelined_send(
                        plan,
                        slots,
                        wire_viewer(sspec, read.num_heads),
                        ops_gatherer(src, sspec, sids, read.src_head_start, read.num_heads, backend="torch"),
                        lambda c, b, tag=tag: pg.send([b.view(torch.uint8).view(-1)], peer, tag + c.index),
                    )
            else:
                pool = StagingPool(depth, plan.max_chunk_bytes)
                with pool.lease(depth) as slots:
                    n = pipelined_recv(
                        plan,
                        slots,
                        wire_viewer(dspec, read.num_heads),
                        lambda c, b, tag=tag: pg.recv([b.view(torch.uint8).view(-1)], peer, tag + c.index),
                        ops_scatterer(dst, dspec, dids, read.dst_head_start, backend="torch"),
                    )
                if not bytes_equal(dst, want):
                    raise AssertionError(f"case {ci}: destination cache differs from the oracle")
            if n != len(plan) or len(plan) < 2:
                raise AssertionError(f"case {ci}: {n} chunks moved, plan has {len(plan)}")
        errq.put((rank, None))
    except BaseException:
        errq.put((rank, traceback.format_exc()))


def test_pipeline_over_gloo_two_processes():
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    ctx = mp.get_context("spawn")
    errq = ctx.Queue()
    procs = [ctx.Process(target=_gloo_worker, args=(r, store.port, errq), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 120
    results = {}
    try:
        while len(results) < 2 and time.monotonic() < deadline:
            try:
                rank, err = errq.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            results[rank] = err
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    assert len(results) == 2, f"workers did not report within the deadline: {results}"
    for rank, err in sorted(results.items()):
        assert err is None, f"rank {rank} failed:\n{err}"


# --------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("pinned", [True, False])
def test_gpu_staging_byte_exact(pinned):
    """CUDA caches through pinned-host (with host fences) or device staging buffers."""
    sspec, dspec, read, sids, dids, src, dst, plan, want = _setup(CASES[0], torch.bfloat16)
    src = [c.cuda() for c in src]
    dst = [c.cuda() for c in dst]
    dev = "cpu" if pinned else "cuda"
    pool_s = StagingPool(2, plan.max_chunk_bytes, device=dev, pin_memory=pinned)
    pool_d = StagingPool(2, plan.max_chunk_bytes, device=dev, pin_memory=pinned)
    assert all(b.is_pinned() for b in pool_s.buffers) == pinned
    q: queue.Queue = queue.Queue()
    sender = threading.Thread(
        target=lambda: pipelined_send(
            plan,
            pool_s.buffers,
            wire_viewer(sspec, read.num_heads),
            ops_gatherer(src, sspec, sids, read.src_head_start, read.num_heads),
            lambda c, b: q.put(b.clone()),
            host_fences(2, dev, "cuda"),
        )
    )
    sender.start()
    pipelined_recv(
        plan,
        pool_d.buffers,
        wire_viewer(dspec, read.num_heads),
        lambda c, b: QueueWork(q, b),
        ops_scatterer(dst, dspec, dids, read.dst_head_start),
        host_fences(2, dev, "cuda"),
    )
    sender.join(30)
    torch.cuda.synchronize()
    assert bytes_equal(dst, want)


def test_pool_holds_buffers_of_unfinished_gpu_work_after_release():
    """A stream that failed while GPU work on its buffers may still run: released buffers
    return to the pool only once that work's event completed, and acquire waits (bounded)."""

    class Ev:
        done = False

        def query(self):
            return self.done

    pool = StagingPool(2, 64)
    ev = Ev()
    with pool.lease(2) as slots:
        pool.hold_until(slots[:1], ev)
    assert pool.num_free == 1
    with pytest.raises(TimeoutError, match="1 held by GPU work"):
        pool.acquire(2, timeout_s=0.05)
    ev.done = True
    assert sorted(pool.acquire(2, timeout_s=1.0)) == [0, 1]
