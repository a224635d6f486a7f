"""The ops against independently built truth, byte for byte: the torch reference and the native
CPU backend (``cpu``) run every data test; validation runs before any backend is chosen."""

import itertools

import pytest
import torch

from kvxfer import KVCacheSpec, Layout
from kvxfer.ops import copy_blocks, gather_blocks, last_backend, scatter_blocks
from tests.kvdata import (
    as_bytes,
    empty_cache,
    first_difference,
    place,
    rank_cache,
    truth_bytes,
    wire_from_truth,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]
LAYOUTS = [Layout.NHD, Layout.HND, "MLA"]
# Both CPU backends, named explicitly: "cpu" not loading (it builds with g++ at install or on
# first use) fails these tests rather than silently testing the fallback twice.
CPU_BACKENDS = ["torch", "cpu"]


def make_spec(layout, dtype=torch.bfloat16, block_size=16, head_dim=72, heads=4, layers=3):
    if layout == "MLA":
        return KVCacheSpec(layers, 1, head_dim, block_size, dtype, use_mla=True)
    return KVCacheSpec(layers, heads, head_dim, block_size, dtype, layout)


def assert_bytes_equal(got: torch.Tensor, want: torch.Tensor):
    got = got.contiguous().view(torch.uint8).reshape(want.shape)
    assert torch.equal(got, want), first_difference(got, want)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("layout,dtype", list(itertools.product(LAYOUTS, DTYPES)))
def test_gather_scatter_roundtrip_matrix(layout, dtype, backend):
    spec = make_spec(layout, dtype, block_size=5)
    num_tokens = 23  # 4 full blocks + 3 tokens
    truth = truth_bytes(spec, num_tokens, seed=1)
    src_ids, dst_ids = [11, 3, 7, 0, 9], [2, 8, 4, 10, 6]
    heads = range(0, 1) if layout == "MLA" else range(1, 3)
    src = empty_cache(spec, 12, 1 if layout == "MLA" else 4)
    place(src, spec, truth, range(spec.num_kv_heads), src_ids)

    wire = gather_blocks(
        src, spec, src_ids, num_tokens, head_start=heads.start, num_heads=len(heads), backend=backend
    )
    assert last_backend() == backend
    assert_bytes_equal(wire, wire_from_truth(truth, spec, heads))

    dst = empty_cache(spec, 12, 1 if layout == "MLA" else 2)
    scatter_blocks(wire, dst, spec, dst_ids, num_tokens, backend=backend)
    assert last_backend() == backend
    want = empty_cache(spec, 12, 1 if layout == "MLA" else 2)
    place(want, spec, truth, heads, dst_ids)  # poison everywhere else, tail of block 6 included
    assert_bytes_equal(as_bytes(dst), as_bytes(want))


