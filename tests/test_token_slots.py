"""Token-slot addressing (``register_caches(..., token_slots=True)``): one id per token, its slot
``block * block_size + offset``, in every layout.

The expectations are built by plain tensor indexing of byte views (slot -> block, offset), not
by kvxfer's own index math: a gather must read, a scatter write, a copy move exactly the rows
of the named slots, in the named order, and leave every other byte poisoned. Slots are drawn at
random across the whole cache (any order, several requests' tails side by side), so a kernel
that reads an id as a block, or drops the in-block offset, moves the wrong rows.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch

from kvxfer import KVCacheSpec, Layout, ops
from kvxfer.views import cache_views
from tests.kvdata import POISON, first_difference

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]
LAYOUTS = ["NHD", "HND", "MLA"]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
CPU_BACKENDS = ["torch", "cpu"] + (["triton"] if INTERPRETED else [])
NUM_BLOCKS = 9


def _spec(layout: str, dtype=torch.bfloat16, block_size: int = 5, heads: int = 4, head_dim: int = 24):
    if layout == "MLA":
        return KVCacheSpec(3, 1, head_dim, block_size, dtype, use_mla=True)
    return KVCacheSpec(3, heads, head_dim, block_size, dtype, Layout(layout))


def _filled(spec: KVCacheSpec, seed: int, device="cpu") -> list[torch.Tensor]:
    """Per-layer caches of random bytes (every row differs: a wrong row is caught)."""
    g = torch.Generator().manual_seed(seed)
    shape = spec.local_cache_shape(NUM_BLOCKS, spec.num_kv_heads)
    out = []
    for _ in range(spec.num_layers):
        raw = torch.randint(
            0, 256, (*shape[:-1], shape[-1] * spec.element_size), generator=g, dtype=torch.uint8
        )
        out.append(raw.view(spec.dtype).to(device))
    return out


def _poisoned(spec: KVCacheSpec, device="cpu") -> list[torch.Tensor]:
    shape = spec.local_cache_shape(NUM_BLOCKS, spec.num_kv_heads)
    return [
        torch.full((*shape[:-1], shape[-1] * spec.element_size), POISON, dtype=torch.uint8)
        .view(spec.dtype)
        .to(device)
        for _ in range(spec.num_layers)
    ]


def _rows(cache: torch.Tensor, spec: KVCacheSpec) -> torch.Tensor:
    """Byte view ``[KV, blocks, block_size, heads, row_bytes]`` of one layer (writable)."""
    raw = cache.view(torch.uint8)
    if spec.use_mla:
        return raw.unsqueeze(0).unsqueeze(3)
    return raw.transpose(2, 3) if spec.layout is Layout.HND else raw


def _read(caches, spec, slots: np.ndarray, heads: slice) -> torch.Tensor:
    """``[L, KV, T, H, row]`` bytes of the tokens at ``slots`` (plain indexing)."""
    s = torch.from_numpy(slots)
    b, o = s // spec.block_size, s % spec.block_size
    return torch.stack([_rows(c, spec).cpu()[:, b, o][:, :, heads] for c in caches])


def _write(caches, spec, slots: np.ndarray, heads: slice, rows: torch.Tensor) -> None:
    s = torch.from_numpy(slots)
    b, o = s // spec.block_size, s % spec.block_size
    for c, r in zip(caches, rows):
        view = _rows(c, spec)
        for kv in range(view.shape[0]):  # a test helper: per K/V, one indexed write
            blk = view[kv, b, o]
            blk[:, heads] = r[kv].to(blk.device)
            view[kv, b, o] = blk


def _wire_rows(wire: torch.Tensor, spec: KVCacheSpec) -> torch.Tensor:
    """``[L, KV, T, H, row]`` bytes of a wire (``[H, L, KV, T, D]``, MLA ``[L, T, D]``)."""
    raw = wire.cpu().contiguous().view(torch.uint8)
    if spec.use_mla:
        return raw.unsqueeze(1).unsqueeze(3)
    return raw.permute(1, 2, 3, 0, 4)


def _slots(spec: KVCacheSpec, num_tokens: int, seed: int) -> np.ndarray:
    """``num_tokens`` distinct slots anywhere in the cache, in random order."""
    return np.random.default_rng(seed).choice(NUM_BLOCKS * spec.block_size, num_tokens, replace=False)


def _equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got, want = got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)
    assert torch.equal(got, want), f"{what}: {first_difference(got, want)}"


def _all_bytes(caches) -> torch.Tensor:
    return torch.stack([c.cpu().contiguous().view(torch.uint8) for c in caches])


# --------------------------------------------------------------------------- data
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_gather_scatter_by_slot(layout, dtype, backend):
    spec = _spec(layout, dtype)
    heads = slice(0, 1) if layout == "MLA" else slice(1, 3)
    num_heads = heads.stop - heads.start
    src = _filled(spec, seed=1)
    reg = ops.register_caches(src, spec, token_slots=True)
    slots = _slots(spec, 23, seed=2)
    wire = ops.gather_blocks(reg, reg.spec, slots, 23, heads.start, num_heads, backend=backend)
    assert ops.last_backend() == backend
    _equal(_wire_rows(wire, spec), _read(src, spec, slots, heads), "gather")

    dst = _poisoned(spec)
    want = _poisoned(spec)
    _write(want, spec, slots, heads, _wire_rows(wire, spec))
    dreg = ops.register_caches(dst, spec, token_slots=True)
    ops.scatter_blocks(wire, dreg, dreg.spec, slots, 23, heads.start, backend=backend)
    _equal(_all_bytes(dst), _all_bytes(want), "scatter (poison elsewhere)")


def _side(caches, spec: KVCacheSpec, n: int, slots: bool, seed: int):
    """(registered caches, the ids an op takes, the slot of each of the ``n`` tokens): random
    distinct slots when ``slots``, else the first ``n`` tokens of random blocks."""
    if slots:
        ids = _slots(spec, n, seed)
        return ops.register_caches(caches, spec, token_slots=True), ids, ids
    ids = np.random.default_rng(seed).permutation(NUM_BLOCKS)[: spec.num_blocks_for(n)]
    tokens = (ids[:, None] * spec.block_size + np.arange(spec.block_size)).reshape(-1)[:n]
    return ops.register_caches(caches, spec), ids, tokens


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize(
    "src_layout,dst_layout,src_slots,dst_slots",
    [
        ("HND", "HND", True, True),
        ("NHD", "HND", False, True),  # whole blocks in, one call's tails out
        ("HND", "NHD", True, False),
        ("MLA", "MLA", True, True),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_copy_by_slot(src_layout, dst_layout, src_slots, dst_slots, dtype, backend):
    sspec = _spec(src_layout, dtype, block_size=4)
    dspec = _spec(dst_layout, dtype, block_size=6)
    n = 17
    src, dst, want = _filled(sspec, seed=3), _poisoned(dspec), _poisoned(dspec)
    heads = slice(0, 1) if src_layout == "MLA" else slice(1, 4)
    dheads = slice(0, 1) if src_layout == "MLA" else slice(0, 3)
    s_reg, s_ids, s_tokens = _side(src, sspec, n, src_slots, seed=4)
    d_reg, d_ids, d_tokens = _side(dst, dspec, n, dst_slots, seed=6)
    _write(want, dspec, d_tokens, dheads, _read(src, sspec, s_tokens, heads))
    ops.copy_blocks(
        s_reg, s_reg.spec, s_ids, d_reg, d_reg.spec, d_ids, n, heads.start, dheads.start,
        heads.stop - heads.start, backend=backend,
    )  # fmt: skip
    _equal(_all_bytes(dst), _all_bytes(want), "copy (poison elsewhere)")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_batch_of_tails_in_one_hnd_call(backend):
    """What the planner sends for HND requests that end inside a block: every request's tail
    slots side by side, one call, each tail landing in its own request's block."""
    spec = _spec("HND", torch.float16, block_size=8)
    src, dst = _filled(spec, seed=8), _poisoned(spec)
    want = _poisoned(spec)
    tails = [(0, 3), (4, 7), (2, 1), (7, 5)]  # (block, tokens): a request's last block
    s_slots = np.concatenate([b * 8 + np.arange(k) for b, k in tails])
    d_blocks = [6, 1, 8, 3]
    d_slots = np.concatenate([d * 8 + np.arange(k) for d, (_, k) in zip(d_blocks, tails)])
    heads = slice(0, 4)
    _write(want, spec, d_slots, heads, _read(src, spec, s_slots, heads))
    s_reg = ops.register_caches(src, spec, token_slots=True)
    d_reg = ops.register_caches(dst, spec, token_slots=True)
    ops.copy_blocks(s_reg, s_reg.spec, s_slots, d_reg, d_reg.spec, d_slots, s_slots.size, backend=backend)
    _equal(_all_bytes(dst), _all_bytes(want), "tails copy")


