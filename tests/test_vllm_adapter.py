"""Tier 1: the vLLM connector's logic against fakes of vLLM's objects (vLLM not installed).

Real kvxfer engines move real bytes between caches laid out as vLLM's kernels read them:
FlashAttention-style caches (token rows) with differing block sizes and TP; CPU_ATTN caches
(ISA ``vec`` pages: K column-major) in whole blocks, the partial last block included; and the
pairing of the two refused with ``KVLayoutMismatch``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from kvxfer import TransferEngine
from kvxfer.ports import free_port_base
from kvxfer.vllm.config import ConnectorConfig, default_host
from kvxfer.vllm.layout import KVLayout, KVLayoutMismatch, caches_from_vllm, check_pair, kvxfer_view
from kvxfer.vllm.scheduler import SchedulerSide, expand_block_ids, prompt_hash
from kvxfer.vllm.worker import WorkerSide

from .vllm_fakes import (
    Blocks,
    Request,
    Status,
    cpu_cache,
    cpu_vec_read,
    cpu_vec_write,
    fa_cache,
    fa_kernel_kv,
    token_rows,
    vllm_config,
)

# ----------------------------------------------------------------------------- import


def test_import_without_vllm_and_clear_error():
    code = (
        "import sys, json\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'vllm' or name.startswith('vllm.'):\n"
        "            raise ModuleNotFoundError(f\"No module named '{name}'\")\n"
        "sys.meta_path.insert(0, Block())\n"
        "import kvxfer.vllm\n"
        "from kvxfer.vllm import scheduler, worker, layout, config\n"
        "err = ''\n"
        "try:\n"
        "    kvxfer.vllm.KvxferConnector\n"
        "except ImportError as e:\n"
        "    err = str(e)\n"
        "print(json.dumps({'err': err, 'registered': kvxfer.vllm.register(),"
        " 'vllm': any(m.startswith('vllm') for m in sys.modules)}))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "needs vLLM" in out["err"] and "pip install" in out["err"], out
    assert out["registered"] is False and out["vllm"] is False


# ----------------------------------------------------------------------------- config


def test_config_from_vllm_ports_dp_and_extra():
    c = ConnectorConfig.from_vllm(
        vllm_config(
            tp=2,
            port=20000,
            dp_rank=3,
            dp_size=4,
            extra={"lease_s": 5, "transport": "pg", "host": "192.0.2.3"},
        )
    )
    assert (c.engine_id, c.base_port, c.tp_size, c.lease_s, c.transport) == ("E-dp3", 20006, 2, 5.0, "pg")
    assert c.host == "192.0.2.3"  # the advertised host comes from kv_connector_extra_config
    assert c.exports and c.loads
    consumer = ConnectorConfig.from_vllm(vllm_config(role="kv_consumer", tp=2))
    assert not consumer.exports and consumer.base_port == 0  # free ports: nobody dials a consumer


def test_config_default_host(monkeypatch, caplog):
    from kvxfer.vllm import config as cfgmod

    extra_free = vllm_config()
    del extra_free.kv_transfer_config.kv_connector_extra_config["host"]
    monkeypatch.setenv("VLLM_HOST_IP", "192.0.2.7")
    assert ConnectorConfig.from_vllm(extra_free).host == "192.0.2.7"
    monkeypatch.delenv("VLLM_HOST_IP")
    monkeypatch.setattr(cfgmod.socket, "gethostbyname", lambda name: "198.51.100.4")
    assert default_host() == "198.51.100.4"
    monkeypatch.setattr(cfgmod.socket, "gethostbyname", lambda name: "127.0.1.1")
    with caplog.at_level("WARNING"):
        assert default_host() == "127.0.0.1"
    assert "advertising 127.0.0.1" in caplog.text and "kv_connector_extra_config.host" in caplog.text
    consumer = vllm_config(role="kv_consumer")
    del consumer.kv_transfer_config.kv_connector_extra_config["host"]
    assert ConnectorConfig.from_vllm(consumer).host == "127.0.0.1"  # bound only, never advertised


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"pp": 2}, "pipeline_parallel_size"),
        ({"dcp": 2}, "decode_context_parallel_size"),
        ({"role": "kv_sender"}, "kv_role"),
        ({"port": 65535, "tp": 2}, "kv_port"),
        ({"extra": {"transport": "rdma"}}, "transport"),
        ({"extra": {"lease_s": 0}}, "lease_s"),
        ({"extra": {"reuse_min_gain": 0.5}}, "reuse_min_gain"),
        ({"extra": {"host": ""}}, "kv_connector_extra_config.host"),
        ({"extra": {"max_sms": 0}}, "kv_connector_extra_config.max_sms"),
        ({"extra": {"max_sms": 8.5}}, "kv_connector_extra_config.max_sms"),
        ({"extra": {"onesided": "yes"}}, "kv_connector_extra_config.onesided"),
    ],
)
def test_config_rejects_naming_the_setting(kw, needle):
    with pytest.raises(ValueError, match=needle):
        ConnectorConfig.from_vllm(vllm_config(**kw))


# ----------------------------------------------------------------------------- layouts


def _fill_random(t: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    t.view(torch.uint8).copy_(
        torch.randint(0, 256, t.view(torch.uint8).shape, generator=g, dtype=torch.uint8)
    )


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


def test_expand_block_ids_and_prompt_hash():
    assert expand_block_ids([3, 1], 1) == [3, 1]
    assert expand_block_ids([3, 1], 4) == [12, 13, 14, 15, 4, 5, 6, 7]
    assert prompt_hash([1, 2, 3], 2) == prompt_hash([1, 2, 9], 2) != prompt_hash([1, 3], 2)


# ----------------------------------------------------------------------------- scheduler side

BS = 16


def _hs(layout: KVLayout, bytes_per_token: int = 0) -> dict:
    """Handshake metadata of one worker (what ``WorkerSide.handshake_info`` returns)."""
    return {
        0: {
            "block_size": layout.block_size,
            "bytes_per_token": bytes_per_token,
            "kv_layout": layout.to_dict(),
        }
    }


def _rows(bs: int = BS) -> KVLayout:
    return KVLayout("FLASH_ATTN", bs, True)


def _vec(bs: int = 32) -> KVLayout:
    return KVLayout("CPU_ATTN", bs, False, "vec")


def _sched(role="kv_both", layout: KVLayout | None = None, **kw) -> SchedulerSide:
    lay = layout or _rows()
    s = SchedulerSide(ConnectorConfig.from_vllm(vllm_config(role=role, block_size=lay.block_size, **kw)))
    s.set_handshake(_hs(lay))
    return s


def _p_finish(s: SchedulerSide, rid="r", n=40, blocks=(7, 8, 9), status=Status.FINISHED_LENGTH_CAPPED):
    req = Request(rid, list(range(100, 100 + n)), {"do_remote_decode": True}, status, num_computed_tokens=n)
    return req, s.request_finished(req, list(blocks))


def test_p_side_holds_blocks_and_returns_params_then_exports():
    s = _sched(engine_id="P", port=21000)
    req, (hold, params) = _p_finish(s)
    assert hold is True
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert (params["engine_id"], params["port"], params["block_ids"], params["num_tokens"]) == (
        "P",
        21000,
        [7, 8, 9],
        40,
    )
    assert params["block_size"] == BS and params["prompt_hash"] == prompt_hash(req.prompt_token_ids, 40)
    assert params["num_valid_tokens"] == 40 and params["kv_layout"] == _rows().to_dict()
    json.dumps(params)  # goes into an HTTP response
    meta = s.build_connector_meta()
    assert [(e.request_id, e.block_ids, e.num_tokens) for e in meta.exports] == [("r", [7, 8, 9], 40)]
    assert s.build_connector_meta().exports == []  # once
    assert s.num_tracked() == 0


def test_p_side_whole_block_layout_exports_the_partial_block_whole():
    s = _sched(layout=_vec(16), engine_id="P")
    req, (hold, params) = _p_finish(s, n=40, blocks=(7, 8, 9))
    assert hold and params["num_tokens"] == 48 and params["num_valid_tokens"] == 40
    assert params["block_ids"] == [7, 8, 9] and params["prompt_hash"] == prompt_hash(req.prompt_token_ids, 40)
    (ex,) = s.build_connector_meta().exports
    assert (ex.block_ids, ex.num_tokens) == ([7, 8, 9], 48)


def test_p_side_with_kernel_blocks_advertises_kernel_ids():
    s = _sched()
    s.set_handshake(_hs(_rows(8), 64))
    _, (_, params) = _p_finish(s, n=20, blocks=(4, 5))
    assert params["block_size"] == 8 and params["block_ids"] == [8, 9, 10]  # 20 tokens: 3 kernel blocks


def test_p_side_without_handshake_does_not_export(caplog):
    s = SchedulerSide(ConnectorConfig.from_vllm(vllm_config(block_size=BS)))
    with caplog.at_level("WARNING"):
        assert _p_finish(s)[1] == (False, None)
    assert "KV layout is unknown" in caplog.text


@pytest.mark.parametrize("status", [Status.FINISHED_ABORTED])
def test_p_side_aborted_or_consumer_frees_at_once(status):
    assert _p_finish(_sched(), status=status)[1] == (False, None)
    assert _p_finish(_sched(role="kv_consumer"))[1] == (False, None)
    s = _sched()
    assert s.request_finished(Request("x", [1, 2]), [1]) == (False, None)  # no params at all
    assert s.build_connector_meta().exports == []


def _p_params(rid="r", n=40, bs=BS, engine="P", port=21000, tokens=None, layout=None):
    s = _sched(layout=layout or _rows(bs), engine_id=engine, port=port)
    toks = tokens if tokens is not None else list(range(100, 100 + n))
    req = Request(rid, toks, {"do_remote_decode": True}, Status.FINISHED_LENGTH_CAPPED, num_computed_tokens=n)
    return s.request_finished(req, list(range(1, 1 + -(-n // s.cfg.block_size))))[1], toks


def test_d_side_loads_all_prompt_tokens_with_ps_params_unmodified():
    s = _sched(role="kv_consumer", engine_id="D")
    params, toks = _p_params()
    req = Request("d1", toks, params)
    assert s.get_num_new_matched_tokens(req, 0) == (40, True)
    s.update_state_after_alloc(req, Blocks([20, 21, 22, 23]), 40)
    meta = s.build_connector_meta()
    (ld,) = meta.loads
    assert ld.request_id == "d1" and ld.block_ids == [20, 21, 22] and ld.num_computed_tokens == 0
    assert ld.params == params and ld.params is not params and not meta.releases
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)  # once (e.g. after a preemption)
    s.update_connector_output({"d1"})
    req.status = Status.FINISHED_STOPPED
    assert s.request_finished(req, [20, 21, 22]) == (False, None)
    assert s.num_tracked() == 0


@pytest.mark.parametrize(("p_bs", "hit"), [(8, 16), (32, 16)])  # on a block of P; inside one of P's
def test_d_side_prefix_hit_passes_full_params_and_skips_the_hit(p_bs, hit):
    s = _sched(role="kv_consumer")
    params, toks = _p_params(n=64, bs=p_bs)
    req = Request("d", toks, params)
    assert s.get_num_new_matched_tokens(req, hit) == (64 - hit, True)
    s.update_state_after_alloc(req, Blocks([30, 31, 32, 33]), 64 - hit)
    (ld,) = s.build_connector_meta().loads
    assert ld.block_ids == [30, 31, 32, 33] and ld.num_computed_tokens == hit  # the whole request
    assert ld.params == params  # not sliced: the exporter accepts only its own params


def test_d_side_whole_block_layouts_pair_only_when_identical(caplog):
    for p_layout, d_layout, ok in [
        (_vec(32), _vec(32), True),
        (_vec(32), KVLayout("CPU_ATTN", 32, False, "amx"), False),
        (_rows(32), _vec(32), False),
        (_vec(32), _rows(32), False),
    ]:
        s = _sched(role="kv_consumer", layout=d_layout)
        params, toks = _p_params(n=40, layout=p_layout)
        req = Request("d", toks, params)
        caplog.clear()
        with caplog.at_level("WARNING"):
            got = s.get_num_new_matched_tokens(req, 0)
        if ok:
            assert got == (40, True) and not caplog.records
            s.update_state_after_alloc(req, Blocks([5, 6]), 40)
            (ld,) = s.build_connector_meta().loads
            assert ld.params["num_tokens"] == 64 and ld.block_ids == [5, 6]
        else:
            assert got == (0, False) and "KVLayoutMismatch" in caplog.text
            s.update_state_after_alloc(req, Blocks([5, 6]), 0)
            meta = s.build_connector_meta()
            assert not meta.loads and [r["request_id"] for r in meta.releases] == ["r"]


def test_d_side_full_local_hit_releases():
    s = _sched(role="kv_consumer")
    params, toks = _p_params(n=32)
    req = Request("d", toks, params)
    assert s.get_num_new_matched_tokens(req, 32) == (0, False)
    s.update_state_after_alloc(req, Blocks([1, 2]), 0)
    assert [r["request_id"] for r in s.build_connector_meta().releases] == ["r"]


def test_d_side_abort_before_allocation_releases_once(caplog):
    s = _sched(role="kv_consumer")
    params, toks = _p_params()
    req = Request("d", toks, params, Status.FINISHED_ABORTED)
    assert s.get_num_new_matched_tokens(req, 0) == (40, True)  # asked, never allocated
    assert s.request_finished(req, []) == (False, None)
    meta = s.build_connector_meta()
    assert [r["request_id"] for r in meta.releases] == ["r"] and not meta.loads
    assert s.num_tracked() == 0
    # rejected before admission: vLLM passes a pre-aborted request whose prompt is a placeholder
    rej = Request("d2", [0], _p_params(rid="r2")[0], Status.FINISHED_ABORTED)
    with caplog.at_level("WARNING"):
        s.request_finished(rej, [])
    assert [r["request_id"] for r in s.build_connector_meta().releases] == ["r2"]
    assert not caplog.records  # released, with no (false) warning about its prompt


def test_d_side_abort_during_load_waits_for_the_workers():
    s = _sched(role="kv_consumer")
    params, toks = _p_params()
    req = Request("d", toks, params)
    s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, Blocks([5, 6, 7]), 40)
    s.build_connector_meta()
    req.status = Status.FINISHED_ABORTED
    assert s.request_finished(req, [5, 6, 7]) == (False, None)
    assert not s.build_connector_meta().releases  # the load itself notifies P
    assert s.num_tracked() > 0
    s.update_connector_output({"d"})
    assert s.num_tracked() == 0


def test_d_side_prompt_mismatch_recomputes_and_releases(caplog):
    s = _sched(role="kv_consumer")
    params, toks = _p_params()
    req = Request("d", [*toks[:-1], 7], params)
    with caplog.at_level("WARNING"):
        assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert "prompt hash differs" in caplog.text
    s.update_state_after_alloc(req, Blocks([1, 2, 3]), 0)
    assert len(s.build_connector_meta().releases) == 1


def test_d_side_finished_load_is_not_parsed_again(caplog):
    """A load reported finished (or failed) and then the request's end: one warning at most
    (the load's), never a second one from parsing the params again."""
    s = _sched(role="kv_consumer")
    params, toks = _p_params()
    req = Request("d", toks, params)
    s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, Blocks([5, 6, 7]), 40)
    s.build_connector_meta()
    s.update_connector_output({"d"})  # reported (failed: its blocks were listed as invalid)
    req.prompt_token_ids = [9] * 40  # would not hash as P's prompt if it were parsed again
    req.status = Status.FINISHED_ABORTED
    with caplog.at_level("WARNING"):
        assert s.request_finished(req, [5, 6, 7]) == (False, None)
    assert not caplog.records and not s.build_connector_meta().releases
    assert s.num_tracked() == 0


