"""The N−1 flow of a model with state groups (Mamba, GDN, short conv): P prefills N−1 prompt
tokens, D computes token N itself.

A state page holds the state after the last token computed, not one entry per token: D, which
computes the last prompt token again (vLLM's ``_update_waiting_for_remote_kv``), must start that
token from h(N−1). So the prefill server computes only the first N−1 tokens of an N-token prompt
(its KV covers tokens 0..N−2, its state is h(N−1)), exports those N−1 tokens, and D loads N−1
tokens and computes token N from the loaded state, sampling the first real token. vLLM's NIXL
connector does the same (``nixl/base_scheduler.py``: ``_truncate_request_for_prefill`` on P from
``on_new_request``, a prefill backoff of one token for Mamba); this module is kvxfer's own
implementation of that flow over vLLM 0.32's ``Request`` fields (``prompt_token_ids``,
``_all_token_ids``, ``num_prompt_tokens``, ``max_tokens``).

A one-token prompt cannot be truncated: nothing is handed off (D computes it).
"""

from __future__ import annotations

import contextlib
import logging

__all__ = ["BACKOFF_TOKENS", "TRUNCATED_KEY", "truncate_for_prefill", "was_truncated"]

_LOG = logging.getLogger(__name__)

BACKOFF_TOKENS = 1  # prompt tokens P leaves to D when the model has state groups
TRUNCATED_KEY = "_kvxfer_n_minus_1"  # set in the request's kv_transfer_params once truncated


def was_truncated(request) -> bool:
    """Whether :func:`truncate_for_prefill` truncated ``request``."""
    params = getattr(request, "kv_transfer_params", None) or {}
    return bool(params.get(TRUNCATED_KEY))


def truncate_for_prefill(request) -> bool:
    """Drop the last :data:`BACKOFF_TOKENS` prompt tokens of a P request (``do_remote_decode``)
    so P computes N−1 tokens; ``max_tokens`` becomes 1. Once per request (a preempted and
    rescheduled request is not truncated again); not a prompt of one token, nor a request that
    does not read the prefix cache (prompt logprobs: D computes its whole prompt anyway).
    Returns whether it truncated."""
    params = getattr(request, "kv_transfer_params", None)
    if not isinstance(params, dict) or not params.get("do_remote_decode") or params.get(TRUNCATED_KEY):
        return False
    n = int(getattr(request, "num_prompt_tokens", 0) or 0)
    skip = getattr(request, "get_skip_reading_prefix_cache", None)
    if n <= BACKOFF_TOKENS or (callable(skip) and skip()):
        return False
    prompt = getattr(request, "prompt_token_ids", None)
    if not isinstance(prompt, list) or len(prompt) != n:
        _LOG.warning(
            "kvxfer: request %s: its prompt is not a token list of num_prompt_tokens=%d (prompt embeddings?); "
            "not truncated, so not handed off",
            getattr(request, "request_id", "?"),
            n,
        )
        return False
    del prompt[-BACKOFF_TOKENS:]
    every = getattr(request, "_all_token_ids", None)
    if isinstance(every, list) and every is not prompt and len(every) == n:
        del every[-BACKOFF_TOKENS:]
    with contextlib.suppress(AttributeError):  # a read-only length (tests' fakes)
        request.num_prompt_tokens = n - BACKOFF_TOKENS
    if hasattr(request, "max_tokens"):
        request.max_tokens = 1
    params[TRUNCATED_KEY] = True
    return True
