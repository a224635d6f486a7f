"""Caches whose bytes encode their origin (rank, layer, kv, block, token offset, head, byte),
poisoned caches, and an independent oracle (plain advanced indexing, not kvxfer.ops) of a
destination cache once a request's tokens were copied in: for the staging pipeline's tests and
the transports' (partial loads, CUDA IPC, NIXL descriptors)."""

from __future__ import annotations

import torch

from kvxfer.spec import KVCacheSpec, Layout

POISON = 0xA5


def make_cache(spec: KVCacheSpec, num_blocks: int, heads_local: int, rank: int, device="cpu") -> list:
    """Per-layer caches whose bytes encode (rank, layer, kv, block, token offset, head, byte)."""
    es = spec.element_size
    shape = spec.local_cache_shape(num_blocks, heads_local)
    out = []
    for layer in range(spec.num_layers):
        idx = [torch.arange(n, dtype=torch.int64) for n in (*shape[:-1], shape[-1] * es)]
        if spec.use_mla:
            blk, tok, byte = idx
            code = blk.view(-1, 1, 1) * 13 + tok.view(1, -1, 1) * 3 + byte.view(1, 1, -1)
        elif spec.layout is Layout.NHD:
            kv, blk, tok, head, byte = idx
            code = (
                kv.view(-1, 1, 1, 1, 1) * 101
                + blk.view(1, -1, 1, 1, 1) * 13
                + tok.view(1, 1, -1, 1, 1) * 3
                + head.view(1, 1, 1, -1, 1) * 7
                + byte.view(1, 1, 1, 1, -1)
            )
        else:
            kv, blk, head, tok, byte = idx
            code = (
                kv.view(-1, 1, 1, 1, 1) * 101
                + blk.view(1, -1, 1, 1, 1) * 13
                + tok.view(1, 1, 1, -1, 1) * 3
                + head.view(1, 1, -1, 1, 1) * 7
                + byte.view(1, 1, 1, 1, -1)
            )
        code = (code + rank * 37 + layer * 29) % 251
        out.append(code.to(torch.uint8).view(spec.dtype).to(device))
    return out


def poisoned(spec: KVCacheSpec, num_blocks: int, heads_local: int, device="cpu") -> list:
    shape = spec.local_cache_shape(num_blocks, heads_local)
    nbytes_last = shape[-1] * spec.element_size
    return [
        torch.full((*shape[:-1], nbytes_last), POISON, dtype=torch.uint8).view(spec.dtype).to(device)
        for _ in range(spec.num_layers)
    ]


def as_tokens(cache: torch.Tensor, spec: KVCacheSpec) -> torch.Tensor:
    """[kv, blocks, bs, heads, bytes] uint8 view of one layer, whatever the layout (MLA: kv=heads=1)."""
    u = cache.view(torch.uint8) if cache.element_size() == 1 else cache.contiguous().view(torch.uint8)
    if spec.use_mla:
        return u.unsqueeze(0).unsqueeze(3)
    return u if spec.layout is Layout.NHD else u.transpose(2, 3)


def expected_dst(
    src,
    src_spec,
    src_ids,
    dst,
    dst_spec,
    dst_ids,
    num_tokens,
    src_h0,
    dst_h0,
    num_heads,
    start=0,
    layers=None,
):
    """Independent oracle (plain advanced indexing, not kvxfer.ops): dst with tokens
    ``[start, num_tokens)`` of the request copied in (the layers ``layers``, default all)."""
    out = [c.clone() for c in dst]
    t = torch.arange(start, num_tokens)
    sb, so = torch.as_tensor(src_ids)[t // src_spec.block_size], t % src_spec.block_size
    db, do = torch.as_tensor(dst_ids)[t // dst_spec.block_size], t % dst_spec.block_size
    for layer in range(src_spec.num_layers) if layers is None else layers:
        s, d = as_tokens(src[layer], src_spec), as_tokens(out[layer], dst_spec)
        rows = s[:, sb, so][:, :, src_h0 : src_h0 + num_heads]
        if dst_spec.use_mla:
            out[layer][db, do] = rows[0, :, 0].view(dst_spec.dtype)
        elif dst_spec.layout is Layout.NHD:
            out[layer].view(torch.uint8)[:, db, do, dst_h0 : dst_h0 + num_heads] = rows
        else:
            ou = out[layer].view(torch.uint8)
            ou.transpose(2, 3)[:, db, do, dst_h0 : dst_h0 + num_heads] = rows
        del d
    return out


def bytes_equal(a: list, b: list) -> bool:
    return all(torch.equal(x.cpu().view(torch.uint8), y.cpu().view(torch.uint8)) for x, y in zip(a, b))
