"""Payloads of the engine tests that encode their origin, and the checks on caches: a request's
payload written into a rank's blocks and compared with them byte for byte, poison, and the
blocks (and tail slots) a transfer must have left untouched.

Payload rows encode their origin: every element of (request seed, global head, layer, kv,
token, d) gets a distinct bit pattern, so a wrong copy names itself when compared.
"""

from __future__ import annotations

import torch

from kvxfer import ops
from kvxfer.spec import KVCacheSpec

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def payload(spec: KVCacheSpec, seed: int, num_tokens: int, heads: range) -> torch.Tensor:
    """Wire ``[len(heads), L, 2, T, D]`` (MLA: ``[L, T, D]``) whose bits encode their origin."""
    if spec.use_mla:
        shape = (1, spec.num_layers, 1, num_tokens, spec.head_dim)
    else:
        shape = (len(heads), spec.num_layers, 2, num_tokens, spec.head_dim)
    h = torch.tensor(list(heads), dtype=torch.int64).view(-1, 1, 1, 1, 1)
    l = torch.arange(shape[1]).view(1, -1, 1, 1, 1)  # noqa: E741
    kv = torch.arange(shape[2]).view(1, 1, -1, 1, 1)
    t = torch.arange(num_tokens).view(1, 1, 1, -1, 1)
    d = torch.arange(spec.head_dim).view(1, 1, 1, 1, -1)
    v = seed * 1_000_003 + h * 100_019 + l * 10_007 + kv * 5_003 + t * 131 + d
    es = spec.element_size
    bits = (v * 2_654_435_761) >> 7
    if es < 8:
        bits = bits % (1 << (8 * es)) - (0 if es == 1 else (1 << (8 * es - 1)))
    w = bits.to(_INT[es]).view(spec.dtype)
    return w.reshape(spec.wire_shape(num_tokens)) if spec.use_mla else w


def fill(
    caches, spec: KVCacheSpec, tp_rank: int, tp_size: int, block_ids, num_tokens: int, seed: int
) -> None:
    """Write request ``seed``'s payload (this rank's heads) into ``block_ids``."""
    heads = spec.heads_of_rank(tp_rank, tp_size)
    wire = payload(spec, seed, num_tokens, heads).to(caches[0].device)
    ops.scatter_blocks(wire, caches, spec, block_ids, num_tokens)


def check(
    caches, spec: KVCacheSpec, tp_rank: int, tp_size: int, block_ids, num_tokens: int, seed: int
) -> bool:
    """True when ``block_ids`` hold request ``seed``'s payload for this rank's heads, byte for byte."""
    heads = spec.heads_of_rank(tp_rank, tp_size)
    got = ops.gather_blocks(caches, spec, block_ids, num_tokens).cpu()
    want = payload(spec, seed, num_tokens, heads)
    return torch.equal(got.view(torch.uint8), want.view(torch.uint8))


POISON = 0x5A


def poison(caches) -> None:
    for c in caches:
        c.view(torch.uint8).fill_(POISON)


def untouched(caches, spec: KVCacheSpec, used_blocks: set[int], num_tokens_by_block: dict[int, int]) -> bool:
    """Blocks not in ``used_blocks`` still hold the poison; the tail slots of partial blocks too."""
    nb = caches[0].shape[0 if spec.use_mla else 1]
    free = torch.tensor(sorted(set(range(nb)) - used_blocks), dtype=torch.int64)
    for c in caches:
        u8 = c.view(torch.uint8)
        blocks = u8[free] if spec.use_mla else u8[:, free]
        if free.numel() and not bool((blocks == POISON).all()):
            return False
        for b, n in num_tokens_by_block.items():
            if n >= spec.block_size:
                continue
            if spec.use_mla:
                tail = u8[b, n:]
            elif spec.layout.value == "NHD":
                tail = u8[:, b, n:]
            else:
                tail = u8[:, b, :, n:]
            if not bool((tail == POISON).all()):
                return False
    return True
