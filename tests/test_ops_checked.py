"""copy_blocks with producer-checked ids (ops.CheckedIds) on registered caches: the engine's
fast path gives the bytes of the validating path, and falls back to full checks whenever the
promise of the ids does not cover the op."""

import numpy as np
import pytest
import torch

from kvxfer import Layout
from kvxfer.ops import CheckedIds, copy_blocks, last_backend, register_caches
from tests.kvdata import as_bytes, empty_cache, place, truth_bytes
from tests.test_ops import CPU_BACKENDS, assert_bytes_equal, make_spec


def _ids(xs, bound, unique):
    return CheckedIds(np.asarray(xs, dtype=np.int64), bound, unique)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize(
    "src_layout,dst_layout,src_bs,dst_bs",
    [(Layout.NHD, Layout.HND, 16, 32), (Layout.HND, Layout.NHD, 5, 3), ("MLA", "MLA", 4, 8)],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e5m2])
def test_checked_ids_copy_matches_truth_and_leaves_poison(
    src_layout, dst_layout, src_bs, dst_bs, dtype, backend
):
    s_spec = make_spec(src_layout, dtype, src_bs, head_dim=40)
    d_spec = make_spec(dst_layout, dtype, dst_bs, head_dim=40)
    num_tokens = 37  # partial last block on both sides
    truth = truth_bytes(s_spec, num_tokens, seed=11)
    s_ids = list(range(s_spec.num_blocks_for(num_tokens)))[::-1]
    d_ids = [2 * i + 1 for i in range(d_spec.num_blocks_for(num_tokens))]
    mla = src_layout == "MLA"
    src = register_caches(empty_cache(s_spec, len(s_ids) + 1, 1 if mla else 4), s_spec)
    place(src, s_spec, truth, range(s_spec.num_kv_heads), s_ids)
    n_dst = 2 * len(d_ids) + 2
    dst = register_caches(empty_cache(d_spec, n_dst, 1 if mla else 2), d_spec)
    for head_start in [0] if mla else [1, 2]:  # two head slices on the same caches: two templates
        heads = range(head_start, head_start + (1 if mla else 2))
        want = register_caches(empty_cache(d_spec, n_dst, 1 if mla else 2), d_spec)
        for t, w in zip(dst, want):
            t.copy_(w)  # poison everywhere
        copy_blocks(
            src,
            s_spec,
            _ids(s_ids, len(s_ids) + 1, False),
            dst,
            d_spec,
            _ids(d_ids, n_dst, True),
            num_tokens,
            src_head_start=heads.start,
            num_heads=len(heads),
            backend=backend,
        )
        assert last_backend() == backend
        assert (heads.start, len(heads), None) in src.__dict__["_sides"]  # the template path ran
        place(want, d_spec, truth, heads, d_ids)
        assert_bytes_equal(as_bytes(dst), as_bytes(want))


def test_checked_ids_layer_subset_uses_its_own_template():
    spec = make_spec(Layout.NHD, torch.float16, 4, head_dim=8, heads=2, layers=4)
    truth = truth_bytes(spec, 9, seed=12)
    src = register_caches(empty_cache(spec, 4, 2), spec)
    place(src, spec, truth, range(2), [3, 0, 2])
    for layers in (None, [2, 0]):
        dst = register_caches(empty_cache(spec, 5, 2), spec)
        copy_blocks(
            src, spec, _ids([3, 0, 2], 4, False), dst, spec, _ids([4, 1, 0], 5, True), 9, layers=layers
        )
        want = register_caches(empty_cache(spec, 5, 2), spec)
        for layer in layers if layers is not None else range(4):
            place([want[layer]], spec, truth[layer : layer + 1], range(2), [4, 1, 0])
        assert_bytes_equal(as_bytes(dst), as_bytes(want))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_checked_ids_into_alternating_destinations_each_land_exactly(backend):
    """A source keeps what it checked per destination (and head slice, layers): copies that
    alternate between destinations of other layouts and block sizes, and a destination made
    anew each time, each land byte for byte and leave the rest poisoned."""
    s_spec = make_spec(Layout.NHD, torch.bfloat16, 4, head_dim=8)
    num_tokens = 10
    truth = truth_bytes(s_spec, num_tokens, seed=21)
    s_ids = [5, 1, 3]
    src = register_caches(empty_cache(s_spec, 6, 4), s_spec)
    place(src, s_spec, truth, range(4), s_ids)
    specs = {
        "hnd8": make_spec(Layout.HND, torch.bfloat16, 8, head_dim=8),
        "nhd2": make_spec(Layout.NHD, torch.bfloat16, 2, head_dim=8),
    }
    dsts = {k: register_caches(empty_cache(sp, 8, 4), sp) for k, sp in specs.items()}
    for k in ("hnd8", "nhd2", "hnd8", "fresh", "fresh"):
        sp = specs.get(k, specs["nhd2"])
        dst = dsts[k] if k in dsts else register_caches(empty_cache(sp, 8, 4), sp)
        for t in dst:
            t.copy_(empty_cache(sp, 8, 4)[0])  # poison again
        d_ids = list(range(8))[-sp.num_blocks_for(num_tokens) :]
        copy_blocks(
            src, s_spec, _ids(s_ids, 6, False), dst, sp, _ids(d_ids, 8, True), num_tokens, backend=backend
        )
        want = register_caches(empty_cache(sp, 8, 4), sp)
        place(want, sp, truth, range(4), d_ids)
        assert_bytes_equal(as_bytes(dst), as_bytes(want))


