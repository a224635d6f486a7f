"""One-sided ipc reads: every way the path can go wrong: a release during the copy, a slot
reused, a compute not done, a layer-wise export, params forged or altered (to reach another
export's slot, or the same params twice in one batch), and an exporter that closed or died
(SIGKILLed in its own process). The load fails naming why, or takes the messaged path; it never
delivers bytes it should not, and D's blocks keep their poison."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time

import pytest

from kvxfer import KVTransferParams, TransferEngine
from kvxfer.transports.ipc import target as target_mod
from kvxfer.transports.ipc.shm import alloc_shm_caches

from .engine_payload import check, fill, poison, untouched
from .engine_procs import free_port_base
from .onesided_helpers import F16, Ranks, poll_until, warm, warmed


# ---------------------------------------------------------------------------- what goes wrong
@pytest.mark.parametrize("when", ["hook", "before_poll"])
def test_release_during_the_copy_fails_the_load_never_delivers(when):
    """P aborts the export while D's one-sided copy runs (after it, before the check) and its
    runner reuses the blocks: D reports the load failed, naming the release. ``hook``: in the
    test hook after the copy (the check a step per view); ``before_poll``: between ``load()``,
    which copied, and the ``poll()`` whose one native call checks and marks."""
    with warmed() as (p, d):
        prm = p.export("x", [3, 4], 12, seed=3)

        def release_and_reuse(epochs=None):
            p[0].abort_export("x")
            fill(p.caches(0), F16, 0, 1, [3, 4], 12, seed=99)

        if when == "hook":
            d[0]._hooks["after_ipc_copy"] = release_and_reuse
        d[0].load("x", prm, [5, 6])
        if when == "before_poll":
            release_and_reuse()
        got = poll_until(d.engines, {"x"}, "recv")
        assert got["x"].startswith("failed:") and "released before or during the copy" in got["x"], got
        assert d.onesided() == [1]
        assert d[0].stats()["transfers"] == 1 and d[0].stats()["failures"] == 1  # the warm one landed


def test_slot_reused_by_a_new_export_fails_the_load():
    """The export ends and a new export of the same id takes its place during the copy: the
    slot's generation moved, the load fails; the new export's params then load one-sided."""
    with warmed() as (p, d):
        prm = p.export("x", [3, 4], 12, seed=3)
        again = {}

        def reexport(epochs):
            d[0]._hooks.pop("after_ipc_copy")
            p[0].abort_export("x")
            again["prm"] = p.export("x", [3, 4], 12, seed=4)

        d[0]._hooks["after_ipc_copy"] = reexport
        d[0].load("x", prm, [5, 6])
        got = poll_until(d.engines, {"x"}, "recv")
        assert got["x"].startswith("failed:"), got
        assert again["prm"]["token"] != prm["token"]
        d[0].load("x", again["prm"], [5, 6])
        assert poll_until(d.engines, {"x"}, "recv") == {"x": "done"}
        assert check(d.caches(0), F16, 0, 1, [5, 6], 12, 4)
        assert d.onesided() == [2]


class Gate:
    """A ready event (``query()``) the test opens."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_compute_not_done_is_never_read_onesided():
    """An export whose ready event has not completed is not read one-sided: the load takes the
    messaged path, which waits for the gate; once P saw it complete, the next load is one-sided."""
    with warmed() as (p, d):
        gate = Gate()
        prm = p.export("g", [3, 4], 12, seed=3, ready=gate)
        d[0].load("g", prm, [5, 6])
        assert d.onesided() == [0] and d[0].stats()["onesided"]["fallbacks"]["not ready"] == 1
        assert poll_until(d.engines, {"g"}, "recv", timeout=0.3) == {}
        gate.done = True
        assert poll_until(d.engines, {"g"}, "recv") == {"g": "done"}
        assert check(d.caches(0), F16, 0, 1, [5, 6], 12, 3)
        gate2 = Gate()
        prm2 = p.export("h", [7, 8], 12, seed=5, ready=gate2)
        gate2.done = True
        p[0].poll()  # P sees the gate open: the slot's ready flag is set
        d[0].load("h", prm2, [9, 10])
        assert d.onesided() == [1]
        assert poll_until(d.engines, {"h"}, "recv") == {"h": "done"}
        assert check(d.caches(0), F16, 0, 1, [9, 10], 12, 5)


