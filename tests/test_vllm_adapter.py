"""Tier 1: the vLLM connector's logic against fakes of vLLM's objects (vLLM not installed).

Real kvxfer engines move real bytes between caches laid out as vLLM's kernels read them
(FlashAttention-style on one side, CPU_ATTN on the other, differing block sizes and TP).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from kvxfer.ports import free_port_base
from kvxfer.vllm.config import ConnectorConfig
from kvxfer.vllm.layout import caches_from_vllm, kvxfer_view
from kvxfer.vllm.scheduler import SchedulerSide, expand_block_ids, prompt_hash
from kvxfer.vllm.worker import WorkerSide

from .vllm_fakes import (
    Blocks,
    Request,
    Status,
    cpu_cache,
    cpu_kernel_kv,
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
        vllm_config(tp=2, port=20000, dp_rank=3, dp_size=4, extra={"lease_s": 5, "transport": "pg"})
    )
    assert (c.engine_id, c.base_port, c.tp_size, c.lease_s, c.transport) == ("E-dp3", 20006, 2, 5.0, "pg")
    assert c.exports and c.loads
    assert not ConnectorConfig.from_vllm(vllm_config(role="kv_consumer")).exports


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


def test_cpu_view_is_the_kernels_k_and_v_without_copy():
    t = cpu_cache(5, 2, 32, 16, torch.float16)
    _fill_random(t, 2)
    v = kvxfer_view(t, "CPU_ATTN", 16, False)
    k_kern, v_kern = cpu_kernel_kv(t)
    assert torch.equal(v[0].transpose(1, 2).view(torch.int16), k_kern.view(torch.int16))
    assert torch.equal(v[1].transpose(1, 2).view(torch.int16), v_kern.view(torch.int16))
    assert v.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()


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
        (torch.zeros(6, 16, 2, 16).transpose(1, 2), "CPU_ATTN", False, "contiguous"),
        (torch.zeros(6, 2, 16, 16), "FLASHMLA", True, "one latent head"),
    ],
)
def test_views_reject_naming_the_problem(t, backend, mla, needle):
    with pytest.raises(ValueError, match=needle):
        kvxfer_view(t, backend, 8, mla)


def test_caches_from_vllm_dedups_shared_layers_and_checks_heads():
    a, b = cpu_cache(4, 2, 32, 8, torch.float16), cpu_cache(4, 2, 32, 8, torch.float16)
    spec, views, names = caches_from_vllm(
        {"l0": a, "l1": b, "l2": a},
        backend="CPU_ATTN",
        head_size=8,
        total_kv_heads=4,
        tp_size=2,
        use_mla=False,
    )
    assert names == ["l0", "l1"] and len(views) == 2
    assert (spec.num_layers, spec.num_kv_heads, spec.block_size, spec.layout.value) == (2, 4, 32, "HND")
    with pytest.raises(ValueError, match="kv heads per rank"):
        caches_from_vllm(
            {"l0": a}, backend="CPU_ATTN", head_size=8, total_kv_heads=8, tp_size=2, use_mla=False
        )


def test_expand_block_ids_and_prompt_hash():
    assert expand_block_ids([3, 1], 1) == [3, 1]
    assert expand_block_ids([3, 1], 4) == [12, 13, 14, 15, 4, 5, 6, 7]
    assert prompt_hash([1, 2, 3], 2) == prompt_hash([1, 2, 9], 2) != prompt_hash([1, 3], 2)


# ----------------------------------------------------------------------------- scheduler side

BS = 16


def _sched(role="kv_both", **kw) -> SchedulerSide:
    return SchedulerSide(ConnectorConfig.from_vllm(vllm_config(role=role, block_size=BS, **kw)))


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
    json.dumps(params)  # goes into an HTTP response
    meta = s.build_connector_meta()
    assert [(e.request_id, e.block_ids, e.num_tokens) for e in meta.exports] == [("r", [7, 8, 9], 40)]
    assert s.build_connector_meta().exports == []  # once
    assert s.num_tracked() == 0


def test_p_side_with_kernel_blocks_advertises_kernel_ids():
    s = _sched()
    s.set_handshake({0: {"block_size": 8, "bytes_per_token": 64}})
    _, (_, params) = _p_finish(s, n=20, blocks=(4, 5))
    assert params["block_size"] == 8 and params["block_ids"] == [8, 9, 10]  # 20 tokens: 3 kernel blocks


@pytest.mark.parametrize("status", [Status.FINISHED_ABORTED])
def test_p_side_aborted_or_consumer_frees_at_once(status):
    assert _p_finish(_sched(), status=status)[1] == (False, None)
    assert _p_finish(_sched(role="kv_consumer"))[1] == (False, None)
    s = _sched()
    assert s.request_finished(Request("x", [1, 2]), [1]) == (False, None)  # no params at all
    assert s.build_connector_meta().exports == []


def _p_params(rid="r", n=40, bs=BS, engine="P", port=21000, tokens=None):
    s = SchedulerSide(ConnectorConfig.from_vllm(vllm_config(engine_id=engine, port=port, block_size=bs)))
    toks = tokens if tokens is not None else list(range(100, 100 + n))
    req = Request(rid, toks, {"do_remote_decode": True}, Status.FINISHED_LENGTH_CAPPED, num_computed_tokens=n)
    return s.request_finished(req, list(range(1, 1 + -(-n // bs))))[1], toks


def test_d_side_loads_all_prompt_tokens():
    s = _sched(role="kv_consumer", engine_id="D")
    params, toks = _p_params()
    req = Request("d1", toks, params)
    assert s.get_num_new_matched_tokens(req, 0) == (40, True)
    s.update_state_after_alloc(req, Blocks([20, 21, 22, 23]), 40)
    meta = s.build_connector_meta()
    (ld,) = meta.loads
    assert ld.request_id == "d1" and ld.block_ids == [20, 21, 22] and ld.params["block_ids"] == [1, 2, 3]
    assert ld.params["num_tokens"] == 40 and ld.params["request_id"] == "r" and not meta.releases
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)  # once (e.g. after a preemption)
    s.update_connector_output({"d1"})
    req.status = Status.FINISHED_STOPPED
    assert s.request_finished(req, [20, 21, 22]) == (False, None)
    assert s.num_tracked() == 0


def test_d_side_prefix_hit_on_block_boundary_loads_only_the_rest():
    s = _sched(role="kv_consumer")
    params, toks = _p_params(n=40, bs=8)  # P blocks of 8: ids 1..5
    req = Request("d", toks, params)
    assert s.get_num_new_matched_tokens(req, 16) == (24, True)
    s.update_state_after_alloc(req, Blocks([30, 31, 32]), 24)
    (ld,) = s.build_connector_meta().loads
    assert ld.block_ids == [31, 32] and ld.params["block_ids"] == [3, 4, 5] and ld.params["num_tokens"] == 24


def test_d_side_prefix_hit_off_the_exporters_blocks_recomputes_and_releases(caplog):
    s = _sched(role="kv_consumer")
    params, toks = _p_params(n=64, bs=32)
    req = Request("d", toks, params)
    with caplog.at_level("WARNING"):
        assert s.get_num_new_matched_tokens(req, 16) == (0, False)
    assert "does not end on a block of the exporter" in caplog.text
    s.update_state_after_alloc(req, Blocks([30, 31, 32, 33]), 0)
    meta = s.build_connector_meta()
    assert not meta.loads and [r["request_id"] for r in meta.releases] == ["r"]


def test_d_side_full_local_hit_releases():
    s = _sched(role="kv_consumer")
    params, toks = _p_params(n=32)
    req = Request("d", toks, params)
    assert s.get_num_new_matched_tokens(req, 32) == (0, False)
    s.update_state_after_alloc(req, Blocks([1, 2]), 0)
    assert [r["request_id"] for r in s.build_connector_meta().releases] == ["r"]


def test_d_side_abort_before_allocation_releases_once():
    s = _sched(role="kv_consumer")
    params, toks = _p_params()
    req = Request("d", toks, params, Status.FINISHED_ABORTED)
    assert s.get_num_new_matched_tokens(req, 0) == (40, True)  # asked, never allocated
    assert s.request_finished(req, []) == (False, None)
    meta = s.build_connector_meta()
    assert [r["request_id"] for r in meta.releases] == ["r"] and not meta.loads
    assert s.num_tracked() == 0
    rej = Request("d2", [0], _p_params(rid="r2")[0], Status.FINISHED_ABORTED)  # rejected: never asked
    s.request_finished(rej, [])
    assert [r["request_id"] for r in s.build_connector_meta().releases] == ["r2"]


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


def test_d_side_unusable_params_recompute_without_release(caplog):
    s = _sched(role="kv_consumer")
    params, toks = _p_params()
    for bad in ({**params, "port": "x"}, {**params, "block_size": 0}, {**params, "block_ids": [1]}):
        req = Request(f"d{len(caplog.records)}", toks, bad)
        with caplog.at_level("WARNING"):
            assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert "unusable kv_transfer_params" in caplog.text
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
    p.set_handshake({0: {"block_size": BS, "bytes_per_token": 1 << 17}})
    turn2 = Request("t2", [*toks, 77, 78], {"do_remote_decode": True, "reuse": out["reuse"]})
    assert p.get_num_new_matched_tokens(turn2, 0) == (49, True)
    # a slow link makes recomputing cheaper: released instead
    p2 = _sched(engine_id="P2", extra={"reuse_link_GBps": 1e-6, "reuse_fixed_pull_s": 0.0})
    p2.set_handshake({0: {"block_size": BS, "bytes_per_token": 1 << 17}})
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


def _fill_fa(caches, block_ids, num_tokens, seed):
    """Write seeded K/V rows for a request's tokens the way FlashAttention writes them."""
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


