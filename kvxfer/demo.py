"""Demo: move three requests from a P engine (tp=2, NHD, block 16) to a D engine (tp=1, HND,
block 32) with the plan and the ops, verify them byte for byte, and print what moved.

    python -m kvxfer.demo [--layers 32] [--tokens 1000 2500 377]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from . import KVCacheSpec, Layout, plan_reads
from .ops import gather_blocks, last_backend, scatter_blocks


def _alloc(spec: KVCacheSpec, num_blocks: int, tp: int) -> list[list[torch.Tensor]]:
    return [
        [torch.zeros(spec.cache_shape(num_blocks, tp), dtype=spec.dtype) for _ in range(spec.num_layers)]
        for _ in range(tp)
    ]


def _block_lists(lengths: list[int], block_size: int, seed: int) -> list[list[int]]:
    """Disjoint, shuffled block lists, one per request (as a paged allocator would hand out)."""
    need = [-(-n // block_size) for n in lengths]
    perm = torch.randperm(sum(need), generator=torch.Generator().manual_seed(seed)).tolist()
    out, start = [], 0
    for n in need:
        out.append(perm[start : start + n])
        start += n
    return out


def run(num_layers: int, lengths: list[int]) -> bool:
    tp_p, tp_d = 2, 1
    p_spec = KVCacheSpec(num_layers, 8, 128, 16, torch.bfloat16, Layout.NHD)
    d_spec = KVCacheSpec(num_layers, 8, 128, 32, torch.bfloat16, Layout.HND)
    p_ids = _block_lists(lengths, p_spec.block_size, seed=1)
    d_ids = _block_lists(lengths, d_spec.block_size, seed=2)
    p_caches = _alloc(p_spec, sum(map(len, p_ids)), tp_p)
    d_caches = _alloc(d_spec, sum(map(len, d_ids)), tp_d)

    # What prefill computed: a wire tensor of all heads per request, written into each P rank.
    g = torch.Generator().manual_seed(0)
    truths = [
        torch.randint(-(2**15), 2**15, p_spec.wire_shape(n), generator=g, dtype=torch.int16).view(
            p_spec.dtype
        )
        for n in lengths
    ]
    for truth, ids, n in zip(truths, p_ids, lengths):
        for r in range(tp_p):
            heads = p_spec.heads_of_rank(r, tp_p)
            scatter_blocks(truth[heads.start : heads.stop].contiguous(), p_caches[r], p_spec, ids, n)

    plan = plan_reads(p_spec, tp_p, d_spec, tp_d)
    moved = 0
    start = time.perf_counter()
    for ids_p, ids_d, n in zip(p_ids, d_ids, lengths):
        for d in range(tp_d):
            for read in plan.reads(d):
                wire = gather_blocks(
                    p_caches[read.src_rank],
                    p_spec,
                    ids_p,
                    n,
                    head_start=read.src_head_start,
                    num_heads=read.num_heads,
                )
                scatter_blocks(wire, d_caches[d], d_spec, ids_d, n, head_start=read.dst_head_start)
                moved += wire.numel() * wire.element_size()
    elapsed = time.perf_counter() - start

    ok = True
    for truth, ids, n in zip(truths, d_ids, lengths):
        got = gather_blocks(d_caches[0], d_spec, ids, n)
        ok &= torch.equal(got.view(torch.uint8), truth.view(torch.uint8))
    print(f"kvxfer demo on CPU, backend={last_backend()}")
    print(f"  P: tp={tp_p} NHD block {p_spec.block_size}  ->  D: tp={tp_d} HND block {d_spec.block_size}")
    print(
        f"  model: {num_layers} layers, 8 kv heads x 128, bf16 ({p_spec.bytes_per_token() / 1024:.0f} KiB/token)"
    )
    print(f"  requests: {len(lengths)}  tokens: {sum(lengths)} ({', '.join(map(str, lengths))})")
    print(
        f"  moved: {moved / 2**20:.1f} MiB in {elapsed * 1e3:.1f} ms = {moved / elapsed / 1e9:.2f} GB/s "
        "(gather + scatter, one process)"
    )
    print(f"  verified byte for byte: {'OK' if ok else 'MISMATCH'}")
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1000, 2500, 377])
    args = ap.parse_args(argv)
    return 0 if run(args.layers, args.tokens) else 1


if __name__ == "__main__":
    sys.exit(main())
