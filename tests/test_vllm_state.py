"""Tier 1: the vLLM connector with state groups (Mamba2, GDN, ...: vLLM's ``MambaSpec``) next to
attention groups, against fakes of vLLM's objects.

What is checked here without an engine: the ``StateSpec`` built from ``MambaSpec`` facts
(shapes, dtypes, page, conv layout, n_groups, GDN's CPU order), what is refused by name, the
attention-shaped view of a state layer's pages, and the N−1 flow on the scheduler side (P's
request truncated once by one token, P's params carrying the running state block, D loading
N−1 tokens and refusing a state export that covers its whole prompt). The P→D byte check with
real engines is ``tests/test_vllm_state_engine.py``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from kvxfer.groups.state import ConvLayout, StateSpec
from kvxfer.vllm.backoff import TRUNCATED_KEY, truncate_for_prefill, was_truncated
from kvxfer.vllm.config import ConnectorConfig
from kvxfer.vllm.groups import HybridModelUnsupported, groups_from_config
from kvxfer.vllm.layout import KVLayout
from kvxfer.vllm.scheduler import SchedulerSide
from kvxfer.vllm.state import attention_view_of_state, conv_layout_from_env, state_spec_from_vllm

from .vllm_fakes import Status, cpu_cache, vllm_config

F32 = torch.float32
BLOCK = 32


def kind(name: str):
    return SimpleNamespace(name=name)


@dataclass
class MambaSpec:
    """vLLM 0.32's ``MambaSpec`` fields the connector reads (per-rank shapes)."""

    shapes: tuple
    dtypes: tuple
    block_size: int = 256
    page_size_padded: int | None = None
    mamba_type: object = field(default_factory=lambda: kind("MAMBA2"))
    mamba_cache_mode: str = "none"
    num_speculative_blocks: int = 0
    tp_replicated: bool = False


@dataclass
class FullAttentionSpec:
    block_size: int = BLOCK
    sliding_window: int | None = None
    attention_chunk_size: int | None = None


@dataclass
class Group:
    layer_names: list
    kv_cache_spec: object
    enable_kv_transfer: bool = True


@dataclass
class Config:
    kv_cache_groups: list


def granite(tp: int = 1, **kw) -> MambaSpec:
    """Tiny GraniteMoeHybrid's Mamba2 layer per rank: 8 heads of 16, n_groups 1 (extended to one
    per rank), d_state 16, kernel 4; SD."""
    heads = 8 // tp
    return MambaSpec(((3, heads * 16 + 2 * 16), (heads, 16, 16)), (F32, F32), **kw)


def qwen3_next(tp: int = 1, **kw) -> MambaSpec:
    """Tiny Qwen3-Next's GDN layer per rank: 2 k heads of 16, 4 v heads of 24, kernel 4; SD."""
    key, v = 2 * 16 // tp, 4 // tp
    return MambaSpec(
        ((3, 2 * key + v * 24), (v, 24, 16)), (torch.bfloat16, F32), mamba_type=kind("GDN_ATTN"), **kw
    )


# ----------------------------------------------------------------------------- StateSpec
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_mamba2_spec_from_vllm_keeps_one_group_replicated(tp):
    st = state_spec_from_vllm(
        granite(tp, page_size_padded=16384), 2, tp, hf_config=SimpleNamespace(mamba_n_groups=1)
    )
    want = StateSpec.mamba2(2, 8, 16, 1, 16, 4, F32, tp_size=tp, page_size_bytes=16384)
    assert st == want
    assert st.vllm_shapes() == granite(tp).shapes
    # without the model config the shapes alone say n_groups = tp (same bytes at equal TP)
    assert state_spec_from_vllm(granite(tp), 2, tp).conv_parts[1].num_units == tp


def test_gdn_spec_from_vllm_with_cpu_order_and_dtypes():
    st = state_spec_from_vllm(qwen3_next(), 3, 1, gdn_ssm_transposed=True)
    assert st == StateSpec.gdn(3, 2, 4, 16, 24, 4, torch.bfloat16, F32, ssm_transposed=True)
    assert st.content_bytes == 3 * 160 * 2 + 4 * 24 * 16 * 4  # conv [q|k|v] = 2*32 + 4*24 channels
    assert state_spec_from_vllm(qwen3_next(2), 3, 2).vllm_shapes() == qwen3_next(2).shapes


