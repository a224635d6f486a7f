"""The one-sided native lane (``OneSided.load_native``, the control module's ``LoadBook``) in the
engine: a load it takes lands as the Python path's does, everything it refuses the Python path
refuses in the same words (nothing recorded twice), a copy that raises fails the load by name
and still frees the exporter, ``wait()`` sees its flights, loads held by ``batched_loads()`` are
launched together at the block's end (one planned launch; a failed one fails each by name), and
without the control module the engine takes the Python tracker and path and lands the same."""

from __future__ import annotations

import contextlib

import pytest
import torch

from kvxfer import idops
from kvxfer.completion import LoadTracker

from .engine_payload import check, fill, untouched
from .onesided_helpers import F16, Ranks, poll_until, warm


@pytest.fixture
def pair():
    """P and D (one rank each), D warmed and one one-sided load made (the target and its lane
    exist: later loads can take the native lane)."""
    assert idops.ensure(), idops.status()
    p = Ranks(F16, 1, "P")
    d = None
    try:
        d = Ranks(F16, 1, "D")
        warm(p, d)
        prm = p.export("first", [1], 5, seed=2)
        d[0].load("first", prm, [1])
        assert poll_until(d.engines, {"first"}, "recv") == {"first": "done"}
        assert poll_until(p.engines, {"first"}, "send") == {"first": "done"}  # freed by its mark
        assert d.onesided() == [1] and d.native() == [0]
        # P's records are the control module's book, which writes P's slot table itself
        assert p[0]._rt.exports._book is not None and p[0]._transports["ipc"].leases.native
        yield p, d
    finally:
        try:
            if d is not None:
                d.close()
        finally:
            p.close()


def _errors(d: Ranks, prm: dict) -> list[str]:
    """What load() raises for bad local ids, a request id already loading and a bad
    num_computed_tokens, in order."""
    out = []
    for rid, ids, k in (
        ("e1", [2, 48], 0),  # out of range
        ("e2", [2, 2], 0),  # repeated
        ("e3", [2], 0),  # too few for 12 tokens
        ("busy", [4, 5], 0),  # already loading
        ("e4", [2, 3], True),  # a bool is no token count
    ):
        with pytest.raises(ValueError) as e:
            d[0].load(rid, prm, ids, k)
        out.append(str(e.value))
    return out


@pytest.mark.parametrize("lane", ["native", "python"])
def test_the_lane_lands_exactly_and_refuses_as_the_python_path_does(pair, lane):
    p, d = pair
    e = d[0]
    if lane == "python":
        e._native_load = None
    busy = p.export("busy", [6, 7], 12, seed=4)
    e.load("busy", busy, [8, 9])
    prm = p.export("a", [2, 3], 12, seed=3)
    errors = _errors(d, prm)
    assert errors == [
        "block_ids: out of range [0, 48) (item 1)",
        "block_ids: repeated block id",
        "block_ids: num_tokens=12 needs 2 blocks, got 1",
        "request_id: 'busy' is already being loaded",
        "num_computed_tokens: must be an int in [0, 12), got True",
    ], errors
    assert e.stats()["onesided"]["in_flight"] == 1 and e.stats()["loads_pending"] == 1
    e.load("a", prm, [4, 5])
    assert poll_until(d.engines, {"busy", "a"}, "recv") == {"busy": "done", "a": "done"}
    assert poll_until(p.engines, {"busy", "a"}, "send") == {"busy": "done", "a": "done"}
    assert check(d.caches(0), F16, 0, 1, [8, 9], 12, 4) and check(d.caches(0), F16, 0, 1, [4, 5], 12, 3)
    assert untouched(d.caches(0), F16, {0, 1, 4, 5, 8, 9}, {0: 1, 1: 5, 5: 4, 9: 4})
    assert d.onesided() == [3] and d.native() == ([2] if lane == "native" else [0])
    assert p[0].stats()["blocks_held"] == 0