def test_d_side_rejection_notice_after_a_failed_load_is_silent(caplog):
    """vLLM's API server answers a failed load with an error and then sends the request's params
    again as a pre-aborted request with prompt [0] (notify_kv_transfer_request_rejected): the
    failed load already notified P, so nothing is released and nothing is warned."""
    s = _sched(role="kv_consumer")
    params, toks = _p_params()
    req = Request("cmpl-1-0-abc", toks, params)
    s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, Blocks([5, 6, 7]), 40)
    s.build_connector_meta()
    s.update_connector_output({"cmpl-1-0-abc"})  # reported (failed)
    req.status = Status.FINISHED_ABORTED
    s.request_finished(req, [5, 6, 7])
    notice = Request("1", [0], params, Status.FINISHED_ABORTED)
    with caplog.at_level("WARNING"):
        assert s.request_finished(notice, []) == (False, None)
    assert not caplog.records and not s.build_connector_meta().releases
    assert s.num_tracked() == 0


def test_d_side_unusable_params_recompute_without_release(caplog):
    s = _sched(role="kv_consumer")
    params, toks = _p_params()
    bad_params = [
        {**params, "port": "x"},
        {**params, "block_size": 0},
        {**params, "block_ids": [1]},
        {k: v for k, v in params.items() if k != "kv_layout"},
        {**params, "num_valid_tokens": 41},
        {**params, "num_valid_tokens": 30},  # a token-row layout never rounds
    ]
    for i, bad in enumerate(bad_params):
        req = Request(f"d{i}", toks, bad)
        with caplog.at_level("WARNING"):
            assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert caplog.text.count("unusable kv_transfer_params") == len(bad_params)
    for needle in ("port", "block_size", "block_ids", "kv_layout: missing", "num_valid_tokens"):
        assert needle in caplog.text
    assert s.build_connector_meta().releases == []


