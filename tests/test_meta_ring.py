"""The launch-table ring (kvxfer.backends.meta_ring) against a stream that runs late: a table is
never overwritten before the copy out of it and the kernel that reads it ran, a full ring refuses
(the caller allocates) instead of waiting, and a CUDA C++ launch planned for the device gets the
bytes of the host-planned one through the ring (the kernels built by g++ through the host shim).

The fake driver's "device" memory is host memory; its stream queues copies, event records and
kernels and runs them only when a test says so, as a GPU runs queued work later."""

from __future__ import annotations

import ctypes
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvxfer import KVCacheSpec, Layout, ops
from kvxfer.backends import cuda, meta_ring
from kvxfer.backends.meta_ring import ALIGN, SEGMENTS, MetaRing

sys.path.insert(0, str(Path(__file__).resolve().parent / "cuda_shim"))
from host_kernels import HostKernels, build


class _Event:
    def __init__(self) -> None:
        self.at = -1  # the stream position of its last record


class LateStream:
    """A :class:`~kvxfer.backends.meta_ring.Driver` whose work runs when :meth:`run` says."""

    def __init__(self) -> None:
        self.queue: list = []  # ("copy", dst, src, n) / ("record", event) / ("call", fn)
        self.ran = 0  # how many queued items have run
        self.buffers: list = []

    def alloc(self, nbytes: int):
        host = np.full(nbytes, 0xEE, dtype=np.uint8)
        dev = np.full(nbytes, 0xDD, dtype=np.uint8)
        self.buffers += [host, dev]
        return host, host.ctypes.data, dev, dev.ctypes.data

    def copy_to_device(self, dst: int, src: int, nbytes: int) -> None:
        self.queue.append(("copy", dst, src, nbytes))

    def new_event(self) -> _Event:
        return _Event()

    def record(self, event: _Event) -> None:
        event.at = len(self.queue)
        self.queue.append(("record", event))

    def done(self, event: _Event) -> bool:
        return self.ran > event.at

    def call(self, fn) -> None:
        """A kernel: ``fn`` runs in stream order."""
        self.queue.append(("call", fn))

    def run(self, count: int | None = None) -> None:
        end = len(self.queue) if count is None else min(len(self.queue), self.ran + count)
        while self.ran < end:
            item = self.queue[self.ran]
            if item[0] == "copy":
                ctypes.memmove(item[1], item[2], item[3])
            elif item[0] == "call":
                item[1]()
            self.ran += 1


def _table(k: int, words: int) -> np.ndarray:
    """Table ``k``: every word names it and its place (a table read from the wrong place or
    overwritten by another says so)."""
    return np.arange(words, dtype=np.int64) + (k << 20)


def _launch_through(ring: MetaRing, stream: LateStream, table: np.ndarray, seen: dict, k: int) -> bool:
    """One launch as the backends make it: under the ring's lock, the table staged (or, when
    the ring refuses, a fresh buffer of its own), then a kernel that reads it in stream order.
    True when the ring took it."""
    with ring.lock:
        off = ring.stage(table)
        if off is not None:
            addr, keep = ring.device_ptr + off, None
        else:
            keep = table.copy()  # the allocating path: a buffer of its own
            addr = keep.ctypes.data
        n = table.size

        def kernel(addr=addr, n=n, keep=keep) -> None:
            seen[k] = np.ctypeslib.as_array((ctypes.c_int64 * n).from_address(addr)).copy()

        stream.call(kernel)
    return off is not None


def test_tables_land_aligned_and_a_table_larger_than_a_segment_is_refused(caplog):
    stream = LateStream()
    ring = MetaRing(stream, nbytes=SEGMENTS * 1024)
    offs = [ring.stage(_table(k, 10)) for k in range(3)]
    assert offs == [0, ALIGN, 2 * ALIGN]
    stream.run()
    for k, off in enumerate(offs):
        got = ring.device[off : off + 80].view(np.int64)
        assert np.array_equal(got, _table(k, 10))
    with caplog.at_level("WARNING", logger="kvxfer.backends.meta_ring"):
        assert ring.stage(_table(9, 129)) is None  # 1032 bytes: more than a 1024-byte segment
        assert ring.stage(_table(9, 200)) is None
    assert ring.stats() == {"staged": 3, "fallbacks": 2, "bytes": 4096, "broken": ""}
    assert caplog.text.count("allocates its table") == 1  # logged once per ring
    with pytest.raises(ValueError, match="multiple of"):
        MetaRing(LateStream(), nbytes=1000)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_table_is_overwritten_before_its_copy_and_kernel_ran(seed):
    """Hundreds of launches of mixed sizes through a 4 x 1 KiB ring on a stream that runs late
    and in bursts: every kernel reads exactly its table; the ring wrapped many times, and
    refused (never waited) while its segments were in use."""
    rng = np.random.default_rng(seed)
    stream = LateStream()
    ring = MetaRing(stream, nbytes=SEGMENTS * 1024)
    tables, seen, took = {}, {}, 0
    for k in range(600):
        tables[k] = _table(k, int(rng.integers(1, 128)))
        took += _launch_through(ring, stream, tables[k], seen, k)
        if rng.random() < 0.15:  # the GPU catches up on part of the queue
            stream.run(int(rng.integers(0, 40)))
    stream.run()
    wrong = [k for k in tables if not np.array_equal(seen[k], tables[k])]
    assert not wrong, f"{len(wrong)} kernels read another table, first {wrong[0]}"
    assert took > 4 * SEGMENTS * 1024 // (128 * 8) and ring.fallbacks > 0, (took, ring.fallbacks)
    assert took + ring.fallbacks == 600


