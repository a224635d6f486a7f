"""Tier 1: the connector's view of vLLM's KV caches (kvxfer.vllm.layout) against fakes of vLLM's
cache tensors: FlashAttention-style caches (token rows) and CPU_ATTN pages (ISA ``vec``: K
column-major) viewed without a copy, the views refused naming the problem, which layouts pair
(every byte landing right; else ``KVLayoutMismatch``), and ``caches_from_vllm``."""

from __future__ import annotations

import json

import pytest
import torch

from kvxfer.vllm.layout import KVLayout, KVLayoutMismatch, caches_from_vllm, check_pair, kvxfer_view

from .vllm_adapter_servers import _fill_random
from .vllm_fakes import cpu_cache, cpu_vec_read, cpu_vec_write, fa_cache, fa_kernel_kv


@pytest.mark.parametrize("physical", ["LBNHC", "LBHNC"])
def test_fa_view_is_the_kernels_k_and_v_without_copy(physical):
    t = fa_cache(6, 2, 16, 8, torch.bfloat16, physical)
    _fill_random(t, 1)
    v = kvxfer_view(t, "FLASH_ATTN", 8, False)
    k_kern, v_kern = fa_kernel_kv(t, 8)
    assert v.shape == (2, 6, 2, 16, 8)
    assert torch.equal(v[0].transpose(1, 2).view(torch.int16), k_kern.view(torch.int16))
    assert torch.equal(v[1].transpose(1, 2).view(torch.int16), v_kern.view(torch.int16))
    assert v.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()


def test_cpu_view_is_the_pages_bytes_not_token_rows():
    """The CPU_ATTN view's rows are each page's bytes in order: V rows are tokens under ISA
    vec, K rows are not (K is column-major), hence whole-block moves only."""
    n, d = 32, 16
    t = cpu_cache(5, 2, n, d, torch.float16)
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(2, 40, 2, d, generator=g).to(torch.float16)
    cpu_vec_write(t, [3, 1], k, v)
    view = kvxfer_view(t, "CPU_ATTN", d, False)
    assert (
        view.shape == (2, 5, 2, n, d) and view.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    )
    assert torch.equal(view[1, 3].transpose(0, 1), v[:n])  # V of block 3: token rows
    assert torch.equal(view[1, 1, :, : 40 - n].transpose(0, 1), v[n:])
    assert not torch.equal(view[0, 3].transpose(0, 1), k[:n])  # K is not
    assert torch.equal(view[0, 3].reshape(2, d, n).permute(2, 0, 1), k[:n])  # it is [d, N] per page
    got_k, got_v = cpu_vec_read(t, [3, 1], 40)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)


def test_mla_view():
    t = torch.zeros(7, 1, 16, 576, dtype=torch.bfloat16)
    v = kvxfer_view(t, "FLASHMLA", 576, True)
    assert v.shape == (7, 16, 576) and v.data_ptr() == t.data_ptr()


@pytest.mark.parametrize(
    ("t", "backend", "mla", "needle"),
    [
        (torch.zeros(2, 6, 16, 2, 8), "FLASH_ATTN", False, "4-D"),
        (torch.zeros(6, 2, 16, 24), "FLASH_ATTN", False, "content dim is 24"),
        (torch.zeros(6, 2, 16, 16), "ROCM_AITER_FA", False, "not supported"),
        (torch.zeros(6, 2, 16, 16), "ROCM_ATTN", False, "not supported"),
        (torch.zeros(6, 16, 2, 16).transpose(1, 2), "CPU_ATTN", False, "contiguous"),
        (torch.zeros(6, 2, 16, 16), "FLASHMLA", True, "one latent head"),
        (torch.zeros(6, 1, 16, 16), "ROCM_AITER_MLA", True, "does not know"),
    ],
)
def test_views_reject_naming_the_problem(t, backend, mla, needle):
    with pytest.raises(ValueError, match=needle):
        kvxfer_view(t, backend, 8, mla)


def test_layouts_pair_only_where_every_byte_lands_right():
    fa16, fa32 = KVLayout("FLASH_ATTN", 16, True), KVLayout("FLASHINFER", 32, True)
    vec, vec_b = KVLayout("CPU_ATTN", 32, False, "vec"), KVLayout("CPU_ATTN", 32, False, "vec")
    check_pair(fa16, fa32)  # token rows: kvxfer converts block size and order
    check_pair(vec, vec_b)  # identical pages
    assert vec.whole_blocks and not fa16.whole_blocks
    assert KVLayout.from_dict(json.loads(json.dumps(vec.to_dict()))) == vec
    for src, dst, needle in [
        (fa16, vec, "token rows"),
        (vec, fa16, "token rows"),
        (vec, KVLayout("CPU_ATTN", 32, False, "amx"), "isa vec vs amx"),
        (vec, KVLayout("CPU_ATTN", 64, False, "vec"), "block_size 32 vs 64"),
        (vec, KVLayout("CPU_ATTN", 32, False, "vec", "fp8"), "cache_dtype auto vs fp8"),
        (KVLayout("CPU_ATTN", 32, False, None), KVLayout("CPU_ATTN", 32, False, None), "ISA is unknown"),
    ]:
        with pytest.raises(KVLayoutMismatch, match=needle):
            check_pair(src, dst)
    with pytest.raises(ValueError, match=r"kv_layout\.token_rows"):
        KVLayout.from_dict({"backend": "X", "block_size": 16, "token_rows": "yes"})


def test_caches_from_vllm_dedups_shared_layers_and_checks_heads():
    a, b = cpu_cache(4, 2, 32, 8, torch.float16), cpu_cache(4, 2, 32, 8, torch.float16)
    spec, views, names, layout = caches_from_vllm(
        {"l0": a, "l1": b, "l2": a},
        backend="CPU_ATTN",
        head_size=8,
        total_kv_heads=4,
        tp_size=2,
        use_mla=False,
        isa="vec",
    )
    assert names == ["l0", "l1"] and len(views) == 2
    assert (spec.num_layers, spec.num_kv_heads, spec.block_size, spec.layout.value) == (2, 4, 32, "HND")
    assert layout == KVLayout("CPU_ATTN", 32, False, "vec", "auto")
    with pytest.raises(ValueError, match="kv heads per rank"):
        caches_from_vllm(
            {"l0": a}, backend="CPU_ATTN", head_size=8, total_kv_heads=8, tp_size=2, use_mla=False
        )
    for dt in ("nvfp4", "int8_per_token_head", "turboquant_k8v4"):
        with pytest.raises(ValueError, match=f"cache_dtype '{dt}'"):
            caches_from_vllm(
                {"l0": a}, backend="CPU_ATTN", head_size=8, total_kv_heads=4, tp_size=2, use_mla=False,
                cache_dtype=dt,
            )  # fmt: skip