def test_d_side_n_children_share_one_export():
    s = _sched(role="kv_consumer")
    params, toks = _p_params()
    kids = [Request(f"{i}_parent", toks, params) for i in range(3)]
    assert s.get_num_new_matched_tokens(kids[0], 0) == (40, True)
    s.update_state_after_alloc(kids[0], Blocks([1, 2, 3]), 40)
    assert s.get_num_new_matched_tokens(kids[1], 0) == (None, False)  # waits for the sibling
    assert len(s.build_connector_meta().loads) == 1
    s.update_connector_output({"0_parent"})
    assert s.get_num_new_matched_tokens(kids[1], 32) == (0, False)  # prefix cache has it now
    s.update_state_after_alloc(kids[1], Blocks([1, 2, 9]), 0)
    assert s.build_connector_meta().releases == []  # P freed it after the first load


def test_d_side_children_list_form_picks_each_childs_export():
    s = _sched(role="kv_consumer")
    exports = [_p_params(rid=f"p{i}")[0] for i in range(2)]
    toks = list(range(100, 140))
    params = {"do_remote_prefill": True, "children": exports}
    for i in range(2):
        req = Request(f"{i}_x", toks, params)
        assert s.get_num_new_matched_tokens(req, 0) == (40, True)
        s.update_state_after_alloc(req, Blocks([10 * i + 1, 10 * i + 2, 10 * i + 3]), 40)
    assert [ld.params["request_id"] for ld in s.build_connector_meta().loads] == ["p0", "p1"]
    assert s.get_num_new_matched_tokens(Request("5_x", toks, params), 0) == (0, False)


