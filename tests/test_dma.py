"""The copy-engine path (kvxfer/backends/dma.py, kvxfer/backends/batch_copy.py) through a fake
driver: the runs built for ``cuMemcpyBatchAsync``, the rule that chooses between it and a
kernel, the fallback, the stats and NVTX ranges.

On CPU a fake driver (``tests/dma_helpers.py``), built from the very ctypes prototype the real
symbol gets, records each batch and performs it with ``memmove`` on CPU memory, so the runs are
checked byte for byte (poisoned destinations, every dtype, NHD/HND/MLA, head slices) against the
torch reference. The real driver's call: ``tests/test_dma_driver.py``.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from kvxfer import KVCacheSpec, Layout, ops, tracing
from kvxfer.backends import batch_copy, dma

from .dma_helpers import (
    POISON,
    FakeDriver,
    _bytes,
    _caches,
    _rule_on,  # noqa: F401  (autouse: the rule applies, $KVXFER_DMA=rule)
    _spec,
)

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)


@pytest.fixture
def fake():
    drv = FakeDriver()
    batch_copy.install_copier(drv.copier)
    ops.reset_backends()
    yield drv
    batch_copy.install_copier(None)
    ops.reset_backends()


# --------------------------------------------------------------------------- runs
def test_adjacent_blocks_coalesce_into_one_run():
    """A whole-head NHD copy: one run per (layer, K/V) stretch of blocks adjacent on both sides;
    addresses computed here from the tensors themselves."""
    spec = _spec("NHD", heads=4, dim=16, bs=4, layers=2)
    src, dst = _caches(spec, 12, "random"), _caches(spec, 8, "poison")
    s_ids, d_ids = [4, 5, 6, 9], [0, 1, 2, 3]
    s = ops.make_side(src, spec, s_ids, 16)
    d = ops.make_side(dst, spec, d_ids, 16, unique_blocks=True)
    runs = dma.plan_runs("copy", s, d)
    block = 4 * 4 * 16 * 2
    want = []
    for layer in range(2):
        for kv in range(2):
            want.append((dst[layer][kv, 0].data_ptr(), src[layer][kv, 4].data_ptr(), 3 * block))
            want.append((dst[layer][kv, 3].data_ptr(), src[layer][kv, 9].data_ptr(), block))
    got = list(zip(runs.dsts.tolist(), runs.srcs.tolist(), runs.sizes.tolist()))
    assert got == want
    assert runs.nbytes == 2 * 2 * 4 * block and runs.unit == block and runs.count == 8
    assert runs.dsts.dtype == np.uint64 and runs.sizes.dtype == np.uint64


def test_runs_continue_across_layers_where_memory_does():
    """MLA layers cut from one allocation, every block in order, into a wire: one run in all."""
    spec = _spec("MLA", dim=16, bs=4, layers=3)
    nb = 5
    flat = torch.randint(0, 100, (3 * nb * 4 * 16,), dtype=torch.int16).view(torch.bfloat16)
    caches = list(flat.view(3, nb, 4, 16).unbind(0))
    side = ops.make_side(caches, spec, list(range(nb)), nb * 4)
    wire = torch.empty(spec.wire_shape(nb * 4, 1, 3), dtype=spec.dtype)
    runs = dma.plan_runs("gather", side, None, wire.data_ptr())
    assert runs.count == 1 and runs.sizes.tolist() == [flat.numel() * 2]
    assert runs.srcs.tolist() == [flat.data_ptr()] and runs.dsts.tolist() == [wire.data_ptr()]


def test_hnd_head_slice_is_one_run_per_block_and_nhd_slice_is_refused():
    hnd = _spec("HND", heads=4, dim=16, bs=4, layers=2)
    src, dst = _caches(hnd, 6, "random"), _caches(hnd, 6, "poison")
    s = ops.make_side(src, hnd, [0, 1], 8, head_start=1, num_heads=2)
    d = ops.make_side(dst, hnd, [3, 5], 8, head_start=2, num_heads=2, unique_blocks=True)
    runs = dma.plan_runs("copy", s, d)
    head = 4 * 16 * 2
    assert runs.unit == 2 * head and runs.count == 2 * 2 * 2  # heads 1-2 of a block: one run
    assert runs.srcs.tolist()[0] == src[0][0, 0, 1].data_ptr()
    assert runs.dsts.tolist()[0] == dst[0][0, 3, 2].data_ptr()
    # a gather of the slice: one head's tokens per run (the wire is head-major)
    wire = torch.empty(hnd.wire_shape(8, 2, 2), dtype=hnd.dtype)
    g = dma.plan_runs("gather", s, None, wire.data_ptr())
    assert g.unit == head and g.count == 2 * 2 * 2 * 2
    nhd = _spec("NHD", heads=4, dim=16, bs=4, layers=2)
    a, b = _caches(nhd, 6, "random"), _caches(nhd, 6, "poison")
    s = ops.make_side(a, nhd, [0, 1], 8, head_start=1, num_heads=2)
    d = ops.make_side(b, nhd, [3, 5], 8, head_start=1, num_heads=2, unique_blocks=True)
    why = dma.plan_runs("copy", s, d)
    assert isinstance(why, str) and "not contiguous" in why
    whole = ops.make_side(a, nhd, [0, 1], 8)
    why = dma.plan_runs("gather", whole, None, 1 << 20)
    assert isinstance(why, str) and "not one run" in why  # NHD rows of several heads interleave
    one = _spec("NHD", heads=1, dim=16, bs=4, layers=2)  # one head per rank: a head's tokens
    s1 = ops.make_side(_caches(one, 4, "random"), one, [2, 3], 8)
    assert dma.plan_runs("gather", s1, None, 1 << 20).unit == 4 * 16 * 2


@pytest.mark.parametrize(
    ("what", "src_spec", "dst_spec", "tokens", "why"),
    [
        ("partial", _spec("HND"), _spec("HND"), 10, "partial last block (2 of 4 tokens)"),
        ("block sizes", _spec("HND", bs=4), _spec("HND", bs=8), 8, "block sizes differ"),
        ("layouts", _spec("NHD"), _spec("HND"), 8, "orders differ"),
    ],
)
def test_transfers_that_are_not_whole_block_runs_are_refused(what, src_spec, dst_spec, tokens, why):
    s = ops.make_side(_caches(src_spec, 6, "random"), src_spec, [0, 1, 2], tokens)
    d = ops.make_side(_caches(dst_spec, 6, "poison"), dst_spec, [3, 4, 5], tokens, unique_blocks=True)
    got = dma.plan_runs("copy", s, d)
    assert isinstance(got, str) and why in got, got


def test_overlapping_source_and_destination_are_refused():
    """A batch runs its copies in no set order: a copy inside one cache whose source blocks are
    written by it is left to a kernel; disjoint blocks of one cache are fine."""
    spec = _spec("NHD", heads=4, bs=4, layers=2)
    caches = _caches(spec, 8, "random")
    s = ops.make_side(caches, spec, [0, 1], 8)
    d = ops.make_side(caches, spec, [1, 2], 8, unique_blocks=True)
    got = dma.plan_runs("copy", s, d)
    assert isinstance(got, str) and "overlap" in got
    d = ops.make_side(caches, spec, [4, 6], 8, unique_blocks=True)
    assert isinstance(dma.plan_runs("copy", s, d), dma.Runs)


def test_runs_are_built_without_a_python_loop_over_blocks(monkeypatch):
    """4K tokens of Llama-3-8B (HND, one head per run): 131072 units built by numpy; no per-block
    Python call (the side's layout is asked once)."""
    spec = KVCacheSpec(32, 8, 8, 16, torch.float16, Layout.HND)
    caches = [torch.empty(spec.local_cache_shape(257, 8), dtype=spec.dtype) for _ in range(32)]
    calls = []
    real = dma._layout
    monkeypatch.setattr(dma, "_layout", lambda side: calls.append(1) or real(side))
    side = ops.make_side(caches, spec, list(range(256))[::-1], 4096)
    runs = dma.plan_runs("gather", side, None, 1 << 40)
    assert runs.count == 8 * 32 * 2 * 256 and runs.unit == 16 * 8 * 2 and len(calls) == 1


# --------------------------------------------------------------------------- exact bytes (fake driver)
def _copy_case(layout, dtype, dst_heads):
    spec = _spec(layout, heads=4, dim=8, bs=4, layers=3, dtype=dtype)
    src = _caches(spec, 9, "random", seed=1)
    dst = _caches(spec, 9, "poison", heads=1 if layout == "MLA" else dst_heads)
    return spec, src, dst


@pytest.mark.parametrize("dtype", DTYPES, ids=[str(d)[6:] for d in DTYPES])
@pytest.mark.parametrize(
    ("layout", "src_hs", "dst_hs", "n", "dst_heads"),
    [("NHD", 0, 0, None, 4), ("HND", 1, 0, 2, 3), ("HND", 0, 0, None, 4), ("MLA", 0, 0, None, 1)],
)
def test_copy_through_the_copy_engines_is_byte_exact(fake, dtype, layout, src_hs, dst_hs, n, dst_heads):
    spec, src, dst = _copy_case(layout, dtype, dst_heads=dst_heads)
    ref = [c.clone() for c in dst]
    s_ids, d_ids = [7, 2, 3, 0], [1, 2, 3, 8]  # two adjacent on both sides, spare blocks poisoned
    layers = [2, 0]
    kw = dict(src_head_start=src_hs, dst_head_start=dst_hs, num_heads=n, layers=layers)
    ops.copy_blocks(src, spec, s_ids, dst, spec, d_ids, 16, dma=True, **kw)
    assert ops.last_backend() == "dma" and len(fake.calls) == 1
    ops.copy_blocks(src, spec, s_ids, ref, spec, d_ids, 16, backend="torch", **kw)
    assert torch.equal(_bytes(dst), _bytes(ref))
    assert (dst[1].view(torch.uint8) == POISON).all()  # a layer not moved


@pytest.mark.parametrize("dtype", DTYPES, ids=[str(d)[6:] for d in DTYPES])
@pytest.mark.parametrize(("layout", "hs", "n"), [("HND", 1, 2), ("HND", 0, None), ("MLA", 0, None)])
def test_gather_and_scatter_through_the_copy_engines_are_byte_exact(fake, dtype, layout, hs, n):
    spec = _spec(layout, heads=4, dim=8, bs=4, layers=3, dtype=dtype)
    src = _caches(spec, 9, "random", seed=2)
    ids = [5, 6, 1, 8]
    kw = dict(head_start=hs, num_heads=n, layers=[1, 2])
    shape = spec.wire_shape(16, 1 if layout == "MLA" else (n or 4), 2)
    wire = torch.full(shape, 0, dtype=dtype)
    wire.view(torch.uint8).fill_(POISON)
    ops.gather_blocks(src, spec, ids, 16, out=wire, dma=True, **kw)
    assert ops.last_backend() == "dma"
    want = ops.gather_blocks(src, spec, ids, 16, backend="torch", **kw)
    assert torch.equal(_bytes([wire]), _bytes([want]))
    dst = _caches(spec, 9, "poison")
    ref = [c.clone() for c in dst]
    skw = dict(head_start=hs, layers=[1, 2])
    ops.scatter_blocks(wire, dst, spec, [0, 1, 2, 7], 16, dma=True, **skw)
    assert ops.last_backend() == "dma" and len(fake.calls) == 2
    ops.scatter_blocks(wire, ref, spec, [0, 1, 2, 7], 16, backend="torch", **skw)
    assert torch.equal(_bytes(dst), _bytes(ref))


def test_the_batch_the_driver_gets(fake):
    """One call per op: every run, one attribute for all of them (source in stream order,
    overlap with compute preferred), attribute index 0; on CPU memory, host hints."""
    spec = _spec("NHD", heads=4, bs=4, layers=2)
    src, dst = _caches(spec, 8, "random"), _caches(spec, 8, "poison")
    ops.copy_blocks(src, spec, [0, 1, 5], dst, spec, [2, 3, 4], 12, dma=True)
    (call,) = fake.calls
    assert len(call["runs"]) == 2 * 2 * 2  # [0,1]->[2,3] one run, [5]->[4] another, per (layer, kv)
    assert call["attrs"] == [
        (
            batch_copy.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            (2, 0),
            (2, 0),
            batch_copy.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE,
        )
    ]
    assert call["idxs"] == [0] and call["stream"] is None
    assert sum(r[2] for r in call["runs"]) == 2 * 2 * 3 * 4 * 4 * 16 * 2


# --------------------------------------------------------------------------- the rule
def _sides(tokens=16, layout="HND", bs=4):
    spec = _spec(layout, heads=4, dim=16, bs=bs, layers=2)
    s = ops.make_side(_caches(spec, 8, "random"), spec, list(range(spec.num_blocks_for(tokens))), tokens)
    d = ops.make_side(
        _caches(spec, 8, "poison"),
        spec,
        [7, 6, 5, 4][: spec.num_blocks_for(tokens)],
        tokens,
        unique_blocks=True,
    )
    return s, d


CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("budget", "large", "tokens", "min_run", "want"),
    [
        (None, False, 16, 0, ("kernel", "budget not small, copy not large")),
        (32, False, 16, 0, ("kernel", "budget not small, copy not large")),
        (16, False, 16, 0, ("dma", "budget small")),
        (8, False, 16, 0, ("dma", "budget small")),
        (None, True, 16, 0, ("dma", "copy large")),
        (132, True, 16, 0, ("dma", "copy large")),
        (8, False, 14, 0, ("kernel", "dma does not apply")),  # partial last block
        (None, True, 14, 0, ("kernel", "dma does not apply")),
        (8, False, 16, 1 << 20, ("kernel", "runs too small")),
    ],
)
def test_choice_rule(fake, monkeypatch, budget, large, tokens, min_run, want):
    s, d = _sides(tokens)
    monkeypatch.setattr(dma, "LARGE_COPY_BYTES", 1 if large else 1 << 40)
    monkeypatch.setattr(dma, "MIN_RUN_BYTES", min_run)
    c = dma.choose("copy", s, d, None, budget, None, CPU)
    assert (c.path, c.key) == want, c
    assert (c.runs is not None) == (c.path == "dma")


