"""Descriptor lists of the nixl direct path, without NIXL: the runs a READ would move (by
address, or by index into the tables prepared once per peer) are replayed with memmove on real
caches and compared byte for byte with ``copy_blocks`` (poison everywhere else, partial last
blocks included); when the direct path is refused, and why."""

from __future__ import annotations

import ctypes
import itertools

import numpy as np
import pytest
import torch

from kvxfer import KVCacheSpec, Layout
from kvxfer.ops import copy_blocks
from kvxfer.transports.nixl.descs import (
    CacheGeometry,
    DirectTables,
    block_runs,
    coalesce,
    descs,
    direct_why,
    epoch_index,
    epoch_runs,
    storages,
)
from tests.kvdata import as_bytes, empty_cache, first_difference, place, truth_bytes


def _spec(kind: str, bs: int, dtype=torch.bfloat16, heads=4, head_dim=24, layers=3) -> KVCacheSpec:
    if kind == "MLA":
        return KVCacheSpec(layers, 1, head_dim, bs, dtype, use_mla=True)
    return KVCacheSpec(layers, heads, head_dim, bs, dtype, Layout(kind))


def _split(ids: list[int], num_tokens: int, bs: int):
    """One call's full blocks, and its partial tail (as block_runs takes them)."""
    nfull = num_tokens // bs
    tail = num_tokens % bs
    return (
        np.array(ids[:nfull], dtype=np.int64),
        np.array(ids[nfull : nfull + (1 if tail else 0)], dtype=np.int64),
        np.array([tail] if tail else [], dtype=np.int64),
    )


def _replay(src_caches, s_spec, s_ids, dst_caches, d_spec, d_ids, n, src_h0, dst_h0, heads) -> int:
    """Build the direct read's runs and move them with memmove; returns the number of runs."""
    sg, dg = CacheGeometry.of(src_caches, s_spec), CacheGeometry.of(dst_caches, d_spec)
    assert direct_why(sg, dg, src_h0, dst_h0, heads) == ""
    fs, ts, tt = _split(s_ids, n, s_spec.block_size)
    fd, td, _ = _split(d_ids, n, d_spec.block_size)
    sa, sl = block_runs(sg, src_h0, heads, fs, ts, tt)
    da, dl = block_runs(dg, dst_h0, heads, fd, td, tt)
    assert np.array_equal(sl, dl)
    sa, da, ln = coalesce(sa, da, sl)
    d = descs(sa, ln, 0)
    assert d.shape == (sa.size, 3) and d.dtype == np.uint64
    for s, t, k in zip(sa.tolist(), da.tolist(), ln.tolist()):
        ctypes.memmove(t, s, k)
    return int(sa.size)