def test_params_loaded_twice_fail_as_loaded_twice_and_altered_ones_are_refused_by_name(pair):
    p, d = pair
    prm = p.export("x", [2, 3], 12, seed=3)
    d[0].load("x1", prm, [4, 5])
    d[0].load("x2", prm, [6, 7])  # the same params again: the lane leaves it to the Python path
    forged = dict(prm, request_id="x", token=prm["token"][:-1] + ("0" if prm["token"][-1] != "0" else "1"))
    d[0].load("y", forged, [8, 9])
    got = poll_until(d.engines, {"x1", "x2", "y"}, "recv")
    assert got["x1"] == "done", got
    assert got["x2"].startswith("failed:") and "'x' is loaded twice in one batch" in got["x2"], got
    assert got["y"].startswith("failed:") and "unauthorized" in got["y"], got
    assert d.native() == [1], "only the first was the lane's"
    assert untouched(d.caches(0), F16, {0, 1, 4, 5}, {0: 1, 1: 5, 5: 4})


def test_a_release_between_load_and_poll_fails_the_load_never_delivers(pair):
    """P aborts the export after the lane's copy and its runner reuses the blocks: D's poll()
    (one native call checks and marks) reports the load failed, naming the release, and writes
    no done mark; the failure's notification goes at once."""
    p, d = pair
    prm = p.export("x", [3, 4], 12, seed=3)
    d[0].load("x", prm, [5, 6])
    assert d.native() == [1]
    p[0].abort_export("x")
    fill(p.caches(0), F16, 0, 1, [3, 4], 12, seed=99)
    got = poll_until(d.engines, {"x"}, "recv")
    assert got["x"].startswith("failed:") and "released before or during the copy" in got["x"], got
    assert poll_until(p.engines, {"x"}, "send") == {"x": "done"}  # the abort's own report
    st = d[0].stats()
    assert st["failures"] == 1 and st["onesided"]["in_flight"] == 0 and st["loads_pending"] == 0


class RaisingCopy:
    def run_bounded(self, *args) -> None:
        raise RuntimeError("the kernel refused")


def test_a_copy_that_raises_fails_the_load_by_name_and_frees_the_exporter(pair):
    p, d = pair
    target = d[0]._loader.peers.get("P").session.onesided
    plain = target.plain
    target.plain = (RaisingCopy(),)
    try:
        prm = p.export("a", [2, 3], 12, seed=3)
        d[0].load("a", prm, [4, 5])
    finally:
        target.plain = plain
    got = poll_until(d.engines, {"a"}, "recv")
    assert got["a"].startswith("failed: one-sided ipc copy: RuntimeError: the kernel refused"), got
    assert poll_until(p.engines, {"a"}, "send") == {"a": "done"}  # the failure's notification
    st = d[0].stats()
    assert st["failures"] == 1 and st["onesided"]["in_flight"] == 0 and st["loads_pending"] == 0


def test_wait_reports_a_load_of_the_lane(pair):
    p, d = pair
    prm = p.export("a", [2, 3], 12, seed=3)
    d[0].load("a", prm, [4, 5])
    assert d.native() == [1]
    got = d[0].wait(["a"], 5.0)
    assert got.finished_recving == {"a"}, got
    assert check(d.caches(0), F16, 0, 1, [4, 5], 12, 3)