def test_layerwise_export_takes_the_messaged_path():
    with warmed() as (p, d):
        prm = p.export("s", [3, 4], 12, seed=3, streaming=True)
        d[0].load("s", prm, [5, 6])
        assert d[0].stats()["onesided"]["fallbacks"]["layer-wise export"] == 1
        p[0].mark_ready("s", range(F16.num_layers))
        assert poll_until(d.engines, {"s"}, "recv") == {"s": "done"}
        assert check(d.caches(0), F16, 0, 1, [5, 6], 12, 3)


def test_forged_and_altered_params_are_never_read_onesided():
    """A forged token finds no slot, nor do params whose ids were changed: both take the
    messaged path, where the exporter refuses them by name; D's blocks keep their poison."""
    with warmed() as (p, d):
        prm = p.export("x", [3, 4], 12, seed=3)
        forged = dict(prm, token="0" * 16 + "f" * 32)
        altered = dict(prm, block_ids=[3, 5])
        d[0].load("x", forged, [5, 6])
        got = poll_until(d.engines, {"x"}, "recv")
        assert got["x"].startswith("failed:") and "unauthorized" in got["x"], got
        d[0].load("x", altered, [5, 6])
        got = poll_until(d.engines, {"x"}, "recv")
        assert got["x"].startswith("failed:") and "refused" in got["x"], got
        assert d.onesided() == [0] and d[0].stats()["onesided"]["fallbacks"]["no live slot"] == 2
        assert untouched(d.caches(0), F16, {0}, {0: 1})
        # the failed load was notified with the export's token: P freed it (as a release)
        assert poll_until(p.engines, {"x"}, "send") == {"x": "done"}
        prm = p.export("y", [3, 4], 12, seed=4)
        d[0].load("y", prm, [5, 6])  # real params load one-sided
        assert poll_until(d.engines, {"y"}, "recv") == {"y": "done"} and d.onesided() == [1]
        assert check(d.caches(0), F16, 0, 1, [5, 6], 12, 4)


def test_params_altered_to_reach_another_exports_slot_are_refused_by_name():
    """A D that holds only B's params loads (a) block ids B never exported, with the token
    re-derived so that the old binding (token MAC XOR content digest) equals B's slot's, and
    (b) B's params under another request id. The one-sided path used to read both, report
    them done and free B; now neither finds a slot, and each fails naming ``unauthorized``, as
    the messaged path refuses it: D's blocks keep their poison, B stays exported, and B's own
    params then load one-sided."""
    with warmed() as (p, d):
        prm = p.export("B", [3, 4], 12, seed=3)
        fill(p.caches(0), F16, 0, 1, [9, 10], 12, seed=66)  # blocks no export holds
        alt = dict(prm, block_ids=[9, 10])
        dg_b = KVTransferParams.from_dict(prm).digest()
        dg_x = KVTransferParams.from_dict(alt).digest()
        mac = int(prm["token"][-32:], 16) ^ int.from_bytes(dg_b, "little") ^ int.from_bytes(dg_x, "little")
        alt["token"] = prm["token"][:16] + f"{mac:032x}"
        d[0].load("alt", alt, [5, 6])
        d[0].load("renamed", dict(prm, request_id="B-other"), [7, 8])
        got = poll_until(d.engines, {"alt", "renamed"}, "recv")
        for rid in ("alt", "renamed"):
            assert got[rid].startswith("failed:") and "unauthorized" in got[rid], got
        assert d.onesided() == [0]
        assert untouched(d.caches(0), F16, {0}, {0: 1})
        assert poll_until(p.engines, {"B"}, "send", timeout=0.5) == {}  # B was not freed
        assert p[0].stats()["exports_live"] == 1
        d[0].load("B", prm, [5, 6])
        assert poll_until(d.engines, {"B"}, "recv") == {"B": "done"} and d.onesided() == [1]
        assert check(d.caches(0), F16, 0, 1, [5, 6], 12, 3)
        assert poll_until(p.engines, {"B"}, "send") == {"B": "done"}


