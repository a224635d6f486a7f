"""Descriptor arithmetic of the ``nixl`` transport: where a request's bytes lie in a paged cache.

Pure numpy, no NIXL: everything here is testable (and tested) on any machine.

* :class:`CacheGeometry` — one rank's caches as NIXL sees them: each layer's base address and
  the byte strides of the logical shape (``[2, blocks, tokens, heads, dim]`` for NHD,
  ``[2, blocks, heads, tokens, dim]`` for HND, ``[blocks, tokens, dim]`` for MLA). It travels
  in the handshake (:meth:`CacheGeometry.to_dict`), so a loader can address the exporter's
  blocks without the exporter's tensors.
* :func:`direct_why` — whether D may READ P's blocks byte for byte into its own (the *direct*
  path): same layout, block size, element size and head dim, and a head slice that is one
  contiguous run per block on both sides (NHD: the whole rank's heads on both sides; HND: any
  contiguous head range; MLA: always). ``""`` when it may, else the reason.
* :func:`block_runs` — the (address, length) runs of a batch of ops calls on one side, in a
  canonical order ``[layer, kv, full blocks..., partial blocks...]`` (a partial block: a
  request's last one, or a partial load's first one, which starts inside the block; a layer
  group of a layer-wise export selects layers); the two sides of a direct read produce
  equal-length lists that pair one to one.
* :class:`BlockTable` — one side's descriptors of every whole block (one per layer, kv, block
  and head slice), which NIXL prepares once per peer; a READ names them by index
  (:meth:`BlockTable.index`), as NIXL's prepared transfers intend.
* :class:`DirectTables` — both sides' tables for the direct reads of one source rank, and
  :meth:`DirectTables.select`: a batch's ops calls (block units) as indices of whole blocks
  plus the runs of its partial blocks (:class:`DirectReads`), which no per-block table holds.
* :func:`coalesce` — merges consecutive pairs that continue contiguously on both sides (adjacent
  blocks), so the partial blocks' list is one descriptor per contiguous run (NIXL merges
  adjacent indexed descriptors itself).
* :func:`epoch_runs` — one descriptor per block of an exporter's lease-epoch array (prepared
  once per peer, indexed by block id).

No per-block or per-layer Python loop: each list is one broadcast numpy expression.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from ...spec import KVCacheSpec, Layout

__all__ = [
    "BlockTable",
    "CacheGeometry",
    "DirectReads",
    "DirectTables",
    "block_runs",
    "coalesce",
    "descs",
    "direct_why",
    "epoch_index",
    "epoch_runs",
    "storages",
]

_U64 = np.uint64


@dataclass(frozen=True)
class CacheGeometry:
    """Addresses and byte strides of one rank's per-layer caches.

    ``kind`` is ``"NHD"``, ``"HND"`` or ``"MLA"``; ``heads`` the heads held on the rank (1 for
    MLA); strides are in bytes (``kv_stride`` 0 for MLA); ``layer_addrs`` the address of element
    ``[0, 0, ...]`` of each layer.
    """

    kind: str
    layer_addrs: tuple[int, ...]
    num_blocks: int
    block_size: int
    heads: int
    head_dim: int
    element_size: int
    kv_stride: int
    block_stride: int
    head_stride: int
    token_stride: int

    @property
    def num_kv(self) -> int:
        return 1 if self.kind == "MLA" else 2

    @property
    def row_bytes(self) -> int:
        """Bytes of one head row (``head_dim`` elements)."""
        return self.head_dim * self.element_size

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["layer_addrs"] = list(self.layer_addrs)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> CacheGeometry:
        """Rebuild from :meth:`to_dict`; ``ValueError`` naming a missing or malformed field."""
        try:
            kw = {k: d[k] for k in cls.__dataclass_fields__}
        except (KeyError, TypeError) as e:
            raise ValueError(f"nixl geometry: missing field {e}") from None
        if kw["kind"] not in ("NHD", "HND", "MLA"):
            raise ValueError(f"nixl geometry: kind {kw['kind']!r} is not NHD, HND or MLA")
        kw["layer_addrs"] = tuple(int(a) for a in kw["layer_addrs"])
        for k, v in kw.items():
            if k not in ("kind", "layer_addrs") and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"nixl geometry: {k} must be a non-negative int, got {v!r}")
        return cls(**kw)

    @classmethod
    def of(cls, caches: Sequence[torch.Tensor], spec: KVCacheSpec) -> CacheGeometry:
        """The geometry of ``caches`` (validated by :func:`kvxfer.ops.register_caches`: all
        layers share one shape and one set of strides, head rows contiguous)."""
        c0 = caches[0]
        es = c0.element_size()
        st = [s * es for s in c0.stride()]
        if spec.use_mla:
            kind, kv, blk, tok, head = "MLA", 0, st[0], st[1], 0
            nb, heads = c0.shape[0], 1
        elif spec.layout is Layout.NHD:
            kind, kv, blk, tok, head = "NHD", st[0], st[1], st[2], st[3]
            nb, heads = c0.shape[1], c0.shape[3]
        else:
            kind, kv, blk, head, tok = "HND", st[0], st[1], st[2], st[3]
            nb, heads = c0.shape[1], c0.shape[2]
        return cls(
            kind,
            tuple(int(c.data_ptr()) for c in caches),
            int(nb),
            spec.block_size,
            int(heads),
            spec.head_dim,
            es,
            kv,
            blk,
            head,
            tok,
        )


def storages(tensors: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """``(address, bytes)`` of the distinct allocations behind ``tensors`` (layers carved out of
    one buffer, or K/V-second views, register their allocation once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[int(s.data_ptr())] = int(s.nbytes())
    return sorted(seen.items())


def _contiguous_why(g: CacheGeometry, side: str, head_start: int, num_heads: int) -> str:
    """Why a block's head slice ``[head_start, +num_heads)`` of ``g`` is not one run ("" if it is)."""
    rb = g.row_bytes
    if g.kind == "MLA":
        return "" if g.token_stride == rb else f"{side}'s MLA token rows are padded"
    if g.kind == "NHD":
        if num_heads != g.heads:
            return f"{side} holds {g.heads} heads per token row in NHD, the read takes {num_heads} of them"
        if g.head_stride != rb or g.token_stride != g.heads * rb:
            return f"{side}'s NHD token rows are padded"
        return ""
    if g.token_stride != rb or g.head_stride != g.block_size * rb:
        return f"{side}'s HND head pages are padded"
    return ""


def direct_why(
    src: CacheGeometry,
    dst: CacheGeometry,
    src_head_start: int,
    dst_head_start: int,
    num_heads: int,
) -> str:
    """``""`` when the read ``(src heads [src_head_start, +num_heads) -> dst heads
    [dst_head_start, ...))`` can move block for block (the direct path), else why not."""
    if src.kind != dst.kind:
        return f"layouts differ ({src.kind} -> {dst.kind})"
    if src.block_size != dst.block_size:
        return f"block sizes differ ({src.block_size} -> {dst.block_size})"
    if src.element_size != dst.element_size or src.head_dim != dst.head_dim:
        return "head rows differ"
    return _contiguous_why(src, "the exporter", src_head_start, num_heads) or _contiguous_why(
        dst, "the loader", dst_head_start, num_heads
    )


def _bases(g: CacheGeometry, head_start: int) -> np.ndarray:
    """``[L, KV]`` uint64 address of (layer, kv, block 0, head ``head_start``, token 0)."""
    layers = np.asarray(g.layer_addrs, dtype=_U64)[:, None]
    kv = (np.arange(g.num_kv, dtype=_U64) * _U64(g.kv_stride))[None, :]
    return layers + kv + _U64(head_start * g.head_stride)


def block_runs(
    g: CacheGeometry,
    head_start: int,
    num_heads: int,
    full: np.ndarray,
    parts: np.ndarray,
    part_tokens: np.ndarray,
    part_start: np.ndarray | None = None,
    layers: list[int] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Runs ``(addresses, lengths)`` (uint64) covering heads ``[head_start, +num_heads)`` of
    whole blocks ``full`` and of tokens ``[part_start[i], part_start[i] + part_tokens[i])`` of
    blocks ``parts[i]`` (a request's partial last block starts at 0; a partial load's first
    block starts inside it), in ``layers`` (default all).

    Order: ``[layer, kv, full blocks in order, then parts in order (HND: one run per head)]``,
    identical on both sides of a direct read (see :func:`direct_why` for when runs are
    contiguous). The caller checks the block ids (in range, token order)."""
    if layers is not None:
        g = dataclasses.replace(g, layer_addrs=tuple(g.layer_addrs[i] for i in layers))
    full = np.asarray(full, dtype=np.int64).astype(_U64)
    parts = np.asarray(parts, dtype=np.int64).astype(_U64)
    pt = np.asarray(part_tokens, dtype=np.int64).astype(_U64)
    ps = np.zeros(parts.size, _U64) if part_start is None else np.asarray(part_start, np.int64).astype(_U64)
    base = _bases(g, head_start)  # [L, KV]
    L, KV = base.shape
    bstride = _U64(g.block_stride)
    tstride = _U64(g.token_stride)
    p_base = parts * bstride + ps * tstride
    if g.kind == "HND":
        full_len = num_heads * g.head_stride
        # parts: one run per head, [nparts, n]
        p_off = p_base[:, None] + np.arange(num_heads, dtype=_U64)[None, :] * _U64(g.head_stride)
        p_len = np.broadcast_to(pt[:, None] * tstride, p_off.shape)
    else:
        full_len = g.block_size * g.token_stride
        p_off = p_base[:, None]
        p_len = (pt * tstride)[:, None]
    f_addr = base[:, :, None] + (full * bstride)[None, None, :]
    p_addr = base[:, :, None] + p_off.reshape(-1)[None, None, :]
    addrs = np.concatenate([f_addr, p_addr], axis=2).reshape(-1)
    one = np.concatenate([np.full(full.size, full_len, dtype=_U64), np.ascontiguousarray(p_len).reshape(-1)])
    lens = np.broadcast_to(one[None, None, :], (L, KV, one.size)).reshape(-1)
    return addrs, lens


def _split_calls(calls: Sequence, bs: int) -> tuple[np.ndarray, ...]:
    """A batch's ops calls (block units on both sides) as ``(src full, dst full, src parts, dst
    parts, part tokens, part starts)``: each call's whole blocks, then at most one partial last
    block, or a partial load's head (``src_offset == dst_offset``, inside one block)."""
    fs, fd, ps, pd, pt, po = [], [], [], [], [], []
    for c in calls:  # per call (a few per batch), never per block
        if c.src_unit not in (0, bs) or c.dst_unit not in (0, bs):
            raise ValueError("nixl direct: a call in token units is not a direct read")
        if c.src_offset or c.dst_offset:
            if c.src_offset != c.dst_offset or c.src_offset + c.num_tokens > bs:
                raise ValueError("nixl direct: a partial load's head call does not line up on both sides")
            ps.append(c.src[:1])
            pd.append(c.dst[:1])
            pt.append(c.num_tokens)
            po.append(c.src_offset)
            continue
        nfull = c.num_tokens // bs
        fs.append(c.src[:nfull])
        fd.append(c.dst[:nfull])
        if c.num_tokens % bs:
            ps.append(c.src[nfull : nfull + 1])
            pd.append(c.dst[nfull : nfull + 1])
            pt.append(c.num_tokens % bs)
            po.append(0)

    def cat(xs: list) -> np.ndarray:
        return np.concatenate([np.asarray(x, dtype=np.int64) for x in xs]) if xs else np.zeros(0, np.int64)

    return cat(fs), cat(fd), cat(ps), cat(pd), np.asarray(pt, dtype=np.int64), np.asarray(po, dtype=np.int64)


class BlockTable:
    """One side's descriptors of whole blocks, prepared once per peer: for each head slice
    ``slices[k] = (head_start, num_heads)``, one run per (layer, kv, block) of every block
    (:func:`block_runs` of all blocks), in the order ``[slice, layer, kv, block]``. A READ then
    names descriptors by index (:meth:`index`) instead of listing addresses."""

    def __init__(self, g: CacheGeometry, slices: Sequence[tuple[int, int]]) -> None:
        self.geometry = g
        self.slices = tuple((int(h), int(n)) for h, n in slices)
        self.num_blocks = g.num_blocks
        self.plane = len(g.layer_addrs) * g.num_kv  # runs of one block in one slice
        self.size = len(self.slices) * self.plane * g.num_blocks
        if self.size >= 2**31:
            raise ValueError(f"nixl: {self.size} block descriptors exceed NIXL's int32 indices")
        # each slice's first index of every (layer, kv) plane, as a column (all layers)
        self._starts = [self._plane_starts(k, None) for k in range(len(self.slices))]

    def _plane_starts(self, k: int, layers: list[int] | None) -> np.ndarray:
        kv = self.geometry.num_kv
        lay = np.arange(len(self.geometry.layer_addrs)) if layers is None else np.asarray(layers, np.int64)
        planes = (k * self.plane + lay[:, None] * kv + np.arange(kv)[None, :]) * self.num_blocks
        return planes.astype(np.int32).reshape(-1, 1)

    def runs(self) -> tuple[np.ndarray, np.ndarray]:
        """``(addresses, lengths)`` of every descriptor, in index order."""
        every = np.arange(self.num_blocks, dtype=np.int64)
        none = np.zeros(0, np.int64)
        out = [block_runs(self.geometry, h, n, every, none, none) for h, n in self.slices]
        if not out:
            return np.zeros(0, _U64), np.zeros(0, _U64)
        return np.concatenate([a for a, _ in out]), np.concatenate([ln for _, ln in out])

    def index(self, k: int, blocks: np.ndarray, layers: list[int] | None, side: str) -> np.ndarray:
        """Indices (int32, as NIXL takes them) of whole ``blocks`` of slice ``k`` in ``layers``
        (default all), in the order ``[layer, kv, blocks]`` of :func:`block_runs`;
        ``ValueError`` naming ``side`` when a block id is out of range (it would name another
        slice's descriptor)."""
        if blocks.size and (int(blocks.min()) < 0 or int(blocks.max()) >= self.num_blocks):
            raise ValueError(
                f"nixl direct: {side} block id out of range [0, {self.num_blocks}): "
                f"{int(blocks.min())}..{int(blocks.max())}"
            )
        starts = self._starts[k] if layers is None else self._plane_starts(k, layers)
        return (starts + blocks.astype(np.int32)[None, :]).reshape(-1)


class DirectReads(NamedTuple):
    """What one direct READ moves: whole blocks by index into the prepared tables (``src``,
    ``dst``, pairwise), and the partial blocks' runs, coalesced (``tail_src``, ``tail_dst``
    addresses, ``tail_lens``), which a READ lists by address."""

    src: np.ndarray
    dst: np.ndarray
    tail_src: np.ndarray
    tail_dst: np.ndarray
    tail_lens: np.ndarray


class DirectTables:
    """Both sides' :class:`BlockTable` for the direct reads ``keys`` ``(src head start, dst
    head start, heads)`` of one source rank (slice ``k`` of each table is ``keys[k]``);
    ``ValueError`` when a key is not a direct read (:func:`direct_why`)."""

    def __init__(self, src: CacheGeometry, dst: CacheGeometry, keys: Sequence[tuple[int, int, int]]) -> None:
        for sh, dh, n in keys:
            why = direct_why(src, dst, sh, dh, n)
            if why:
                raise ValueError(f"nixl direct: read {(sh, dh, n)} is not direct: {why}")
        self.keys = [tuple(k) for k in keys]
        self.pos = {k: i for i, k in enumerate(self.keys)}
        self.src = BlockTable(src, [(sh, n) for sh, _, n in self.keys])
        self.dst = BlockTable(dst, [(dh, n) for _, dh, n in self.keys])

    def select(
        self, calls: Sequence, keys: Sequence[tuple[int, int, int]], layers: list[int] | None = None
    ) -> DirectReads:
        """The READ of ``calls`` (:class:`kvxfer.batching.Call` with block units on both
        sides, equal block sizes) for each of ``keys``, in ``layers`` (default all)."""
        src, dst = self.src.geometry, self.dst.geometry
        fs, fd, ps, pd, pt, po = _split_calls(calls, src.block_size)
        for b, t, side in ((ps, self.src, "source"), (pd, self.dst, "destination")):
            if b.size and (int(b.min()) < 0 or int(b.max()) >= t.num_blocks):
                raise ValueError(f"nixl direct: {side} block id out of range [0, {t.num_blocks})")
        si, di, ts, td, tl = [], [], [], [], []
        for key in keys:  # per head slice (one in practice), never per block
            k = self.pos.get(tuple(key))
            if k is None:
                raise ValueError(f"nixl direct: read {tuple(key)} was not prepared for this peer")
            si.append(self.src.index(k, fs, layers, "source"))
            di.append(self.dst.index(k, fd, layers, "destination"))
            if ps.size:
                sh, dh, n = key
                a, la = block_runs(src, sh, n, fs[:0], ps, pt, po, layers)
                b, lb = block_runs(dst, dh, n, fd[:0], pd, pt, po, layers)
                if not np.array_equal(la, lb):
                    raise ValueError("nixl direct: source and destination runs differ (not a direct read)")
                ts.append(a)
                td.append(b)
                tl.append(la)
        z = np.zeros(0, _U64)
        tails = coalesce(np.concatenate(ts), np.concatenate(td), np.concatenate(tl)) if ts else (z, z, z)
        if len(si) == 1:
            return DirectReads(si[0], di[0], *tails)
        none = np.zeros(0, np.int32)
        return DirectReads(np.concatenate(si) if si else none, np.concatenate(di) if di else none, *tails)


def coalesce(src: np.ndarray, dst: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge consecutive ``(src, dst, len)`` triples that continue contiguously on both sides;
    returns the merged arrays (one descriptor per contiguous run)."""
    if src.size <= 1:
        return src, dst, lens
    end_s = src[:-1] + lens[:-1]
    end_d = dst[:-1] + lens[:-1]
    brk = (src[1:] != end_s) | (dst[1:] != end_d)
    starts = np.flatnonzero(np.concatenate([[True], brk]))
    if starts.size == src.size:
        return src, dst, lens
    return src[starts], dst[starts], np.add.reduceat(lens, starts)


def epoch_runs(base: int, num_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """``(addresses, lengths)`` of one 8-byte descriptor per block of an int64 epoch array at
    ``base`` (prepared once per peer; a READ names block ids as indices: :func:`epoch_index`)."""
    return _U64(base) + np.arange(num_blocks, dtype=_U64) * _U64(8), np.full(num_blocks, 8, dtype=_U64)


def epoch_index(block_ids: Sequence[np.ndarray], num_blocks: int) -> np.ndarray:
    """The epoch descriptors (int32 indices) of ``block_ids``: each block once, ascending (so
    NIXL merges adjacent ones); ``ValueError`` when one is out of range."""
    ids = np.sort(np.concatenate(block_ids))
    if ids.size and (int(ids[0]) < 0 or int(ids[-1]) >= num_blocks):
        raise ValueError(f"nixl direct: source block id out of range [0, {num_blocks})")
    first = np.empty(ids.size, dtype=bool)
    first[:1] = True
    np.not_equal(ids[1:], ids[:-1], out=first[1:])
    return ids[first].astype(np.int32)


def descs(addrs: np.ndarray, lens: np.ndarray, device_id: int) -> np.ndarray:
    """An ``N x 3`` uint64 descriptor array ``(address, length, device id)`` for NIXL."""
    out = np.empty((addrs.size, 3), dtype=_U64)
    out[:, 0] = addrs
    out[:, 1] = lens
    out[:, 2] = device_id
    return out