@pytest.mark.parametrize(
    "src_layout,dst_layout,src_bs,dst_bs",
    [
        (Layout.NHD, Layout.HND, 16, 32),
        (Layout.HND, Layout.NHD, 32, 16),
        (Layout.NHD, Layout.NHD, 7, 3),
        ("MLA", "MLA", 16, 32),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_copy_converts_layout_and_block_size(src_layout, dst_layout, src_bs, dst_bs, dtype, backend):
    s_spec = make_spec(src_layout, dtype, src_bs, head_dim=96)
    d_spec = make_spec(dst_layout, dtype, dst_bs, head_dim=96)
    num_tokens = 45
    truth = truth_bytes(s_spec, num_tokens, seed=2)
    s_ids = list(range(s_spec.num_blocks_for(num_tokens)))[::-1]
    d_ids = [2 * i + 1 for i in range(d_spec.num_blocks_for(num_tokens))]
    mla = src_layout == "MLA"
    src = empty_cache(s_spec, len(s_ids) + 1, 1 if mla else 4)
    place(src, s_spec, truth, range(s_spec.num_kv_heads), s_ids)
    dst = empty_cache(d_spec, 2 * len(d_ids) + 2, 1 if mla else 2)
    heads = range(0, 1) if mla else range(2, 4)
    copy_blocks(
        src,
        s_spec,
        s_ids,
        dst,
        d_spec,
        d_ids,
        num_tokens,
        src_head_start=heads.start,
        dst_head_start=0,
        num_heads=len(heads),
        backend=backend,
    )
    assert last_backend() == backend
    want = empty_cache(d_spec, 2 * len(d_ids) + 2, 1 if mla else 2)
    place(want, d_spec, truth, heads, d_ids)
    assert_bytes_equal(as_bytes(dst), as_bytes(want))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_layer_subset_and_out_buffer(backend):
    spec = make_spec(Layout.HND, torch.float16, 4, head_dim=8, layers=5)
    truth = truth_bytes(spec, 10, seed=3)
    src = rank_cache(spec, truth, 0, 1, [4, 1, 2], 6)
    layers = [4, 0, 2]
    out = torch.empty(spec.wire_shape(10, 4, 3), dtype=spec.dtype)
    got = gather_blocks(src, spec, [4, 1, 2], 10, layers=layers, out=out, backend=backend)
    assert got is out
    assert_bytes_equal(out, wire_from_truth(truth, spec, range(4), layers))
    dst = empty_cache(spec, 6, 4)
    scatter_blocks(out, dst, spec, [0, 3, 5], 10, layers=layers, backend=backend)
    for layer in range(5):
        want = empty_cache(spec, 6, 4)[0]
        if layer in layers:
            place([want], spec, truth[layer : layer + 1], range(4), [0, 3, 5])
        assert_bytes_equal(dst[layer], want.view(torch.uint8).reshape(dst[layer].view(torch.uint8).shape))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_noncontiguous_layer_views_of_one_buffer(backend):
    """Per-layer caches carved out of one allocation (as engines often do) at odd offsets."""
    spec = make_spec(Layout.NHD, torch.bfloat16, 8, head_dim=6, heads=2, layers=3)
    shape = spec.local_cache_shape(5, 2)
    n = torch.Size(shape).numel()
    buf = torch.zeros(3 * n + 3, dtype=torch.bfloat16)
    caches = [buf[1 + i * n : 1 + (i + 1) * n].view(shape) for i in range(3)]
    truth = truth_bytes(spec, 13, seed=4)
    place(caches, spec, truth, range(2), [3, 0])
    wire = gather_blocks(caches, spec, [3, 0], 13, backend=backend)
    assert_bytes_equal(wire, wire_from_truth(truth, spec, range(2)))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_zero_tokens_is_a_noop(backend):
    spec = make_spec(Layout.NHD)
    caches = empty_cache(spec, 4, 4)
    wire = gather_blocks(caches, spec, [], 0, backend=backend)
    assert wire.shape == (4, 3, 2, 0, 72)
    scatter_blocks(wire, caches, spec, [], 0, backend=backend)
    assert_bytes_equal(as_bytes(caches), as_bytes(empty_cache(spec, 4, 4)))


# ------------------------------------------------------------------------------- validation
@pytest.fixture
def setup():
    spec = make_spec(Layout.NHD, torch.bfloat16, 4, head_dim=8, heads=4, layers=2)
    return spec, empty_cache(spec, 6, 4)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(block_ids=[0, 6], num_tokens=8), "block id 6 out of range"),
        (dict(block_ids=[-1, 2], num_tokens=8), "block id -1 out of range"),
        (dict(block_ids=[0], num_tokens=5), "needs 2 blocks"),
        (dict(block_ids=[[0, 1]], num_tokens=5), "1-D"),
        (dict(block_ids=torch.tensor([0.0, 1.0]), num_tokens=5), "integers"),
        (dict(block_ids=[0, 1], num_tokens=-1), "num_tokens"),
        (dict(block_ids=[0, 1], num_tokens=5, head_start=3, num_heads=2), "head_start/num_heads"),
        (dict(block_ids=[0, 1], num_tokens=5, num_heads=0), "head_start/num_heads"),
        (dict(block_ids=[0, 1], num_tokens=5, layers=[2]), "layer 2 out of range"),
        (dict(block_ids=[0, 1], num_tokens=5, layers=[1, 1]), "repeated layer"),
        (dict(block_ids=[0, 1], num_tokens=5, backend="cuda-graph"), "backend"),
    ],
)
def test_gather_rejects(setup, kwargs, match):
    spec, caches = setup
    with pytest.raises(ValueError, match=match):
        gather_blocks(caches, spec, **kwargs)


