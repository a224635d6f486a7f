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

from kvxfer import ops
from kvxfer.engine_types import describe_error
from kvxfer.spec import KVCacheSpec, Layout
from kvxfer.transports.pg.pipeline import StagedPipeline
from kvxfer.transports.staging import (
    Chunk,
    StagingPool,
    chunk_tokens_for,
    cut,
    pipelined_recv,
    pipelined_send,
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


def expected_dst(
    src,
    src_spec,
    src_ids,
    dst,
    dst_spec,
    dst_ids,
    num_tokens,
    src_h0,
    dst_h0,
    num_heads,
    start=0,
    layers=None,
):
    """Independent oracle (plain advanced indexing, not kvxfer.ops): dst with tokens
    ``[start, num_tokens)`` of the request copied in (the layers ``layers``, default all)."""
    out = [c.clone() for c in dst]
    t = torch.arange(start, num_tokens)
    sb, so = torch.as_tensor(src_ids)[t // src_spec.block_size], t % src_spec.block_size
    db, do = torch.as_tensor(dst_ids)[t // dst_spec.block_size], t % dst_spec.block_size
    for layer in range(src_spec.num_layers) if layers is None else layers:
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
def test_chunk_tokens_agree_on_both_units():
    # 16 (P) vs 32 (D): unit 32; 100 tokens fit a buffer -> chunks of 96.
    assert chunk_tokens_for(1000, 10, 16, 32) == 96
    assert chunk_tokens_for(10_000, 1, 16, 16, max_chunk_tokens=40) == 32
    with pytest.raises(ValueError, match=r"lcm\(12, 32\) = 96"):
        chunk_tokens_for(600, 100, 12, 32)
    with pytest.raises(ValueError, match="lcm"):
        chunk_tokens_for(10_000, 1, 16, 16, max_chunk_tokens=8)
    for bad in (dict(buffer_bytes=1.5), dict(bytes_per_token=True), dict(max_chunk_tokens=0)):
        kw = dict(buffer_bytes=64, bytes_per_token=4, src_unit=16, dst_unit=16) | bad
        with pytest.raises(ValueError, match=next(iter(bad))):
            chunk_tokens_for(**kw)


def test_cut_mixed_block_sizes_partial_last():
    """Both ends cut the same tokens: 250 tokens, chunks of 96 over blocks of 16 (P) and 32 (D)."""
    src = cut([(list(range(100, 116)), 250)], 96, 16)
    dst = cut([(list(range(200, 208)), 250)], 96, 32)
    assert [(c.index, c.num_tokens) for c in src] == [(0, 96), (1, 96), (2, 58)]
    assert [(c.index, c.num_tokens) for c in dst] == [(0, 96), (1, 96), (2, 58)]
    assert src[1].units == list(range(106, 112)) and src[2].units == list(range(112, 116))
    assert dst[2] == Chunk(2, [206, 207], 58, 0, 32)  # 58 tokens: 2 blocks of 32, the last partial
    t = torch.arange(1000, 1016)
    views = cut([(t, 250)], 96, 16)
    assert views[1].units.data_ptr() == t[6:].data_ptr()  # tensor slices are views


@pytest.mark.parametrize("seed", range(40))
def test_cut_tiles_calls(seed):
    rng = random.Random(seed)
    sbs, dbs = rng.choice([1, 5, 12, 16, 32, 48]), rng.choice([3, 16, 20, 32, 64])
    bpt = rng.randint(1, 50)
    unit = math.lcm(sbs, dbs)
    buf = rng.randint(unit * bpt, 6 * unit * bpt)
    chunk = chunk_tokens_for(buf, bpt, sbs, dbs)
    assert chunk % unit == 0 and chunk * bpt <= buf
    lens = [rng.randint(0, 700) for _ in range(rng.randint(1, 3))]
    for bs in (sbs, dbs):
        calls, base = [], 0
        for n in lens:
            nb = -(-n // bs)
            calls.append((list(range(base, base + nb)), n))
            base += nb
        got = cut(calls, chunk, bs)
        assert [c.index for c in got] == list(range(len(got)))
        assert sum(c.num_tokens for c in got) == sum(lens)
        assert [u for c in got for u in c.units] == list(range(base))
        assert all(0 < c.num_tokens <= chunk and len(c.units) == -(-c.num_tokens // bs) for c in got)
    with pytest.raises(ValueError, match="not a multiple of the unit"):
        cut([([0], 5)], 10, 4)


def test_cut_calls_in_units_of_their_own():
    """A batch's block call, then its tails as token slots (a call unit of 1): each chunk keeps
    its call's unit, both ends cut at the same tokens; a call unit the chunk cannot hold is
    refused, naming it."""
    calls = [(list(range(10)), 150, 0), (list(range(500, 520)), 20, 0, 1)]
    got = cut(calls, 64, 16)
    assert [(c.num_tokens, c.unit) for c in got] == [(64, 16), (64, 16), (22, 16), (20, 1)]
    assert got[2].units == [8, 9] and got[3].units == list(range(500, 520))
    dst = cut([(list(range(5)), 150, 0), (list(range(700, 720)), 20, 0, 1)], 64, 32)
    assert [(c.index, c.num_tokens) for c in dst] == [(c.index, c.num_tokens) for c in got]
    assert [c.unit for c in dst] == [32, 32, 32, 1]
    with pytest.raises(ValueError, match="not a multiple of the unit 48"):
        cut([([0], 5, 0, 48)], 64, 16)


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


def test_wire_view_checks_size():
    spec = KVCacheSpec(2, 4, 8, 16, torch.bfloat16)
    view = wire_viewer(spec, num_heads=2)
    c = cut([(list(range(3)), 40)], 32, 16)[0]
    buf = torch.empty(4096, dtype=torch.uint8)
    w = view(c, buf)
    assert w.shape == (2, 2, 2, 32, 8) and w.dtype == torch.bfloat16 and w.is_contiguous()
    assert w.data_ptr() == buf.data_ptr()
    with pytest.raises(ValueError, match=r"needs \d+ bytes"):
        view(c, buf[:100])


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
    return cut([(list(range(4)), 64)], 16, 16)


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


class FailingWork:
    """A posted send/receive whose wait fails (the peer gave up: a transport timeout)."""

    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait(self):
        self.log.append(("wait", self.name))
        raise RuntimeError(f"timeout waiting for chunk {self.name}")


def test_recv_reports_the_scatter_fault_not_the_timeout_that_followed():
    """A scatter that fails (a CUDA fault on a GPU) makes the peer give up, so the receives
    still posted fail too while the pipeline drains: the scatter's error is raised, the
    drain's failures ride along as notes, and every posted receive is still waited."""
    log = []
    slots = [torch.zeros(16, dtype=torch.uint8) for _ in range(2)]

    def recv(c, b):
        log.append(("recv", c.index))
        return FakeWork(log, c.index) if c.index == 0 else FailingWork(log, c.index)

    def scatter(c, b):
        raise RuntimeError(f"illegal address in the scatter of chunk {c.index}")

    with pytest.raises(RuntimeError, match="illegal address in the scatter of chunk 0") as err:
        pipelined_recv(_plan4(), slots, lambda c, s: s[: c.num_tokens], recv, scatter)
    assert any("timeout waiting for chunk 1" in n for n in err.value.__notes__)
    assert log == [("recv", 0), ("recv", 1), ("wait", 0), ("wait", 1)]
    # the reason a failed load reports names both, the cause first
    why = describe_error(err.value)
    assert why.startswith("RuntimeError: illegal address in the scatter of chunk 0; ")
    assert why.endswith("RuntimeError: timeout waiting for chunk 1")


def test_send_reports_the_gather_fault_and_a_clean_drain_failure_is_raised():
    log = []
    slots = [torch.zeros(16, dtype=torch.uint8) for _ in range(2)]

    def gather(c, b):
        if c.index == 1:
            raise RuntimeError("illegal address in the gather of chunk 1")

    def send(c, b):
        return FailingWork(log, c.index)

    with pytest.raises(RuntimeError, match="gather of chunk 1") as err:
        pipelined_send(_plan4(), slots, lambda c, s: s[: c.num_tokens], gather, send)
    assert any("timeout waiting for chunk 0" in n for n in err.value.__notes__)
    # no other error: the first failing wait is raised once every posted send was waited
    log.clear()
    with pytest.raises(RuntimeError, match="timeout waiting for chunk 2") as err:
        pipelined_send(
            _plan4()[:4],
            slots,
            lambda c, s: s[: c.num_tokens],
            lambda c, b: None,
            lambda c, b: FakeWork(log, c.index) if c.index < 2 else FailingWork(log, c.index),
        )
    assert log == [("wait", 0), ("wait", 1), ("wait", 2), ("wait", 3)]
    assert any("timeout waiting for chunk 3" in n for n in err.value.__notes__)


def test_pipeline_argument_errors():
    plan = _plan4()
    one = [torch.zeros(16, dtype=torch.uint8)]
    with pytest.raises(ValueError, match="at least 2"):
        pipelined_send(plan, one, None, None, None)
    with pytest.raises(ValueError, match="one per slot"):
        pipelined_send(plan, one * 2, None, None, None, fences=[FakeFence([], 0)])
    assert StagedPipeline()._fences(StagingPool(2, 64), torch.device("cpu"), 1.0) is None


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
    bpt = sspec.bytes_per_token(read.num_heads)
    chunk = chunk_tokens_for(1 << 20, bpt, sspec.block_size, dspec.block_size, cap)
    src_chunks = cut([(sids, T)], chunk, sspec.block_size)
    dst_chunks = cut([(dids, T)], chunk, dspec.block_size)
    want = expected_dst(
        src, sspec, sids, dst, dspec, dids, T, read.src_head_start, read.dst_head_start, read.num_heads
    )
    return sspec, dspec, read, src_chunks, dst_chunks, src, dst, chunk * bpt, want


def _gatherer(src, spec, read=None):
    h0, nh = (read.src_head_start, read.num_heads) if read is not None else (0, None)

    def gather(c, buf):
        ops.gather_blocks(src, spec, c.units, c.num_tokens, h0, nh, out=buf, backend="torch")

    return gather


def _scatterer(dst, spec, read=None):
    h0 = read.dst_head_start if read is not None else 0

    def scatter(c, buf):
        ops.scatter_blocks(buf, dst, spec, c.units, c.num_tokens, h0, backend="torch")

    return scatter


class QueueWork:
    """The receive side of an in-process "transport": the next chunk the sender queued, or the
    sender's exception (so a failed sender fails the receiver at once, not after 30 s)."""

    def __init__(self, q, buf):
        self.q, self.buf = q, buf

    def wait(self):
        item = self.q.get(timeout=30)
        if isinstance(item, BaseException):
            raise RuntimeError("the sender thread failed") from item
        self.buf.copy_(item)


def _sending_thread(q: queue.Queue, send) -> threading.Thread:
    """A thread running ``send()``; an exception it raises is queued for the receiver."""

    def run():
        try:
            send()
        except BaseException as exc:
            q.put(exc)
            raise

    return threading.Thread(target=run, name="test-sender")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_pipeline_threads_byte_exact(case, dtype):
    sspec, dspec, read, schunks, dchunks, src, dst, max_bytes, want = _setup(CASES[case], dtype)
    assert len(schunks) >= 2 or CASES[case][6] <= CASES[case][7]
    q: queue.Queue = queue.Queue()
    pool_s, pool_d = StagingPool(2, max_bytes), StagingPool(3, max_bytes)
    sender = _sending_thread(
        q,
        lambda: pipelined_send(
            schunks,
            pool_s.buffers,
            wire_viewer(sspec, read.num_heads),
            _gatherer(src, sspec, read),
            lambda c, b: q.put(b.clone()),
        ),
    )
    sender.start()
    n = pipelined_recv(
        dchunks,
        pool_d.buffers,
        wire_viewer(dspec, read.num_heads),
        lambda c, b: QueueWork(q, b),
        _scatterer(dst, dspec, read),
    )
    sender.join(30)
    assert not sender.is_alive() and n == len(dchunks) == len(schunks)
    assert not bytes_equal(
        dst, poisoned(dspec, dst[0].shape[1], dst[0].shape[3 if dspec.layout is Layout.NHD else 2])
    )
    assert bytes_equal(dst, want)


def test_pipeline_threads_mla():
    case = (dict(layout="NHD", block_size=16), 2, 0, dict(layout="NHD", block_size=24), 1, 0, 100, 48)
    sspec, dspec, _read, schunks, dchunks, src, dst, max_bytes, want = _setup(case, torch.float16, mla=True)
    assert len(schunks) == 3
    q: queue.Queue = queue.Queue()
    pipelined_send(
        schunks,
        StagingPool(2, max_bytes).buffers,
        wire_viewer(sspec, 1),
        _gatherer(src, sspec),
        lambda c, b: q.put(b.clone()),
    )
    pipelined_recv(
        dchunks,
        StagingPool(2, max_bytes).buffers,
        wire_viewer(dspec, 1),
        lambda c, b: QueueWork(q, b),
        _scatterer(dst, dspec),
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
            sspec, dspec, read, schunks, dchunks, src, dst, max_bytes, want = _setup(case, dtype, seed=ci)
            tag = 1000 * (ci + 1)
            pool = StagingPool(depth, max_bytes)
            if rank == 0:
                with pool.lease(depth) as slots:
                    n = pipelined_send(
                        schunks,
                        slots,
                        wire_viewer(sspec, read.num_heads),
                        _gatherer(src, sspec, read),
                        lambda c, b, tag=tag: pg.send([b.view(torch.uint8).view(-1)], peer, tag + c.index),
                    )
            else:
                with pool.lease(depth) as slots:
                    n = pipelined_recv(
                        dchunks,
                        slots,
                        wire_viewer(dspec, read.num_heads),
                        lambda c, b, tag=tag: pg.recv([b.view(torch.uint8).view(-1)], peer, tag + c.index),
                        _scatterer(dst, dspec, read),
                    )
                if not bytes_equal(dst, want):
                    raise AssertionError(f"case {ci}: destination cache differs from the oracle")
            if n != len(schunks) or len(schunks) < 2:
                raise AssertionError(f"case {ci}: {n} chunks moved, the cut has {len(schunks)}")
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
    sspec, dspec, read, schunks, dchunks, src, dst, max_bytes, want = _setup(CASES[0], torch.bfloat16)
    src = [c.cuda() for c in src]
    dst = [c.cuda() for c in dst]
    dev = "cpu" if pinned else "cuda"
    pool_s = StagingPool(2, max_bytes, device=dev, pin_memory=pinned)
    pool_d = StagingPool(2, max_bytes, device=dev, pin_memory=pinned)
    assert all(b.is_pinned() for b in pool_s.buffers) == pinned

    def fences():
        return StagedPipeline()._fences(pool_s, torch.device("cuda"), 30.0)

    assert (fences() is not None) == pinned
    q: queue.Queue = queue.Queue()

    def gather(c, buf):
        ops.gather_blocks(src, sspec, c.units, c.num_tokens, read.src_head_start, read.num_heads, out=buf)

    def scatter(c, buf):
        ops.scatter_blocks(buf, dst, dspec, c.units, c.num_tokens, read.dst_head_start)

    sender = _sending_thread(
        q,
        lambda: pipelined_send(
            schunks,
            pool_s.buffers,
            wire_viewer(sspec, read.num_heads),
            gather,
            lambda c, b: q.put(b.clone()),
            fences(),
        ),
    )
    sender.start()
    pipelined_recv(
        dchunks,
        pool_d.buffers,
        wire_viewer(dspec, read.num_heads),
        lambda c, b: QueueWork(q, b),
        scatter,
        fences(),
    )
    sender.join(30)
    assert not sender.is_alive()
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
