"""Tier 1: the connector's scheduler side (kvxfer.vllm.scheduler) against fakes of vLLM's requests
and block lists: the kv_transfer_params P hands out when a prefill finishes (blocks held, whole-
block layouts, kernel block ids, sliding-window blocks not handed off), and how D uses them
(loads, prefix hits, releases, aborts, recomputes, n>1 children), the reuse model's choices."""

from __future__ import annotations

import json

import pytest

from kvxfer.vllm import scheduler as scheduler_mod
from kvxfer.vllm.config import ConnectorConfig
from kvxfer.vllm.layout import KVLayout
from kvxfer.vllm.scheduler import SchedulerSide, expand_block_ids, prompt_hash

from .vllm_fakes import Blocks, Request, Status, vllm_config


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


def test_remote_keys_loaded_are_forgotten_oldest_first_in_batches(monkeypatch):
    """D remembers the remote keys it loaded (a sibling's params are not loaded twice) up to
    ``_CONSUMED_MAX``, forgetting the oldest a batch at a time; the newest are always kept."""
    monkeypatch.setattr(scheduler_mod, "_CONSUMED_MAX", 8)
    monkeypatch.setattr(scheduler_mod, "_CONSUMED_SLACK", 2)
    s = _sched()
    sizes = []
    for k in range(40):
        s._consume(("P", f"r{k}"))
        sizes.append(len(s._consumed))
    assert max(sizes) == 10 and min(sizes[10:]) == 8
    assert list(s._consumed)[-8:] == [("P", f"r{k}") for k in range(32, 40)]