def test_reuse_d_holds_after_decode_and_p_pulls_when_it_pays():
    d = _sched(engine_id="D", port=22000)
    toks = list(range(50))
    req = Request("t1", toks[:40], {"hold_for_reuse": True}, Status.FINISHED_STOPPED, num_computed_tokens=49)
    req.output_token_ids = toks[40:]
    hold, out = d.request_finished(req, [3, 4, 5, 6])
    assert hold and out["reuse"]["num_tokens"] == 49 and out["reuse"]["engine_id"] == "D"
    assert d.build_connector_meta().exports[0].num_tokens == 49
    # turn 2 on P: the prompt extends the conversation
    p = _sched(engine_id="P", extra={"reuse_fixed_pull_s": 0.0})  # 6.4 MB at 10 GB/s < 49 tok at 20k/s
    p.set_handshake(_hs(_rows(), 1 << 17))
    turn2 = Request("t2", [*toks, 77, 78], {"do_remote_decode": True, "reuse": out["reuse"]})
    assert p.get_num_new_matched_tokens(turn2, 0) == (49, True)
    # a slow link makes recomputing cheaper: released instead
    p2 = _sched(engine_id="P2", extra={"reuse_link_GBps": 1e-6, "reuse_fixed_pull_s": 0.0})
    p2.set_handshake(_hs(_rows(), 1 << 17))
    assert p2.get_num_new_matched_tokens(Request("t3", [*toks, 5], turn2.kv_transfer_params), 0) == (0, False)
    p2.update_state_after_alloc(Request("t3", [*toks, 5], turn2.kv_transfer_params), Blocks([1, 2, 3, 4]), 0)
    assert [r["request_id"] for r in p2.build_connector_meta().releases] == ["t1"]


def test_measured_link_bandwidth_feeds_the_reuse_model():
    s = _sched()
    before = s.link_Bps
    s.update_connector_output(set(), {"bytes": 10**6, "busy_s": 1.0})
    assert s.link_Bps < before


# ----------------------------------------------------------------------------- worker + scheduler, real engines

HEADS, HD, LAYERS = 4, 16, 3
POISON = -7.0  # every D block starts as this; blocks a load must not write keep it


def _fill_fa(caches, block_ids, num_tokens, seed):
    """Write seeded K/V rows for a request's tokens the way FlashAttention writes them;
    returns per layer [2, T, H, d]."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in caches:
        k, v = fa_kernel_kv(t, HD)
        bs = k.shape[1]
        ids = torch.tensor(block_ids)[torch.arange(num_tokens) // bs]
        off = torch.arange(num_tokens) % bs
        rows = torch.randn(2, num_tokens, k.shape[2], HD, generator=g).to(t.dtype)
        k[ids, off] = rows[0]
        v[ids, off] = rows[1]
        out.append(rows)
    return out


def _fill_cpu(caches, block_ids, num_tokens, seed):
    """The same through ISA vec's page layout (K column-major); the slots after the last token
    of the last block hold other bytes (a whole-block move carries them, harmlessly)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in caches:
        _fill_random(t, seed + 100)
        rows = torch.randn(2, num_tokens, t.shape[1], HD, generator=g).to(t.dtype)
        cpu_vec_write(t, block_ids, rows[0], rows[1])
        out.append(rows)
    return out


_KINDS = {  # kind -> (cache factory, backend, isa, block size)
    "fa16": (lambda nb, h: fa_cache(nb, h, 16, HD, torch.bfloat16), "FLASH_ATTN", None, 16),
    "fa32": (lambda nb, h: fa_cache(nb, h, 32, HD, torch.bfloat16, "LBHNC"), "FLASH_ATTN", None, 32),
    "cpu32": (lambda nb, h: cpu_cache(nb, h, 32, HD, torch.bfloat16), "CPU_ATTN", "vec", 32),
}


