"""kvxfer's log lines in a vLLM server's log.

vLLM configures its own ``vllm`` logger (its handler, format and ``VLLM_LOGGING_LEVEL``, no
propagation) and leaves the root logger alone, so a library's ``INFO`` lines (which transport a
peer took, why a load was not read one-sided, where the engine's threads run) would go nowhere
and its warnings would print without vLLM's prefix. :func:`join_vllm_logging` routes the
``kvxfer`` logger through vLLM's handlers, unless somebody configured logging themselves.
"""

from __future__ import annotations

import logging


def join_vllm_logging() -> bool:
    """Give the ``kvxfer`` logger vLLM's handlers and level when nobody configured it (no
    handler and no level of its own) nor the root logger (no handler), and vLLM configured its
    ``vllm`` logger (it has handlers: ``VLLM_CONFIGURE_LOGGING=0`` leaves it without). Returns
    whether it did. Idempotent."""
    kv, root, vl = logging.getLogger("kvxfer"), logging.getLogger(), logging.getLogger("vllm")
    if kv.handlers or kv.level != logging.NOTSET or root.handlers or not vl.handlers:
        return False
    for h in vl.handlers:
        kv.addHandler(h)
    kv.setLevel(vl.level or logging.INFO)
    kv.propagate = False
    return True
