import math

import pytest

from kvxfer.reuse import decide_reuse


def test_pull_when_link_beats_prefill():
    # 4K tokens, 128 KiB/token (32 layers x 8 heads x 128 x 2 x bf16), 20 GB/s vs 10K tok/s prefill
    d = decide_reuse(4096, 131072, 20e9, 10_000)
    assert d.pull and d.pull_s == pytest.approx(4096 * 131072 / 20e9)
    assert d.recompute_s == pytest.approx(0.4096)


def test_recompute_when_link_is_slow_or_context_short():
    assert not decide_reuse(4096, 131072, 0.5e9, 10_000).pull  # 1.07 s pull vs 0.41 s prefill
    assert not decide_reuse(16, 131072, 20e9, 10_000, fixed_pull_s=0.01).pull  # latency dominates
    assert not decide_reuse(0, 131072, 20e9, 10_000).pull


def test_quadratic_attention_term_moves_the_crossover():
    args = (8192, 131072, 1.5e9, 20_000)
    assert not decide_reuse(*args).pull
    assert decide_reuse(*args, attn_tokens2_per_s=1e8).pull
    # crossover is not a fixed token threshold: it moves with bandwidth
    fast = [n for n in (256, 1024, 4096) if decide_reuse(n, 131072, 40e9, 10_000, fixed_pull_s=0.005).pull]
    slow = [n for n in (256, 1024, 4096) if decide_reuse(n, 131072, 1e9, 10_000, fixed_pull_s=0.005).pull]
    assert fast != slow


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"num_tokens": -1}, "num_tokens"),
        ({"bytes_per_token": 0}, "bytes_per_token"),
        ({"link_bytes_per_s": 0}, "link_bytes_per_s"),
        ({"prefill_tokens_per_s": -1}, "prefill_tokens_per_s"),
        ({"min_gain": 0.5}, "min_gain"),
        ({"attn_tokens2_per_s": 0.0}, "attn_tokens2_per_s"),
    ],
)
def test_bad_inputs_named(kw, field):
    args = {
        "num_tokens": 10,
        "bytes_per_token": 10,
        "link_bytes_per_s": 1.0,
        "prefill_tokens_per_s": 1.0,
        "attn_tokens2_per_s": math.inf,
    }
    args.update(kw)
    with pytest.raises(ValueError, match=field):
        decide_reuse(**args)