def test_bad_caches_rejected(setup):
    spec, caches = setup
    with pytest.raises(ValueError, match="2 layers"):
        gather_blocks(caches[:1], spec, [0], 1)
    with pytest.raises(ValueError, match="dtype"):
        gather_blocks([c.view(torch.int16) for c in caches], spec, [0], 1)
    with pytest.raises(ValueError, match="block_size"):
        gather_blocks([c[:, :, :2] for c in caches], spec, [0], 1)
    with pytest.raises(ValueError, match=r"caches\[1\]"):
        gather_blocks([caches[0], caches[1][:, :3]], spec, [0], 1)
    with pytest.raises(ValueError, match="head_dim must be contiguous"):
        gather_blocks([c.transpose(3, 4).contiguous().transpose(3, 4) for c in caches], spec, [0], 1)
    with pytest.raises(ValueError, match="list of per-layer tensors"):
        gather_blocks(caches[0], spec, [0], 1)


def test_scatter_rejects_before_writing(setup):
    spec, caches = setup
    wire = torch.ones(spec.wire_shape(8, 4), dtype=spec.dtype)
    before = as_bytes(caches).clone()
    with pytest.raises(ValueError, match="repeated block id"):
        scatter_blocks(wire, caches, spec, [1, 1], 8)
    with pytest.raises(ValueError, match="block id 9 out of range"):
        scatter_blocks(wire, caches, spec, [1, 9], 8)
    with pytest.raises(ValueError, match="expected wire shape"):
        scatter_blocks(wire[:, :, :, :7], caches, spec, [1, 2], 8)
    with pytest.raises(ValueError, match="dtype"):
        scatter_blocks(wire.half(), caches, spec, [1, 2], 8)
    with pytest.raises(ValueError, match="contiguous"):
        scatter_blocks(wire.transpose(0, 1).contiguous().transpose(0, 1), caches, spec, [1, 2], 8)
    with pytest.raises(ValueError, match="head_start/num_heads"):
        scatter_blocks(wire[:2].contiguous(), caches, spec, [1, 2], 8, head_start=3)
    assert torch.equal(as_bytes(caches), before)


def test_gather_rejects_bad_out(setup):
    spec, caches = setup
    with pytest.raises(ValueError, match="expected wire shape"):
        gather_blocks(caches, spec, [0], 4, out=torch.empty(1, dtype=spec.dtype))
    with pytest.raises(ValueError, match="dtype"):
        gather_blocks(caches, spec, [0], 4, out=torch.empty(spec.wire_shape(4), dtype=torch.float16))


def test_copy_rejects_incompatible(setup):
    spec, caches = setup
    other = make_spec(Layout.NHD, torch.float16, 4, head_dim=8, heads=4, layers=2)
    with pytest.raises(ValueError, match="dtype differs"):
        copy_blocks(caches, spec, [0], empty_cache(other, 2, 4), other, [0], 4)
    with pytest.raises(ValueError, match="dst_block_ids: repeated"):
        copy_blocks(caches, spec, [0, 1], empty_cache(spec, 2, 4), spec, [1, 1], 8)
    with pytest.raises(ValueError, match="src_block_ids: block id 7"):
        copy_blocks(caches, spec, [7], empty_cache(spec, 2, 4), spec, [1], 4)


def test_registered_caches_give_same_result_and_still_check_spec():
    from kvxfer.ops import PagedCache, register_caches

    spec = make_spec(Layout.HND, torch.bfloat16, 4, head_dim=8, heads=2, layers=3)
    truth = truth_bytes(spec, 9, seed=5)
    plain = rank_cache(spec, truth, 0, 1, [2, 0, 1], 4)
    reg = register_caches(plain, spec)
    assert isinstance(reg, PagedCache) and len(reg) == 3 and reg[1] is plain[1]
    assert_bytes_equal(gather_blocks(reg, spec, [2, 0, 1], 9), wire_from_truth(truth, spec, range(2)))
    other = make_spec(Layout.HND, torch.bfloat16, 8, head_dim=8, heads=2, layers=3)
    with pytest.raises(ValueError, match="block_size"):
        gather_blocks(reg, other, [0], 4)  # a different spec re-validates the tensors
    with pytest.raises(ValueError, match="dtype"):
        register_caches([c.view(torch.int16) for c in plain], spec)


