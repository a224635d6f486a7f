"""Transports: how a request's KV gets from an exporter rank's cache into a loader rank's.

Three kinds, chosen at handshake and reported in stats (never a silent fallback):

* ``ipc`` — the loader maps the exporter's cache memory (a *cache mapper*,
  :mod:`kvxfer.transports.ipc.mappers`: ``"shm"`` for CPU caches in shared memory, ``"cuda"`` for
  CUDA IPC handles) and runs one ``copy_blocks`` per (batch, source rank) straight from it into
  its own cache; no staging. After every copy the loader compares the exporter's per-block
  lease epochs (an int64 array the exporter shares) with the snapshot it was granted, so data
  of released blocks is never delivered. :mod:`kvxfer.transports.choice` picks the transport
  and says why ipc cannot be used when it cannot.
* ``pg`` — a 2-rank torch ProcessGroup per (exporter rank, loader rank) pair
  (:mod:`kvxfer.transports.pg.groups`: NCCL, or Gloo on CPU and through pinned host memory when both
  ranks share a GPU) through the chunked, double-buffered staging pipeline of
  :mod:`kvxfer.transports.pg.pipeline`.
* ``nixl`` — one-sided READs through a NIXL agent per rank (:mod:`kvxfer.transports.nixl.agent`,
  UCX: InfiniBand, RoCE, EFA, TCP; optional, ``kvxfer[nixl]``): *direct* (the loader READs the
  exporter's blocks into its own, one descriptor per contiguous run,
  :mod:`kvxfer.transports.nixl.descs`) when layouts, block sizes and head slices line up, else
  *staged* (gather, READ of staging buffers, scatter: :mod:`kvxfer.transports.nixl.staged`).
  The engine's side of it is :mod:`kvxfer.transports.nixl.role`.

Modules, one job each: ``mappers`` (registry), ``shm``/``cuda_ipc``/``cuda_mapper`` (the two
mappers), ``choice`` (transport and pair backend, with reasons), ``pg`` (pair groups),
``staged`` (the pg pipeline), ``batching`` (views and packing requests into ops calls),
``nixl`` / ``nixl_descs`` / ``nixl_staged`` (NIXL agents, descriptor lists, the staged path).
"""

from __future__ import annotations

from .batching import BatchPlan, CacheView, Call, Item, cache_views, plan_batch, unit_view
from .ipc.mappers import mapper, register_mapper

TRANSPORTS = ("ipc", "pg", "nixl")

__all__ = [
    "TRANSPORTS",
    "BatchPlan",
    "CacheView",
    "Call",
    "Item",
    "cache_views",
    "mapper",
    "plan_batch",
    "register_mapper",
    "unit_view",
]