def test_the_copy_engines_are_not_taken_by_default(fake, monkeypatch):
    """Without $KVXFER_DMA=rule a call the rule would send to the copy engines (small budget,
    large copy) takes the kernel, naming why; dma=True still takes them."""
    monkeypatch.delenv(dma.DMA_ENV, raising=False)
    monkeypatch.setattr(dma, "LARGE_COPY_BYTES", 1)
    monkeypatch.setattr(dma, "MIN_RUN_BYTES", 0)
    s, d = _sides(16)
    c = dma.choose("copy", s, d, None, 8, None, CPU)
    assert (c.path, c.key) == ("kernel", "copy engines not by default") and "$KVXFER_DMA=rule" in c.detail
    assert dma.choose("copy", s, d, None, 8, True, CPU).path == "dma"
    monkeypatch.setenv(dma.DMA_ENV, "rule")
    assert dma.choose("copy", s, d, None, 8, None, CPU).path == "dma"


def test_choice_overrides_and_switches(fake, monkeypatch):
    s, d = _sides(16)
    assert dma.choose("copy", s, d, None, 8, False, CPU).key == "dma=False"
    assert dma.choose("copy", s, d, None, None, True, CPU).path == "dma"
    monkeypatch.setenv(dma.DMA_ENV, "0")
    assert dma.choose("copy", s, d, None, 8, None, CPU).key == "$KVXFER_DMA off"
    assert dma.choose("copy", s, d, None, 8, True, CPU).path == "dma"  # asked for by the call
    s, d = _sides(14)
    with pytest.raises(
        ValueError, match=r"dma=True: this copy is not whole-block copies: partial last block"
    ):
        dma.choose("copy", s, d, None, None, True, CPU)