def test_ds_layout_and_speculative_rows():
    ds = MambaSpec(((96, 3), (4, 16, 16)), (F32, F32))
    assert state_spec_from_vllm(ds, 1, conv_layout="DS").conv_layout is ConvLayout.DS
    spec = MambaSpec(((5, 96), (4, 16, 16)), (F32, F32), num_speculative_blocks=2)
    st = state_spec_from_vllm(spec, 1)
    assert st.state_len == 5 and st.vllm_shapes() == spec.shapes  # kernel 4 + 2 spec tokens - 1
    assert conv_layout_from_env({}) is ConvLayout.SD
    assert conv_layout_from_env({"VLLM_SSM_CONV_STATE_LAYOUT": "DS"}) is ConvLayout.DS
    with pytest.raises(ValueError, match="SD or DS"):
        conv_layout_from_env({"VLLM_SSM_CONV_STATE_LAYOUT": "XY"})


def test_mamba1_and_short_conv():
    m1 = MambaSpec(((3, 64), (64, 16)), (F32, F32), mamba_type=kind("MAMBA1"))
    assert state_spec_from_vllm(m1, 2, 2).ssm_heads == 128
    sc = MambaSpec(((2, 64),), (F32,), mamba_type=kind("SHORT_CONV"))
    st = state_spec_from_vllm(sc, 2)
    assert (st.kind.value, st.state_len, st.content_bytes) == ("short_conv", 2, 2 * 64 * 4)


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        (granite(mamba_cache_mode="other"), "mamba_cache_mode 'other'"),
        (granite(mamba_type=kind("LINEAR")), "state kind LINEAR is not carried"),
        (granite(mamba_type=kind("CUSTOM")), "state kind CUSTOM is not carried"),
        (granite(tp_replicated=True), "TP-replicated"),
        (MambaSpec(((3, 96), (4, 16, 16), (4, 16)), (F32, F32, F32)), "ReplaySSM"),
        (MambaSpec(((3, 95), (4, 16, 16)), (F32, F32)), "not x"),
        (granite(page_size_padded=100), "page_size_bytes"),
    ],
)
def test_state_groups_not_carried_are_named(spec, why):
    cfg = Config([Group(["m0"], spec), Group(["a0"], FullAttentionSpec())])
    with pytest.raises(HybridModelUnsupported, match=rf"model m: KV cache group 0 \(MambaSpec.*{why}"):
        groups_from_config(cfg, "m")


def test_groups_from_config_carries_state_groups():
    cfg = Config(
        [
            Group(["l0.mixer", "l2.mixer"], granite(page_size_padded=16384)),
            Group(["l1.attn", "l3.attn"], FullAttentionSpec()),
        ]
    )
    m, a = groups_from_config(cfg, "granite", hf_config=SimpleNamespace(mamba_n_groups=1))
    assert m.is_state and not a.is_state
    assert (m.index, m.layer_names, m.block_size, m.num_speculative_blocks) == (
        0,
        ("l0.mixer", "l2.mixer"),
        256,
        0,
    )
    assert m.state.num_layers == 2 and m.state.page_bytes == 16384
    assert m.describe() == "mamba2 x2" and a.describe() == "full x2"
    # one state group per layer position, as vLLM forms Qwen3-Next's groups
    qn = Config(
        [Group([f"l{i}.linear_attn"], qwen3_next()) for i in range(3)]
        + [Group(["l3.attn"], FullAttentionSpec())]
    )
    got = groups_from_config(qn, "qwen3_next", gdn_ssm_transposed=True)
    assert [g.is_state for g in got] == [True, True, True, False]
    assert got[0].state.ssm_transposed
    only = Config([Group(["m0"], granite())])
    with pytest.raises(HybridModelUnsupported, match="only state groups, no attention group"):
        groups_from_config(only, "mamba")


