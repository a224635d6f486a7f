"""PreparedCopy.batch: a batch of requests in CSR form (source ids, destination ids, token counts)
lands the bytes one copy_blocks per request gives, in as few kernel calls as exactness allows,
and a bad batch is refused, naming what is wrong, before anything is written."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvxfer import Layout, ops
from kvxfer.ops import PreparedCopy, register_caches
from tests.kvdata import as_bytes, empty_cache
from tests.test_ops import CPU_BACKENDS, assert_bytes_equal, make_spec


def _random_cache(spec, num_blocks, heads, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for c in empty_cache(spec, num_blocks, heads):
        raw = c.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))
        out.append(c)
    return out


def _csr(segments):
    ids = (
        np.concatenate([np.asarray(s, dtype=np.int64) for s in segments])
        if segments
        else np.zeros(0, np.int64)
    )
    ptr = np.zeros(len(segments) + 1, dtype=np.int64)
    np.cumsum([len(s) for s in segments], out=ptr[1:])
    return ids, ptr


def _requests(s_spec, d_spec, tokens, n_src, n_dst, extra, seed):
    """Per request: source ids (any, may repeat across requests), destination ids (distinct
    over the batch), each with ``extra`` ids beyond what its tokens need."""
    rng = np.random.default_rng(seed)
    free = list(rng.permutation(n_dst))
    src, dst = [], []
    for n in tokens:
        src.append(rng.integers(0, n_src, s_spec.num_blocks_for(n) + extra).tolist())
        dst.append([int(free.pop()) for _ in range(d_spec.num_blocks_for(n) + extra)])
    return src, dst


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize(
    "src_layout,dst_layout,src_bs,dst_bs,tokens,calls",
    [
        (Layout.NHD, Layout.HND, 4, 8, [16, 5, 8, 0, 13], 2),  # ragged 5 and 13 close a call each
        (Layout.HND, Layout.NHD, 8, 8, [16, 24, 8, 3], 1),  # whole blocks but the last: one call
        ("MLA", "MLA", 4, 4, [3, 4, 7], 2),  # 3 closes a call; 4 then 7 share one
    ],
)
@pytest.mark.parametrize("extra", [0, 2])
def test_a_batch_lands_the_bytes_of_one_copy_per_request(
    src_layout, dst_layout, src_bs, dst_bs, tokens, calls, extra, backend
):
    s_spec = make_spec(src_layout, torch.bfloat16, src_bs, head_dim=24)
    d_spec = make_spec(dst_layout, torch.bfloat16, dst_bs, head_dim=24)
    mla = src_layout == "MLA"
    heads = dict(src_head_start=0 if mla else 1, dst_head_start=0, num_heads=1 if mla else 2)
    n_src, n_dst = 12, 40
    src = register_caches(_random_cache(s_spec, n_src, 1 if mla else 4, seed=1), s_spec)
    dst = register_caches(empty_cache(d_spec, n_dst, 1 if mla else 2), d_spec)
    want = register_caches(empty_cache(d_spec, n_dst, 1 if mla else 2), d_spec)
    s_segs, d_segs = _requests(s_spec, d_spec, tokens, n_src, n_dst, extra, seed=2)
    for s_ids, d_ids, n in zip(s_segs, d_segs, tokens):
        ops.copy_blocks(src, s_spec, s_ids, want, d_spec, d_ids, n, backend=backend, **heads)
    s_ids, s_ptr = _csr(s_segs)
    d_ids, d_ptr = _csr(d_segs)
    made = PreparedCopy(src, dst, backend=backend, **heads).batch(s_ids, s_ptr, d_ids, d_ptr, tokens)
    assert made == calls
    assert ops.last_backend() == backend
    assert_bytes_equal(as_bytes(dst), as_bytes(want))


def test_a_batch_of_token_slots_is_one_call():
    """Token-slot registrations (one id per token): any requests concatenate exactly."""
    spec = make_spec(Layout.HND, torch.float16, 4, head_dim=8, heads=2, layers=2)
    src = register_caches(_random_cache(spec, 6, 2, seed=3), spec, token_slots=True)
    dst = register_caches(empty_cache(spec, 6, 2), spec, token_slots=True)
    want = register_caches(empty_cache(spec, 6, 2), spec, token_slots=True)
    tokens = [3, 5, 1]
    rng = np.random.default_rng(4)
    d_all = rng.permutation(24)
    s_segs = [rng.integers(0, 24, n).tolist() for n in tokens]
    d_segs = [d_all[:3].tolist(), d_all[3:8].tolist(), d_all[8:9].tolist()]
    for s_ids, d_ids, n in zip(s_segs, d_segs, tokens):
        ops.copy_blocks(src, src.spec, s_ids, want, want.spec, d_ids, n, backend="torch")
    made = PreparedCopy(src, dst, backend="torch").batch(*_csr(s_segs), *_csr(d_segs), torch.tensor(tokens))
    assert made == 1
    assert_bytes_equal(as_bytes(dst), as_bytes(want))


def test_an_empty_batch_and_a_batch_of_no_tokens_run_nothing():
    spec = make_spec(Layout.NHD, torch.bfloat16, 4, head_dim=8, heads=2, layers=2)
    src = register_caches(_random_cache(spec, 4, 2, seed=5), spec)
    dst = register_caches(empty_cache(spec, 4, 2), spec)
    before = as_bytes(dst).clone()
    copy = PreparedCopy(src, dst)
    assert copy.batch([], [0], [], [0], []) == 0
    assert copy.batch([1], [0, 1, 1], [2], [0, 0, 1], [0, 0]) == 0
    assert torch.equal(as_bytes(dst), before)


BAD = [
    (dict(num_tokens=[4, -1]), r"num_tokens: request 1 has -1 tokens"),
    (dict(num_tokens=[4.0, 4.0]), r"num_tokens: must hold integers"),
    (dict(src_indptr=[0, 1]), r"src_indptr: 2 requests need 3 offsets, got 2"),
    (dict(dst_indptr=[1, 2, 2]), r"dst_indptr: must start at 0 and end at 2"),
    (dict(src_ids=[0, 1, 2], src_indptr=[0, 2, 1]), r"src_indptr: must start at 0 and end at 3"),
    (dict(src_indptr=[0, 3, 2]), r"src_indptr: offsets must not decrease \(request 1\)"),
    (dict(num_tokens=[8, 4]), r"num_tokens\[0\]: needs 2 blocks, but src_block_ids of request 0 has 1"),
    (dict(src_ids=[0, 9]), r"src_block_ids: block id 9 out of range \[0, 4\)"),
    (dict(dst_ids=[-1, 2]), r"dst_block_ids: block id -1 out of range"),
    (dict(dst_ids=[3, 3]), r"dst_block_ids: repeated block id 3 in a destination"),
    (dict(dst_ids=[[1, 2]]), r"dst_block_ids: must be 1-D"),
    (dict(max_sms=0), r"max_sms: must be a positive int"),
    (dict(dma="yes"), r"dma: must be None"),
]


@pytest.mark.parametrize("change,match", BAD)
def test_a_bad_batch_is_refused_before_anything_is_written(change, match):
    spec = make_spec(Layout.NHD, torch.bfloat16, 4, head_dim=8, heads=2, layers=2)
    src = register_caches(_random_cache(spec, 4, 2, seed=6), spec)
    dst = register_caches(empty_cache(spec, 4, 2), spec)
    before = as_bytes(dst).clone()
    args = dict(src_ids=[0, 1], src_indptr=[0, 1, 2], dst_ids=[2, 3], dst_indptr=[0, 1, 2], num_tokens=[4, 4])
    args.update(change)
    with pytest.raises(ValueError, match=match):
        PreparedCopy(src, dst, backend="torch").batch(**args)
    assert torch.equal(as_bytes(dst), before)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_run_bounded_lands_what_copy_blocks_lands_and_takes_only_its_own_bounds(backend):
    """PreparedCopy.run_bounded (ids bounded by their producer, as the one-sided load's) lands
    exactly the bytes copy_blocks does, partial last block included, and leaves other blocks
    alone; takes() agrees only to ids of the sides' own block sizes within their block counts
    (not token slots)."""
    s_spec = make_spec(Layout.NHD, torch.float16, 4, head_dim=8)
    d_spec = make_spec(Layout.HND, torch.float16, 4, head_dim=8)
    src = register_caches(_random_cache(s_spec, 10, 4, seed=5), s_spec)
    dst = register_caches(_random_cache(d_spec, 12, 2, seed=6), d_spec)  # random: a poison
    want = register_caches([c.clone() for c in dst], d_spec)
    heads = dict(src_head_start=2, dst_head_start=0, num_heads=2)
    s_ids = np.array([7, 2, 9], dtype=np.int64)
    d_ids = np.array([11, 0, 5], dtype=np.int64)
    ops.copy_blocks(src, s_spec, s_ids, want, d_spec, d_ids, 10, backend=backend, **heads)
    copy = PreparedCopy(src, dst, backend=backend, **heads)
    assert copy.takes(4, 10, 4, 12) and copy.takes(4, 3, 4, 12)
    assert not copy.takes(4, 11, 4, 12) and not copy.takes(4, 10, 4, 13)  # beyond a side
    assert not copy.takes(8, 10, 4, 12) and not copy.takes(4, 10, 1, 12)  # another unit
    copy.run_bounded(s_ids, d_ids, 10)  # 10 tokens: the third block partial
    assert_bytes_equal(as_bytes(dst), as_bytes(want))
    slots = register_caches(empty_cache(d_spec, 12, 2), d_spec, token_slots=True)
    assert not PreparedCopy(src, slots, backend=backend, **heads).takes(4, 10, 1, 48)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_run_bounded_calls_in_a_row_and_from_threads_each_land_their_own_ids(backend, monkeypatch):
    """run_bounded reuses its sides between calls: each call lands its own ids and token count
    (not the last call's), from one thread and from several at once, and a call that raises
    leaves the next one correct."""
    import threading

    spec = make_spec(Layout.NHD, torch.bfloat16, 4, head_dim=8)
    src = register_caches(_random_cache(spec, 40, 2, seed=7), spec)
    dst = register_caches(_random_cache(spec, 40, 2, seed=8), spec)  # random: a poison
    want = register_caches([c.clone() for c in dst], spec)
    copy = PreparedCopy(src, dst, backend=backend)
    rng = np.random.default_rng(3)
    dst_free = rng.permutation(40)
    calls = []
    for n in [9, 4, 13, 1, 16, 7, 3, 12]:
        nb = spec.num_blocks_for(n)
        s = rng.integers(0, 40, nb).astype(np.int64)
        d, dst_free = dst_free[:nb].astype(np.int64), dst_free[nb:]
        calls.append((s, d, n))
        ops.copy_blocks(src, spec, s, want, spec, d, n, backend=backend)
    for s, d, n in calls[:3]:
        copy.run_bounded(s, d, n)
    import kvxfer.prepared as prepared

    def failing(*args):
        raise RuntimeError("simulated launch failure")

    with monkeypatch.context() as m:
        m.setattr(prepared, "launch", failing)
        with pytest.raises(RuntimeError, match="simulated"):
            copy.run_bounded(*calls[3])
    copy.run_bounded(*calls[3])
    errors = []

    def run(part):
        try:
            for s, d, n in part:
                copy.run_bounded(s, d, n)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(calls[i::2],)) for i in (4, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors and not any(t.is_alive() for t in threads)
    assert_bytes_equal(as_bytes(dst), as_bytes(want))