@pytest.mark.parametrize("how", ["each", "batched", "messaged-first"])
def test_the_same_params_twice_in_one_batch_are_refused_as_the_messaged_path_refuses_them(how):
    """The same params loaded under two local ids before a poll: the first lands, the second
    fails naming it ("loaded twice in one batch", the messaged path's words), writes nothing,
    and P releases and reports the export once. (The one-sided path read both, and their done
    marks and the notification naming the id twice made P release it without reporting it.)
    ``messaged-first``: the first load is queued for the messaged path (its export not ready
    yet), the second would have been one-sided."""
    with warmed() as (p, d):
        gate = Gate() if how == "messaged-first" else None
        prm = p.export("x", [3, 4], 12, seed=3, ready=gate)
        with d[0].batched_loads() if how == "batched" else contextlib.nullcontext():
            d[0].load("x1", prm, [5, 6])
            if gate is not None:
                gate.done = True
                p[0].poll()  # the slot's ready flag is set: a second load could go one-sided
            d[0].load("x2", prm, [7, 8])
        got = poll_until(d.engines, {"x1", "x2"}, "recv")
        assert got["x1"] == "done", got
        assert got["x2"].startswith("failed:") and "'x' is loaded twice in one batch" in got["x2"], got
        assert check(d.caches(0), F16, 0, 1, [5, 6], 12, 3)
        assert untouched(d.caches(0), F16, {0, 5, 6}, {0: 1, 6: 4})
        assert poll_until(p.engines, {"x"}, "send") == {"x": "done"}
        assert poll_until(p.engines, {"other"}, "send", timeout=0.3) == {}  # not reported again
        assert p[0].stats()["blocks_held"] == 0
        assert d.onesided() == [0 if how == "messaged-first" else 1]


# ------------------------------------------------------------------ an exporter that dies
def exporter_proc(port: int, q) -> None:
    """P in its own process: exports "warm" and "a", hands their params over, then waits to be
    killed."""
    shm = alloc_shm_caches(F16, 16, 1)
    e = TransferEngine(F16, shm.caches, 0, 1, "P", port=port, lease_s=30.0).start()
    for rid, ids, seed in (("warm", [0], 1), ("a", [3, 4], 3)):
        fill(shm.caches, F16, 0, 1, ids, 12 if rid == "a" else 1, seed)
        q.put(e.export(rid, ids, 12 if rid == "a" else 1))
    time.sleep(120)


def test_exporter_killed_is_a_named_failure_not_a_hang(monkeypatch):
    """P is SIGKILLed after D mapped it: its heartbeat stops, D no longer reads it one-sided,
    and the load fails by its deadline with the reason; D's process goes on."""
    monkeypatch.setattr(target_mod, "_STALE_NS", int(0.2e9))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port_base(1)
    proc = ctx.Process(target=exporter_proc, args=(port, q), daemon=True)
    proc.start()
    dshm = alloc_shm_caches(F16, 16, 1)
    poison(dshm.caches)
    d = TransferEngine(F16, dshm.caches, 0, 1, "D", timeout_s=1.0).start()
    try:
        warm_prm, prm = q.get(timeout=60), q.get(timeout=60)
        d.load("warm", warm_prm, [0])
        assert poll_until([d], {"warm"}, "recv") == {"warm": "done"}
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        time.sleep(0.4)  # past the (shortened) heartbeat bound
        t0 = time.monotonic()
        d.load("a", prm, [5, 6])
        assert d.stats()["onesided"]["fallbacks"]["exporter closed or silent"] == 1
        got = poll_until([d], {"a"}, "recv", timeout=10.0)
        assert got["a"].startswith("failed:"), got
        assert time.monotonic() - t0 < 5.0
        assert untouched(dshm.caches, F16, {0}, {0: 1})
    finally:
        d.close()
        dshm.close()
        if proc.is_alive():
            proc.kill()
        proc.join(10)


def test_exporter_closing_after_the_copy_fails_the_load_as_released():
    """P closes between D's one-sided copy and D's check: its exports were released first, so the
    load fails naming the release (as the messaged path does), never done."""
    with warmed() as (p, d):
        prm = p.export("a", [3, 4], 12, seed=3)
        d[0].load("a", prm, [5, 6])
        assert d.onesided() == [1]
        p[0].close()
        got = poll_until(d.engines, {"a"}, "recv")
        assert got["a"].startswith("failed:") and "released before or during the copy" in got["a"], got


def test_closed_exporter_is_not_read_onesided():
    p, d = Ranks(F16, 1, "P"), Ranks(F16, 1, "D", timeout_s=1.0)
    try:
        warm(p, d)
        prm = p.export("a", [3, 4], 12, seed=3)
        p[0].close()
        d[0].load("a", prm, [5, 6])
        assert d.onesided() == [0]
        got = poll_until(d.engines, {"a"}, "recv", timeout=5.0)
        assert got["a"].startswith("failed:"), got
        assert untouched(d.caches(0), F16, {0}, {0: 1})
    finally:
        p.close()
        d.close()
