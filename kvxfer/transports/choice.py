"""Which transport a loader picks for a pair of engines, with the reason.

At handshake, :func:`choose` returns ``(transport, reason)``; an explicit
``"ipc"`` (or ``"nixl"``) that cannot work raises ``ValueError("transport 'ipc' was asked for
but cannot be used: <reason>")``; ``"auto"`` falls back to ``nixl`` across hosts when both
sides offer it (``reason = "nixl: ipc cannot be used: not on one host; ..."``), else to ``pg``
with ``reason = "pg: ipc cannot be used: <reason>"``. On one host auto picks ``nixl`` only from
an exporter that offers nothing else (one configured ``transport="nixl"``). For CUDA caches
the decision is :func:`kvxfer.transports.ipc.cuda_ipc.choose_transport`
(different hosts, ``expandable_segments``, PID namespaces, GPU visibility, same process), with
NVML topology (:mod:`kvxfer.topology`) consulted only when the two GPUs differ.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .ipc.offer import ipc_usable

__all__ = ["choose"]


def _nixl_usable(local_nixl: str, replies: list) -> tuple[bool, str]:
    """Whether this loader rank and every exporter rank can use NIXL, and why (not)."""
    if local_nixl:
        return False, f"this loader cannot: {local_nixl}"
    for r in replies:
        entry = getattr(r, "nixl", None) or {}
        if entry.get("why"):
            return False, f"exporter rank {r.tp_rank}: {entry['why']}"
        if "nixl" not in r.transports:
            return False, f"exporter rank {r.tp_rank} does not offer nixl"
        if not entry.get("agent"):
            return False, f"exporter rank {r.tp_rank}: no NIXL entry in its handshake"
    return True, "both sides offer NIXL (UCX)"


def choose(
    requested: str,
    device: torch.device,
    local_info: dict,
    identity: str,
    replies: list,
    topology: Callable[[], Any] | None = None,
    peer_access: Callable[[str, str], bool] | None = None,
    local_nixl: str = "NIXL is not offered by this loader",
) -> tuple[str, str]:
    """``(transport, reason)`` for a loader rank whose handshake got ``replies`` (one per
    exporter rank). Raises ``ValueError`` naming the reason when the requested transport
    cannot be used (never a silent fallback); ``topology()`` is called only for two GPUs;
    ``peer_access`` as in :func:`kvxfer.transports.ipc.cuda_ipc.ipc_supported`; ``local_nixl``
    is ``""`` when this loader can use NIXL, else why not."""
    if requested == "nixl":
        ok, why = _nixl_usable(local_nixl, replies)
        if not ok:
            raise ValueError(f"transport 'nixl' was asked for but cannot be used: {why}")
        return "nixl", "nixl: requested"
    pg_ok = all("pg" in r.transports for r in replies)
    if requested == "pg":
        if not pg_ok:
            raise ValueError("transport 'pg' was asked for but the exporter does not offer it")
        return "pg", "pg: requested"
    ok, why = ipc_usable(device, local_info, identity, replies, topology, peer_access)
    if requested == "ipc":
        if not ok:
            raise ValueError(f"transport 'ipc' was asked for but cannot be used: {why}")
        return "ipc", f"ipc: {why}"
    if ok:
        return "ipc", f"ipc: {why}"
    nok, nwhy = _nixl_usable(local_nixl, replies)
    if nok and not all(r.hostname == identity for r in replies):
        return "nixl", f"nixl: ipc cannot be used: {why}; {nwhy}"
    if pg_ok:
        return "pg", f"pg: ipc cannot be used: {why}"
    if nok:  # one host, but the exporter offers nothing else (it is configured for nixl)
        return "nixl", f"nixl: the exporter offers no other transport (ipc cannot be used: {why})"
    raise ValueError(
        "no common transport (exporter offers " + ",".join(replies[0].transports) + f"; ipc: {why})"
    )
