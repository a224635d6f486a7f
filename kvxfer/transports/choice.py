"""What an engine rank offers at handshake, and which transport a loader picks (with the reason).

Exporter side, at start-up: :func:`offer_ipc` describes the rank's caches through the cache
mapper of their device (``"shm"`` for CPU caches in shared memory, ``"cuda"`` —
:mod:`kvxfer.transports.cuda_mapper` — for CUDA caches), allocates the shared block-epoch
array (host shared memory on both), and builds the ``ipc`` entry of the handshake reply:

    offered:     {"mapper", "caches", "epochs", "num_blocks", "info", "why": ""}
    not offered: {"mapper": None, "info", "why": <reason>}

``info`` is :func:`kvxfer.transports.cuda_ipc.local_ipc_info` of the cache device (host,
pid, PID namespace, GPU UUIDs, ``expandable_segments``).

Loader side, at handshake: :func:`choose` returns ``(transport, reason)``; an explicit
``"ipc"`` (or ``"nixl"``) that cannot work raises ``ValueError("transport 'ipc' was asked for
but cannot be used: <reason>")``; ``"auto"`` falls back to ``nixl`` across hosts when both
sides offer it (``reason = "nixl: ipc cannot be used: not on one host; ..."``), else to ``pg``
with ``reason = "pg: ipc cannot be used: <reason>"``. On one host auto picks ``nixl`` only from
an exporter that offers nothing else (one configured ``transport="nixl"``). For CUDA caches
the decision is :func:`kvxfer.transports.cuda_ipc.choose_transport`
(different hosts, ``expandable_segments``, PID namespaces, GPU visibility, same process), with
NVML topology (:mod:`kvxfer.topology`) consulted only when the two GPUs differ.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from . import cuda_ipc, mapper

__all__ = ["IpcOffer", "attach", "choose", "detach", "offer_ipc", "offered_pg_backends", "pair_backends"]


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
        desc = m.describe(caches)
        why = "" if desc is not None else "the exporter's caches are not mappable (not in shm)"
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


def _ipc_usable(
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
    ``peer_access`` as in :func:`kvxfer.transports.cuda_ipc.ipc_supported`; ``local_nixl``
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
    ok, why = _ipc_usable(device, local_info, identity, replies, topology, peer_access)
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


def offered_pg_backends(default: str, device: torch.device) -> list[str]:
    """Pair-group backends an exporter rank serves, preferred first: its pipeline's ``default``
    and, for CUDA caches offered over NCCL, Gloo through pinned host staging as well (for a
    loader on the same GPU, where NCCL cannot form the pair)."""
    if device.type == "cuda" and default == "nccl":
        return ["nccl", "gloo"]
    return [default]


def pair_backends(device: torch.device, local_info: dict, replies: list) -> tuple[list[str], str]:
    """The pair-group backend for each exporter rank in ``replies``, and why when it is not
    the one the exporter prefers ("" otherwise).

    NCCL cannot put the two ranks of one communicator on one GPU ("duplicate GPU"): an
    exporter rank whose caches live on this loader's GPU (same host, same GPU UUID) is read
    over Gloo through pinned host staging when it offers Gloo; otherwise ``ValueError``
    names the problem. Every other rank uses the backend it prefers.
    """
    out: list[str] = []
    shared: list[int] = []
    for r in replies:
        entry = r.pg or {}
        default = entry.get("backend", "gloo")
        offered = entry.get("backends") or [default]
        backend = default
        peer = (r.ipc or {}).get("info") or {}
        same_gpu = (
            device.type == "cuda"
            and local_info.get("gpu_uuid") is not None
            and peer.get("gpu_uuid") == local_info.get("gpu_uuid")
            and peer.get("host_id") == local_info.get("host_id")
        )
        if default == "nccl" and same_gpu:
            if "gloo" not in offered:
                raise ValueError(
                    f"pg: exporter rank {r.tp_rank} shares GPU {peer['gpu_uuid']} with this loader and "
                    "offers only NCCL, which cannot put both ranks of a pair on one GPU"
                )
            backend = "gloo"
            shared.append(r.tp_rank)
        out.append(backend)
    why = ""
    if shared:
        why = (
            f"Gloo through pinned host staging for exporter rank(s) {shared}: they share this "
            "loader's GPU and NCCL cannot put both ranks of a pair on one GPU"
        )
    return out, why


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
