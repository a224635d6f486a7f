"""Tier 1: the vLLM connector's two sides with real kvxfer engines moving real bytes (vLLM not
installed): FlashAttention-style caches (token rows) with differing block sizes and TP, and
CPU_ATTN caches (ISA ``vec`` pages: K column-major) in whole blocks, the partial last block
included, handed over P -> D exactly (messaged, then one-sided once D mapped P), prefix hits on
D, P's key file and blocks freed, and the exact check shown able to fail."""

from __future__ import annotations

import pytest

from kvxfer.vllm.config import ConnectorConfig

from .vllm_adapter_servers import HD, HEADS, _check_d, _hand_over, _run_until, _Servers
from .vllm_fakes import vllm_config


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