def test_without_a_batched_copy_the_rule_falls_back(monkeypatch):
    """No copier for these tensors (CPU memory, no fake): the kernel, naming why; and
    ``dma=True`` names the same reason."""
    batch_copy.install_copier(None)
    s, d = _sides(16)
    c = dma.choose("copy", s, d, None, 4, None, CPU)
    assert (c.path, c.key) == ("kernel", "no cuMemcpyBatchAsync") and "CUDA memory" in c.detail
    with pytest.raises(ValueError, match="dma=True: no batched copy here"):
        dma.choose("copy", s, d, None, None, True, CPU)


def test_a_driver_without_the_call_falls_back_with_a_logged_reason(monkeypatch, caplog):
    def no_call():
        raise OSError("the driver exports no cuMemcpyBatchAsync")

    monkeypatch.setattr(batch_copy, "_Driver", no_call)
    batch_copy.install_copier(None)
    try:
        with caplog.at_level(logging.WARNING, logger="kvxfer.backends.batch_copy"):
            c, why = batch_copy.copier(torch.device("cuda", 0))
            again = batch_copy.copier(torch.device("cuda", 1))
        assert c is None and again[0] is None and "exports no cuMemcpyBatchAsync" in why
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "transfers use the kernels" in warnings[0] and why in warnings[0]
        s, d = _sides(16)
        choice = dma.choose("copy", s, d, None, 8, None, torch.device("cuda", 0))
        assert (choice.path, choice.key) == ("kernel", "no cuMemcpyBatchAsync")
        assert dma.status("cuda").startswith("off: OSError: the driver exports no")
    finally:
        batch_copy.install_copier(None)


