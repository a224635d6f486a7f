"""Soak: 500 random-length requests with random aborts and absent loaders, P (tp=1, a small
reused block pool) -> D (tp=2), 3 processes. Nothing lost, nothing leaked, every request
reported exactly once on each side, every delivered request byte-exact."""

from __future__ import annotations

import pytest
import torch

from kvxfer import CompletionAggregator, KVCacheSpec
from kvxfer.completion import PollResult

from .engine_procs import free_port_base, run_procs, soak_exporter, soak_loader


@pytest.mark.parametrize("transport", ["ipc", "pg"])
def test_soak_500_requests(transport):
    src = KVCacheSpec(2, 2, 8, 16, torch.float16)
    dst = KVCacheSpec(2, 2, 8, 8, torch.float16, layout="HND")
    sc = {
        "src_spec": src.to_dict(),
        "dst_spec": dst.to_dict(),
        "transport": transport,
        "seed": 7,
        "num": 500,
        "max_tokens": 120,
        "src_blocks": 96,
        "dst_blocks": 8000,
        "dst_block_size": 8,
        "p_abort": 0.1,
        "p_skip": 0.03,
        "lease_s": 1.0,
        "deadline_s": 45.0,
        "src_port": free_port_base(1),
        "dst_port": free_port_base(2),
    }
    res = run_procs(
        {
            "P": (soak_exporter, (sc, "@queue:d0", "@queue:d1")),
            "D0": (soak_loader, (sc, 0, "@queue:d0")),
            "D1": (soak_loader, (sc, 1, "@queue:d1")),
        },
        deadline_s=80,
    )
    p = res["P"]
    assert p["exported"] == 500
    everyone = {f"s{i}" for i in range(500)}
    assert set(p["reports"]) == everyone and set(p["reports"].values()) == {1}, "P lost or re-reported"
    assert p["held"] == [] and p["free"] == 96 and p["stats"]["blocks_held"] == 0, "P leaked blocks"
    skipped = set(p["skipped"])
    assert p["stats"]["expirations"] >= len(skipped - set(p["aborted"]))
    agg = CompletionAggregator(2)
    once: list[str] = []
    finished: set[str] = set()
    for r in range(2):
        d = res[f"D{r}"]
        assert d["ended"] and d["bad"] == [], d["bad"]
        assert set(d["loaded"]) == everyone - skipped
        assert d["stats"]["loads_pending"] == 0
    polls = [res["D0"]["polls"], res["D1"]["polls"]]
    for i in range(max(map(len, polls))):
        for r in range(2):
            if i < len(polls[r]):
                q = polls[r][i]
                out = agg.add(
                    r, PollResult(set(), set(q["finished_recving"]), q["failed"], set(), q["errors"])
                )
                once += sorted(out.finished_recving) + sorted(out.failed)
                finished |= out.finished_recving
    assert sorted(once) == sorted(everyone - skipped), "D's aggregator lost or re-reported a request"
    assert agg.pending() == 0
    # Requests that were not aborted must all have landed.
    assert (everyone - skipped - set(p["aborted"])) <= finished
