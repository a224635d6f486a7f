"""2-rank torch ProcessGroups per (exporter rank, loader rank) pair, made lazily from a TCPStore.

No global ``init_process_group``: each exporter rank hosts a TCPStore; a loader rank that reads
from it over ``pg`` creates a pair group under a key naming (loader engine, loader rank,
generation) — the exporter is rank 0, the loader rank 1. Gloo on CPU tensors; the same code
takes NCCL (``backend="nccl"``) for CUDA tensors. Payloads travel as flat uint8 views, so every
cache dtype (bf16, fp8, ...) moves bit-exactly whatever the backend supports natively.
A pair whose send or receive failed or timed out is discarded; the next use makes a new one.
"""

from __future__ import annotations

import datetime
import logging

import torch

__all__ = [
    "PAIR_TIMEOUT_FACTOR",
    "connect_store",
    "discard_pair",
    "new_pair",
    "offered_pg_backends",
    "pair_backends",
    "pg_backend_for",
    "recv_tensor",
    "send_tensor",
    "serve_store",
]

_LOG = logging.getLogger(__name__)

# A pair group's own timeout (what NCCL's watchdog enforces, tearing down the whole process by
# default when it fires) is this many times the engine's bound: every send or receive is waited
# within it first (a send for timeout_s, a stream's receives by its load's deadline), and a pair
# whose op failed or timed out is aborted explicitly (discard_pair), so the watchdog never sees
# a timed-out op of ours.
PAIR_TIMEOUT_FACTOR = 10
# the exporter's words for a send request naming a pair it does not hold: the loader pairs anew
UNKNOWN_PAIR = "unknown pair group"


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def pg_backend_for(device: torch.device) -> str:
    """``"gloo"`` for CPU caches, ``"nccl"`` for CUDA caches."""
    return "nccl" if device.type == "cuda" else "gloo"


def serve_store(host: str, timeout_s: float):
    """Start a TCPStore server on a free port of ``host``; returns the store (``.port``)."""
    import torch.distributed as dist

    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=_td(timeout_s))


def connect_store(host: str, port: int, timeout_s: float):
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=False, timeout=_td(timeout_s))


def new_pair(
    store,
    key: str,
    rank: int,
    host: str,
    timeout_s: float,
    backend: str = "gloo",
    bound_s: float | None = None,
):
    """Join the 2-rank group ``key`` as ``rank`` (0 exporter, 1 loader); blocks until both join
    (``timeout_s``). ``bound_s``: the engine's bound on each op (default ``timeout_s``), of which
    an NCCL pair's watchdog gets ``PAIR_TIMEOUT_FACTOR`` times for its whole life (not the time
    left when it was made: a pair made near a load's deadline would get a short watchdog)."""
    import torch.distributed as dist

    prefix = dist.PrefixStore(f"kvxfer/{key}", store)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = _td(timeout_s)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return dist.ProcessGroupGloo(prefix, rank, 2, opts)
    if backend == "nccl":  # pragma: no cover - GPU only
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = _td((timeout_s if bound_s is None else bound_s) * PAIR_TIMEOUT_FACTOR)
        return dist.ProcessGroupNCCL(prefix, rank, 2, opts)
    raise ValueError(f"backend: must be 'gloo' or 'nccl', got {backend!r}")


def send_tensor(pg, tensor: torch.Tensor, peer: int, timeout_s: float) -> None:
    """Send contiguous ``tensor`` (as bytes) to ``peer``; raises on failure or timeout."""
    pg.send([tensor.reshape(-1).view(torch.uint8)], peer, 0).wait(_td(timeout_s))


def recv_tensor(pg, tensor: torch.Tensor, peer: int, timeout_s: float) -> None:
    """Receive into contiguous ``tensor`` (as bytes) from ``peer``; raises on failure or timeout."""
    pg.recv([tensor.reshape(-1).view(torch.uint8)], peer, 0).wait(_td(timeout_s))


def discard_pair(group, why: str = "") -> None:
    """Abort a pair group whose op failed or timed out (its peer may be dead or stuck), so its
    communicator and pending ops are torn down now, in this process, without taking the
    process with them; never raises (a failure to abort is logged)."""
    if group is None:
        return
    for name in ("abort", "shutdown"):
        fn = getattr(group, name, None)
        if fn is None:
            continue
        try:
            fn()
            return
        except Exception as e:  # an already broken group may refuse: try the next, then log
            _LOG.warning(
                "kvxfer pg: %s() of a discarded pair group failed (%s: %s)%s",
                name,
                type(e).__name__,
                e,
                f"; discarded because {why}" if why else "",
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
