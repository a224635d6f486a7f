"""Test payloads that encode their origin, and a naive (loop-free of cleverness) cache model.

The "truth" of a request is what the model computed: ``truth[layer, kv, global_head, token]``
is one head row of raw bytes. Each row starts with its origin (layer, kv, head, token) so a
misplaced row names itself in a failing comparison; the rest is seeded noise. Caches are
filled from the truth by plain indexing, independently of kvxfer's own index math.
"""

from __future__ import annotations

import torch

from kvxfer import KVCacheSpec, Layout

POISON = 0xA5


def truth_bytes(spec: KVCacheSpec, num_tokens: int, seed: int = 0) -> torch.Tensor:
    """uint8 ``[L, KV, H, T, row_bytes]``: the request's KV rows as raw bytes."""
    g = torch.Generator().manual_seed(seed)
    row = spec.head_dim * spec.element_size
    shape = (spec.num_layers, spec.num_kv, spec.num_kv_heads, num_tokens, row)
    data = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    grid = torch.meshgrid(
        torch.arange(spec.num_layers),
        torch.arange(spec.num_kv),
        torch.arange(spec.num_kv_heads),
        torch.arange(num_tokens),
        indexing="ij",
    )
    stamp = torch.stack([*grid, grid[3] >> 8], dim=-1).to(torch.uint8)  # layer, kv, head, token lo/hi
    n = min(row, stamp.shape[-1])
    data[..., :n] = stamp[..., :n]
    return data


def empty_cache(
    spec: KVCacheSpec, num_blocks: int, heads_local: int, fill: int = POISON
) -> list[torch.Tensor]:
    """Per-layer caches of one rank, every byte set to ``fill``."""
    shape = spec.local_cache_shape(num_blocks, heads_local)
    es = spec.element_size
    out = []
    for _ in range(spec.num_layers):
        raw = torch.full((*shape[:-1], shape[-1] * es), fill, dtype=torch.uint8)
        out.append(raw.view(spec.dtype))
    return out


def _byte_view(cache: torch.Tensor, spec: KVCacheSpec) -> torch.Tensor:
    """``[KV, blocks, block_size, heads, row_bytes]`` byte view of one layer (a view, writable)."""
    raw = cache.view(torch.uint8)
    if spec.use_mla:
        return raw.unsqueeze(0).unsqueeze(3)
    if spec.layout is Layout.HND:
        return raw.transpose(2, 3)
    return raw


def place(
    caches: list[torch.Tensor],
    spec: KVCacheSpec,
    truth: torch.Tensor,
    global_heads: range,
    block_ids: list[int],
    local_head_start: int = 0,
) -> None:
    """Write the truth's rows of ``global_heads`` for all tokens into ``block_ids`` of ``caches``."""
    num_tokens = truth.shape[3]
    t = torch.arange(num_tokens)
    blocks = torch.tensor(block_ids, dtype=torch.int64)[t // spec.block_size]
    offs = t % spec.block_size
    for layer, cache in enumerate(caches):
        view = _byte_view(cache, spec)
        for i, h in enumerate(global_heads):
            view[:, blocks, offs, local_head_start + i] = truth[layer, :, h]


def rank_cache(
    spec: KVCacheSpec,
    truth: torch.Tensor,
    tp_rank: int,
    tp_size: int,
    block_ids: list[int],
    num_blocks: int,
) -> list[torch.Tensor]:
    """What rank ``tp_rank`` would hold had it computed the request itself (poison elsewhere)."""
    heads = spec.heads_of_rank(tp_rank, tp_size)
    caches = empty_cache(spec, num_blocks, len(heads))
    place(caches, spec, truth, heads, block_ids)
    return caches


def as_bytes(tensors) -> torch.Tensor:
    """All tensors' bytes, flattened and stacked on the CPU, for one ``torch.equal``."""
    return torch.stack([t.contiguous().view(torch.uint8).reshape(-1).cpu() for t in tensors])


def wire_from_truth(truth: torch.Tensor, spec: KVCacheSpec, global_heads: range, layers=None) -> torch.Tensor:
    """The wire tensor, as bytes, that a gather of ``global_heads`` must produce."""
    sel = truth if layers is None else truth[list(layers)]
    if spec.use_mla:
        return sel[:, 0, 0].contiguous()  # [L, T, row]
    return sel[:, :, global_heads.start : global_heads.stop].permute(2, 0, 1, 3, 4).contiguous()


def first_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    """Where two byte tensors first differ (index and values), for assertion messages."""
    if a.shape != b.shape:
        return f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}"
    diff = (a != b).nonzero()
    if diff.numel() == 0:
        return "equal"
    idx = tuple(diff[0].tolist())
    return f"{diff.shape[0]} bytes differ; first at {idx}: {int(a[idx])} vs {int(b[idx])}"
