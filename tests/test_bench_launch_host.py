"""profiling/bench_launch_host.py runs its loop (on CPU: no ring, the same calls) and restores the
ring registry it swaps for each run."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "profiling"))

import bench_launch_host

from kvxfer.backends import meta_ring


def test_the_loop_times_every_call_and_restores_the_rings():
    before = dict(meta_ring._rings)
    enabled = meta_ring.enabled
    for ring in (False, True):
        row = bench_launch_host.time_calls("cpu", torch.device("cpu"), ring, calls=3, batch=2, tokens=16)
        assert row["ring"] is ring and 0 < row["p50_us"] <= row["p90_us"] and row["rings"] == {}
    assert meta_ring._rings == before and meta_ring.enabled is enabled