def _batch(p, d, n: int, lengths=(12, 5, 16, 9)) -> dict:
    """``n`` exports of P (odd lengths: partial last blocks) and their local ids on D:
    request id -> (params, local ids, num_tokens, seed)."""
    out, s_next, d_next = {}, 2, 2
    for i in range(n):
        t = lengths[i % len(lengths)]
        k = -(-t // F16.block_size)
        s_ids, d_ids = list(range(s_next, s_next + k))[::-1], list(range(d_next, d_next + k))
        s_next, d_next = s_next + k, d_next + k
        out[f"b{i}"] = (p.export(f"b{i}", s_ids, t, seed=30 + i), d_ids, t, 30 + i)
    return out


def test_a_batch_of_the_lane_is_held_then_launched_together_exactly(pair):
    p, d = pair
    e = d[0]
    reqs = _batch(p, d, 4)
    calls0 = e.stats()["ops_calls"]
    with e.batched_loads():
        for rid, (prm, ids, _, _) in reqs.items():
            e.load(rid, prm, ids)
        assert e.stats()["onesided"]["in_flight"] == 0 and e.stats()["loads_pending"] == 4, "held"
        assert e.stats()["ops_calls"] == calls0, "nothing copied before the block ends"
    assert e.stats()["onesided"]["in_flight"] == 4
    assert poll_until(d.engines, set(reqs), "recv") == dict.fromkeys(reqs, "done")
    assert poll_until(p.engines, set(reqs), "send") == dict.fromkeys(reqs, "done")  # by the marks
    calls = e.stats()["ops_calls"] - calls0
    assert 0 < calls < 4, (
        f"one planned launch (whole blocks, then the tails' slots), not a call per load: {calls}"
    )
    used, tails = {0, 1}, {0: 1, 1: 5}
    for prm, ids, t, seed in reqs.values():
        assert check(d.caches(0), F16, 0, 1, ids, t, seed), prm["request_id"]
        used |= set(ids)
        tails[ids[-1]] = t - (len(ids) - 1) * F16.block_size
    assert untouched(d.caches(0), F16, used, tails)
    assert d.native() == [4] and e.stats()["failures"] == 0


@pytest.mark.parametrize("how", ["mapping dropped", "copy raises", "interrupted"])
def test_a_batch_of_the_lane_whose_launch_fails_fails_each_load_by_name(pair, how):
    """``interrupted``: what escapes the launch (here a KeyboardInterrupt) still leaves no load
    held: each fails by name, then the interrupt goes on."""
    p, d = pair
    e = d[0]
    reqs = _batch(p, d, 3)
    before = [c.view(torch.uint8).clone() for c in d.caches(0)]
    session = e._loader.peers.get("P").session
    lock = session.lock
    try:
        escapes = pytest.raises(KeyboardInterrupt) if how == "interrupted" else contextlib.nullcontext()
        with escapes, e.batched_loads():
            for rid, (prm, ids, _, _) in reqs.items():
                e.load(rid, prm, ids)
            if how == "mapping dropped":
                session.close()  # what forgetting a remote does
            else:
                session.lock = RaisingLock(KeyboardInterrupt if how == "interrupted" else RuntimeError)
    finally:
        session.lock = lock
    got = poll_until(d.engines, set(reqs), "recv")
    want = {
        "mapping dropped": "mapping was dropped before the launch",
        "copy raises": "RuntimeError: no lock",
        "interrupted": "the batch's launch was interrupted",
    }[how]
    for rid in reqs:
        assert got[rid].startswith("failed: one-sided ipc copy:") and want in got[rid], got
    assert all(torch.equal(a, b.view(torch.uint8)) for a, b in zip(before, d.caches(0))), "nothing was copied"
    # the failures' notification frees every export on P
    assert poll_until(p.engines, set(reqs), "send") == dict.fromkeys(reqs, "done")
    st = e.stats()
    assert st["failures"] == 3 and st["onesided"]["in_flight"] == 0 and st["loads_pending"] == 0
    assert d.native() == [3]


class RaisingLock:
    def __init__(self, kind: type[BaseException]) -> None:
        self.kind = kind

    def __enter__(self):
        raise self.kind("no lock")

    def __exit__(self, *exc) -> None:
        return None


def test_without_the_control_module_the_engine_takes_the_python_tracker_and_path(monkeypatch):
    monkeypatch.setattr(idops, "native", lambda: None)
    p = Ranks(F16, 1, "P")
    d = None
    try:
        d = Ranks(F16, 1, "D")
        assert type(d[0]._rt.loads) is LoadTracker and d[0]._native_load is None
        assert p[0]._rt.exports._book is None and not p[0]._transports["ipc"].leases.native
        warm(p, d)
        for k in range(2):
            prm = p.export(f"a{k}", [2 + 2 * k, 3 + 2 * k], 12, seed=3 + k)
            d[0].load(f"a{k}", prm, [4 + 2 * k, 5 + 2 * k])
            assert poll_until(d.engines, {f"a{k}"}, "recv") == {f"a{k}": "done"}
            assert check(d.caches(0), F16, 0, 1, [4 + 2 * k, 5 + 2 * k], 12, 3 + k)
        assert d.onesided() == [2] and d.native() == [0]
    finally:
        if d is not None:
            d.close()
        p.close()
