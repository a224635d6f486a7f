"""``vllm.general_plugins`` entry point: registers ``KvxferConnector`` with vLLM's factory.

vLLM loads general plugins in every process it starts (API server, engine core, workers), so
:func:`register` runs many times: it does nothing when the name is already registered, and
nothing (but a debug line) when vLLM is not importable.
"""

from __future__ import annotations

import logging

_LOG = logging.getLogger(__name__)

NAME = "KvxferConnector"


def register() -> bool:
    """Register ``KvxferConnector`` (module ``kvxfer.vllm``); True if this call registered it."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError as e:
        _LOG.debug("kvxfer.vllm plugin: vLLM not importable (%s); nothing registered", e)
        return False
    if NAME in getattr(KVConnectorFactory, "_registry", {}):
        return False
    try:
        KVConnectorFactory.register_connector(NAME, "kvxfer.vllm", NAME)
    except ValueError:  # registered by another thread of this process in between
        return False
    return True
