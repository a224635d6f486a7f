"""StateSpec (kvxfer.groups.state): per-rank shapes and page layout as vLLM 0.32/0.33 holds them
(docs/research/vllm-hybrid.md §3), TP sharding and replication, the canonical wire's layout,
and every invariant refused by name."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvxfer.groups import WIRE_ALIGN, ConvLayout, ConvPart, StateKind, StateSpec


def qwen3_next_like(**kw):
    """The research doc's Qwen3-Next-like GDN layer: 2 key heads of 16, 4 value heads of 24,
    kernel 4, fp32."""
    base = dict(
        num_layers=3, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=24, conv_kernel=4,
        conv_dtype=torch.float32,
    )  # fmt: skip
    base.update(kw)
    return StateSpec.gdn(**base)


def granite_like(**kw):
    """GraniteMoeHybrid's tiny config: 8 heads of 16 (intermediate 128), 1 group, d_state 16."""
    base = dict(
        num_layers=2,
        num_heads=8,
        head_dim=16,
        n_groups=1,
        d_state=16,
        conv_kernel=4,
        conv_dtype=torch.bfloat16,
    )
    base.update(kw)
    return StateSpec.mamba2(**base)


def test_gdn_page_matches_vllms_view():
    """§3.3 [ran]: conv (3, 160) f32 = 1920 B, SSM (4, 24, 16) f32 = 6144 B, content 8064 in an
    8192-byte page."""
    s = qwen3_next_like(page_size_bytes=8192)
    assert s.conv_shape == (3, 160) and s.conv_bytes == 1920
    assert s.ssm_shape == (4, 24, 16) and s.ssm_bytes == 6144
    assert s.content_bytes == 8064 and s.page_bytes == 8192 and s.cache_shape(10) == (10, 8192)
    assert s.vllm_shapes() == ((3, 160), (4, 24, 16))
    t = qwen3_next_like(ssm_transposed=True, conv_layout="DS", tp_size=2)
    assert t.conv_shape == (80, 3) and t.ssm_shape == (2, 16, 24)  # bytes [h, K, V]
    assert t.vllm_shapes() == ((80, 3), (2, 24, 16))  # vLLM's spec order whatever the bytes
    assert [t.conv_part_offset(i) for i in range(3)] == [0, 16, 32]


