"""Tier 1: what goes wrong between the vLLM connector's two sides, with real engines (vLLM not
installed): a layout pairing refused with ``KVLayoutMismatch`` (P released, nothing written on
D), an aborted decode releasing P before its lease, failed loads reported by block ids and by
request, loads of vLLM's null block refused and counted, and P's lease expiring."""

from __future__ import annotations

import logging
import time

from .vllm_adapter_servers import POISON, _run_until, _Servers
from .vllm_fakes import Blocks, Request, Status


def _finished_on_p(srv: _Servers, num_tokens: int, blocks: list[int]) -> dict:
    """P's request "p" of ``num_tokens`` prompt tokens in ``blocks`` finished, handed off to a
    decode server: the kv_transfer_params P answers with."""
    preq = Request(
        "p", list(range(num_tokens)), {"do_remote_decode": True}, Status.FINISHED_STOPPED,
        num_computed_tokens=num_tokens,
    )  # fmt: skip
    return srv.ps.request_finished(preq, blocks)[1]


def test_layout_mismatch_is_refused_naming_it_and_releases_p(caplog):
    srv = _Servers(1, 1, "fa16", "cpu32", lease_s=60.0)
    try:
        srv.fill_p([1, 2, 3], 40)
        params = _finished_on_p(srv, 40, [1, 2, 3])
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
        params = _finished_on_p(srv, 20, [1, 2])
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
        params = _finished_on_p(srv, 40, [1, 2, 3])
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


def test_failed_load_is_reported_by_request_too():
    """vLLM 0.32 takes failed loads by request (failed_recving): a request is failed (or
    recomputed) even when its block table no longer holds the blocks reported bad."""
    srv = _Servers(1, 1, timeout_s=0.5)
    try:
        params = _finished_on_p(srv, 40, [1, 2, 3])
        srv.ps.build_connector_meta()  # never exported
        dreq = Request("d", list(range(40)), params)
        srv.ds.get_num_new_matched_tokens(dreq, 0)
        srv.ds.update_state_after_alloc(dreq, Blocks([6, 7]), 40)
        _run_until(srv, "D", lambda a: "d" in a["recv"], timeout=8)
        assert srv.dw[0].take_failed_loads() == {"d"} and srv.dw[0].take_failed_loads() == set()
    finally:
        srv.close()


def test_loads_and_exports_of_the_null_block_are_refused_and_counted(caplog):
    """A load whose blocks hold vLLM's null block (D's sliding window) is never written (the
    null block must stay zeros): refused, reported failed by block ids and by request, and
    counted in the failures vLLM logs (kvxfer_failures)."""
    srv = _Servers(1, 1)
    try:
        params = _finished_on_p(srv, 40, [1, 2, 3])
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
        _finished_on_p(srv, 10, [1])
        acc = _run_until(srv, "P", lambda a: a["send"].get("p") == 1, timeout=5)
        assert acc["send"] == {"p": 1}
        assert srv.pw[0].engine.stats()["expirations"] == 1
    finally:
        srv.close()


def test_a_failed_load_after_a_local_prefix_hit_reports_only_the_blocks_it_writes():
    """D's own prefix-cache hit is vLLM's: other running requests may share those blocks, and
    vLLM fails (or recomputes) every request holding a block reported invalid."""
    srv = _Servers(1, 1, timeout_s=0.5)
    try:
        params = _finished_on_p(srv, 40, [1, 2, 3])
        srv.ps.build_connector_meta()  # never exported: the load fails
        dreq = Request("d", list(range(40)), params)
        assert srv.ds.get_num_new_matched_tokens(dreq, 32) == (8, True)  # 32 tokens hit locally
        srv.ds.update_state_after_alloc(dreq, Blocks([5, 6]), 8)
        acc = _run_until(srv, "D", lambda a: "d" in a["recv"], timeout=8)
        assert acc["bad"] == {6}  # block 5 is the local hit: still valid
        assert srv.dw[0].take_failed_loads() == {"d"}
    finally:
        srv.close()


def test_params_without_a_prompt_hash_are_refused_and_release_p(caplog):
    """The prompt hash is what ties the loaded KV to this prompt: params stripped of it would
    file another prompt's KV in D's prefix cache under this one."""
    srv = _Servers(1, 1, lease_s=60.0)
    try:
        srv.fill_p([1, 2, 3], 40)
        params = _finished_on_p(srv, 40, [1, 2, 3])
        srv.step("P")
        stripped = {k: v for k, v in params.items() if k != "prompt_hash"}
        dreq = Request("d", list(range(40)), stripped)
        with caplog.at_level(logging.WARNING, logger="kvxfer.vllm"):
            assert srv.ds.get_num_new_matched_tokens(dreq, 0) == (0, False)
        assert "carry no prompt_hash" in caplog.text
        srv.ds.update_state_after_alloc(dreq, Blocks([6, 7]), 0)
        srv.step("D")  # the release goes out
        _run_until(srv, "P", lambda a: a["send"].get("p") == 1, timeout=8)
        assert all(bool((t == POISON).all()) for t in srv.dcache[0])  # nothing written on D
    finally:
        srv.close()
