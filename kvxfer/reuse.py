"""D→P reuse for multi-turn: pull a finished decode's KV back, or recompute it?

A cost model, not a threshold. Pulling ``T`` tokens costs a fixed latency (handshake when not
cached, control round trips) plus ``T * bytes_per_token / link_bandwidth``; recomputing them
costs a prefill of ``T`` tokens, linear at ``prefill_tokens_per_s`` plus the attention term that
grows with ``T²`` (``attn_tokens2_per_s``; infinite disables it). Pull when it is cheaper.
``link_bytes_per_s`` should be measured (e.g. ``TransferEngine.stats()["throughput_Bps"]``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["ReuseDecision", "decide_reuse"]


@dataclass(frozen=True)
class ReuseDecision:
    """``pull`` is True when moving the KV is estimated cheaper than recomputing it."""

    pull: bool
    pull_s: float
    recompute_s: float
    num_tokens: int


def decide_reuse(
    num_tokens: int,
    bytes_per_token: int,
    link_bytes_per_s: float,
    prefill_tokens_per_s: float,
    fixed_pull_s: float = 0.0,
    attn_tokens2_per_s: float = math.inf,
    min_gain: float = 1.0,
) -> ReuseDecision:
    """Decide pull vs recompute for ``num_tokens`` tokens of context.

    Args:
        num_tokens: tokens of KV held by the remote engine.
        bytes_per_token: wire bytes per token (``KVCacheSpec.bytes_per_token()``).
        link_bytes_per_s: measured transfer bandwidth between the engines.
        prefill_tokens_per_s: measured prefill throughput (linear part).
        fixed_pull_s: per-pull latency (handshake if not cached, round trips).
        attn_tokens2_per_s: quadratic attention cost rate, ``T² / rate`` seconds.
        min_gain: pull only if recompute_s >= min_gain * pull_s (hysteresis, >= 1).
    """
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens: must be a non-negative int, got {num_tokens!r}")
    if bytes_per_token <= 0:
        raise ValueError(f"bytes_per_token: must be > 0, got {bytes_per_token!r}")
    if not link_bytes_per_s > 0:
        raise ValueError(f"link_bytes_per_s: must be > 0, got {link_bytes_per_s!r}")
    if not prefill_tokens_per_s > 0:
        raise ValueError(f"prefill_tokens_per_s: must be > 0, got {prefill_tokens_per_s!r}")
    if fixed_pull_s < 0:
        raise ValueError(f"fixed_pull_s: must be >= 0, got {fixed_pull_s!r}")
    if not attn_tokens2_per_s > 0:
        raise ValueError(f"attn_tokens2_per_s: must be > 0, got {attn_tokens2_per_s!r}")
    if min_gain < 1.0:
        raise ValueError(f"min_gain: must be >= 1, got {min_gain!r}")
    pull_s = fixed_pull_s + num_tokens * bytes_per_token / link_bytes_per_s
    recompute_s = num_tokens / prefill_tokens_per_s + num_tokens * num_tokens / attn_tokens2_per_s
    pull = num_tokens > 0 and recompute_s >= min_gain * pull_s
    return ReuseDecision(pull=pull, pull_s=pull_s, recompute_s=recompute_s, num_tokens=num_tokens)
