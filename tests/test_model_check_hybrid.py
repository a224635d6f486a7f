"""Hybrid models' caches through kvxfer's TransferEngine (profiling/model_check_hybrid.py, on
CPU): transformers' Qwen3-Next (GDN + full attention), GraniteMoeHybrid (Mamba2, one group
replicated under TP, + full attention) and Gemma-3 (sliding window + full attention), every group
moved by P's engines and D's over ``ipc`` from P's vLLM-like pages into D's at another TP (2->1,
1->2), attention layout, block size, conv layout and GDN SSM order; D's pages byte-equal to HF's
cache laid out straight, D's next-token log-probabilities equal to a plain run's, P's engines
holding no block after the load, the bytes D's engines count what the groups need; a 1 % error in
one conv state, one SSM state or one in-window block fails the check, and so does a move that gets
the conv layout wrong or puts the state in another block of D's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.test_profiling import ROOT, _run

pytest.importorskip("transformers", reason="the test extra brings transformers")


def _result(res) -> dict:
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_every_group_of_three_hybrid_models_decodes_as_a_plain_run():
    res = _run("model_check_hybrid.py", timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    got = _result(res)
    assert got["ok"] and got["atol"] == 1e-4
    assert [r["model"] for r in got["results"]] == ["qwen3_next", "granite", "gemma3"]
    for r in got["results"]:
        assert r["seconds"] < 60, r  # measured 5-7 s a model on 2 cores
        assert [(d["p"][:3], d["d"][:3], d["ops"]) for d in r["directions"]] == [
            ("TP2", "TP1", "engine/ipc"),
            ("TP1", "TP2", "engine/ipc"),
        ]
        for d in r["directions"]:
            n, eng, need = r["tokens"], d["engine"], d["bytes_needed"]
            assert n % d["p_block_size"] and n % d["d_block_size"], d  # partial last blocks on both sides
            assert n > 2 * max(d["p_block_size"], d["d_block_size"]), d  # and several blocks
            assert d["p_block_size"] != d["d_block_size"], d
            assert d["held"] and d["bytes_exact"] and d["p_untouched"] and d["argmax_equal"], d
            assert d["max_abs_logprob_diff"] <= 1e-4 and not d["replica_problems"], d
            assert eng["recv"] == eng["sent"] == "done" and eng["same_params"], d
            assert eng["p_blocks_held_exported"] > 0 and eng["p_blocks_held_end"] == 0, d
            assert eng["bytes_recv"] == need["total"] < need["every_block_whole"], d
            want = {"conv", "ssm"} if r["model"] != "gemma3" else {"window"}
            assert set(d["mutations"]) == want, d
            for m in d["mutations"].values():  # measured 5.3e-3 .. 1.1e-1 against 1e-4
                assert m["failed"] and m["max_abs_logprob_diff"] > 10 * 1e-4, m
            if r["model"] == "gemma3":  # only the window's tokens cross, not every block
                assert need["sliding"] / 5 < need["full"] / 1 / 4, d  # per layer: 5 sliding, 1 full
                assert eng["bytes_recv"] < need["every_block_whole"] / 2, d


def _wrapped(tmp_path, body: str):
    script = tmp_path / "wrapped.py"
    script.write_text(body)
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=ROOT, env=env
    )


_WRONG_LAYOUT = """
import sys
sys.path.insert(0, "profiling")
from kvxfer.groups import state_ops
import model_check_hybrid

real = state_ops._geometry


def as_if_sd(spec, section):  # a copy that writes DS pages as if they were SD
    import dataclasses
    return real(dataclasses.replace(spec, conv_layout="SD"), section)


state_ops._geometry = as_if_sd
if __name__ == "__main__":
    sys.exit(model_check_hybrid.main(["--models", "granite"]))
"""


def test_a_move_that_ignores_the_conv_layout_fails_the_check(tmp_path):
    """A wrong move, not a wrong cache: the state ops the ipc transport re-shards with treat
    every conv state as SD, so D's DS pages get their conv bytes transposed; the bytes and the
    log-probabilities both show it."""
    res = _wrapped(tmp_path, _WRONG_LAYOUT)
    assert res.returncode == 1, res.stdout + res.stderr
    got = _result(res)
    (granite,) = got["results"]
    for d in granite["directions"]:
        assert not d["held"] and not d["bytes_exact"] and d["max_abs_logprob_diff"] > 1e-3, d


_WRONG_STATE_BLOCK = """
import sys
sys.path.insert(0, "profiling")
import kvxfer
import model_check_hybrid

real = kvxfer.TransferEngine.load


def load(self, request_id, params, block_ids, *args, **kwargs):  # D's state lands in a spare block
    lists = [list(x) for x in block_ids]
    used = {b for x in lists for b in x}
    lists[-1] = [min(set(range(1, max(used) + 2)) - used)]
    return real(self, request_id, params, lists, *args, **kwargs)


kvxfer.TransferEngine.load = load
if __name__ == "__main__":
    sys.exit(model_check_hybrid.main(["--models", "qwen3_next"]))
"""


def test_a_move_into_another_state_block_fails_the_check(tmp_path):
    """D's engines load the state into a free block other than the one D's pages are read
    from: the moved bytes are where D never looks, its state block stays poison."""
    res = _wrapped(tmp_path, _WRONG_STATE_BLOCK)
    assert res.returncode == 1, res.stdout + res.stderr
    (qwen,) = _result(res)["results"]
    for d in qwen["directions"]:
        assert d["engine"]["recv"] == "done" and d["engine"]["p_blocks_held_end"] == 0, d
        assert not d["held"] and not d["bytes_exact"], d
        assert not d["max_abs_logprob_diff"] <= 1e-3, d