def test_prepared_copy_by_slot():
    spec = _spec("HND", torch.bfloat16, block_size=4)
    src, dst, want = _filled(spec, seed=9), _poisoned(spec), _poisoned(spec)
    s_reg = ops.register_caches(src, spec, token_slots=True)
    d_reg = ops.register_caches(dst, spec, token_slots=True)
    copy = ops.PreparedCopy(s_reg, d_reg, 1, 0, 2)
    for seed in (10, 11):  # two calls through one template
        s, d = _slots(spec, 6, seed), _slots(spec, 6, seed + 100)
        _write(want, spec, d, slice(0, 2), _read(src, spec, s, slice(1, 3)))
        copy(
            ops.CheckedIds(s, s_reg.info.num_blocks, False), ops.CheckedIds(d, d_reg.info.num_blocks, True), 6
        )
        _equal(_all_bytes(dst), _all_bytes(want), f"prepared copy {seed}")


# --------------------------------------------------------------------------- validation
@pytest.fixture
def hnd():
    spec = _spec("HND")
    src, dst = _filled(spec, 12), _poisoned(spec)
    return spec, ops.register_caches(src, spec, token_slots=True), dst


def test_slot_out_of_range_is_refused_before_writing(hnd):
    spec, reg, dst = hnd
    dreg = ops.register_caches(dst, spec, token_slots=True)
    before = _all_bytes(dst)
    last = NUM_BLOCKS * spec.block_size
    with pytest.raises(ValueError, match=f"block id {last} out of range \\[0, {last}\\)"):
        ops.copy_blocks(reg, reg.spec, [0, 1], dreg, dreg.spec, [3, last], 2)
    with pytest.raises(ValueError, match="repeated block id 7 in a destination"):
        ops.copy_blocks(reg, reg.spec, [0, 1], dreg, dreg.spec, [7, 7], 2)
    _equal(_all_bytes(dst), before, "nothing written")