def test_dma_true_on_a_transfer_that_is_not_runs_writes_nothing(fake):
    spec = _spec("NHD", heads=4, bs=4, layers=2)
    src, dst = _caches(spec, 8, "random"), _caches(spec, 8, "poison")
    with pytest.raises(ValueError, match="partial last block"):
        ops.copy_blocks(src, spec, [0, 1, 2], dst, spec, [3, 4, 5], 10, dma=True)
    with pytest.raises(ValueError, match="dma: must be None"):
        ops.gather_blocks(src, spec, [0, 1], 8, dma="yes")
    with pytest.raises(ValueError, match="dma: must be None"):
        ops.scatter_blocks(torch.zeros(spec.wire_shape(8), dtype=spec.dtype), dst, spec, [0, 1], 8, dma=1)
    assert fake.calls == [] and all((c.view(torch.uint8) == POISON).all() for c in dst)


# --------------------------------------------------------------------------- ops: stats, NVTX, failure
class _Ranges:
    def __init__(self) -> None:
        self.names: list[str] = []

    def push_range(self, message=None, color=None, domain=None):
        self.names.append(message)

    def pop_range(self, domain=None):
        pass


def test_registered_budget_chooses_per_call_and_stats_and_nvtx_say_why(fake, monkeypatch):
    monkeypatch.delenv("KVXFER_NVTX", raising=False)
    monkeypatch.setattr(dma, "MIN_RUN_BYTES", 0)  # the tiny runs of this test count as big
    saved = dict(tracing._state)
    rec = _Ranges()
    tracing.set_enabled(True, nvtx_module=rec)
    try:
        spec = _spec("HND", heads=4, bs=4, layers=2)
        src = ops.register_caches(_caches(spec, 8, "random"), spec, max_sms=8)
        dst = ops.register_caches(_caches(spec, 8, "poison"), spec, max_sms=8)
        ops.copy_blocks(src, spec, [0, 1], dst, spec, [2, 3], 8)  # whole blocks, small budget: DMA
        ops.copy_blocks(src, spec, [0, 1], dst, spec, [4, 5], 7)  # partial last block: the kernel
        ops.gather_blocks(src, spec, [0, 1], 8, max_sms=64)  # budget not small, copy small
        st = ops.path_stats(dst)
    finally:
        tracing._state.update(saved)
    assert st["max_sms"] == 8 and st["dma"] == 1 and st["kernel"] == 1
    assert st["reasons"] == {"copy dma: budget small": 1, "copy kernel: dma does not apply": 1}
    assert st["last"].startswith("copy kernel: dma does not apply (partial last block")
    assert ops.path_stats(src)["reasons"]["gather kernel: budget not small, copy not large"] == 1
    assert rec.names[0].startswith("kvxfer.copy dma: budget small (8 SMs <= 16;")
    assert rec.names[1].startswith("kvxfer.copy kernel: dma does not apply (partial last block")
    assert rec.names[2].startswith("kvxfer.gather kernel: budget not small, copy not large (budget 64 SMs")
    with pytest.raises(ValueError, match="register_caches"):
        ops.path_stats([torch.zeros(1)])