@pytest.mark.parametrize("backend", ["torch", "triton", "cpu"])
@pytest.mark.parametrize("layout", [Layout.NHD, Layout.HND])
def test_kv_second_allocation_passed_as_strided_view(layout, backend):
    """Caches allocated K/V-second ([num_blocks, 2, ...], as some attention backends do) are
    handed over as a transpose(0, 1) view: the ops follow the tensor's strides."""
    spec = make_spec(layout, torch.bfloat16, 8, head_dim=16, heads=4, layers=2)
    shape = spec.local_cache_shape(6, 4)  # (2, nb, ...)
    raw = [torch.full((shape[1], 2, *shape[2:]), 7, dtype=torch.bfloat16) for _ in range(2)]
    views = [r.transpose(0, 1) for r in raw]
    assert not views[0].is_contiguous()
    truth = truth_bytes(spec, 13, seed=6)
    place(views, spec, truth, range(4), [5, 2])
    # Triton runs interpreted on CPU tensors without a GPU, compiled on CUDA tensors with one.
    dev = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    raw = [r.to(dev) for r in raw]
    views = [r.transpose(0, 1) for r in raw]
    wire = gather_blocks(views, spec, [5, 2], 13, backend=backend)
    assert_bytes_equal(wire.cpu(), wire_from_truth(truth, spec, range(4)))
    dst_raw = [torch.zeros_like(r) for r in raw]
    dst = [r.transpose(0, 1) for r in dst_raw]
    scatter_blocks(wire, dst, spec, [1, 3], 13, backend=backend)
    want = [torch.zeros_like(r).transpose(0, 1).cpu() for r in raw]
    place(want, spec, truth, range(4), [1, 3])
    assert_bytes_equal(as_bytes([d.cpu() for d in dst]), as_bytes(want))


# --------------------------------------------------------------------------- backend choice
@pytest.fixture
def fresh_backends():
    from kvxfer import ops

    ops.reset_backends()
    yield ops
    ops.reset_backends()


