"""The staged (chunked, double-buffered) pg pipeline between processes over Gloo: large
requests split into >= 3 chunks arrive byte for byte across TP, layout and block-size
differences; each side allocates its staging pool once and reuses it."""

from __future__ import annotations

import pytest
import torch

from kvxfer import KVCacheSpec

from .test_engine_procs import _aggregate, _run, _scenario

CASES = [
    # P tp=2 NHD bs=16 -> D tp=1 HND bs=8 (fp16, head_dim 24): 2 heads per read, 384 B/token
    (KVCacheSpec(2, 4, 24, 16, torch.float16), 2, KVCacheSpec(2, 4, 24, 8, torch.float16, layout="HND"), 1),
    # P tp=1 HND bs=8 -> D tp=2 NHD bs=12 (bf16): 1 head per read, 192 B/token
    (KVCacheSpec(3, 2, 16, 8, torch.bfloat16, layout="HND"), 1, KVCacheSpec(3, 2, 16, 12, torch.bfloat16), 2),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_staged_pg_between_processes(case):
    src, src_tp, dst, dst_tp = CASES[case]
    bpt = src.bytes_per_token(num_heads=max(src.heads_per_rank(src_tp), dst.heads_per_rank(dst_tp)))
    lengths = [300, 37, 100, 1]
    sc = _scenario(src, src_tp, dst, dst_tp, "pg", lengths, seed=3)
    sc["staged"] = {"buffer_bytes": 72 * bpt}  # <= 72 tokens per chunk: 300 tokens -> >= 5 chunks
    res = _run(sc)
    want = {r[0] for r in sc["requests"]}
    for r in range(dst_tp):
        d = res[f"D{r}"]
        assert d["ok"] == dict.fromkeys(want, True), [p["errors"] for p in d["polls"] if p["errors"]]
        assert d["untouched"]
        s = d["stats"]
        assert s["transfers"] == len(want) and s["failures"] == 0 and s["transports"] == {"P": "pg"}
        assert s["staging_pools"] == 1
        # the batch's whole blocks and its tails (token slots, any layout) pack into chunks of
        # at most 72 tokens of the widest read: >= 438 / 144 tokens of a one-head read
        assert s["staging_chunks_recv"] >= 4, s
        assert s["staging_streams"] >= 1
    sent = sum(res[f"P{r}"]["stats"]["staging_chunks_sent"] for r in range(src_tp))
    assert sent == sum(res[f"D{r}"]["stats"]["staging_chunks_recv"] for r in range(dst_tp))
    for r in range(src_tp):
        p = res[f"P{r}"]["stats"]
        # a lane per stream running at once: at most one per loader rank it serves
        assert 1 <= p["staging_pools"] <= dst_tp and p["blocks_held"] == 0
    assert sorted(_aggregate(res, "D", dst_tp)) == sorted(want)
    assert sorted(_aggregate(res, "P", src_tp)) == sorted(want)
