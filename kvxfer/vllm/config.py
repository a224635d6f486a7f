"""The connector's configuration, read from vLLM's ``VllmConfig`` (duck-typed: no vLLM import).

Where things come from:

* ``kv_transfer_config.engine_id`` (vLLM makes one per server; ``-dp<rank>`` is appended with
  data parallelism): the kvxfer engine id of this server.
* ``kv_transfer_config.kv_port``: the side channel of a server that exports (``kv_producer``,
  ``kv_both``). TP rank ``r`` of data-parallel rank ``d`` binds ``kv_port + d * tp_size + r``;
  P and D servers on one host need ``kv_port`` ranges that do not overlap. A ``kv_consumer``
  never exports, so nobody dials its side channel: each of its ranks binds a free port and
  ``kv_port`` is not used.
* The advertised host: vLLM's ``KVTransferConfig`` has no field for it (0.32 and 0.33 reject
  ``kv_ip``), so it is ``kv_connector_extra_config.host``. The side channel binds it and the
  params P returns name it, so it must be reachable from the other servers. Default:
  :func:`default_host` (``$VLLM_HOST_IP``, else the address this machine's name resolves to,
  else ``127.0.0.1`` with a warning); ``127.0.0.1`` for a ``kv_consumer``.
* ``kv_transfer_config.kv_connector_extra_config`` (all optional):

  ===========================  ==========  ===================================================
  key                          default     meaning
  ===========================  ==========  ===================================================
  ``host``                     see above   address the side channel binds and params advertise
  ``transport``                ``"auto"``  ``"auto"``, ``"ipc"``, ``"pg"`` or ``"nixl"`` (kvxfer
                                           transports; nixl needs ``kvxfer[nixl]``)
  ``lease_s``                  30          how long P holds exported blocks without heartbeat
  ``timeout_s``                30          bound of every wait (a load whose export has not
                                           appeared by then fails; a P that died is seen at
                                           once or by its missing heartbeat, not by this)
  ``verify_prompt``            true        D checks a hash of P's prompt tokens before loading
  ``max_sms``                  none        SM budget of every transfer kernel (a positive int;
                                           none: no budget, see ``TransferEngine(max_sms=)``)
  ``onesided``                 true        D reads an ``ipc`` export straight from P's lease-slot
                                           table, no message before the copy (false: every
                                           load takes the messaged path)
  ``reuse_link_GBps``          10          D->P reuse: link bandwidth before one is measured
  ``reuse_prefill_tokens_per_s`` 20000     D->P reuse: this engine's prefill speed
  ``reuse_fixed_pull_s``       0.002       D->P reuse: fixed cost of one pull
  ``reuse_min_gain``           1.0         D->P reuse: pull only if recompute >= gain * pull
  ===========================  ==========  ===================================================
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket
from dataclasses import dataclass

_LOG = logging.getLogger(__name__)

__all__ = ["ROLES", "ConnectorConfig", "default_host", "port_in_use", "port_in_use_message"]

ROLES = ("kv_producer", "kv_consumer", "kv_both")

_EXTRA_DEFAULTS: dict[str, object] = {
    "host": None,
    "transport": "auto",
    "lease_s": 30.0,
    "timeout_s": 30.0,  # a stalled P is waited for (profiling/results/2026-11-28-cpu-vllm-pd-cma/, run 3)
    "verify_prompt": True,
    "max_sms": None,
    "onesided": True,
    "reuse_link_GBps": 10.0,
    "reuse_prefill_tokens_per_s": 20000.0,
    "reuse_fixed_pull_s": 0.002,
    "reuse_min_gain": 1.0,
}


def default_host() -> str:
    """This machine's address for the side channel when ``kv_connector_extra_config.host`` is
    not set: ``$VLLM_HOST_IP`` (vLLM's own setting for it), else the address the host name
    resolves to when that is not a loopback address, else ``127.0.0.1`` (a warning says so:
    servers on other hosts cannot reach it). Sends nothing on the network."""
    env = os.environ.get("VLLM_HOST_IP", "").strip()
    if env:
        return env
    name = socket.gethostname()
    try:
        addr = socket.gethostbyname(name)
    except OSError as e:
        addr, why = "", f"{name!r} does not resolve ({e})"
    else:
        why = f"{name!r} resolves to the loopback address {addr}"
    if addr and not ipaddress.ip_address(addr).is_loopback:
        return addr
    _LOG.warning(
        "kvxfer connector: advertising 127.0.0.1 (%s): only servers on this host can load from it; "
        "set kv_connector_extra_config.host (or $VLLM_HOST_IP) to an address the others reach",
        why,
    )
    return "127.0.0.1"


def port_in_use(host: str, port: int) -> OSError | None:
    """The error of binding ``host:port`` as a listening socket would (``SO_REUSEADDR``, as
    zmq binds: connections in TIME_WAIT do not count) when the port is in use, else None (free,
    or another problem the side channel's own bind reports)."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            s.listen(1)
        except OSError as e:
            return e if e.errno == errno.EADDRINUSE else None
    return None


def port_in_use_message(host: str, port: int, why: object, engine_id: str = "", tp_rank: int = 0) -> str:
    """What a server whose side-channel port is taken says: the port, the rule, the fix."""
    who = f"engine {engine_id} TP rank {tp_rank} binds" if engine_id else "TP rank 0 binds"
    return (
        f"kvxfer connector: side-channel port {port} on {host} is in use ({why}): {who} kv_port + "
        f"data_parallel_rank * tp_size + tp_rank = {port}. Give this server another kv_port in "
        f"--kv-transfer-config (servers on one host need ranges of tp_size ports that do not "
        f"overlap), or stop the process holding it (ss -ltnp 'sport = :{port}')"
    )


def _positive(key: str, v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise ValueError(f"kv_connector_extra_config.{key}: must be a number > 0, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class ConnectorConfig:
    """Everything the scheduler and worker sides need from vLLM's configuration.

    Args:
        engine_id: kvxfer engine id of this server (and data-parallel rank).
        role: vLLM ``kv_role``: ``kv_producer`` exports, ``kv_consumer`` loads, ``kv_both`` both.
        host: address the side channel binds and the params advertise.
        base_port: side-channel port of TP rank 0 (rank r binds ``base_port + r``); 0 for a
            ``kv_consumer``, whose ranks bind free ports (nobody dials them).
        tp_size: tensor-parallel size of this server.
        block_size: vLLM's (KV cache manager's) block size in tokens.
        transport, lease_s, timeout_s, max_sms, onesided: passed to
            :class:`kvxfer.TransferEngine`.
        verify_prompt: compare the prompt-token hash in P's params before loading (params
            without one are refused). The hash is not keyed: it catches params paired with the
            wrong prompt, not a client that forges them; clients must not reach D's
            ``kv_transfer_params`` (the router sets them from P's answer).
        reuse_*: the D->P reuse cost model (:func:`kvxfer.reuse.decide_reuse`).
    """

    engine_id: str
    role: str
    host: str
    base_port: int
    tp_size: int
    block_size: int
    transport: str = "auto"
    lease_s: float = 30.0
    timeout_s: float = 30.0
    verify_prompt: bool = True
    max_sms: int | None = None
    onesided: bool = True
    reuse_link_Bps: float = 10e9
    reuse_prefill_tokens_per_s: float = 20000.0
    reuse_fixed_pull_s: float = 0.002
    reuse_min_gain: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.engine_id, str) or not self.engine_id:
            raise ValueError(
                f"kv_transfer_config.engine_id: must be a non-empty string, got {self.engine_id!r}"
            )
        if self.role not in ROLES:
            raise ValueError(f"kv_transfer_config.kv_role: must be one of {ROLES}, got {self.role!r}")
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"kv_connector_extra_config.host: must be a non-empty string, got {self.host!r}")
        for name, v in (("tp_size", self.tp_size), ("block_size", self.block_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: must be a positive int, got {v!r}")
        bp = self.base_port
        if self.role == "kv_consumer" and bp == 0:
            pass  # free ports, chosen by each rank
        elif isinstance(bp, bool) or not isinstance(bp, int) or not 1 <= bp <= 65535 - self.tp_size + 1:
            raise ValueError(
                f"kv_transfer_config.kv_port: ports {bp!r}..{bp!r}+{self.tp_size - 1} must lie in [1, 65535]"
            )
        if self.transport not in ("auto", "ipc", "pg", "nixl"):
            raise ValueError(
                "kv_connector_extra_config.transport: must be 'auto', 'ipc', 'pg' or 'nixl', "
                f"got {self.transport!r}"
            )
        if not isinstance(self.verify_prompt, bool):
            raise ValueError(
                f"kv_connector_extra_config.verify_prompt: must be a bool, got {self.verify_prompt!r}"
            )
        ms = self.max_sms
        if ms is not None and (isinstance(ms, bool) or not isinstance(ms, int) or ms < 1):
            raise ValueError(
                f"kv_connector_extra_config.max_sms: must be a positive int (SMs) or null, got {ms!r}"
            )
        if not isinstance(self.onesided, bool):
            raise ValueError(f"kv_connector_extra_config.onesided: must be a bool, got {self.onesided!r}")
        if not self.reuse_fixed_pull_s >= 0:
            raise ValueError(
                f"kv_connector_extra_config.reuse_fixed_pull_s: must be >= 0, got {self.reuse_fixed_pull_s!r}"
            )
        if self.reuse_min_gain < 1.0:
            raise ValueError(
                f"kv_connector_extra_config.reuse_min_gain: must be >= 1, got {self.reuse_min_gain!r}"
            )

    @property
    def exports(self) -> bool:
        """Whether this server hands KV out (prefill, or decode for multi-turn reuse)."""
        return self.role in ("kv_producer", "kv_both")

    @property
    def loads(self) -> bool:
        """Whether this server takes KV in (decode, or prefill for multi-turn reuse)."""
        return self.role in ("kv_consumer", "kv_both")

    @classmethod
    def from_vllm(cls, vllm_config) -> ConnectorConfig:
        """Read a ``VllmConfig`` (any object with the same attributes); ``ValueError`` naming
        the setting for what kvxfer cannot serve (pipeline or context parallelism, bad values)."""
        kvc = getattr(vllm_config, "kv_transfer_config", None)
        if kvc is None:
            raise ValueError("kv_transfer_config: must be set to use KvxferConnector")
        par = vllm_config.parallel_config
        pp = getattr(par, "pipeline_parallel_size", 1)
        if pp != 1:
            raise ValueError(f"pipeline_parallel_size: KvxferConnector supports 1, got {pp}")
        for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
            v = getattr(par, name, 1)
            if v != 1:
                raise ValueError(f"{name}: KvxferConnector supports 1, got {v}")
        tp = par.tensor_parallel_size
        dp_size = getattr(par, "data_parallel_size", 1)
        dp_rank = getattr(par, "data_parallel_index", getattr(par, "data_parallel_rank", 0)) or 0
        extra = dict(getattr(kvc, "kv_connector_extra_config", None) or {})
        unknown = sorted(set(extra) - set(_EXTRA_DEFAULTS))
        if unknown:
            _LOG.warning("kvxfer connector: ignoring unknown kv_connector_extra_config keys %s", unknown)
        opt = {**_EXTRA_DEFAULTS, **{k: v for k, v in extra.items() if k in _EXTRA_DEFAULTS}}
        engine_id = kvc.engine_id
        if dp_size > 1:
            engine_id = f"{engine_id}-dp{dp_rank}"
        port = getattr(kvc, "kv_port", None)
        if isinstance(port, bool) or not isinstance(port, int):
            raise ValueError(f"kv_transfer_config.kv_port: must be an int, got {port!r}")
        role = kvc.kv_role
        if opt["host"] is not None:
            host = opt["host"]
        else:  # a consumer's side channel is never dialed: it binds loopback
            host = "127.0.0.1" if role == "kv_consumer" else default_host()
        return cls(
            engine_id=engine_id,
            role=role,
            host=host,
            base_port=0 if role == "kv_consumer" else port + dp_rank * tp,
            tp_size=tp,
            block_size=vllm_config.cache_config.block_size,
            transport=opt["transport"],
            lease_s=_positive("lease_s", opt["lease_s"]),
            timeout_s=_positive("timeout_s", opt["timeout_s"]),
            verify_prompt=opt["verify_prompt"],
            max_sms=opt["max_sms"],
            onesided=opt["onesided"],
            reuse_link_Bps=_positive("reuse_link_GBps", opt["reuse_link_GBps"]) * 1e9,
            reuse_prefill_tokens_per_s=_positive(
                "reuse_prefill_tokens_per_s", opt["reuse_prefill_tokens_per_s"]
            ),
            reuse_fixed_pull_s=float(opt["reuse_fixed_pull_s"]),
            reuse_min_gain=_positive("reuse_min_gain", opt["reuse_min_gain"]),
        )