def test_slot_caches_refuse_the_block_spec(hnd):
    spec, reg, _ = hnd
    assert reg.spec.block_size == 1 and reg.info.slot_block == spec.block_size
    assert reg.info.num_blocks == NUM_BLOCKS * spec.block_size
    with pytest.raises(ValueError, match="registered with token_slots"):
        ops.gather_blocks(reg, spec, [0], 5)


def test_token_slots_must_be_a_bool(hnd):
    spec, _, dst = hnd
    with pytest.raises(ValueError, match="token_slots: must be True or False"):
        ops.register_caches(dst, spec, token_slots=1)


def test_copy_engines_refuse_token_slots(hnd, monkeypatch):
    from kvxfer.backends import dma

    monkeypatch.setenv(dma.DMA_ENV, "rule")  # the rule would take them where they apply

    spec, reg, dst = hnd
    dreg = ops.register_caches(dst, spec, token_slots=True)
    src = ops.make_side(reg, reg.spec, np.arange(10), 10)
    out = ops.make_side(dreg, dreg.spec, np.arange(10), 10, unique_blocks=True)
    assert src.slot_block == spec.block_size
    with pytest.raises(ValueError, match="HND token slots: a slot's rows are not block runs"):
        dma.choose("copy", src, out, None, None, True, torch.device("cpu"))
    choice = dma.choose("copy", src, out, None, 4, None, torch.device("cpu"))  # a small budget
    assert choice.path == "kernel" and "token slots" in choice.detail