def test_checked_ids_whose_promise_does_not_cover_the_op_are_checked():
    spec = make_spec(Layout.NHD, torch.bfloat16, 4, head_dim=8, heads=2, layers=2)
    src = register_caches(empty_cache(spec, 3, 2), spec)
    dst = register_caches(empty_cache(spec, 3, 2), spec)
    before = as_bytes(dst).clone()
    # bound beyond this cache's block count: range checked, the bad id named
    with pytest.raises(ValueError, match="src_block_ids: block id 5 out of range"):
        copy_blocks(src, spec, _ids([5], 8, False), dst, spec, _ids([0], 3, True), 4)
    # destination ids not promised unique: repeats found
    with pytest.raises(ValueError, match="dst_block_ids: repeated block id 1"):
        copy_blocks(src, spec, _ids([0, 2], 3, False), dst, spec, _ids([1, 1], 3, False), 8)
    # too few ids for the tokens
    with pytest.raises(ValueError, match="needs 2 blocks"):
        copy_blocks(src, spec, _ids([0], 3, False), dst, spec, _ids([1, 2], 3, True), 8)
    # incompatible specs are refused on this path too
    other = make_spec(Layout.NHD, torch.float16, 4, head_dim=8, heads=2, layers=2)
    odst = register_caches(empty_cache(other, 3, 2), other)
    with pytest.raises(ValueError, match="incompatible caches"):
        copy_blocks(src, spec, _ids([0], 3, False), odst, other, _ids([0], 3, True), 4)
    assert torch.equal(as_bytes(dst), before)  # nothing written by a refused call


def _torch_calls(fn) -> list[str]:
    """The calls into torch (its C functions and Tensor methods, its Python code) while ``fn``
    runs: a torch call runs torch's dispatcher, ~6 us each with a cold cache."""
    import sys

    seen: list[str] = []

    def prof(frame, event, arg):
        if event == "c_call":
            q = getattr(arg, "__qualname__", "") or ""
            owner = type(getattr(arg, "__self__", None)).__module__ or ""
            module = getattr(arg, "__module__", "") or ""
            if (
                module.startswith("torch")
                or owner.startswith("torch")
                or q.startswith(("Tensor.", "TensorBase."))
            ):
                seen.append(q)
        elif event == "call" and "/torch/" in frame.f_code.co_filename:
            seen.append(f"{frame.f_code.co_filename.rsplit('/torch/', 1)[-1]}:{frame.f_code.co_name}")

    old = sys.getprofile()
    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(old)
    return seen