# ----------------------------------------------------------------------------- views
def test_attention_view_of_state_covers_the_state_page():
    nb, heads, d = 6, 2, 16
    attn = cpu_cache(nb, heads, BLOCK, d, F32)  # pages of 2*32*32*4 = 8192 bytes
    page = attn.stride(0) * 4
    content = 5248
    state = attn.view(torch.int8).view(nb, page)[:, None, None, :content]
    state[4, 0, 0] = torch.arange(content, dtype=torch.int64).remainder(251).to(torch.int8)
    v = attention_view_of_state(state, attn)
    assert v.shape == attn.shape and v.stride() == attn.stride() and v.dtype == F32
    assert v.data_ptr() == attn.data_ptr()
    assert torch.equal(v[4].contiguous().view(torch.int8).reshape(-1)[:content], state[4, 0, 0])
    with pytest.raises(ValueError, match="pages of 4096 bytes"):
        attention_view_of_state(attn.view(torch.int8).view(nb * 2, page // 2)[:nb, None, None, :100], attn)


# ----------------------------------------------------------------------------- N-1 flow
class VllmRequest:
    """The ``vllm.v1.request.Request`` fields the N-1 flow touches (0.32)."""

    def __init__(self, rid, prompt, params, max_tokens=16):
        self.request_id = rid
        self.prompt_token_ids = list(prompt)
        self._all_token_ids = list(prompt)
        self.num_prompt_tokens = len(prompt)
        self.max_tokens = max_tokens
        self.kv_transfer_params = params
        self.status = Status.WAITING
        self.num_computed_tokens = 0

    @property
    def all_token_ids(self):
        return list(self._all_token_ids)


def test_truncate_for_prefill_once():
    r = VllmRequest("r", range(10, 50), {"do_remote_decode": True})
    assert truncate_for_prefill(r)
    assert (r.prompt_token_ids[-1], len(r._all_token_ids), r.num_prompt_tokens, r.max_tokens) == (
        48,
        39,
        39,
        1,
    )
    assert was_truncated(r) and r.kv_transfer_params[TRUNCATED_KEY]
    assert not truncate_for_prefill(r)  # preempted and rescheduled: not again
    assert r.num_prompt_tokens == 39
    one = VllmRequest("one", [7], {"do_remote_decode": True})
    assert not truncate_for_prefill(one) and one.num_prompt_tokens == 1
    d = VllmRequest("d", range(9), {"do_remote_prefill": True})
    assert not truncate_for_prefill(d) and d.num_prompt_tokens == 9
    plain = VllmRequest("p", range(9), None)
    assert not truncate_for_prefill(plain)


def _groups():
    cfg = Config(
        [Group(["m0", "m1"], granite(page_size_padded=16384)), Group(["a0", "a1"], FullAttentionSpec())]
    )
    return groups_from_config(cfg, "granite", hf_config=SimpleNamespace(mamba_n_groups=1))


def _sched(role: str, groups=None) -> SchedulerSide:
    cfg = ConnectorConfig.from_vllm(vllm_config(role=role, engine_id=role[3], block_size=BLOCK))
    s = SchedulerSide(cfg, groups=_groups() if groups is None else groups)
    layout = KVLayout("CPU_ATTN", BLOCK, False, "vec")
    s.set_handshake({0: {"block_size": BLOCK, "bytes_per_token": 1024, "kv_layout": layout.to_dict()}})
    return s


class Blocks:
    def __init__(self, lists):
        self.lists = lists

    def get_block_ids(self):
        return tuple(list(x) for x in self.lists)


@pytest.mark.parametrize("n", [2, 5, 31, 32, 33, 70, 97])
def test_n_minus_1_flow_scheduler(n):
    p, d = _sched("kv_producer"), _sched("kv_consumer")
    prompt = list(range(3, 3 + n))
    req = VllmRequest("p-1", prompt, {"do_remote_decode": True}, max_tokens=1)
    p.on_new_request(req)
    assert req.num_prompt_tokens == n - 1 and req.prompt_token_ids == prompt[:-1]
    req.status, req.num_computed_tokens = Status.FINISHED_LENGTH_CAPPED, n - 1
    req._all_token_ids.append(99)  # the sampled token
    need = -(-(n - 1) // BLOCK)
    attn = list(range(10, 10 + need))
    hold, params = p.request_finished(req, ([7], attn))  # "none" mode: the state block alone
    assert hold
    assert params["num_valid_tokens"] == n - 1 and params["num_tokens"] == need * BLOCK
    assert params["groups"] == [1, need] and params["block_ids"] == [7, *attn]
    (ex,) = p.build_connector_meta().exports
    assert ex.block_ids == [[7], attn] and ex.computed_tokens == n - 1
    dreq = VllmRequest("d-1", prompt, params)
    assert d.get_num_new_matched_tokens(dreq, 0) == (n - 1, True)
    dattn = list(range(40, 40 + -(-n // BLOCK)))
    d.update_state_after_alloc(dreq, Blocks([[3], dattn]), n - 1)
    (ld,) = d.build_connector_meta().loads
    assert ld.block_ids == [[3], dattn[:need]] and ld.computed_tokens == n - 1


def test_attention_only_models_keep_the_whole_prompt():
    cfg = Config([Group(["a0"], FullAttentionSpec()), Group(["s0"], FullAttentionSpec(sliding_window=None))])
    s = _sched("kv_producer", groups=groups_from_config(cfg))
    req = VllmRequest("p", range(40), {"do_remote_decode": True})
    s.on_new_request(req)
    assert req.num_prompt_tokens == 40 and not was_truncated(req)


def test_state_exports_p_did_not_truncate_are_not_made(caplog):
    p = _sched("kv_producer")
    one = VllmRequest("p-1", [5], {"do_remote_decode": True}, max_tokens=1)
    p.on_new_request(one)
    one.status, one.num_computed_tokens = Status.FINISHED_LENGTH_CAPPED, 1
    with caplog.at_level(logging.WARNING):
        assert p.request_finished(one, ([7], [10])) == (False, None)
    assert "hands off N-1 of N prompt tokens" in caplog.text
    reuse = VllmRequest("d-2", range(40), {"hold_for_reuse": True})
    reuse.status, reuse.num_computed_tokens = Status.FINISHED_LENGTH_CAPPED, 40
    with caplog.at_level(logging.WARNING):
        assert p.request_finished(reuse, ([7], [10, 11])) == (False, None)
    assert "reuse (hold_for_reuse) of a model with state groups is not carried" in caplog.text


def test_state_export_of_the_whole_prompt_is_not_loaded(caplog):
    """P's params covering all N prompt tokens (a P without the N-1 flow): D would compute the
    last token again from h(N); recomputed and released instead."""
    p, d = _sched("kv_producer"), _sched("kv_consumer")
    req = VllmRequest("p-1", range(3, 43), {"do_remote_decode": True, TRUNCATED_KEY: True}, max_tokens=1)
    req.status, req.num_computed_tokens = Status.FINISHED_LENGTH_CAPPED, 40
    hold, params = p.request_finished(req, ([7], [10, 11]))
    assert hold and params["num_valid_tokens"] == 40
    dreq = VllmRequest("d-1", range(3, 43), params)
    with caplog.at_level(logging.WARNING):
        assert d.get_num_new_matched_tokens(dreq, 0) == (0, False)
    assert "loads at most all but the last" in caplog.text
    d.update_state_after_alloc(dreq, Blocks([[3], [40, 41]]), 0)
    meta = d.build_connector_meta()
    assert not meta.loads and [r["request_id"] for r in meta.releases] == ["p-1"]


def test_null_state_block_is_not_exported(caplog):
    p = _sched("kv_producer")
    req = VllmRequest("p-1", range(10), {"do_remote_decode": True}, max_tokens=1)
    p.on_new_request(req)
    req.status, req.num_computed_tokens = Status.FINISHED_LENGTH_CAPPED, 9
    with caplog.at_level(logging.WARNING):
        assert p.request_finished(req, ([0], [10])) == (False, None)
    assert (
        "block_ids[0] (mamba2 state, layers [0, 1]): the state block (position 0) is the null block"
        in caplog.text
    )