def test_mamba2_replicates_one_group_under_tp():
    """n_groups=1 at TP 2 and 4: every rank holds the whole group in B and C (§3.4)."""
    s = granite_like(tp_size=4)
    assert s.conv_dim_local == 128 // 4 + 2 * 16 and s.conv_shape == (3, 64)
    assert [s.units_of_rank(0, r) for r in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert [s.units_of_rank(1, r) for r in range(4)] == [range(0, 1)] * 4
    assert s.ssm_shape == (2, 16, 16) and s.local_units(1) == 1
    assert granite_like().conv_shape == (3, 160)  # HF's conv state is (1, 160, 4)


def test_replicated_parts_follow_the_kv_head_rule():
    s = StateSpec(
        kind="mamba2", num_layers=1,
        conv_parts=(ConvPart("x", 8, 2), ConvPart("B", 2, 3, True), ConvPart("C", 2, 3, True)),
        state_len=2, ssm_heads=8, ssm_head_shape=(2, 3), conv_dtype=torch.float32, ssm_dtype=torch.float32,
        tp_size=2,
    )  # fmt: skip
    assert [s.units_of_rank(1, r) for r in range(2)] == [range(0, 1), range(1, 2)]
    with pytest.raises(ValueError, match="n_groups % tp == 0 or n_groups == 1"):
        dataclasses.replace(s, tp_size=4)  # Megatron could; vLLM's MambaMixer2 asserts


def test_other_kinds():
    m1 = StateSpec.mamba1(num_layers=2, intermediate_size=24, d_state=5, conv_kernel=4, conv_dtype=torch.float16,
                          ssm_dtype=torch.float32, tp_size=3, num_speculative_tokens=2)  # fmt: skip
    assert m1.state_len == 5 and m1.conv_shape == (5, 8) and m1.ssm_shape == (8, 5)
    assert m1.content_bytes == 5 * 8 * 2 + 8 * 5 * 4
    sc = StateSpec.short_conv(
        num_layers=2, dim=24, conv_kernel=3, conv_dtype=torch.bfloat16, conv_layout="DS"
    )
    assert (
        sc.num_sections == 1 and sc.ssm_shape == () and sc.ssm_bytes == 0 and sc.vllm_shapes() == ((24, 2),)
    )
    assert sc.kind is StateKind.SHORT_CONV and sc.conv_layout is ConvLayout.DS


def test_wire_layout_is_aligned_and_canonical():
    s = qwen3_next_like(conv_dtype=torch.bfloat16, ssm_dtype=torch.float32)
    lay = s.wire_layout(num_states=2)
    assert lay.shapes == ((2, 3, 2, 3, 16), (2, 3, 2, 3, 16), (4, 3, 2, 3, 24), (4, 3, 2, 24, 16))
    assert all(o % WIRE_ALIGN == 0 for o in lay.offsets) and lay.offsets[0] == 0
    assert lay.nbytes == 2 * (576 * 2) + 1728 * 2 + 4 * 3 * 2 * 24 * 16 * 4
    # the wire depends on neither TP, layout, SSM order nor page
    other = qwen3_next_like(conv_dtype=torch.bfloat16, ssm_dtype=torch.float32, tp_size=2, conv_layout="DS",
                            ssm_transposed=True, page_size_bytes=1 << 16)  # fmt: skip
    assert other.wire_layout(num_states=2) == lay
    odd = s.wire_layout([1, 0, 1, 1], num_layers=1)
    assert odd.offsets == (0, 96, 96, 240) and odd.nbytes == 240 + 24 * 16 * 4
    views = s.wire_views(torch.zeros(lay.nbytes, dtype=torch.uint8), num_states=2)
    assert views["v"].dtype == torch.bfloat16 and views["ssm"].shape == (4, 3, 2, 24, 16)


def test_roundtrip_dict_and_mismatches():
    s = granite_like(tp_size=2, conv_layout="DS", ssm_dtype=torch.float32, page_size_bytes=1 << 14)
    assert StateSpec.from_dict(s.to_dict()) == s
    assert s.model_mismatch(granite_like(tp_size=4, ssm_dtype=torch.float16)) is None
    assert "num_layers differs" in s.model_mismatch(granite_like(num_layers=3))
    assert "conv_parts differs" in s.model_mismatch(granite_like(n_groups=2))
    assert "state_len differs" in s.model_mismatch(granite_like(conv_kernel=3))
    assert "kind differs" in s.model_mismatch(qwen3_next_like())
    assert s.dtype_mismatch(granite_like(ssm_dtype=torch.float32)) is None
    assert "ssm_dtype differs" in s.dtype_mismatch(granite_like())
    for bad, match in [
        ("x", "state spec: expected a dict"),
        ({}, "kind: missing"),
        ({**s.to_dict(), "conv_dtype": 3}, "conv_dtype: must be a dtype name"),
        ({**s.to_dict(), "conv_parts": [["x", 8]]}, "conv_parts: must be a list"),
        ({**s.to_dict(), "ssm_dtype": "float99"}, "dtype: unknown dtype name"),
        ({**s.to_dict(), "tp_size": 3}, "tp_size: 3"),
    ]:
        with pytest.raises(ValueError, match=match):
            StateSpec.from_dict(bad)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: granite_like(num_layers=0), "num_layers: must be a positive int"),
        (lambda: granite_like(conv_kernel=0), "conv_kernel: must be a positive int"),
        (lambda: granite_like(conv_kernel=1), "state_len: must be a positive int"),
        (lambda: granite_like(conv_dtype="bf16"), "conv_dtype: must be a torch.dtype"),
        (lambda: granite_like(ssm_dtype=torch.complex64), "ssm_dtype: dtype"),
        (lambda: granite_like(conv_layout="SDS"), "conv_layout: must be 'SD' or 'DS'"),
        (lambda: granite_like(tp_size=3), "tp_size: 3 is not a divisor of it: x has 8 units"),
        (lambda: granite_like(n_groups=2, tp_size=4), "n_groups % tp == 0 or n_groups == 1"),
        (lambda: granite_like(page_size_bytes=100), "page_size_bytes: 100 is less than the state's content"),
        (lambda: granite_like(num_speculative_tokens=-1), "num_speculative_tokens: must be an int >= 0"),
        (lambda: qwen3_next_like(tp_size=4), "tp_size: 4 is not a divisor of it: q has 2 units"),
        (lambda: qwen3_next_like(ssm_transposed=1), "ssm_transposed: must be a bool"),
        (lambda: dataclasses.replace(granite_like(), ssm_transposed=True), "ssm_transposed: only a gdn state"),
        (lambda: dataclasses.replace(granite_like(), kind="mamba3"), "kind: must be one of"),
        (lambda: dataclasses.replace(granite_like(), kind="gdn"), r"conv_parts: a gdn state has parts \('q', 'k', 'v'\)"),
        (lambda: dataclasses.replace(granite_like(), conv_parts=[ConvPart("x", 8, 16)]), "conv_parts: must be a tuple of ConvPart"),
        (lambda: dataclasses.replace(granite_like(), ssm_head_shape=(16, 15)), "mamba2's SSM state is"),
        (lambda: dataclasses.replace(granite_like(), ssm_heads=4), "mamba2's SSM state is"),
        (lambda: dataclasses.replace(granite_like(), ssm_head_shape=[16, 16]), "ssm_head_shape: must be a tuple"),
        (lambda: dataclasses.replace(granite_like(), ssm_head_shape=(16, 0)), "ssm_head_shape: must be a positive int"),
        (lambda: dataclasses.replace(granite_like(), conv_parts=(ConvPart("x", 8, 16), ConvPart("B", 1, 16, True), ConvPart("C", 1, 8, True))), "mamba2's B and C must match"),
        (lambda: dataclasses.replace(granite_like(), conv_parts=(ConvPart("x", 8, 16, True), ConvPart("B", 1, 16, True), ConvPart("C", 1, 16, True))), "x part is sharded by head"),
        (lambda: dataclasses.replace(qwen3_next_like(), ssm_head_shape=(16, 24)), r"gdn's SSM state is .* \(canonical order\)"),
        (lambda: dataclasses.replace(qwen3_next_like(), conv_parts=(ConvPart("q", 2, 16), ConvPart("k", 2, 8), ConvPart("v", 4, 24))), "gdn's q and k must match"),
        (lambda: dataclasses.replace(qwen3_next_like(), ssm_heads=0), "ssm_heads: a gdn state has SSM heads"),
        (lambda: StateSpec.short_conv(num_layers=1, dim=8, conv_kernel=3, conv_dtype=torch.float32).__class__(
            kind="short_conv", num_layers=1, conv_parts=(ConvPart("bx", 8, 1),), state_len=2, ssm_heads=2,
            ssm_head_shape=(3,), conv_dtype=torch.float32, ssm_dtype=torch.float32), "a short_conv state has no SSM state"),
        (lambda: StateSpec(kind="mamba1", num_layers=1, conv_parts=(ConvPart("x", 8, 2),), state_len=2, ssm_heads=8,
                           ssm_head_shape=(3,), conv_dtype=torch.float32, ssm_dtype=torch.float32), "mamba1's x part is per channel"),
        (lambda: ConvPart("", 1, 1), "conv part name"),
        (lambda: ConvPart("x", 0, 1), "conv part x: num_units"),
        (lambda: ConvPart("x", 1, 1, replicate=1), "conv part x: replicate must be a bool"),
    ],
)  # fmt: skip
def test_invariants_named(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_ranks_and_counts():
    s = granite_like(tp_size=2)
    with pytest.raises(ValueError, match=r"tp_rank: must be in \[0, 2\)"):
        s.units_of_rank(0, 2)
    with pytest.raises(ValueError, match="counts: one unit count per section"):
        s.wire_layout([1, 1])
    with pytest.raises(ValueError, match=r"counts\[B\]: must be an int >= 0"):
        s.wire_layout([1, -1, 1, 1])
    with pytest.raises(ValueError, match="section: 3 is not a conv part"):
        s.conv_part_offset(3)
    with pytest.raises(ValueError, match=r"wire: expected \d+ bytes, got 7"):
        s.wire_views(torch.zeros(7, dtype=torch.uint8))
    with pytest.raises(ValueError, match="wire: must be a contiguous uint8 tensor"):
        s.wire_views(torch.zeros(7, dtype=torch.int16))