def test_the_engines_copy_makes_no_torch_call_once_its_sides_are_kept():
    """The engine's ops call (registered caches, checked ids, the native CPU backend): after
    the first call of a head slice has kept its template, a copy makes no torch call at all;
    the sides carry their ids as numpy and the device is kept (each torch call cost ~6 us of
    host time per request with a cold cache, profiling/bench_engine.py)."""
    from kvxfer.backends.registry import backend_status

    status = backend_status("cpu")["cpu"]
    if not status["available"]:
        pytest.skip(f"the native CPU backend does not load here: {status['reason']}")
    spec = make_spec(Layout.NHD, torch.bfloat16, 16)
    src = register_caches(empty_cache(spec, 9, 2), spec)
    dst = register_caches(empty_cache(spec, 9, 2), spec)

    def copy(ids):
        copy_blocks(src, spec, _ids(ids, 9, False), dst, spec, _ids(ids[::-1], 9, True), 40, backend="cpu")

    copy([1, 2, 3])  # keeps the templates and the backend's tables
    assert _torch_calls(lambda: copy([4, 5, 6])) == []
    assert last_backend() == "cpu"


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("kind", ["strided", "int32"])
def test_checked_ids_that_are_not_dense_int64_are_checked_and_made_dense(backend, kind):
    """Backends read a side's ids in place (the CPU one by address): checked ids that are a
    strided view or another dtype go through the full checks, which make them dense int64."""
    spec = make_spec(Layout.NHD, torch.bfloat16, 4)
    num_tokens = 10
    truth = truth_bytes(spec, num_tokens, seed=5)
    s_ids, d_ids = [6, 2, 4], [1, 5, 3]
    src = register_caches(empty_cache(spec, 8, 4), spec)
    place(src, spec, truth, range(4), s_ids)
    dst = register_caches(empty_cache(spec, 8, 4), spec)
    want = register_caches(empty_cache(spec, 8, 4), spec)

    def wrap(ids, unique):
        if kind == "strided":
            a = np.zeros(2 * len(ids), dtype=np.int64)
            a[::2] = ids
            return CheckedIds(a[::2], 8, unique)
        return CheckedIds(np.asarray(ids, dtype=np.int32), 8, unique)

    copy_blocks(src, spec, wrap(s_ids, False), dst, spec, wrap(d_ids, True), num_tokens, backend=backend)
    place(want, spec, truth, range(4), d_ids)
    assert_bytes_equal(as_bytes(dst), as_bytes(want))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize(
    "src_layout,dst_layout,src_bs,dst_bs,dtype",
    [
        (Layout.NHD, Layout.HND, 16, 32, torch.float16),
        (Layout.HND, Layout.NHD, 5, 3, torch.float8_e4m3fn),
        ("MLA", "MLA", 4, 8, torch.bfloat16),
    ],
)
def test_prepared_copy_gives_copy_blocks_bytes_call_after_call(
    src_layout, dst_layout, src_bs, dst_bs, dtype, backend
):
    """ops.PreparedCopy (the one-sided ipc load's copy): the bytes copy_blocks gives, for each of
    several calls with other ids and token counts (partial last blocks), poison elsewhere kept."""
    from kvxfer.ops import PreparedCopy

    s_spec = make_spec(src_layout, dtype, src_bs, head_dim=40)
    d_spec = make_spec(dst_layout, dtype, dst_bs, head_dim=40)
    mla = src_layout == "MLA"
    n_src = s_spec.num_blocks_for(64) + 1
    n_dst = 2 * d_spec.num_blocks_for(64) + 2
    src = register_caches(empty_cache(s_spec, n_src, 1 if mla else 4), s_spec)
    truth = truth_bytes(s_spec, 64, seed=3)
    s_all = list(range(n_src - 1))[::-1]
    place(src, s_spec, truth, range(s_spec.num_kv_heads), s_all)
    dst = register_caches(empty_cache(d_spec, n_dst, 1 if mla else 2), d_spec)
    want = register_caches(empty_cache(d_spec, n_dst, 1 if mla else 2), d_spec)
    heads = dict(src_head_start=0 if mla else 2, num_heads=1 if mla else 2)
    copy = PreparedCopy(src, dst, backend=backend, **heads)
    rng = np.random.default_rng(0)
    for num_tokens in (64, 37, 1):
        s_ids = s_all[: s_spec.num_blocks_for(num_tokens)]
        d_ids = [int(x) for x in rng.permutation(n_dst)[: d_spec.num_blocks_for(num_tokens)]]
        copy(_ids(s_ids, n_src, False), _ids(d_ids, n_dst, True), num_tokens)
        assert last_backend() == backend
        copy_blocks(src, s_spec, s_ids, want, d_spec, d_ids, num_tokens, backend=backend, **heads)
        assert_bytes_equal(as_bytes(dst), as_bytes(want))
    assert as_bytes(dst).ne(as_bytes(empty_cache(d_spec, n_dst, 1 if mla else 2))).any()  # it wrote


def test_prepared_copy_refuses_what_copy_blocks_refuses_before_writing():
    from kvxfer.ops import PreparedCopy

    spec = make_spec(Layout.NHD, torch.bfloat16, 4, head_dim=8, heads=2, layers=2)
    src = register_caches(empty_cache(spec, 3, 2), spec)
    dst = register_caches(empty_cache(spec, 3, 2), spec)
    before = as_bytes(dst).clone()
    copy = PreparedCopy(src, dst)
    with pytest.raises(ValueError, match="src_block_ids: block id 5 out of range"):
        copy(_ids([5], 8, False), _ids([0], 3, True), 4)
    with pytest.raises(ValueError, match="dst_block_ids: repeated block id 1"):
        copy([0, 2], [1, 1], 8)  # plain ids: checked like copy_blocks checks them
    with pytest.raises(ValueError, match="needs 2 blocks"):
        copy(_ids([0], 3, False), _ids([1, 2], 3, True), 8)
    with pytest.raises(ValueError, match="num_tokens"):
        copy(_ids([0], 3, False), _ids([1], 3, True), 2.0)
    copy(_ids([0], 3, False), _ids([1], 3, True), 0)  # nothing to copy
    assert torch.equal(as_bytes(dst), before)
    other = make_spec(Layout.NHD, torch.float16, 4, head_dim=8, heads=2, layers=2)
    with pytest.raises(ValueError, match="incompatible caches"):
        PreparedCopy(src, register_caches(empty_cache(other, 3, 2), other))
    with pytest.raises(ValueError, match="registered caches"):
        PreparedCopy(list(src), dst)
    with pytest.raises(ValueError, match="head"):
        PreparedCopy(src, dst, src_head_start=1, num_heads=2)