def test_backend_status_says_why_each_backend_is_unavailable(fresh_backends):
    ops = fresh_backends
    st = ops.backend_status("cuda" if not torch.cuda.is_available() else "cpu")
    for name in ops.BACKENDS:
        assert set(st[name]) >= {"available", "reason", "default"}
        assert st[name]["available"] or st[name]["reason"], (name, st[name])
    assert sum(r["default"] for r in st.values()) == 1
    cpu = ops.backend_status("cpu")
    assert cpu["torch"]["available"]
    assert cpu["cpu" if cpu["cpu"]["available"] else "torch"]["default"]  # the native backend first
    assert not cpu["cuda"]["available"] and "CUDA tensors" in cpu["cuda"]["reason"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback chain of a machine without CUDA")
def test_fallback_past_an_unavailable_backend_is_logged_with_its_reason(fresh_backends, caplog):
    ops = fresh_backends
    with caplog.at_level("WARNING", logger="kvxfer.backends.registry"):
        assert ops.resolve_backend("cuda") == "torch"
        ops.resolve_backend("cuda")  # logged once per backend, not per call
    msgs = [r.getMessage() for r in caplog.records if r.name == "kvxfer.backends.registry"]
    assert len([m for m in msgs if "'cuda' unavailable" in m]) == 1, msgs
    assert any("no CUDA device is visible" in m for m in msgs), msgs


def test_forced_backend_env(fresh_backends, monkeypatch):
    """$KVXFER_BACKEND forces backend=None calls; an unusable forced backend is an error
    naming why, never a silent fallback."""
    ops = fresh_backends
    spec = make_spec(Layout.NHD, torch.float16, 4, head_dim=8, heads=2, layers=2)
    caches = [torch.zeros(spec.local_cache_shape(4, 2), dtype=spec.dtype) for _ in range(2)]
    monkeypatch.setenv(ops.FORCE_ENV, "cuda")
    with pytest.raises(
        ValueError, match=r"\$KVXFER_BACKEND: 'cuda' is not available for cpu tensors here \("
    ):
        gather_blocks(caches, spec, [1], 3)
    monkeypatch.setenv(ops.FORCE_ENV, "bogus")
    ops.reset_backends()
    with pytest.raises(ValueError, match=r"\$KVXFER_BACKEND: must be one of"):
        gather_blocks(caches, spec, [1], 3)
    monkeypatch.setenv(ops.FORCE_ENV, "torch")
    ops.reset_backends()
    gather_blocks(caches, spec, [1], 3)
    assert ops.last_backend() == "torch"


def test_cuda_order_env_reorders_cuda_tensors_only(fresh_backends, monkeypatch, caplog):
    """$KVXFER_CUDA_BACKENDS sets the order backend=None tries on CUDA tensors (an unusable
    entry is passed over with its reason); CPU tensors keep theirs; an unknown name raises
    naming the variable. Availability is seeded: no GPU is needed."""
    from kvxfer.backends import registry

    ops = fresh_backends
    cpu_default = ops.resolve_backend("cpu")

    def seed(**ok):
        ops.reset_backends()
        for name, avail in ok.items():
            registry._available[(name, "cuda")] = avail
            registry._why[(name, "cuda")] = "" if avail else f"{name} seeded unavailable"

    seed(cuda=True, triton=True, torch=True)
    assert registry.cuda_order() == registry.CUDA_ORDER == ("triton", "cuda", "torch")
    assert ops.resolve_backend("cuda") == "triton"  # the built-in order: Triton first
    monkeypatch.setenv(registry.CUDA_ORDER_ENV, "cuda, triton,torch")
    assert registry.cuda_order() == ("cuda", "triton", "torch")
    assert ops.resolve_backend("cuda") == "cuda"
    assert ops.resolve_backend("cpu") == cpu_default
    monkeypatch.delenv(registry.CUDA_ORDER_ENV)
    seed(cuda=True, triton=False, torch=True)
    with caplog.at_level("WARNING", logger="kvxfer.backends.registry"):
        assert ops.resolve_backend("cuda") == "cuda"
    assert any(
        "'triton' unavailable" in r.getMessage() and "seeded unavailable" in r.getMessage()
        for r in caplog.records
    )
    monkeypatch.setenv(registry.CUDA_ORDER_ENV, "triton,cudnn")
    with pytest.raises(ValueError, match=r"\$KVXFER_CUDA_BACKENDS='triton,cudnn'.*\['cudnn'\]"):
        ops.resolve_backend("cuda")
    assert ops.resolve_backend("cpu") == cpu_default


def test_warmup_covers_every_tile_bucket_with_one_small_wire(fresh_backends, monkeypatch):
    """ops.warmup hands the backend every power of two of tokens up to 4096 (the Triton token
    tiles come in power-of-two buckets) and one single-token wire for all of them: nothing is
    launched, and a 4K-token wire would stay in torch's allocator after an engine's start()."""
    import types

    ops = fresh_backends
    spec = make_spec(Layout.NHD, torch.float16, 16, head_dim=8, heads=2, layers=2)
    caches = [torch.zeros(spec.local_cache_shape(300, 2), dtype=spec.dtype) for _ in range(2)]
    seen = []
    fake = types.SimpleNamespace(warmup=lambda side, wire: seen.append((side.num_tokens, wire)))
    monkeypatch.setattr(ops, "_module", lambda name: fake)
    ops.warmup(caches, spec, backend="torch")
    assert [t for t, _ in seen] == [1 << k for k in range(13)]
    wires = {id(w) for _, w in seen}
    assert len(wires) == 1 and seen[0][1].shape[3] == 1, "one single-token wire for every size"
    seen.clear()
    small = [c[:, :10] for c in caches]  # 160 tokens fit: up to 128, then 160
    ops.warmup(small, spec, backend="torch")
    assert [t for t, _ in seen] == [1, 2, 4, 8, 16, 32, 64, 128, 160]


def test_warmup_prepares_without_touching_the_caches(fresh_backends):
    """ops.warmup resolves the backend and prepares its kernels; it never writes a cache."""
    ops = fresh_backends
    spec = make_spec(Layout.HND, torch.bfloat16, 16, head_dim=16, heads=2, layers=2)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    caches = [torch.full(spec.local_cache_shape(8, 2), 3, dtype=spec.dtype, device=dev) for _ in range(2)]
    before = [c.clone() for c in caches]
    name = ops.warmup(caches, spec)
    assert name == ops.resolve_backend(dev)
    if dev == "cpu":
        assert ops.warmup(caches, spec, backend="triton") == "triton"  # interpreter: nothing to compile
    assert all(torch.equal(a, b) for a, b in zip(caches, before))