def test_block_size_one_needs_no_slots():
    spec = _spec("HND", block_size=1)
    reg = ops.register_caches(_filled(spec, 13), spec, token_slots=True)
    assert reg.spec is spec and reg.info.slot_block == 1


def test_too_many_slots_are_refused_and_the_views_go_without(monkeypatch, caplog):
    """More slots than the kernels' 32-bit division takes: the registration is refused by name,
    and an engine's views keep block units only (with a warning), as before token slots."""
    from kvxfer import paged

    spec = _spec("HND")  # 9 blocks of 5: 45 slots
    monkeypatch.setattr(paged, "MAX_SLOTS", 44)
    caches = _filled(spec, 18)
    with pytest.raises(ValueError, match="token_slots: 45 slots in caches, more than 44"):
        ops.register_caches(caches, spec, token_slots=True)
    with caplog.at_level(logging.WARNING, logger="kvxfer.views"):
        views = cache_views(caches, spec)
    assert [v.unit for v in views] == [spec.block_size]
    assert "token_slots: 45 slots in caches, more than 44" in caplog.text and "a call each" in caplog.text


# --------------------------------------------------------------------------- views
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cache_views_offer_token_slots_in_every_layout(layout):
    spec = _spec(layout)
    views = cache_views(_filled(spec, 14), spec)
    assert [v.unit for v in views] == [spec.block_size, 1]
    slots = views[1].caches
    if layout == "HND":  # no tensor view re-blocks HND: the kernels address its slots
        assert slots.info.slot_block == spec.block_size and slots[0].shape == views[0].caches[0].shape
    else:  # a plain block-size-1 view (the copy engines can still take its runs)
        assert slots.info.slot_block == 1 and slots[0].shape[2 if layout == "NHD" else 1] == 1


# --------------------------------------------------------------------------- GPU
def _round_trip(device: str, backend: str, layout: str) -> None:
    """Gather, scatter and copy by slot on ``device`` (the GPU test's body; rehearsed on CPU)."""
    spec = _spec(layout, torch.bfloat16, block_size=16, head_dim=128)
    heads = slice(0, 1) if layout == "MLA" else slice(1, 3)
    num_heads = heads.stop - heads.start
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    src = _filled(spec, 15, device)
    reg = ops.register_caches(src, spec, token_slots=True)
    slots = _slots(spec, 37, seed=16)
    wire = ops.gather_blocks(reg, reg.spec, slots, 37, heads.start, num_heads, backend=backend)
    sync()
    assert ops.last_backend() == backend
    _equal(_wire_rows(wire, spec), _read(src, spec, slots, heads), "gather")
    dst, want = _poisoned(spec, device), _poisoned(spec)
    _write(want, spec, slots, heads, _wire_rows(wire, spec))
    dreg = ops.register_caches(dst, spec, token_slots=True)
    ops.scatter_blocks(wire, dreg, dreg.spec, slots, 37, heads.start, backend=backend)
    sync()
    _equal(_all_bytes(dst), _all_bytes(want), "scatter")
    d2, want2 = _poisoned(spec, device), _poisoned(spec)
    d_slots = _slots(spec, 37, seed=17)
    _write(want2, spec, d_slots, heads, _read(src, spec, slots, heads))
    d2reg = ops.register_caches(d2, spec, token_slots=True)
    ops.copy_blocks(
        reg,
        reg.spec,
        slots,
        d2reg,
        d2reg.spec,
        d_slots,
        37,
        heads.start,
        heads.start,
        num_heads,
        backend=backend,
    )
    sync()
    _equal(_all_bytes(d2), _all_bytes(want2), "copy")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_rehearsed_on_cpu(layout):
    _round_trip("cpu", "cpu", layout)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_slots_on_gpu(layout, backend):
    if backend == "triton" and INTERPRETED:
        pytest.skip("TRITON_INTERPRET is set: Triton runs CPU tensors only")
    _round_trip("cuda", backend, layout)
