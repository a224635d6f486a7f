"""``ipc`` cache mapper for CUDA caches: :mod:`kvxfer.transports.ipc.cuda_ipc` behind the mapper
interface the engine uses (registered as ``"cuda"``; the CPU one is ``"shm"``).

* :func:`describe` (exporter, at start-up): :func:`~kvxfer.transports.ipc.cuda_ipc.publish_caches`
  of the rank's caches (IPC handles of the allocation bases) — or None when they cannot be
  exported; :func:`offer` says why.
* :func:`attach` (loader, once per exporter rank): opens the allocations through one
  process-wide :class:`~kvxfer.transports.ipc.cuda_ipc.IpcHandleCache` on the loader's device and
  returns per-layer tensors over the exporter's memory; ``ops.copy_blocks`` then reads them
  straight into the loader's cache. Each attach is one *owner* of the mappings it uses, so
  two engines (or two exporter ranks in one process) sharing an allocation never close it
  under each other's feet; :func:`detach` releases that owner.
* :func:`attach_array`: the exporter's per-block lease epochs. They are host bookkeeping
  (written by the exporter's tracker, compared on the loader's host before and after a copy),
  so they stay in POSIX shared memory for GPU caches too: this is
  :func:`kvxfer.transports.ipc.shm.attach_array`.
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass

import torch

from . import cuda_ipc, shm

__all__ = ["attach", "attach_array", "describe", "detach", "handle_cache", "offer"]

_LOG = logging.getLogger(__name__)

_cache: cuda_ipc.IpcHandleCache | None = None
_lock = threading.Lock()
_owners = itertools.count()


def handle_cache(driver: cuda_ipc.IpcDriver | None = None) -> cuda_ipc.IpcHandleCache:
    """The process-wide cache of opened peer allocations (``driver`` replaces the CUDA one;
    tests pass a fake before first use)."""
    global _cache
    with _lock:
        if _cache is None or driver is not None:
            _cache = cuda_ipc.IpcHandleCache(driver)
        return _cache


def offer(caches: list[torch.Tensor], engine_id: str = "") -> tuple[dict | None, str]:
    """(description, "") when ``caches`` can be exported over CUDA IPC, else (None, why)."""
    if not caches or caches[0].device.type != "cuda":
        return None, "the caches are not CUDA tensors"
    try:
        desc = cuda_ipc.publish_caches(caches, engine_id, handle_cache().driver)
    except Exception as e:  # no CuPy, expandable_segments, driver error: say which
        why = f"cannot export CUDA IPC handles of the caches: {type(e).__name__}: {e}"
        _LOG.warning("kvxfer engine %s: ipc not offered: %s", engine_id or "?", why)
        return None, why
    return desc, ""


def describe(caches: list[torch.Tensor], engine_id: str = "") -> dict | None:
    """:func:`kvxfer.transports.ipc.cuda_ipc.publish_caches` of ``caches``, or None if impossible."""
    return offer(caches, engine_id)[0]


@dataclass(frozen=True)
class _Owner:
    """One attach's claim on the mappings it opened (released by :func:`detach`)."""

    name: str


def attach(desc: dict, device: torch.device | str | None = None) -> tuple[list[torch.Tensor], _Owner]:
    """Map the caches :func:`describe` described, on ``device`` (default: the current CUDA
    device; the engine passes its cache device). Raises on a bad description or a failed open."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    owner = _Owner(f"{desc.get('engine_id', '?')}#{next(_owners)}")
    caches = handle_cache().open_caches(owner.name, desc, device)
    return caches, owner


def attach_array(name: str, n: int):
    """The exporter's int64 ``[n]`` epoch array: host shared memory (see module doc)."""
    return shm.attach_array(name, n)


def detach(handle) -> None:
    """Release what :func:`attach` (mappings) or :func:`attach_array` (shm) returned."""
    if isinstance(handle, _Owner):
        handle_cache().invalidate_peer(handle.name)
    else:
        shm.detach(handle)