def test_a_ring_that_did_not_wait_for_its_events_would_be_caught():
    """The mutation the test above must catch: segments reused without their events done."""
    rng = np.random.default_rng(0)
    stream = LateStream()
    stream.done = lambda event: True
    ring = MetaRing(stream, nbytes=SEGMENTS * 1024)
    tables, seen = {}, {}
    for k in range(300):
        tables[k] = _table(k, int(rng.integers(1, 128)))
        _launch_through(ring, stream, tables[k], seen, k)
        if rng.random() < 0.15:
            stream.run(int(rng.integers(0, 40)))
    stream.run()
    assert any(not np.array_equal(seen[k], tables[k]) for k in tables)


def test_a_failing_driver_call_retires_the_ring(caplog):
    stream = LateStream()
    ring = MetaRing(stream, nbytes=SEGMENTS * 1024)
    assert ring.stage(_table(0, 4)) == 0

    def fails(dst, src, n):
        raise TypeError("memcpyAsync() takes 5 arguments")

    stream.copy_to_device = fails
    with caplog.at_level("WARNING", logger="kvxfer.backends.meta_ring"):
        assert ring.stage(_table(1, 4)) is None
    assert "TypeError: memcpyAsync() takes 5 arguments" in caplog.text
    stream.copy_to_device = LateStream.copy_to_device.__get__(stream)
    assert ring.stage(_table(2, 4)) is None  # retired, though the driver works again
    assert ring.stats()["fallbacks"] == 2 and ring.broken


def test_rings_are_off_when_asked(monkeypatch):
    monkeypatch.setenv(meta_ring.ENV, "0")
    monkeypatch.setattr(meta_ring, "_rings", {})
    assert not meta_ring.enabled()
    assert meta_ring.ring_for(torch.device("cuda", 0), type("S", (), {"cuda_stream": 0x10})()) is None


# ------------------------------------------------------------- a CUDA C++ launch through it
@pytest.fixture(scope="module")
def plain_shim(tmp_path_factory) -> Path:
    """The host shim built without sanitizers (loaded into this process)."""
    if shutil.which("g++") is None:
        pytest.skip("g++ not found: cannot build the host shim")
    return build(tmp_path_factory.mktemp("kvx_shim_plain"), sanitize=False)


