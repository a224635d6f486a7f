"""Transports: how a request's KV gets from an exporter rank's cache into a loader rank's.

Two kinds, chosen at handshake and reported in stats (never a silent fallback):

* ``ipc`` — the loader maps the exporter's cache memory and runs one ``copy_blocks`` per
  (batch, source rank) straight from it into its own cache; no staging. A *cache mapper* says
  how an exporter describes its memory and how a loader maps it: ``"shm"``
  (:mod:`kvxfer.transports.shm`, CPU caches in POSIX shared memory) and ``"cuda"``
  (:mod:`kvxfer.transports.cuda_mapper`, CUDA IPC handles); :mod:`kvxfer.transports.choice`
  picks by cache device and says why ipc cannot be used when it cannot. Extension point:
  :func:`register_mapper` — a CUDA IPC mapper (``describe(caches) -> dict | None``,
  ``attach(desc) -> (caches, handle)``, ``detach(handle)``) plugs in under another name and
  the engine uses it unchanged. Before and after every direct copy the loader compares the
  exporter's per-block lease epochs (an int64 array the exporter shares) with the snapshot it
  was granted, so data of released blocks is never delivered.
* ``pg`` — a 2-rank torch ProcessGroup per (exporter rank, loader rank) pair
  (:mod:`kvxfer.transports.pg`): the exporter gathers into a wire tensor and sends it; the
  loader receives and scatters. Extension point: :class:`WirePipeline` — the engine hands
  each chunk's wire to ``pipeline.send(...)`` / receives with ``pipeline.recv(...)``; the
  default sends a chunk whole; a chunked, double-buffered staging pipeline (pinned host
  buffers for GPU caches) replaces it without touching the engine.

This module also holds the batching arithmetic shared by both: *unit views* of a cache and the
packing of several requests into one ops call (:func:`build_chunks`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from ..plan import token_slots
from ..spec import KVCacheSpec, Layout

__all__ = [
    "TRANSPORTS",
    "Chunk",
    "Item",
    "WirePipeline",
    "build_chunks",
    "dedupe_prefixes",
    "mapper",
    "register_mapper",
    "unit_view",
    "units_of",
]

TRANSPORTS = ("ipc", "pg")
_MAPPERS: dict[str, str | ModuleType] = {
    "shm": "kvxfer.transports.shm",
    "cuda": "kvxfer.transports.cuda_mapper",
}


def register_mapper(name: str, module: str | ModuleType) -> None:
    """Register an ``ipc`` cache mapper (module or import path) exposing describe/attach/detach."""
    _MAPPERS[name] = module


def mapper(name: str) -> ModuleType:
    """The cache mapper registered as ``name``."""
    import importlib

    m = _MAPPERS.get(name)
    if m is None:
        raise ValueError(f"ipc mapper: unknown {name!r} (registered: {sorted(_MAPPERS)})")
    if isinstance(m, str):
        m = importlib.import_module(m)
        _MAPPERS[name] = m
    return m


class WirePipeline:
    """Moves one chunk's wire tensor over a pair group. Default: the whole wire at once.

    Subclass (e.g. a chunked, double-buffered staging pipeline) and pass it to the engine as
    ``pipeline=``; both methods must be bounded by ``timeout_s``.
    """

    def send(self, pg, wire: torch.Tensor, peer: int, timeout_s: float) -> None:
        from .pg import send_tensor

        send_tensor(pg, wire, peer, timeout_s)

    def recv(self, pg, wire: torch.Tensor, peer: int, timeout_s: float) -> None:
        from .pg import recv_tensor

        recv_tensor(pg, wire, peer, timeout_s)


# ------------------------------------------------------------------------------- batching
def unit_view(
    caches: Sequence[torch.Tensor], spec: KVCacheSpec
) -> tuple[list[torch.Tensor], KVCacheSpec, int]:
    """View a cache so several requests can share one ops call.

    NHD ``[2, nb, bs, h, d]`` and MLA ``[nb, bs, d]`` caches are viewed with block size 1
    (``[2, nb*bs, 1, h, d]``, ``[nb*bs, 1, d]``): a "block" is then one token slot, so
    any concatenation of requests is exact. HND ``[2, nb, h, bs, d]`` cannot be re-blocked (its
    token stride is inside a block), nor can caches whose blocks are padded apart; they keep
    their blocks. Returns (views, spec of the
    views, unit = tokens per unit).
    """
    c0 = caches[0]
    if spec.use_mla:
        mergeable = c0.stride(0) == c0.shape[1] * c0.stride(1)
        if mergeable:
            views = [c.view(-1, 1, c.shape[-1]) for c in caches]
    elif spec.layout is Layout.NHD:
        mergeable = c0.stride(1) == c0.shape[2] * c0.stride(2)
        if mergeable:
            views = [c.view(2, -1, 1, c.shape[3], c.shape[4]) for c in caches]
    else:
        mergeable = False
    if not mergeable:  # HND, or blocks padded apart: keep whole blocks as units
        return list(caches), spec, spec.block_size
    return views, dataclasses.replace(spec, block_size=1), 1


def units_of(block_ids: torch.Tensor, block_size: int, num_tokens: int, unit: int) -> torch.Tensor:
    """Unit ids of a request's tokens: token slots when ``unit == 1``, else its blocks."""
    if unit == 1:
        return token_slots(block_ids, block_size, num_tokens)
    return block_ids[: -(-num_tokens // block_size)].to(torch.int64)


@dataclass
class Item:
    """One request as seen by one (batch, source rank): unit ids on both sides."""

    request_id: str
    src: torch.Tensor  # int64 source unit ids, ceil(num_tokens / src_unit)
    dst: torch.Tensor  # int64 destination unit ids, ceil(num_tokens / dst_unit)
    num_tokens: int
    skip: int = 0  # leading tokens carried by an earlier sibling in this batch (n>1)


@dataclass
class Chunk:
    """One ops call: concatenated unit ids of the requests it carries."""

    request_ids: list[str]
    src: torch.Tensor
    dst: torch.Tensor
    num_tokens: int


def _common_units(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(a.numel(), b.numel())
    diff = (a[:n] != b[:n]).nonzero()
    return int(diff[0]) if diff.numel() else n


def dedupe_prefixes(items: list[Item], src_unit: int, dst_unit: int) -> None:
    """Set ``skip`` of every request whose leading tokens an earlier request already carries.

    Two requests share a prefix when their leading source *and* destination units are equal
    (n>1 children whose loader gives them the same prefix blocks, as prefix caching does);
    the later one then skips the shared tokens, rounded down to whole units of both sides.
    """
    align = math.lcm(src_unit, dst_unit)
    leaders: dict[tuple[int, int], Item] = {}
    for it in items:
        if it.num_tokens == 0:
            continue
        key = (int(it.src[0]), int(it.dst[0]))
        lead = leaders.get(key)
        if lead is None:
            leaders[key] = it
            continue
        shared = min(
            _common_units(lead.src, it.src) * src_unit,
            _common_units(lead.dst, it.dst) * dst_unit,
            lead.num_tokens,
            it.num_tokens,
        )
        it.skip = shared // align * align


def build_chunks(items: list[Item], src_unit: int, dst_unit: int) -> list[Chunk]:
    """Pack requests into as few ops calls as exactness allows.

    A request can follow another in one call only if the tokens before it fill whole units on
    both sides (a multiple of ``lcm(src_unit, dst_unit)``): then token ``t`` of the call lies
    in unit ``t // unit`` of the concatenated unit lists on either side. With unit 1 (NHD/MLA)
    everything packs into one call; an HND side starts a new call after a request with a
    partial last block. Requests' skipped prefixes (:func:`dedupe_prefixes`) are left out.
    """
    align = math.lcm(src_unit, dst_unit)
    chunks: list[Chunk] = []
    ids: list[str] = []
    srcs: list[torch.Tensor] = []
    dsts: list[torch.Tensor] = []
    total = 0

    def close() -> None:
        nonlocal ids, srcs, dsts, total
        if total:
            chunks.append(Chunk(ids, torch.cat(srcs), torch.cat(dsts), total))
        ids, srcs, dsts, total = [], [], [], 0

    for it in items:
        n = it.num_tokens - it.skip
        if n <= 0:
            continue
        ids.append(it.request_id)
        srcs.append(it.src[it.skip // src_unit : -(-it.num_tokens // src_unit)])
        dsts.append(it.dst[it.skip // dst_unit : -(-it.num_tokens // dst_unit)])
        total += n
        if total % align:
            close()
    close()
    return chunks
