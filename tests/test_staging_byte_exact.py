"""The double-buffered staging pipeline byte-exact end to end against an independent oracle:
sender and receiver threads (TP re-sharding, layouts, block sizes, dtypes, MLA), real Gloo
between 2 processes, and (``gpu``) CUDA caches through pinned-host or device staging buffers."""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading
import time
import traceback
from datetime import timedelta

import pytest
import torch

from kvxfer import ops
from kvxfer.spec import KVCacheSpec, Layout
from kvxfer.transports.pg.pipeline import StagedPipeline
from kvxfer.transports.staging import (
    StagingPool,
    chunk_tokens_for,
    cut,
    pipelined_recv,
    pipelined_send,
    wire_viewer,
)

from .cache_oracle import bytes_equal, expected_dst, make_cache, poisoned

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


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
