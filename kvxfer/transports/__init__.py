"""Transports: how a request's KV gets from an exporter rank's cache into a loader rank's.

Each kind lives in a folder of its own and is one object per engine rank, behind the small
interface :class:`Transport` that the engine's roles call (the loader and the exporter find a
transport by its name in a dict, never by a string switch). For the loader a transport opens a
session with each handshaken peer (:class:`~kvxfer.transfer.Session`), which moves the copies
the load planner (:mod:`kvxfer.planner`) prepared and returns their completion; checking what
landed is the planner's:

* ``ipc/`` — one host: the loader maps the exporter's cache memory (a cache mapper,
  :mod:`~kvxfer.transports.ipc.mappers`: shared memory for CPU caches, CUDA IPC for CUDA
  caches) and runs one ``copy_blocks`` per ops call straight from it; its completion carries
  the exporter's block epochs, which the planner compares with the grant's, so data of
  released blocks is never delivered. One-sided reads are a mode of its session.
* ``pg/`` — a 2-rank torch ProcessGroup per (exporter rank, loader rank) pair (NCCL, or Gloo
  on CPU and through pinned host memory when both ranks share a GPU) through the chunked,
  double-buffered staging pipeline; each exporter pair has a thread of its own.
* ``nixl/`` — one-sided READs through a NIXL agent per rank (UCX; optional, ``kvxfer[nixl]``):
  *direct* when layouts, block sizes and head slices line up, else *staged*.

Shared by them: ``staging`` (staging pools and the chunked pipeline),
``streams`` (the engine's two ends of a staged stream, pg and staged nixl), ``choice`` (which
transport a loader picks, with the reason).
"""

from __future__ import annotations

from .base import LoaderLink, StreamJob, Transport, offered
from .ipc.mappers import mapper, register_mapper

TRANSPORTS = ("ipc", "pg", "nixl")

__all__ = [
    "TRANSPORTS",
    "LoaderLink",
    "StreamJob",
    "Transport",
    "mapper",
    "offered",
    "register_mapper",
]
