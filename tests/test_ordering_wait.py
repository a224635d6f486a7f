"""``kvxfer.ordering.wait_event``: the bounded poll of a CUDA event that every copy, gather and
scatter wait goes through. Run on a fake clock (no GPU, no real sleeping), so how late it sees
completion and how often it queries are exact numbers, not timings."""

from __future__ import annotations

import types

import pytest

from kvxfer import ordering
from kvxfer.ordering import FenceTimeout, wait_event

WAKE_S = 60e-6  # what one time.sleep() costs on top of its argument (a Linux wake-up)


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        assert s >= 0
        self.sleeps.append(s)
        self.t += s + WAKE_S


class _Event:
    """Completes at fake time ``done_at``; counts queries."""

    def __init__(self, clock: _Clock, done_at: float) -> None:
        self.clock, self.done_at, self.queries = clock, done_at, 0

    def query(self) -> bool:
        self.queries += 1
        return self.clock.t >= self.done_at


@pytest.fixture
def clock(monkeypatch):
    c = _Clock()
    monkeypatch.setattr(ordering, "time", types.SimpleNamespace(monotonic=c.monotonic, sleep=c.sleep))
    return c


@pytest.mark.parametrize("done_at", [0.0, 50e-6, 400e-6, 1e-3, 1.6e-3, 5e-3, 40e-3])
def test_completion_is_seen_soon_after_it_happens(clock, done_at):
    ev = _Event(clock, done_at)
    wait_event(ev, 10.0, "copy")
    late = clock.t - done_at
    # at most an eighth of the time waited (the sleep in flight) plus the 20 us floor and one
    # wake-up; the doubling steps it replaced saw a 1 ms copy ~0.9 ms late
    assert 0 <= late <= done_at / 8 + 20e-6 + WAKE_S + 1e-9, (done_at, late)
    assert ev.queries <= 60, ev.queries  # a bounded number of wake-ups, not a spin
    assert all(s <= 1e-3 for s in clock.sleeps)


def test_a_wait_that_runs_out_raises_fence_timeout_with_the_event_and_what_it_keeps(clock):
    ev = _Event(clock, float("inf"))
    keep = object()
    with pytest.raises(FenceTimeout, match=r"copy: CUDA work not complete within 0\.05s") as e:
        wait_event(ev, 0.05, "copy", keep)
    assert e.value.event is ev and e.value.keep is keep
    assert 0.05 <= clock.t <= 0.05 + 1e-3 + WAKE_S