def test_a_prepared_batch_dispatches_each_call_as_a_copy_does(fake, monkeypatch):
    """PreparedCopy.batch: each packed call takes the path a copy would (here dma=True: the copy
    engines, one driver batch per call), the bytes those of a kernel copy per request, and the
    registered caches record each choice."""
    monkeypatch.setattr(dma, "MIN_RUN_BYTES", 0)
    spec = _spec("HND", heads=4, bs=4, layers=2)
    src = ops.register_caches(_caches(spec, 8, "random"), spec)
    dst = ops.register_caches(_caches(spec, 8, "poison"), spec)
    ref = _caches(spec, 8, "poison")
    segs = [([0, 1], [4, 5], 8), ([2], [6], 4), ([7, 3], [0, 2], 8)]  # whole blocks: one call
    for s_ids, d_ids, n in segs:
        ops.copy_blocks(src, spec, s_ids, ref, spec, d_ids, n, backend="torch")
    calls = ops.PreparedCopy(src, dst).batch(
        [0, 1, 2, 7, 3], [0, 2, 3, 5], [4, 5, 6, 0, 2], [0, 2, 3, 5], [8, 4, 8], dma=True
    )
    assert calls == 1 and len(fake.calls) == 1 and ops.last_backend() == "dma"
    assert torch.equal(_bytes(dst), _bytes(ref))
    assert ops.path_stats(dst)["reasons"] == {"copy dma: dma=True": 1}