class _Servers:
    """A P server and a D server (each: one SchedulerSide and one WorkerSide per TP rank) whose
    caches are of kinds ``p_kind`` / ``d_kind`` (see ``_KINDS``). D's caches start poisoned."""

    def __init__(
        self,
        tp_p: int,
        tp_d: int,
        p_kind="fa16",
        d_kind="fa32",
        lease_s=30.0,
        timeout_s=15.0,  # a bound, not a speed check: pairing a pg group on a loaded 2-core CI host took over 5 s
        nb=16,
        shm=False,
        workers_first=False,
        transport="auto",
    ):
        extra = {"lease_s": lease_s, "timeout_s": timeout_s, "transport": transport}
        self.kinds = (p_kind, d_kind)
        self.pc = ConnectorConfig.from_vllm(
            vllm_config(
                engine_id="P", tp=tp_p, port=free_port_base(tp_p), block_size=_KINDS[p_kind][3], extra=extra
            )
        )
        self.dc = ConnectorConfig.from_vllm(
            vllm_config(role="kv_consumer", engine_id="D", tp=tp_d, block_size=_KINDS[d_kind][3], extra=extra)
        )
        if not workers_first:  # workers_first: vLLM's order (the scheduler after the caches)
            self.ps, self.ds = SchedulerSide(self.pc), SchedulerSide(self.dc)
        self.pw, self.dw, self.pcache, self.dcache = [], [], [], []
        self.segments = []  # shm=True: every rank's caches in shared memory (ipc can map them)
        for tp, kind, cfg, workers, caches_out in (
            (tp_p, p_kind, self.pc, self.pw, self.pcache),
            (tp_d, d_kind, self.dc, self.dw, self.dcache),
        ):
            make, backend, isa, _ = _KINDS[kind]
            for r in range(tp):
                caches = {f"l{i}": make(nb, HEADS // tp) for i in range(LAYERS)}
                if shm:
                    caches = dict(zip(caches, self._in_shm(list(caches.values()))))
                if workers is self.dw:
                    for t in caches.values():
                        t.fill_(POISON)
                w = WorkerSide(cfg, r)
                w.register(
                    caches, backend=backend, head_size=HD, total_kv_heads=HEADS, use_mla=False, isa=isa
                )
                workers.append(w)
                caches_out.append(list(caches.values()))
        if workers_first:
            self.ps, self.ds = SchedulerSide(self.pc), SchedulerSide(self.dc)
        self.ps.set_handshake({r: w.handshake_info() for r, w in enumerate(self.pw)})
        self.ds.set_handshake({r: w.handshake_info() for r, w in enumerate(self.dw)})

    def _in_shm(self, tensors):
        """The same shapes and strides over one shared-memory segment (what the ipc transport
        maps on CPU), zeroed."""
        from kvxfer.transports.ipc.shm import alloc_shm_array

        per = -(-max(t.untyped_storage().nbytes() for t in tensors) // 256) * 256
        words, seg = alloc_shm_array(per * len(tensors) // 8, "kv")
        self.segments.append(seg)
        raw = words.view(torch.uint8)
        out = []
        for i, t in enumerate(tensors):
            base = raw[i * per : (i + 1) * per].view(t.dtype)
            out.append(base.as_strided(t.shape, t.stride(), base.storage_offset() + t.storage_offset()))
        return out

    def fill_p(self, block_ids, n, seed=5):
        fill = _fill_cpu if self.kinds[0] == "cpu32" else _fill_fa
        return [fill(c, block_ids, n, seed) for c in self.pcache]  # per P rank: per layer [2, T, H, d]

    def d_rows(self, r, layer, block_ids, n):
        """(K, V) [T, H, d] of D rank r's layer as D's attention kernel reads them."""
        t = self.dcache[r][layer]
        if self.kinds[1] == "cpu32":
            return cpu_vec_read(t, block_ids, n)
        k, v = fa_kernel_kv(t, HD)
        return token_rows(k, block_ids, n), token_rows(v, block_ids, n)

    def step(self, side: str) -> tuple[set[str], set[str], set[int]]:
        """One engine step of a server: meta to every worker, then aggregate like vLLM does
        (a request is done once every worker reported it)."""
        sched, workers = (self.ps, self.pw) if side == "P" else (self.ds, self.dw)
        meta = sched.build_connector_meta()
        counts_s, counts_r, bad = {}, {}, set()
        for w in workers:
            w.start(meta)
        for w in workers:
            s, r = w.finished()
            for rid in s:
                counts_s[rid] = counts_s.get(rid, 0) + 1
            for rid in r:
                counts_r[rid] = counts_r.get(rid, 0) + 1
            bad |= w.take_load_errors()
        return counts_s, counts_r, bad

    def close(self):
        from kvxfer.transports.ipc.shm import release_segment

        for w in self.pw + self.dw:
            w.close()
        for seg in self.segments:
            release_segment(seg)


def _run_until(srv, side, pred, timeout=30.0, first=None):
    """Step ``side`` until ``pred(acc)`` holds; acc accumulates per-request worker reports
    (``first``: the reports of a step already taken, counted first)."""
    acc = {"send": {}, "recv": {}, "bad": set()}
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        s, r, bad = first if first is not None else srv.step(side)
        first = None
        for k, v in s.items():
            acc["send"][k] = acc["send"].get(k, 0) + v
        for k, v in r.items():
            acc["recv"][k] = acc["recv"].get(k, 0) + v
        acc["bad"] |= bad
        if pred(acc):
            return acc
        time.sleep(0.01)
    raise AssertionError(f"timed out: {acc}")


def _hand_over(srv, n, p_blocks, d_blocks, hit=0, d_req="d-1", p_req="p-1", p_first=False):
    """P prefills ``n`` tokens into ``p_blocks``, D loads them into ``d_blocks`` after a local
    hit of ``hit`` tokens; returns P's rows (per rank, per layer) and D's worker reports.
    ``p_first``: P's workers export before D's start the load (else after)."""
    rows = srv.fill_p(p_blocks, n)
    toks = list(range(n))
    preq = Request(
        p_req, toks, {"do_remote_decode": True}, Status.FINISHED_LENGTH_CAPPED, num_computed_tokens=n
    )
    hold, params = srv.ps.request_finished(preq, p_blocks)
    assert hold
    dreq = Request(d_req, toks, json.loads(json.dumps(params)))  # through the proxy: JSON
    assert srv.ds.get_num_new_matched_tokens(dreq, hit) == (n - hit, True)
    srv.ds.update_state_after_alloc(dreq, Blocks(d_blocks), n - hit)
    first = None
    if p_first:
        srv.step("P")  # P's workers export
        first = srv.step("D")  # start_load_kv loads (one-sided: launched, and done by get_finished)
    else:
        srv.step("D")  # the load starts before the export exists (the params come from P's scheduler)
        srv.step("P")  # now P exports
    acc = _run_until(srv, "D", lambda a: a["recv"].get(d_req) == len(srv.dw), first=first)
    srv.ds.update_connector_output({d_req})
    return rows, acc


def _check_d(srv, rows, d_blocks, n, hit=0, written=()):
    """D's kernels read exactly P's K/V for tokens [hit, n); blocks of the hit stay poisoned, and
    every block but these and ``written`` (an earlier request's)."""
    tp_p, tp_d = len(srv.pw), len(srv.dw)
    want = [torch.cat([rows[r][layer] for r in range(tp_p)], dim=2) for layer in range(LAYERS)]
    hd = HEADS // tp_d
    bs_d = _KINDS[srv.kinds[1]][3]
    for r in range(tp_d):
        for layer in range(LAYERS):
            got_k, got_v = srv.d_rows(r, layer, d_blocks, n)
            w = want[layer][:, :, r * hd : (r + 1) * hd]
            assert torch.equal(got_k[hit:].view(torch.int16), w[0, hit:].view(torch.int16)), (r, layer)
            assert torch.equal(got_v[hit:].view(torch.int16), w[1, hit:].view(torch.int16)), (r, layer)
            t = srv.dcache[r][layer]
            for blk in d_blocks[: hit // bs_d]:
                assert bool((t[blk] == POISON).all()), f"block {blk} of the local hit was written"
            others = [b for b in range(t.shape[0]) if b not in d_blocks and b not in written]
            assert bool((t[others] == POISON).all()), "a block outside the request was written"


@pytest.mark.parametrize(
    ("tp_p", "tp_d", "p_kind", "d_kind"),
    [
        (1, 1, "fa16", "fa32"),
        (2, 1, "fa16", "fa32"),
        (4, 2, "fa16", "fa32"),
        (1, 2, "fa16", "fa32"),
        (1, 1, "cpu32", "cpu32"),
        (2, 1, "cpu32", "cpu32"),
        (1, 2, "cpu32", "cpu32"),
    ],
)
@pytest.mark.parametrize("transport", ["auto", "pg"])
def test_p_to_d_through_engines_exact_bytes_and_p_frees(tp_p, tp_d, p_kind, d_kind, transport):
    """``auto`` reads P's plain CPU caches with ipc (cross-memory attach); ``pg`` streams them."""
    srv = _Servers(tp_p, tp_d, p_kind, d_kind, transport=transport)
    try:
        n = 45  # a partial last block on both sides (P 16: 2 + 13 tokens / 32: 1 + 13; D 32: 1 + 13)
        p_blocks = [3, 9, 4] if p_kind == "fa16" else [3, 9]
        rows, acc = _hand_over(srv, n, p_blocks, [11, 2])
        assert not acc["bad"]
        _check_d(srv, rows, [11, 2], n)
        used = "ipc" if transport == "auto" else "pg"
        assert all(w.engine.stats()["transports"] == {"P": used} for w in srv.dw)
        _run_until(srv, "P", lambda a: a["send"].get("p-1") == tp_p)
        assert all(w.engine.stats()["blocks_held"] == 0 for w in srv.pw)
        assert all(w.pending() == 0 for w in srv.pw + srv.dw)
        assert srv.ps.num_tracked() == 0
    finally:
        srv.close()


@pytest.mark.parametrize("tp_p", [1, 2])
def test_p_key_file_is_gone_once_the_scheduler_is_built(tp_p):
    """In vLLM's order (the workers start their engines, then the scheduler is built) P's host
    key file (kvxfer.auth) is removed as soon as the scheduler read it: a server stopped by a
    signal, whose workers never close, leaves none behind; hand-overs still verify."""
    from kvxfer.auth import key_path

    srv = _Servers(tp_p, 1, "fa16", "fa32", workers_first=True)
    try:
        assert not key_path("P", srv.pc.base_port).exists()
        rows, acc = _hand_over(srv, 45, [3, 9, 4], [11, 2])
        assert not acc["bad"]
        _check_d(srv, rows, [11, 2], 45)
    finally:
        srv.close()


@pytest.mark.parametrize(
    ("tp_p", "tp_d", "p_kind", "d_kind"), [(2, 1, "fa16", "fa32"), (1, 2, "cpu32", "cpu32")]
)
def test_worker_reads_one_sided_once_p_is_mapped(tp_p, tp_d, p_kind, d_kind):
    """The second hand-over: D's start_load_kv launches the copy itself (no lease grant), its
    get_finished reports it, P frees from the done marks; the bytes are P's. With the
    connector's defaults (lease 30 s, timeout 30 s: the lease has less than the timeout left)."""
    dflt = ConnectorConfig.from_vllm(vllm_config(role="kv_consumer"))
    assert dflt.lease_s <= dflt.timeout_s  # what this test covers: a lease no longer than the timeout
    srv = _Servers(tp_p, tp_d, p_kind, d_kind, shm=True, lease_s=dflt.lease_s, timeout_s=dflt.timeout_s)
    try:
        _hand_over(srv, 45, [3, 9, 4] if p_kind == "fa16" else [3, 9], [11, 2])
        assert all(w.engine.stats()["transports"] == {"P": "ipc"} for w in srv.dw)
        assert [w.stats_delta()["onesided_loads"] for w in srv.dw] == [0] * tp_d  # the first: messaged
        _run_until(srv, "P", lambda a: a["send"].get("p-1") == tp_p)
        n, p_blocks, d_blocks = 45, [5, 6, 7] if p_kind == "fa16" else [5, 6], [8, 7]
        rows, acc = _hand_over(srv, n, p_blocks, d_blocks, d_req="d-2", p_req="p-2", p_first=True)
        assert not acc["bad"]
        assert [w.engine.stats()["onesided"]["loads"] for w in srv.dw] == [1] * tp_d
        deltas = [w.stats_delta() for w in srv.dw]  # what D's log shows per interval
        assert [d["onesided_loads"] for d in deltas] == [1] * tp_d and all(
            d["transfers"] == 1 for d in deltas
        )
        _check_d(srv, rows, d_blocks, n, written=(11, 2))
        _run_until(srv, "P", lambda a: a["send"].get("p-2") == tp_p)
        assert all(w.engine.stats()["blocks_held"] == 0 for w in srv.pw)
    finally:
        srv.close()


@pytest.mark.parametrize(("p_kind", "d_kind"), [("fa16", "fa32"), ("cpu32", "cpu32")])
def test_prefix_hit_on_d_loads_the_rest_with_full_params(p_kind, d_kind):
    srv = _Servers(1, 1, p_kind, d_kind)
    try:
        n, hit = 77, 32  # D holds the first block; P's params name the whole request
        p_blocks = [5, 1, 7, 2, 8] if p_kind == "fa16" else [5, 1, 7]
        rows, acc = _hand_over(srv, n, p_blocks, [4, 12, 6], hit=hit)
        assert not acc["bad"]
        _check_d(srv, rows, [4, 12, 6], n, hit=hit)
        _run_until(srv, "P", lambda a: a["send"].get("p-1") == 1)
    finally:
        srv.close()


def test_mutation_a_perturbed_byte_fails_the_exact_check():
    """The exact check above can fail: one element of one loaded K page changed is caught."""
    srv = _Servers(1, 1, "cpu32", "cpu32")
    try:
        rows, _ = _hand_over(srv, 45, [3, 9], [11, 2])
        page = srv.dcache[0][1].view(16, HEADS, 2 * 32 * HD)[2, 0]  # D block 2 (the partial one), head 0
        page[5] *= 1.01  # K of token 32 + 5, dim 0 (vec: element dim * N + token)
        with pytest.raises(AssertionError):
            _check_d(srv, rows, [11, 2], 45)
    finally:
        srv.close()


def test_layout_mismatch_is_refused_naming_it_and_releases_p(caplog):
    srv = _Servers(1, 1, "fa16", "cpu32", lease_s=60.0)
    try:
        srv.fill_p([1, 2, 3], 40)
        preq = Request(
            "p", list(range(40)), {"do_remote_decode": True}, Status.FINISHED_STOPPED, num_computed_tokens=40
        )
        _, params = srv.ps.request_finished(preq, [1, 2, 3])
        srv.step("P")
        dreq = Request("d", list(range(40)), params)
        with caplog.at_level(logging.WARNING, logger="kvxfer.vllm"):
            assert srv.ds.get_num_new_matched_tokens(dreq, 0) == (0, False)
        assert (
            "KVLayoutMismatch" in caplog.text
            and "FLASH_ATTN" in caplog.text
            and "CPU_ATTN/vec" in caplog.text
        )
        srv.ds.update_state_after_alloc(dreq, Blocks([6, 7]), 0)
        srv.step("D")  # the release goes out
        _run_until(srv, "P", lambda a: a["send"].get("p") == 1, timeout=8)
        assert all(bool((t == POISON).all()) for t in srv.dcache[0])  # nothing written on D
        # the workers refuse such a load too, before anything is written
        from kvxfer.vllm.scheduler import LoadSpec, TransferMeta

        with caplog.at_level(logging.WARNING, logger="kvxfer.vllm"):
            srv.dw[0].start(TransferMeta(loads=[LoadSpec("d2", params, [6, 7], 0)]))
        assert "load of d2 refused (KVLayoutMismatch" in caplog.text
        assert srv.dw[0].finished()[1] == {"d2"} and srv.dw[0].take_load_errors() == {6, 7}
        assert all(bool((t == POISON).all()) for t in srv.dcache[0])
    finally:
        srv.close()


def test_aborted_decode_releases_p_before_the_lease():
    srv = _Servers(2, 1, lease_s=60.0)
    try:
        preq = Request(
            "p", list(range(20)), {"do_remote_decode": True}, Status.FINISHED_STOPPED, num_computed_tokens=20
        )
        _, params = srv.ps.request_finished(preq, [1, 2])
        srv.step("P")
        dreq = Request("d", list(range(20)), params, Status.FINISHED_ABORTED)
        srv.ds.request_finished(dreq, [])  # aborted while waiting: never allocated
        srv.step("D")
        t0 = time.monotonic()
        _run_until(srv, "P", lambda a: a["send"].get("p") == 2, timeout=8)
        assert time.monotonic() - t0 < 8 < 60
        assert all(w.engine.stats()["blocks_held"] == 0 for w in srv.pw)
    finally:
        srv.close()


def test_failed_load_is_reported_finished_with_its_block_ids():
    srv = _Servers(1, 1, timeout_s=0.5)
    try:
        preq = Request(
            "p", list(range(40)), {"do_remote_decode": True}, Status.FINISHED_STOPPED, num_computed_tokens=40
        )
        _, params = srv.ps.request_finished(preq, [1, 2, 3])
        srv.ps.build_connector_meta()  # P never exports it (e.g. P's worker died)
        dreq = Request("d", list(range(40)), params)
        srv.ds.get_num_new_matched_tokens(dreq, 0)
        srv.ds.update_state_after_alloc(dreq, Blocks([6, 7]), 40)
        acc = _run_until(srv, "D", lambda a: "d" in a["recv"], timeout=8)
        assert acc["bad"] == {6, 7}  # manager block ids: vLLM's kv_load_failure_policy applies
        stats = srv.dw[0].stats_delta()
        assert stats["failures"] == 1 and srv.dw[0].stats_delta() is None  # deltas, then idle
    finally:
        srv.close()


def test_stats_delta_carries_the_intervals_load_latency():
    """stats_delta carries the interval's summed load latency: vLLM logs its mean
    (kvxfer_avg_ms, one interval's loads) beside the engine-lifetime percentiles."""
    srv = _Servers(1, 1)
    try:
        srv.dw[0].stats_delta()
        _hand_over(srv, 45, [3, 9, 4], [11, 2])
        d = srv.dw[0].stats_delta()
        assert d["transfers"] == 1 and 0 < d["latency_sum_s"] < 5.0, d
        assert abs(d["latency_sum_s"] - srv.dw[0].engine.stats()["latency_sum_s"]) < 1e-9
    finally:
        srv.close()


def test_failed_load_is_reported_by_request_too():
    """vLLM 0.32 takes failed loads by request (failed_recving): a request is failed (or
    recomputed) even when its block table no longer holds the blocks reported bad."""
    srv = _Servers(1, 1, timeout_s=0.5)
    try:
        preq = Request(
            "p", list(range(40)), {"do_remote_decode": True}, Status.FINISHED_STOPPED, num_computed_tokens=40
        )
        _, params = srv.ps.request_finished(preq, [1, 2, 3])
        srv.ps.build_connector_meta()  # never exported
        dreq = Request("d", list(range(40)), params)
        srv.ds.get_num_new_matched_tokens(dreq, 0)
        srv.ds.update_state_after_alloc(dreq, Blocks([6, 7]), 40)
        _run_until(srv, "D", lambda a: "d" in a["recv"], timeout=8)
        assert srv.dw[0].take_failed_loads() == {"d"} and srv.dw[0].take_failed_loads() == set()
    finally:
        srv.close()


def test_p_side_sliding_window_blocks_out_of_the_window_are_not_handed_off(caplog):
    """A sliding-window group: vLLM put its null block (id 0) in place of the blocks the window
    passed. That KV is not whole: no params (D computes the prompt), a warning, no export."""
    s = _sched(engine_id="P")
    s.window = "sliding window of 32 tokens (SlidingWindowSpec)"
    with caplog.at_level("WARNING"):
        assert _p_finish(s, n=97, blocks=(0, 0, 5, 6))[1] == (False, None)
        assert _p_finish(s, n=70, blocks=(0, 5, 6))[1] == (False, None)  # one null block: not whole either
    assert s.build_connector_meta().exports == [] and s.num_not_handed_off == 2
    assert "not handed off: 2 of its 4 blocks are out of the sliding window" in caplog.text
    assert "sliding window of 32 tokens" in caplog.text and caplog.text.count("not handed off") == 1
    assert _p_finish(s, n=40, blocks=(7, 8))[1][0] is True  # in the window: handed off


def test_loads_and_exports_of_the_null_block_are_refused_and_counted(caplog):
    """A load whose blocks hold vLLM's null block (D's sliding window) is never written (the
    null block must stay zeros): refused, reported failed by block ids and by request, and
    counted in the failures vLLM logs (kvxfer_failures)."""
    srv = _Servers(1, 1)
    try:
        preq = Request(
            "p", list(range(40)), {"do_remote_decode": True}, Status.FINISHED_STOPPED, num_computed_tokens=40
        )
        _, params = srv.ps.request_finished(preq, [1, 2, 3])
        srv.step("P")
        dreq = Request("d", list(range(40)), params)
        srv.ds.get_num_new_matched_tokens(dreq, 0)
        srv.ds.update_state_after_alloc(dreq, Blocks([0, 7]), 40)
        with caplog.at_level("WARNING"):
            _, recv, bad = srv.step("D")
        assert recv == {"d": 1} and bad == {0, 7}
        assert srv.dw[0].take_failed_loads() == {"d"}
        assert "load of d refused" in caplog.text and "null block" in caplog.text
        assert srv.dw[0].stats_delta()["failures"] == 1
        assert bool((srv.dcache[0][0][0] == POISON).all())  # block 0 untouched
        _run_until(srv, "P", lambda a: a["send"].get("p") == 1)  # D released P's blocks
    finally:
        srv.close()


def test_p_lease_expiry_reports_finished_sending():
    srv = _Servers(1, 1, lease_s=0.3)
    try:
        preq = Request(
            "p", list(range(10)), {"do_remote_decode": True}, Status.FINISHED_STOPPED, num_computed_tokens=10
        )
        srv.ps.request_finished(preq, [1])
        acc = _run_until(srv, "P", lambda a: a["send"].get("p") == 1, timeout=5)
        assert acc["send"] == {"p": 1}
        assert srv.pw[0].engine.stats()["expirations"] == 1
    finally:
        srv.close()


def test_ports_consumer_free_and_producer_in_use_named(caplog):
    """A kv_consumer binds free ports (TP 2: two consumers on one host need no kv_port); an
    exporting server whose port is taken fails naming the port and the fix."""
    import socket

    make, backend, _, bs = _KINDS["fa16"]
    workers = []
    try:
        for _ in range(2):
            cfg = ConnectorConfig.from_vllm(vllm_config(role="kv_consumer", tp=2, block_size=bs, port=14579))
            for r in range(2):
                w = WorkerSide(cfg, r)
                w.register(
                    {"l0": make(4, 2)}, backend=backend, head_size=HD, total_kv_heads=HEADS, use_mla=False
                )
                workers.append(w)
        assert len({w.engine.port + w.tp_rank for w in workers}) == 4
        base = free_port_base(1)
        with socket.socket() as held:
            held.bind(("127.0.0.1", base))
            held.listen()
            cfg = ConnectorConfig.from_vllm(vllm_config(role="kv_producer", block_size=bs, port=base))
            w = WorkerSide(cfg, 0)
            with pytest.raises(RuntimeError, match=f"side-channel port {base} on 127.0.0.1 is in use") as ei:
                w.register(
                    {"l0": make(4, 4)}, backend=backend, head_size=HD, total_kv_heads=HEADS, use_mla=False
                )
            assert "another kv_port" in str(ei.value)
    finally:
        for w in workers:
            w.close()


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs CPU affinity calls and two CPUs",
)
def test_engine_threads_are_not_bound_to_the_workers_pinned_core():
    """vLLM's CPU worker binds its main thread to one core (GOMP_CPU_AFFINITY), the same core for
    every server on a host; the engine's threads, started from that thread, would inherit it and
    stall behind busy-waiting workers. They run on every CPU of the process; the calling thread
    keeps its binding."""
    make, backend, _, bs = _KINDS["fa16"]
    wide = os.sched_getaffinity(0)
    pinned = {min(wide)}
    out: dict = {}

    def as_vllm_worker():  # a thread of its own: pytest's thread keeps its affinity
        os.sched_setaffinity(0, pinned)
        cfg = ConnectorConfig.from_vllm(
            vllm_config(role="kv_producer", block_size=bs, port=free_port_base(1))
        )
        w = WorkerSide(cfg, 0)
        try:
            w.register({"l0": make(4, 4)}, backend=backend, head_size=HD, total_kv_heads=HEADS, use_mla=False)
            out["caller"] = os.sched_getaffinity(0)
            prefix = f"kvxfer-server-{cfg.engine_id}-"
            out["engine"] = [
                os.sched_getaffinity(t.native_id) for t in threading.enumerate() if t.name.startswith(prefix)
            ]
        finally:
            w.close()

    t = threading.Thread(target=as_vllm_worker)
    t.start()
    t.join(60)
    assert out["caller"] == pinned
    assert out["engine"] and all(a == wide for a in out["engine"]), (out, wide)


def test_extra_config_reaches_the_engine():
    """``max_sms``, ``onesided`` and ``transport`` in kv_connector_extra_config are what the
    worker's engine is built with (the only way a vLLM deployment sets the SM budget)."""
    make, backend, _, bs = _KINDS["fa16"]
    seen: dict = {}

    def factory(*a, **kw):
        seen.update(kw)
        return TransferEngine(*a, **kw)

    for extra, want in (
        ({}, (None, True, "auto")),
        ({"max_sms": 12, "onesided": False, "transport": "pg"}, (12, False, "pg")),
    ):
        cfg = ConnectorConfig.from_vllm(
            vllm_config(
                role="kv_producer",
                block_size=bs,
                port=free_port_base(1),
                extra={"host": "127.0.0.1", **extra},
            )
        )
        assert (cfg.max_sms, cfg.onesided, cfg.transport) == want
        w = WorkerSide(cfg, 0, engine_factory=factory)
        try:
            w.register({"l0": make(4, 4)}, backend=backend, head_size=HD, total_kv_heads=HEADS, use_mla=False)
            assert (seen["max_sms"], seen["onesided"], seen["transport"]) == want
            assert w.engine.stats()["onesided"].get("off", False) is (not want[1])
        finally:
            w.close()


def test_port_in_use_is_named_when_vllm_first_loads_the_connector_class():
    """An exporting server's kv_port in use is reported when vLLM's config checks load the
    connector class in the API server process (KVConnectorFactory.get_connector_class), before
    any model loads, not when the worker binds after loading it. Main process only, once, and
    only before it started a child (the engine core); a consumer, or a free port, passes."""
    code = (
        "import importlib, json, socket\n"
        "held = socket.socket()\n"
        "held.bind(('127.0.0.1', 0))\n"
        "held.listen()\n"
        "class KVC:\n"
        "    kv_role = 'kv_producer'\n"
        "    kv_port = held.getsockname()[1]\n"
        "    kv_connector_extra_config = {'host': '127.0.0.1'}\n"
        "def get_connector_class(kv_transfer_config):  # vLLM's call, as far as the frame goes\n"
        "    return getattr(importlib.import_module(kv_transfer_config.path), 'KvxferConnector')\n"
        "out = {'port': KVC.kv_port}\n"
        "for role, path in (('kv_consumer', 'kvxfer.vllm'), ('kv_producer', 'kvxfer.vllm')):\n"
        "    KVC.kv_role, KVC.path = role, path\n"
        "    try:\n"
        "        get_connector_class(KVC())\n"
        "        out[role] = 'no error'\n"
        "    except Exception as e:\n"
        "        out[role] = f'{type(e).__name__}: {e}'\n"
        "    import kvxfer.vllm\n"
        "    kvxfer.vllm._ports_checked = False\n"
        "import multiprocessing, time\n"
        "child = multiprocessing.get_context('spawn').Process(target=time.sleep, args=(30,))\n"
        "child.start()  # the engine core started: its worker may hold the port by now\n"
        "try:\n"
        "    get_connector_class(KVC())\n"
        "    out['after_engine_start'] = 'no error'\n"
        "except Exception as e:\n"
        "    out['after_engine_start'] = f'{type(e).__name__}: {e}'\n"
        "child.kill()\n"
        "print(json.dumps(out))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert not out["kv_consumer"].startswith("RuntimeError"), out  # a consumer binds no kv_port
    want = f"RuntimeError: kvxfer connector: side-channel port {out['port']} on 127.0.0.1 is in use"
    assert out["kv_producer"].startswith(want) and "another kv_port" in out["kv_producer"], out
    # a first lookup after the server started its engine core (vLLM's stat logger) is not the
    # early check: the port may be this server's own worker's
    assert not out["after_engine_start"].startswith("RuntimeError"), out
