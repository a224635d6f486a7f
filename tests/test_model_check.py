"""A real model's KV through the engine (profiling/model_check.py, on CPU): transformers' Llama
prefilled in P, its KV moved over ipc into D's cache of another layout and block size, and D's
next-token log-probabilities equal to a plain run's; the same check fails when one token's K is
1 % off on D, and when the engine leaves a partial last block behind."""

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


def test_a_real_models_kv_decodes_as_a_plain_run():
    res = _run("model_check.py", "--device", "cpu", timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    got = _result(res)
    assert got["held"] and got["ok"] and got["argmax_equal"] and got["p_freed"], got
    assert got["max_abs_logprob_diff"] <= got["atol"] == 1e-4
    assert (got["p"], got["d"]) == ("NHD/16", "HND/32") and got["tokens"] % 16 and got["tokens"] % 32
    # two loads: the first handshakes (the messaged path), the second reads one-sided
    assert len(got["logprob_diff_per_load"]) == 2 and got["onesided_loads"] == 1, got


def test_one_key_off_by_one_percent_fails_the_check():
    """The check can fail: one token's K of one layer scaled by 1.01 on D after the load."""
    res = _run("model_check.py", "--device", "cpu", "--mutate", timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr  # 0: the check failed, as it must
    got = _result(res)
    assert got["mutated"] and not got["held"] and got["ok"], got
    assert got["max_abs_logprob_diff"] > 10 * got["atol"], got  # measured 1.1e-3 against 1e-4
    assert "check FAILED" in res.stdout


_NO_TAIL = """
import sys
sys.path.insert(0, "profiling")
from kvxfer import prepared
import model_check

real = prepared.launch


def no_tail(how, src, dst, budget, dma):  # an engine whose copies drop a partial last block's tokens
    n = src.num_tokens
    if n > 16 and n % 16:
        src.num_tokens = dst.num_tokens = n - n % 16
    return real(how, src, dst, budget, dma)


prepared.launch = no_tail
if __name__ == "__main__":
    sys.exit(model_check.main(["--device", "cpu"]))
"""


def test_an_engine_that_drops_the_tail_fails_the_check(tmp_path):
    """A wrong copy, not a wrong cache: the engine's copy moves whole blocks only (the 5 tokens of
    the partial last block stay zero on D); the check sees it."""
    script = tmp_path / "no_tail.py"
    script.write_text(_NO_TAIL)
    env = {**os.environ, "PYTHONPATH": ROOT}
    res = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=ROOT, env=env
    )
    assert res.returncode == 1, res.stdout + res.stderr
    got = _result(res)
    assert not got["held"] and got["max_abs_logprob_diff"] > 0.1, got
