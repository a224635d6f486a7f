"""Hybrid models' caches through kvxfer's ops (profiling/model_check_hybrid.py, on CPU):
transformers' Qwen3-Next (GDN + full attention), GraniteMoeHybrid (Mamba2, one group replicated
under TP, + full attention) and Gemma-3 (sliding window + full attention), every group moved from
P's vLLM-like pages into D's at another TP (2->1, 1->2), attention layout, block size, conv layout
and GDN SSM order; D's pages byte-equal to HF's cache laid out straight, D's next-token
log-probabilities equal to a plain run's; a 1 % error in one conv state, one SSM state or one
in-window block fails the check, and so does a copy that gets the conv layout wrong."""

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
        assert r["tokens"] % 8 and r["tokens"] % 6  # partial last blocks on both sides
        assert [(d["p"][:3], d["d"][:3], d["ops"]) for d in r["directions"]] == [
            ("TP2", "TP1", "gather/scatter"),
            ("TP1", "TP2", "copy"),
        ]
        for d in r["directions"]:
            assert d["held"] and d["bytes_exact"] and d["p_untouched"] and d["argmax_equal"], d
            assert d["max_abs_logprob_diff"] <= 1e-4 and not d["replica_problems"], d
            want = {"conv", "ssm"} if r["model"] != "gemma3" else {"window"}
            assert set(d["mutations"]) == want, d
            for m in d["mutations"].values():  # measured 2.9e-3 .. 6.9e-2 against 1e-4
                assert m["failed"] and m["max_abs_logprob_diff"] > 10 * 1e-4, m
            if r["model"] == "gemma3":  # only the window's tokens cross, not every block
                assert d["bytes_moved"]["sliding"] < d["bytes_moved"]["sliding_all_blocks"] / 2, d


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


def test_a_copy_that_ignores_the_conv_layout_fails_the_check(tmp_path):
    """A wrong copy, not a wrong cache: the state ops treat every conv state as SD, so D's DS
    pages get their conv bytes transposed; the bytes and the log-probabilities both show it."""
    script = tmp_path / "wrong_layout.py"
    script.write_text(_WRONG_LAYOUT)
    env = {**os.environ, "PYTHONPATH": ROOT}
    res = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=ROOT, env=env
    )
    assert res.returncode == 1, res.stdout + res.stderr
    got = _result(res)
    (granite,) = got["results"]
    for d in granite["directions"]:
        assert not d["held"] and not d["bytes_exact"] and d["max_abs_logprob_diff"] > 1e-3, d
