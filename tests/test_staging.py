"""Staging pool, chunk planner and the double-buffered pipeline's ordering (fakes), on CPU; the
pipeline byte-exact end to end (threads, real Gloo between 2 processes, GPU) is in
``tests/test_staging_byte_exact.py``."""

from __future__ import annotations

import itertools
import math
import random
import threading
import time

import pytest
import torch

from kvxfer.engine_types import describe_error
from kvxfer.spec import KVCacheSpec
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