@pytest.mark.parametrize("op", ["gather", "scatter", "copy"])
def test_a_device_planned_launch_through_the_ring_moves_the_host_planned_bytes(plain_shim, op):
    """plan_* for a CUDA device leaves the table's addresses as offsets; enqueue_staged puts
    the table through the ring and the kernel (g++ build) moves exactly the bytes the
    host-planned launch moves, launch after launch, with the stream running late."""
    host = HostKernels(plain_shim, max_blocks=3)
    spec = KVCacheSpec(3, 4, 24, 5, torch.float16, Layout.HND)
    other = KVCacheSpec(3, 4, 24, 3, torch.float16, Layout.NHD)
    g = torch.Generator().manual_seed(7)

    def caches(sp, nb):
        return [torch.randn(sp.local_cache_shape(nb, 4), generator=g).to(sp.dtype) for _ in range(3)]

    src_c, dst_a, dst_b = caches(spec, 12), caches(other, 20), caches(other, 20)
    for a, b in zip(dst_a, dst_b):
        b.copy_(a)
    stream = LateStream()
    ring = MetaRing(stream, nbytes=SEGMENTS * 1024)
    wires = []
    for k, num_tokens in enumerate([17, 1, 33, 9, 40, 5] * 4):
        s_ids = list(np.random.default_rng(k).permutation(12)[: spec.num_blocks_for(num_tokens)])
        d_ids = list(np.random.default_rng(100 + k).permutation(20)[: other.num_blocks_for(num_tokens)])
        src = ops.make_side(src_c, spec, s_ids, num_tokens, 1, 2)
        dst_a_side = ops.make_side(dst_a, other, d_ids, num_tokens, 2, 2)
        dst_b_side = ops.make_side(dst_b, other, d_ids, num_tokens, 2, 2)
        wire = torch.empty(src.wire_view_shape(), dtype=spec.dtype)
        wire_b = torch.empty_like(wire)
        if op == "gather":
            want, plan = (
                cuda.plan_gather(src, wire.data_ptr(), 3),
                cuda.plan_gather(src, wire_b.data_ptr(), 3, "cuda"),
            )
        elif op == "scatter":
            wire.copy_(torch.randn(wire.shape, generator=g).to(wire.dtype))
            want = cuda.plan_scatter(wire.data_ptr(), dst_a_side, 3)
            plan = cuda.plan_scatter(wire.data_ptr(), dst_b_side, 3, "cuda")
        else:
            want, plan = cuda.plan_copy(src, dst_a_side, 3), cuda.plan_copy(src, dst_b_side, 3, "cuda")
        assert want.rel == () and len(plan.rel) == (4 if op == "copy" else 2)
        host._run(want)
        wires.append((wire, wire_b, plan.meta))  # kept alive until the stream ran

        def enqueue(args, plan=plan):
            stream.call(lambda: host._run(cuda.Launch(plan.name, plan.grid, plan.block, args, plan.meta)))

        def allocate(meta):
            keep = meta.clone()  # as the caching allocator keeps a device table for queued work
            wires.append(keep)
            return keep, keep.data_ptr()

        cuda.enqueue_staged(plan, ring, enqueue, allocate)
        if k % 5 == 4:
            stream.run(3)
    stream.run()
    assert ring.staged > 0
    if op == "gather":
        for wire, wire_b, _ in (w for w in wires if isinstance(w, tuple)):
            assert torch.equal(wire.view(torch.uint8), wire_b.view(torch.uint8))
    else:
        for a, b in zip(dst_a, dst_b):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_the_cuda_launch_stages_its_table_through_the_stream_ring(monkeypatch):
    """cuda._launch (fake cupy and stream: nothing runs on a GPU): a plan planned for the device
    asks for the ring of its device and stream, stages its table there, and the kernel gets the
    ring's device address plus the offsets; a plan with addresses (rel empty) is passed as is."""
    import types

    from kvxfer.backends import cuda as kc
    from tests.test_device_context import FakeRuntime

    rt = FakeRuntime()
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=rt)))
    launched = []
    monkeypatch.setattr(kc, "_kernels", lambda i: {"kvx_copy_w16": lambda g, b, a: launched.append(a)})

    class _Ctx:
        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    monkeypatch.setattr(kc, "_cupy_stream", lambda ptr, i: _Ctx())
    stream = types.SimpleNamespace(cuda_stream=0xABC)
    monkeypatch.setattr(kc.torch.cuda, "current_stream", lambda d: stream)
    late = LateStream()
    ring = MetaRing(late, nbytes=SEGMENTS * 1024)
    asked = []
    monkeypatch.setattr(meta_ring, "ring_for", lambda dev, s: asked.append((dev, s)) or ring)
    table = torch.from_numpy(np.arange(6, dtype=np.int64) + 500)
    plan = kc.Launch("kvx_copy_w16", 2, 256, (7, 0, 16, 9), table, (1, 2))
    kc._launch(plan, torch.device("cuda", 0))
    assert asked == [(torch.device("cuda", 0), stream)]
    args = [int(a) for a in launched[0]]
    assert args == [7, ring.device_ptr, ring.device_ptr + 16, 9]
    late.run()
    assert np.array_equal(ring.device[:48].view(np.int64), table.numpy())
    kc._launch(kc.Launch("kvx_copy_w16", 2, 256, (1, 2), None), torch.device("cuda", 0))
    assert [int(a) for a in launched[1]] == [1, 2] and len(asked) == 1


def test_the_triton_side_takes_its_ids_from_the_ring():
    """kernels.launch._Side.args with a ring: the ids are staged as int32 and handed to the
    kernel as a view of the ring's device bytes (here a CPU tensor standing in)."""
    from kvxfer.kernels import launch as kl

    spec = KVCacheSpec(2, 2, 8, 4, torch.float16, Layout.NHD)
    caches = [torch.zeros(spec.cache_shape(9, 1), dtype=spec.dtype) for _ in range(2)]
    side = ops.make_side(caches, spec, [7, 2, 5], 10)
    late = LateStream()
    ring = MetaRing(late, nbytes=SEGMENTS * 1024)
    ring.device = torch.from_numpy(ring.device)  # the device buffer as the Triton path slices it
    (_, ids), _ = kl._Side(side).args(2, ring)
    late.run()
    assert ids.dtype == torch.int32 and ids.tolist() == [7, 2, 5] and ring.staged == 1
    assert ids.data_ptr() == ring.device_ptr  # a view of the ring, nothing allocated
