"""The ``ipc`` transport's handshake: what an exporter rank offers and a loader maps.

Exporter side, at start-up: :func:`offer_ipc` describes the rank's caches through the cache
mapper of their device (``"shm"`` for CPU caches in shared memory, ``"cma"`` for other CPU
caches, :mod:`kvxfer.transports.ipc.cma`, ``"cuda"`` —
:mod:`kvxfer.transports.ipc.cuda_mapper` — for CUDA caches), allocates the shared
block-epoch array (host shared memory on both), and builds the ``ipc`` entry of the handshake
reply:

    offered:     {"mapper", "caches", "epochs", "num_blocks", "info", "why": ""}
    not offered: {"mapper": None, "info", "why": <reason>}

``info`` is :func:`kvxfer.transports.ipc.cuda_ipc.local_ipc_info` of the cache device (host,
pid, PID namespace, GPU UUIDs, ``expandable_segments``). Loader side: :func:`ipc_usable` says
whether every exporter rank can be mapped from here (and why not), :func:`attach` maps one,
:func:`detach` releases it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from . import cuda_ipc
from .mappers import mapper

__all__ = ["IpcOffer", "attach", "detach", "ipc_usable", "offer_ipc"]


@dataclass
class IpcOffer:
    """An exporter rank's ``ipc`` handshake entry and the epoch array it shares."""

    desc: dict
    epochs: torch.Tensor | None = None
    epoch_shm: Any = None

    @property
    def offered(self) -> bool:
        return self.desc.get("mapper") is not None


def _mapper_name(device: torch.device) -> str:
    return "cuda" if device.type == "cuda" else "shm"


def offer_ipc(
    caches: list[torch.Tensor], device: torch.device, num_blocks: int, engine_id: str, enabled: bool = True
) -> IpcOffer:
    """Describe ``caches`` for loaders on this host; allocate the shared epoch array if offered
    (``enabled=False``: the engine is configured for ``pg`` or ``nixl`` only; nothing is
    published)."""
    info = cuda_ipc.local_ipc_info(device)
    if not enabled:
        why = "the exporter is configured for another transport (pg only or nixl only)"
        return IpcOffer({"mapper": None, "info": info, "why": why})
    name = _mapper_name(device)
    m = mapper(name)
    if name == "cuda":
        desc, why = m.offer(caches, engine_id)
    else:
        desc, why = m.describe(caches), ""
        if desc is None:  # plain CPU caches: read with cross-memory attach where the OS allows
            cma = mapper("cma")
            name, desc = "cma", cma.describe(caches)
            if desc is None:
                why = (
                    "the exporter's caches are not mappable (not in shm; "
                    + (cma.available() or "cross-memory attach: caches of different shapes")
                    + ")"
                )
    if desc is None:
        return IpcOffer({"mapper": None, "info": info, "why": why})
    epochs, seg = mapper("shm").alloc_shm_array(num_blocks)
    entry = {
        "mapper": name,
        "caches": desc,
        "epochs": seg.name,
        "num_blocks": num_blocks,
        "info": info,
        "why": "",
    }
    return IpcOffer(entry, epochs, seg)


def ipc_usable(
    device: torch.device,
    local_info: dict,
    identity: str,
    replies: list,
    topology: Callable[[], Any] | None,
    peer_access: Callable[[str, str], bool] | None = None,
) -> tuple[bool, str]:
    """Whether this loader rank can map every exporter rank's caches, and why (not)."""
    if not all(r.hostname == identity for r in replies):
        return False, "not on one host"
    want = _mapper_name(device)
    why_ok = ""
    for r in replies:
        entry = r.ipc or {}
        if "ipc" not in r.transports or entry.get("mapper") is None:
            return False, entry.get("why") or f"exporter rank {r.tp_rank} does not offer ipc"
        if entry["mapper"] == "cma" and want == "shm":
            why = _cma_usable(local_info, entry.get("info"), entry.get("caches"))
            if why:
                return False, f"exporter rank {r.tp_rank}: {why}"
            why_ok = why_ok or "cross-memory attach on one host"
            continue
        if entry["mapper"] != want:
            return False, (
                f"exporter rank {r.tp_rank}'s caches are mapped with {entry['mapper']!r}, this rank's "
                f"{device.type} caches need {want!r} (ipc needs both caches on one kind of device)"
            )
        if want == "shm":
            why_ok = "shared memory on one host"
            continue
        peer = entry.get("info")
        try:
            ok, why = cuda_ipc.ipc_supported(local_info, peer, peer_access)
            if ok and topology is not None and peer["gpu_uuid"] != local_info["gpu_uuid"]:
                kind, msg = cuda_ipc.choose_transport(local_info, peer, "auto", topology(), peer_access)
                ok, why = kind == "ipc", msg.partition(": ")[2]
        except ValueError as e:
            return False, str(e)
        if not ok:
            return False, f"exporter rank {r.tp_rank}: {why}"
        why_ok = why
    return True, why_ok


def _cma_usable(local: dict, peer, desc) -> str:
    """Why this process cannot read an exporter's caches with cross-memory attach ("" if it
    can): the same host and PID namespace, and the kernel letting this process read the
    exporter's probe (Yama's ``ptrace_scope`` 1, Ubuntu's default, does not), so ``auto`` takes
    another transport instead of failing every load."""
    cma = mapper("cma")
    why = cma.available()
    if why:
        return why
    if not isinstance(peer, dict) or not isinstance(peer.get("pid"), int):
        return "cross-memory attach: the exporter sent no process info"
    if peer.get("host_id") != local.get("host_id") or peer.get("pid_ns") != local.get("pid_ns"):
        return "cross-memory attach needs one host and one PID namespace"
    if not isinstance(desc, dict) or desc.get("pid") != peer["pid"]:
        return "cross-memory attach: the exporter's description names another process"
    return cma.probe(desc)


def attach(entry: dict, device: torch.device) -> tuple[list[torch.Tensor], torch.Tensor, list]:
    """Loader: map an exporter rank's caches and epoch array from its handshake ``entry``;
    returns (caches, epochs, handles for :func:`detach`)."""
    m = mapper(entry["mapper"])
    if entry["mapper"] == "cuda":
        caches, h1 = m.attach(entry["caches"], device)
    else:
        caches, h1 = m.attach(entry["caches"])
    try:
        ep, h2 = m.attach_array(entry["epochs"], entry["num_blocks"])
    except BaseException:
        m.detach(h1)
        raise
    return caches, ep, [(m, h1), (m, h2)]


def detach(handles: list) -> None:
    """Release what :func:`attach` returned."""
    for m, h in handles:
        m.detach(h)
