"""``StagingLanes``: staging pools for streams that run at once, one whole pool per stream, made
on first need up to a cap, reused, bounded waits, and no lane lost to a failed allocation or to
buffers a failed stream's GPU work held (the engine-level case, a slow loader beside another:
``tests/test_pg_bounds.py``)."""

from __future__ import annotations

import threading
import time

import pytest

from kvxfer.transports.pg.pipeline import StagedPipeline
from kvxfer.transports.staging import StagingLanes, StagingPool


def _lanes(max_lanes: int, made: list) -> StagingLanes:
    def make() -> StagingPool:
        made.append(StagingPool(2, 64))
        return made[-1]

    return StagingLanes(make, max_lanes)


def test_lanes_are_reused_grown_on_overlap_and_bounded():
    made: list = []
    lanes = _lanes(2, made)
    with lanes.lane(2, 1.0) as a:
        pass
    with lanes.lane(2, 1.0) as b:
        assert b is a and len(made) == 1  # one stream after another: one lane
        with lanes.lane(2, 1.0) as c:
            assert c is not a and len(made) == 2
            t0 = time.monotonic()
            with pytest.raises(TimeoutError, match="all 2 lanes streaming"), lanes.lane(2, 0.2):
                pass
            assert time.monotonic() - t0 >= 0.2
    assert lanes.pools == made and len(lanes._idle) == 2


def test_a_waiting_stream_takes_the_lane_freed_first():
    lanes = _lanes(1, [])
    got = []
    with lanes.lane(2, 1.0) as a:
        t = threading.Thread(target=lambda: got.append(lanes._take(2, time.monotonic() + 5.0, 5.0, True)))
        t.start()
        time.sleep(0.1)
        assert not got  # waiting, not failed
    t.join(5)
    assert got == [a]


def test_a_lane_whose_buffers_gpu_work_holds_is_passed_over_while_another_can_be_made():
    made: list = []
    lanes = _lanes(2, made)
    with lanes.lane(2, 1.0) as a:
        idx = a.acquire(2, 1.0)

        class Pending:
            def query(self) -> bool:
                return False

        a.hold_until([a.buffers[i] for i in idx], Pending())
        a.release(idx)  # quarantined: its GPU work "still runs"
    with lanes.lane(2, 1.0) as b:
        assert b is not a and len(made) == 2


def test_a_lane_that_cannot_be_made_counts_nothing():
    calls = []

    def make() -> StagingPool:
        calls.append(1)
        raise RuntimeError("out of memory")

    lanes = StagingLanes(make, 1)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="out of memory"), lanes.lane(2, 0.1):
            pass
    assert calls == [1, 1] and lanes.pools == []
    with pytest.raises(ValueError, match="max_lanes"):
        StagingLanes(make, 0)
    with pytest.raises(ValueError, match="max_streams"):
        StagedPipeline(max_streams=0)


class _Event:
    """A CUDA event stand-in: completed once ``done`` is set."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_a_lane_whose_held_buffers_came_free_is_reused_not_doubled():
    """A failed stream's buffers wait for its GPU work; once that completed the lane is taken
    again (before, its free count looked stale and each such stream made a new lane)."""
    made: list = []
    lanes = _lanes(4, made)
    for _ in range(3):
        ev = _Event()
        with lanes.lane(2, 1.0) as pool:
            idx = pool.acquire(2, 1.0)
            pool.hold_until([pool.buffers[i] for i in idx], ev)
            pool.release(idx)
        ev.done = True  # the failed stream's GPU work completed
    assert len(made) == 1


def test_a_lane_that_cannot_be_made_waits_for_one_that_exists(caplog):
    made: list = []
    fail = [False]

    def make() -> StagingPool:
        if fail[0]:
            raise RuntimeError("out of memory")
        made.append(StagingPool(2, 64))
        return made[-1]

    lanes = StagingLanes(make, 3)
    got = []
    with lanes.lane(2, 1.0) as a:
        fail[0] = True
        t = threading.Thread(target=lambda: got.append(lanes._take(2, time.monotonic() + 5.0, 5.0, True)))
        t.start()
        time.sleep(0.1)
        assert not got  # waiting for `a`, not failed
    t.join(5)
    assert got == [a] and len(made) == 1 and lanes.max_lanes == 1  # no more tries
    assert "could not be made" in caplog.text


class _Stop(BaseException):
    pass


def test_a_make_cut_short_gives_its_reservation_back():
    """An interrupt inside a lane's allocation does not keep its place among the lanes."""
    stop = [True]

    def make() -> StagingPool:
        if stop[0]:
            raise _Stop
        return StagingPool(2, 64)

    lanes = StagingLanes(make, 1)
    with pytest.raises(_Stop), lanes.lane(2, 0.1):
        pass
    stop[0] = False
    with lanes.lane(2, 0.5) as pool:
        assert lanes.pools == [pool]


def test_a_make_failing_beside_one_in_progress_waits_for_that_one():
    """Two streams start at once and memory holds one lane: the second waits for the first's."""
    started, go = threading.Event(), threading.Event()
    calls = []

    def make() -> StagingPool:
        calls.append(1)
        if len(calls) == 1:
            started.set()
            go.wait(5)  # the first allocation is slow
            return StagingPool(2, 64)
        raise RuntimeError("out of memory")

    lanes = StagingLanes(make, 2)
    got: list = []

    def first() -> None:
        with lanes.lane(2, 5.0) as pool:
            got.append(pool)
            time.sleep(0.2)

    t = threading.Thread(target=first)
    t.start()
    assert started.wait(5)
    second: list = []
    u = threading.Thread(target=lambda: second.append(lanes._take(2, time.monotonic() + 5.0, 5.0, True)))
    u.start()
    time.sleep(0.1)
    go.set()
    t.join(5)
    u.join(5)
    assert second == got and len(calls) == 2  # not failed: it took the first's lane once free