CASES = [
    # kind, block, src heads on rank, dst heads on rank, src head start, dst head start, heads read
    ("NHD", 8, 4, 4, 0, 0, 4),
    ("HND", 8, 4, 2, 2, 0, 2),  # P tp=1 -> D tp=2, rank 1's heads
    ("HND", 16, 2, 4, 0, 2, 2),  # P tp=2 rank 1 -> D tp=1
    ("MLA", 16, 1, 1, 0, 0, 1),
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
@pytest.mark.parametrize("num_tokens", [1, 16, 37])
def test_direct_runs_move_exactly_what_copy_blocks_moves(case, dtype, num_tokens):
    kind, bs, sh, dh, s0, d0, n = CASES[case]
    spec = _spec(kind, bs, dtype)
    truth = truth_bytes(spec, num_tokens, seed=3)
    need = spec.num_blocks_for(num_tokens)
    s_ids = [9, 3, 4, 5, 0][:need]  # 3, 4, 5 adjacent: coalesced
    d_ids = [1, 6, 7, 8, 11][:need]
    src = empty_cache(spec, 12, sh, fill=0x3C)  # not the destination's poison: overreads show
    global_src = range(s0, s0 + n) if kind != "MLA" else range(1)
    place(src, spec, truth, global_src, s_ids, local_head_start=s0 if kind != "MLA" else 0)
    got = empty_cache(spec, 12, dh)
    want = empty_cache(spec, 12, dh)
    runs = _replay(src, spec, s_ids, got, spec, d_ids, num_tokens, s0, d0, n)
    copy_blocks(src, spec, s_ids, want, spec, d_ids, num_tokens, s0, d0, n)
    assert torch.equal(as_bytes(got), as_bytes(want)), first_difference(as_bytes(got), as_bytes(want))
    assert runs > 0


def test_adjacent_blocks_coalesce_to_one_run_per_plane():
    spec = _spec("NHD", 16)
    caches = empty_cache(spec, 16, 4)
    g = CacheGeometry.of(caches, spec)
    full = np.array([3, 4, 5, 9], dtype=np.int64)
    a, ln = block_runs(g, 0, 4, full, np.zeros(0, np.int64), np.zeros(0, np.int64))
    assert a.size == 3 * 2 * 4  # layers x kv x blocks
    sa, _, cl = coalesce(a, a + np.uint64(1 << 40), ln)
    assert sa.size == 3 * 2 * 2  # [3..5] and [9] per (layer, kv)
    assert int(cl.sum()) == int(ln.sum())
    assert set(cl.tolist()) == {3 * g.block_stride, g.block_stride}
    # only pairs contiguous on BOTH sides merge
    _, _, cl2 = coalesce(a, a[::-1].copy(), ln)
    assert cl2.size == a.size


def test_kv_second_strided_view_and_layers_of_one_buffer():
    """K/V-second allocations passed as transpose(0, 1) views, and layers carved from one
    buffer: the geometry follows the strides; registration takes each allocation once."""
    spec = _spec("NHD", 8, heads=2)
    shape = spec.local_cache_shape(6, 2)
    big = torch.empty((3, shape[1], 2, *shape[2:]), dtype=torch.bfloat16)
    big.view(torch.uint8).fill_(0x3C)
    src = [big[i].transpose(0, 1) for i in range(3)]
    assert len(storages(src)) == 1
    truth = truth_bytes(spec, 13, seed=4)
    place(src, spec, truth, range(2), [5, 2])
    got_raw = torch.empty_like(big)  # poisoned apart from the source
    got_raw.view(torch.uint8).fill_(0xA5)
    got = [got_raw[i].transpose(0, 1) for i in range(3)]
    want = [g.contiguous() for g in got]
    _replay(src, spec, [5, 2], got, spec, [1, 3], 13, 0, 0, 2)
    copy_blocks(src, spec, [5, 2], want, spec, [1, 3], 13)
    assert torch.equal(as_bytes(got), as_bytes(want))


def _padded_hnd(spec: KVCacheSpec, nb: int, heads: int) -> list[torch.Tensor]:
    raw = torch.zeros((2, nb, heads, spec.block_size, spec.head_dim + 8), dtype=spec.dtype)
    return [raw[..., : spec.head_dim] for _ in range(spec.num_layers)]


def test_direct_refused_with_the_reason():
    nhd16, nhd32, hnd16 = _spec("NHD", 16), _spec("NHD", 32), _spec("HND", 16)
    g = {
        "nhd16x4": CacheGeometry.of(empty_cache(nhd16, 4, 4), nhd16),
        "nhd16x2": CacheGeometry.of(empty_cache(nhd16, 4, 2), nhd16),
        "nhd32x4": CacheGeometry.of(empty_cache(nhd32, 4, 4), nhd32),
        "hnd16x4": CacheGeometry.of(empty_cache(hnd16, 4, 4), hnd16),
        "hnd16pad": CacheGeometry.of(_padded_hnd(hnd16, 4, 4), hnd16),
        "mla16": CacheGeometry.of(empty_cache(_spec("MLA", 16), 4, 1), _spec("MLA", 16)),
    }
    assert direct_why(g["nhd16x4"], g["nhd16x4"], 0, 0, 4) == ""
    assert "layouts differ (NHD -> HND)" in direct_why(g["nhd16x4"], g["hnd16x4"], 0, 0, 4)
    assert "block sizes differ (16 -> 32)" in direct_why(g["nhd16x4"], g["nhd32x4"], 0, 0, 4)
    assert "takes 2 of them" in direct_why(g["nhd16x4"], g["nhd16x2"], 2, 0, 2)  # TP 1 -> 2 in NHD
    assert "padded" in direct_why(g["hnd16pad"], g["hnd16x4"], 0, 0, 4)
    assert "layouts differ (MLA -> NHD)" in direct_why(g["mla16"], g["nhd16x4"], 0, 0, 1)
    assert direct_why(g["hnd16x4"], g["hnd16x4"], 1, 2, 2) == ""  # any head range in HND


def test_geometry_round_trips_and_rejects_garbage():
    spec = _spec("HND", 16)
    g = CacheGeometry.of(empty_cache(spec, 4, 4), spec)
    assert CacheGeometry.from_dict(g.to_dict()) == g
    with pytest.raises(ValueError, match="missing field"):
        CacheGeometry.from_dict({"kind": "NHD"})
    bad = g.to_dict() | {"kind": "XYZ"}
    with pytest.raises(ValueError, match="kind"):
        CacheGeometry.from_dict(bad)
    with pytest.raises(ValueError, match="block_stride"):
        CacheGeometry.from_dict(g.to_dict() | {"block_stride": -1})


def test_epoch_runs_one_word_per_block():
    a, ln = epoch_runs(1000, 4)
    assert a.tolist() == [1000, 1008, 1016, 1024] and ln.tolist() == [8] * 4
    got = epoch_index([np.array([5, 6, 7, 2]), np.array([2, 6, 0])], 8)
    assert got.tolist() == [0, 2, 5, 6, 7] and got.dtype == np.int32  # each block once, ascending
    assert epoch_index([np.zeros(0, np.int64)], 8).size == 0
    for bad in (8, -1):
        with pytest.raises(ValueError, match="out of range"):
            epoch_index([np.array([1, bad])], 8)


def test_runs_for_a_4k_token_request_are_vectorised():
    """32 layers, 256 blocks, a tail: one numpy expression per side, lists of equal length."""
    spec = KVCacheSpec(32, 8, 128, 16, torch.bfloat16)
    g = CacheGeometry.of([torch.empty(spec.cache_shape(300, 1), dtype=spec.dtype)] * 32, spec)
    rng = np.random.default_rng(0)
    ids = rng.permutation(300)[:257]
    a, ln = block_runs(g, 0, 8, ids[:256], ids[256:], np.array([5]))
    assert a.size == ln.size == 32 * 2 * 257
    assert int(ln.sum()) == 32 * 2 * (256 * 16 + 5) * 8 * 128 * 2
    assert list(itertools.islice(ln.tolist(), 2)) == [16 * 8 * 128 * 2] * 2


@pytest.mark.parametrize("kind", ["NHD", "HND", "MLA"])
@pytest.mark.parametrize("first", [0, 16, 21, 47])
@pytest.mark.parametrize("layers", [None, [0, 2]])
def test_direct_runs_of_partial_loads_and_layer_groups(kind, first, layers):
    """The real planner's calls (block units, a partial load starting inside a block: a head
    call at the same offset on both sides; n>1 siblings sharing a prefix) and a layer group of
    a layer-wise export, replayed with memmove: exactly tokens [first, n) of those layers move,
    nothing else changes (the independent oracle of the staging tests)."""
    from kvxfer.batching import Item, plan_batch
    from tests.cache_oracle import bytes_equal, expected_dst, make_cache, poisoned

    spec = KVCacheSpec(3, 1, 40, 16, torch.bfloat16, use_mla=True) if kind == "MLA" else _spec(kind, 16)
    heads = spec.num_kv_heads
    src = make_cache(spec, 24, heads, 0)
    dst = poisoned(spec, 24, heads)
    n1, n2 = 60, 50  # two requests: the second a sibling sharing the first block
    s1, d1 = [3, 4, 9, 10], [11, 12, 5, 6]
    s2, d2 = [3, 20, 21, 22], [11, 0, 1, 2]
    want = expected_dst(
        src, spec, torch.tensor(s1), dst, spec, torch.tensor(d1), n1, 0, 0, heads, first, layers
    )
    want = expected_dst(
        src, spec, torch.tensor(s2), want, spec, torch.tensor(d2), n2, 0, 0, heads, first, layers
    )
    items = [
        Item("a", np.array(s1), np.array(d1), n1, first=first),
        Item("b", np.array(s2), np.array(d2), n2, first=first),
    ]
    bp = plan_batch(items, 16, [16], 16, [16])
    tables = DirectTables(CacheGeometry.of(src, spec), CacheGeometry.of(dst, spec), [(0, 0, heads)])
    moved = _replay_tables(tables, bp.calls, [(0, 0, heads)], layers)
    assert bytes_equal(dst, want), [(c.num_tokens, c.src_offset) for c in bp.calls]
    assert moved > 0


def _replay_tables(tables: DirectTables, calls, keys, layers=None) -> int:
    """What one direct READ of ``calls`` moves through the prepared tables (indices into every
    block's descriptors, then the partial blocks' runs), replayed with memmove; returns the
    bytes moved. Each indexed pair must have equal lengths (NIXL refuses others)."""
    sa, sl = tables.src.runs()
    da, dl = tables.dst.runs()
    assert sa.size == tables.src.size and da.size == tables.dst.size
    sel = tables.select(calls, keys, layers)
    assert sel.src.shape == sel.dst.shape
    assert np.array_equal(sl[sel.src], dl[sel.dst])
    pairs = list(zip(sa[sel.src].tolist(), da[sel.dst].tolist(), sl[sel.src].tolist()))
    pairs += list(zip(sel.tail_src.tolist(), sel.tail_dst.tolist(), sel.tail_lens.tolist()))
    for s, t, k in pairs:
        ctypes.memmove(t, s, k)
    return sum(k for _, _, k in pairs)


class _Call:
    """A stand-in for :class:`kvxfer.batching.Call` (block units, no offset)."""

    def __init__(self, src, dst, num_tokens, src_offset=0, dst_offset=0) -> None:
        self.src, self.dst, self.num_tokens = np.asarray(src), np.asarray(dst), num_tokens
        self.src_offset, self.dst_offset, self.src_unit, self.dst_unit = src_offset, dst_offset, 0, 0


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("num_tokens", [1, 16, 37])
def test_prepared_tables_move_exactly_what_copy_blocks_moves(case, dtype, num_tokens):
    """Indices into the per-peer tables (and the tails by address) move the same bytes as
    ``copy_blocks``, for head slices of HND and for MLA; nothing else changes."""
    kind, bs, sh, dh, s0, d0, n = CASES[case]
    spec = _spec(kind, bs, dtype)
    truth = truth_bytes(spec, num_tokens, seed=5)
    need = spec.num_blocks_for(num_tokens)
    s_ids = [9, 3, 4, 5, 0][:need]
    d_ids = [1, 6, 7, 8, 11][:need]
    src = empty_cache(spec, 12, sh, fill=0x3C)
    global_src = range(s0, s0 + n) if kind != "MLA" else range(1)
    place(src, spec, truth, global_src, s_ids, local_head_start=s0 if kind != "MLA" else 0)
    got, want = empty_cache(spec, 12, dh), empty_cache(spec, 12, dh)
    key = (s0, d0, n)
    other = (0, 0, 1) if kind == "HND" and key != (0, 0, 1) else None  # a second slice in the tables
    tables = DirectTables(
        CacheGeometry.of(src, spec), CacheGeometry.of(got, spec), [k for k in (other, key) if k is not None]
    )
    moved = _replay_tables(tables, [_Call(s_ids, d_ids, num_tokens)], [key])
    copy_blocks(src, spec, s_ids, want, spec, d_ids, num_tokens, s0, d0, n)
    assert torch.equal(as_bytes(got), as_bytes(want)), first_difference(as_bytes(got), as_bytes(want))
    heads_bytes = (
        n * spec.head_dim * spec.dtype.itemsize if kind != "MLA" else spec.head_dim * spec.dtype.itemsize
    )
    assert moved == spec.num_layers * (1 if kind == "MLA" else 2) * num_tokens * heads_bytes


def test_tables_index_order_and_refusals():
    """Indices follow ``[layer, kv, blocks]`` of the slice's range, one per whole block; a block
    id out of range, a read not prepared, or a call in token units are refused by name."""
    spec = _spec("HND", 16, heads=4)
    caches = empty_cache(spec, 10, 4)
    g = CacheGeometry.of(caches, spec)
    t = DirectTables(g, g, [(0, 0, 2), (2, 2, 2)])
    assert t.src.size == 2 * 3 * 2 * 10  # slices x layers x kv x blocks
    sel = t.select([_Call([4, 5], [7, 8], 32)], [(2, 2, 2)], layers=[1])
    base = 1 * 3 * 2 * 10  # slice 1
    assert sel.src.tolist() == [base + 2 * 10 + 4, base + 2 * 10 + 5, base + 3 * 10 + 4, base + 3 * 10 + 5]
    assert sel.dst.tolist() == [base + 2 * 10 + 7, base + 2 * 10 + 8, base + 3 * 10 + 7, base + 3 * 10 + 8]
    assert sel.tail_src.size == 0
    with pytest.raises(ValueError, match="source block id out of range"):
        t.select([_Call([10], [0], 16)], [(0, 0, 2)])
    with pytest.raises(ValueError, match="destination block id out of range"):
        t.select([_Call([0, 1], [0, 10], 20)], [(0, 0, 2)])
    with pytest.raises(ValueError, match="not prepared"):
        t.select([_Call([0], [0], 16)], [(1, 1, 2)])
    c = _Call([0], [0], 16)
    c.src_unit = 1
    with pytest.raises(ValueError, match="token units"):
        t.select([c], [(0, 0, 2)])
    nhd = _spec("NHD", 16, heads=4)
    gn = CacheGeometry.of(empty_cache(nhd, 4, 4), nhd)
    with pytest.raises(ValueError, match="not direct"):
        DirectTables(gn, gn, [(0, 0, 2)])  # NHD: half of a token row is not one run


def test_index_of_a_4k_token_batch_is_vectorised_and_small():
    """1 x 4096 tokens over 32 layers: 32 x 2 x 256 indices per side and 32 x 2 tail runs."""
    spec = KVCacheSpec(32, 8, 128, 16, torch.bfloat16)
    g = CacheGeometry.of([torch.empty(spec.cache_shape(300, 1), dtype=spec.dtype)] * 32, spec)
    t = DirectTables(g, g, [(0, 0, 8)])
    rng = np.random.default_rng(0)
    ids = rng.permutation(300)[:257]
    sel = t.select([_Call(ids, ids[::-1].copy(), 4096 + 5)], [(0, 0, 8)])
    assert sel.src.size == sel.dst.size == 32 * 2 * 256
    assert sel.tail_src.size == 32 * 2 and set(sel.tail_lens.tolist()) == {5 * 8 * 128 * 2}
