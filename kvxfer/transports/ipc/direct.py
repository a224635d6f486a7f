"""One-sided ``ipc`` loads read by cross-memory attach straight into the loader's caches.

Where an exporter's plain CPU caches (:mod:`kvxfer.transports.ipc.cma`) are laid out as this
rank's (same spec, same heads, one source rank: vLLM's served CPU pairs), a block is the same
bytes on both sides, so a one-sided load (:mod:`kvxfer.transports.ipc.onesided`) reads each
block from the exporter into its destination block with ``process_vm_readv`` instead of into a
mirror first and copying from there: one copy instead of two, and no page faults on mirror
pages emptied after the last load. A partial last block moves its rows only. Loads that start
inside a block, state groups and any other layout take the mirrors' path. The checks after the
copy are the one-sided path's own (a release meanwhile fails the load).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ...spec import Layout

if TYPE_CHECKING:  # pragma: no cover
    from ...engine_types import LoadItem
    from ...peer import Peer
    from ...plan import Read
    from ...rank import Rank
    from .cma import Direct
    from .session import IpcMap

__all__ = ["direct_fits", "direct_target", "read_direct"]


def direct_target(rank: Rank, peer: Peer, sources: list[tuple[IpcMap, list[Read]]]) -> Direct | None:
    """Cross-memory attach straight into this rank's caches, when the peer is one source rank of
    plain CPU caches laid out as this rank's (same spec and heads, one read of every head):
    a block is then the same bytes on both sides. None otherwise (the mirrors' path)."""
    if len(sources) != 1:
        return None
    (mapping, reads), spec, ps = sources[0], rank.spec, peer.spec
    remote = mapping.remote
    if remote is None or len(reads) != 1:
        return None
    r = reads[0]
    heads = spec.heads_per_rank(rank.tp_size)
    if (
        (ps.num_layers, ps.block_size, ps.dtype, ps.layout, ps.use_mla, ps.head_dim, ps.num_kv_heads)
        != (
            spec.num_layers,
            spec.block_size,
            spec.dtype,
            spec.layout,
            spec.use_mla,
            spec.head_dim,
            spec.num_kv_heads,
        )
        or peer.tp_size != rank.tp_size
        or (r.src_head_start, r.dst_head_start, r.num_heads) != (0, 0, heads)
    ):
        return None
    token_dim = 1 if spec.use_mla else (2 if spec.layout is Layout.NHD else 3)
    return remote.direct(list(rank.caches), token_dim)


def direct_fits(rank: Rank, items: list[LoadItem]) -> bool:
    """Whether ``items`` move whole blocks only (each from a block boundary), and no state group
    (whose pages take the mirrors' path)."""
    bs, gs = rank.spec.block_size, rank.groups
    if gs is not None:
        if any(gs.whole):
            return False
        return all(x.first % bs == 0 and not x.skip for it in items for x in it.groups)
    return all(it.first % bs == 0 and not it.skip for it in items)


def read_direct(d: Direct, rank: Rank, items: list[LoadItem]) -> int:
    """Each load's blocks (per group: its layers, from its first block) read straight into this
    rank's caches, all in one batch of reads; returns the reads made (1, or 0 for nothing)."""
    bs, gs = rank.spec.block_size, rank.groups
    every = np.arange(rank.spec.num_layers, dtype=np.int64)
    reads = []
    for it in items:
        parts = (
            [(every, it)]
            if gs is None
            else [(np.asarray(g.layers, dtype=np.int64), x) for g, x in zip(gs.groups, it.groups)]
        )
        for layers, x in parts:
            n = x.num_tokens
            need, b0 = -(-n // bs), x.first // bs
            if b0 >= need:
                continue
            src = np.asarray(x.src[b0:need], dtype=np.int64)
            dst = np.asarray(x.dst[b0:need], dtype=np.int64)
            if dst.size != src.size or int(dst.min()) < 0 or int(dst.max()) >= rank.num_blocks:
                raise ValueError(f"block ids of {it.request_id} out of range for a direct read")
            reads.append((layers, src, dst, n - (need - 1) * bs))
    if not reads:
        return 0
    d.remote.read_direct_many(d, reads)
    return 1
