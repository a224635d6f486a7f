"""Helpers of the lease-slot table tests (``tests/test_slots*.py``): a token and a digest, an
exporter's table with a loader's view of the same memory, epochs that name their block, and the
autouse fixture ``path`` (a test module imports it) that runs each test twice: the loader's
reads, checks and marks as native calls (csrc/ctl/lease_slots.h) and as the same steps in
Python."""

from __future__ import annotations

import numpy as np
import pytest

from kvxfer import idops
from kvxfer.transports.ipc import slots
from kvxfer.transports.ipc.slots import HEADER, SLOT, ExporterSlots, SlotView

TOKEN = "0011223344556677" + "8899aabbccddeeff0123456789abcdef"
DIGEST = bytes(range(16))
FAR = 10**18  # a lease end no check reaches


@pytest.fixture(autouse=True, params=["native", "python"], name="path")
def _loader_path(request, monkeypatch):
    """The loader's side through the native module, or through Python (the module not loaded)."""
    if request.param == "native":
        assert idops.ensure(), idops.status()  # a compiler is there (tests/test_idops.py says so too)
    else:
        monkeypatch.setattr(slots, "_native", lambda: None)
    return request.param


def _table(n: int = 64, incarnation: str = "inc-1") -> tuple[ExporterSlots, SlotView]:
    t = np.zeros(HEADER + n * SLOT, dtype=np.int64)
    ex, view = ExporterSlots(t, incarnation), SlotView(t)
    return ex, view


def _token(k: int) -> str:
    """Another export's token: its MAC differs in both halves (as real ones do)."""
    return TOKEN[:16] + f"{k:016x}" + f"{k * 7919:016x}"


def _epochs(num_blocks: int = 40) -> tuple[np.ndarray, np.ndarray]:
    """Epochs that name their block (a snapshot of the wrong blocks cannot pass), and ids."""
    return np.arange(num_blocks, dtype=np.int64) * 1000 + 7, np.array([5, 3, 39, 0, 17], dtype=np.int64)