def test_whether_the_copy_engines_are_considered_is_not_asked_per_call(fake, monkeypatch):
    """The test's fake driver is looked for when caches are checked (registration), never in an
    op call: a call on registered caches asks no hook."""
    spec = _spec("HND", heads=4, bs=4, layers=2)
    src = ops.register_caches(_caches(spec, 8, "random"), spec)
    dst = ops.register_caches(_caches(spec, 8, "poison"), spec)
    wire = ops.gather_blocks(src, spec, [0, 1], 8)

    def asked():
        raise AssertionError("serves_cpu asked in an op call")

    monkeypatch.setattr(batch_copy, "serves_cpu", asked)
    ids = ops.CheckedIds(np.array([2, 3], dtype=np.int64), 8, True)
    ops.copy_blocks(src, spec, ids, dst, spec, ids, 8)
    ops.PreparedCopy(src, dst)(ids, ids, 8)
    ops.gather_blocks(src, spec, ids, 8, out=wire)
    ops.scatter_blocks(wire, dst, spec, ids, 8)
    # each call still chose its path and recorded it (a copy on both caches' records)
    assert ops.path_stats(dst)["kernel"] == 3 and ops.path_stats(src)["kernel"] == 4


def test_engine_views_share_one_record_and_carry_the_budget():
    from kvxfer.views import cache_views, view_at

    spec = _spec("NHD", heads=2, bs=4, layers=2)
    views = cache_views(_caches(spec, 8, "poison"), spec, 12)
    assert len(views) == 2 and all(v.caches.max_sms == 12 for v in views)
    assert views[0].caches.path_stats is views[1].caches.path_stats
    off = view_at({v.unit: v for v in views}, 4, 1, {})
    assert off.caches.max_sms == 12 and off.caches.path_stats is views[0].caches.path_stats


def test_a_failing_driver_call_falls_back_to_the_kernel(monkeypatch, caplog):
    """The driver refuses the batch: one warning, the kernel moves the same bytes (exact), and
    the path stays off for the device type (later calls say why)."""
    drv = FakeDriver(abi=1, rc=1, fail_at=3)
    batch_copy.install_copier(drv.copier)
    monkeypatch.setattr(dma, "MIN_RUN_BYTES", 0)
    try:
        spec = _spec("HND", heads=4, bs=4, layers=2)
        src = ops.register_caches(_caches(spec, 8, "random"), spec)
        dst = ops.register_caches(_caches(spec, 8, "poison"), spec, max_sms=4)
        ref = [c.clone() for c in dst]
        with caplog.at_level(logging.WARNING, logger="kvxfer.backends.batch_copy"):
            ops.copy_blocks(src, spec, [0, 1], dst, spec, [2, 3], 8)
            ops.copy_blocks(src, spec, [0, 1], dst, spec, [2, 3], 8)
        ops.copy_blocks(src, spec, [0, 1], ref, spec, [2, 3], 8, backend="torch")
        assert torch.equal(_bytes(dst), _bytes(ref))
        assert len(drv.calls) == 1 and ops.last_backend() != "dma"
        msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(msgs) == 1 and "fake v1 returned 1 at run 3" in msgs[0]
        st = ops.path_stats(dst)
        assert st["reasons"] == {"copy kernel: dma call failed": 1, "copy kernel: no cuMemcpyBatchAsync": 1}
        assert "off" in st["dma_path"] and "fake v1 returned 1" in st["dma_path"]
    finally:
        batch_copy.install_copier(None)