class _Servers:
    """A P server (tp_p ranks, FlashAttention layout, block 16) and a D server (tp_d ranks,
    CPU_ATTN layout, block 32), each: one SchedulerSide and one WorkerSide per rank."""

    def __init__(self, tp_p: int, tp_d: int, lease_s: float = 30.0, timeout_s: float = 5.0, nb: int = 16):
        extra = {"lease_s": lease_s, "timeout_s": timeout_s}
        self.pc = ConnectorConfig.from_vllm(
            vllm_config(engine_id="P", tp=tp_p, port=free_port_base(tp_p), block_size=16, extra=extra)
        )
        self.dc = ConnectorConfig.from_vllm(
            vllm_config(engine_id="D", tp=tp_d, port=free_port_base(tp_d), block_size=32, extra=extra)
        )
        self.ps, self.ds = SchedulerSide(self.pc), SchedulerSide(self.dc)
        self.pw, self.dw, self.pcache, self.dcache = [], [], [], []
        for r in range(tp_p):
            caches = {f"l{i}": fa_cache(nb, HEADS // tp_p, 16, HD, torch.bfloat16) for i in range(LAYERS)}
            w = WorkerSide(self.pc, r)
            w.register(caches, backend="FLASH_ATTN", head_size=HD, total_kv_heads=HEADS, use_mla=False)
            self.pw.append(w)
            self.pcache.append(list(caches.values()))
        for r in range(tp_d):
            caches = {f"l{i}": cpu_cache(nb, HEADS // tp_d, 32, HD, torch.bfloat16) for i in range(LAYERS)}
            w = WorkerSide(self.dc, r)
            w.register(caches, backend="CPU_ATTN", head_size=HD, total_kv_heads=HEADS, use_mla=False)
            self.dw.append(w)
            self.dcache.append(list(caches.values()))
        self.ps.set_handshake({r: w.handshake_info() for r, w in enumerate(self.pw)})
        self.ds.set_handshake({r: w.handshake_info() for r, w in enumerate(self.dw)})

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
        for w in self.pw + self.dw:
            w.close()


def _run_until(srv, side, pred, timeout=10.0):
    """Step ``side`` until ``pred(acc)`` holds; acc accumulates per-request worker reports."""
    acc = {"send": {}, "recv": {}, "bad": set()}
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        s, r, bad = srv.step(side)
        for k, v in s.items():
            acc["send"][k] = acc["send"].get(k, 0) + v
        for k, v in r.items():
            acc["recv"][k] = acc["recv"].get(k, 0) + v
        acc["bad"] |= bad
        if pred(acc):
            return acc
        time.sleep(0.01)
    raise AssertionError(f"timed out: {acc}")


@pytest.mark.parametrize(("tp_p", "tp_d"), [(1, 1), (2, 1), (4, 2), (1, 2)])
def test_p_to_d_through_engines_exact_bytes_and_p_frees(tp_p, tp_d):
    srv = _Servers(tp_p, tp_d)
    try:
        n = 45  # two P blocks of 16 and a partial one; two D blocks of 32
        p_blocks = [3, 9, 4]
        rows = [_fill_fa(c, p_blocks, n, seed=5) for c in srv.pcache]  # per P rank: per layer [2, T, H, d]
        toks = list(range(n))
        preq = Request(
            "p-1", toks, {"do_remote_decode": True}, Status.FINISHED_LENGTH_CAPPED, num_computed_tokens=n
        )
        hold, params = srv.ps.request_finished(preq, p_blocks)
        assert hold
        # D may ask before P's workers exported (the params come from P's scheduler)
        dreq = Request("d-1", toks, json.loads(json.dumps(params)))
        assert srv.ds.get_num_new_matched_tokens(dreq, 0) == (n, True)
        srv.ds.update_state_after_alloc(dreq, Blocks([11, 2]), n)
        srv.step("D")  # the load starts before the export exists
        srv.step("P")  # now P exports
        acc = _run_until(srv, "D", lambda a: a["recv"].get("d-1") == tp_d)
        assert not acc["bad"]
        srv.ds.update_connector_output({"d-1"})
        # exact bytes, as the CPU kernel reads D's cache
        want = [torch.cat([rows[r][layer] for r in range(tp_p)], dim=2) for layer in range(LAYERS)]
        hd = HEADS // tp_d
        for r in range(tp_d):
            for layer in range(LAYERS):
                k, v = cpu_kernel_kv(srv.dcache[r][layer])
                got_k = token_rows(k, [11, 2], n)
                got_v = token_rows(v, [11, 2], n)
                w = want[layer][:, :, r * hd : (r + 1) * hd]
                assert torch.equal(got_k.view(torch.int16), w[0].view(torch.int16)), (r, layer)
                assert torch.equal(got_v.view(torch.int16), w[1].view(torch.int16)), (r, layer)
        acc = _run_until(srv, "P", lambda a: a["send"].get("p-1") == tp_p)
        assert all(w.engine.stats()["blocks_held"] == 0 for w in srv.pw)
        assert all(w.pending() == 0 for w in srv.pw + srv.dw)
        assert srv.ps.num_tracked() == 0
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
