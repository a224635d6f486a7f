"""The control module's ``LoadBook`` (``csrc/ctl/load_book.h``, ``load_lane.h``) on its own: the
one-sided native lane's lookup and record (``begin``) against a real lease-slot table, every
refusal writing nothing, the launch (a batch's all or none), the landing and its report
(``complete``, an event asked once per call), a release or a stopped exporter seen after the
copy, events still running and late, a failed or dropped launch, and the argument checks. The
tracker methods are ``LoadTracker``'s (``tests/test_tracker.py`` runs its tests through both);
the engine's use of the lane is in ``tests/test_onesided_*.py``."""

from __future__ import annotations

import collections
import time
from types import SimpleNamespace

import numpy as np
import pytest

from kvxfer import idops
from kvxfer.auth import EngineSecret, content_digest
from kvxfer.completion import PollResult, native_load_book
from kvxfer.params import params_dict
from kvxfer.transports.ipc.slots import HEADER, SLOT, ExporterSlots, SlotView

STALE_NS = 2_000_000_000
NUM_BLOCKS = 40  # the exporter's
LOCAL_BLOCKS = 30
PER_TOKEN = 64  # wire bytes per token (what the lane says; nothing is copied here)
SECRET = EngineSecret("P", 0, 0)


class Event:
    """A stand-in CUDA event: complete once ``done`` is set."""

    def __init__(self, done: bool = False) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def event_done(ev) -> bool:
    return ev.query()


class Exporter:
    """An exporter rank's lease-slot table and block epochs, and exports opened in it."""

    def __init__(self) -> None:
        self.table = np.zeros(HEADER + 64 * SLOT, dtype=np.int64)
        self.slots = ExporterSlots(self.table, "inc")
        SlotView(self.table)  # a loader reads one-sided from here: slots are opened
        self.epochs = np.zeros(NUM_BLOCKS, dtype=np.int64)
        self.opened: dict[str, int] = {}

    def export(self, rid: str, ids: list[int], num_tokens: int, ready: bool = True, nonce: int = 0) -> dict:
        digest = content_digest(num_tokens, np.array(ids, dtype=np.int64))
        token = SECRET.token(rid, nonce.to_bytes(8, "big"), digest)
        self.opened[rid] = self.slots.open(rid, token, digest, time.monotonic() + 600, ready, False)
        return params_dict(rid, "P", "127.0.0.1", 5555, 1, list(ids), num_tokens, token)

    def release(self, rid: str, ids: list[int]) -> None:
        self.slots.close(self.opened.pop(rid))
        self.epochs[ids] += 1

    def serve(self, book, marks_all: bool = True) -> SimpleNamespace:
        """Loads of engine "P" read this rank through a target of ``book`` (its ``lane``)."""
        t = SimpleNamespace()
        t.lane = (
            t, (self.table,), (self.epochs,), ((self.table, 0),), "127.0.0.1", 5555, 1,
            16, NUM_BLOCKS, 16, LOCAL_BLOCKS, PER_TOKEN, 1, marks_all, "peer",
        )  # fmt: skip
        book.set_target("P", t)
        return t


@pytest.fixture
def book():
    assert idops.ensure(), idops.status()
    return native_load_book(set(), STALE_NS)


def begin(book, rid, params, local, queued=frozenset(), timeout_s=10.0, max_tokens=-1):
    now_ns = time.monotonic_ns()
    return book.begin(
        rid, params, local, set(queued), now_ns, now_ns + 5_000_000_000, time.perf_counter(),
        now_ns * 1e-9 + timeout_s, max_tokens,
    )  # fmt: skip


def complete(book, marked: collections.deque, now_ns: int | None = None):
    now_ns = time.monotonic_ns() if now_ns is None else now_ns
    return book.complete(now_ns, time.perf_counter(), 0, 1, event_done, marked.append, 123.0)


def done_marks(ex: Exporter) -> list:
    return ex.slots.take_done()


def test_a_load_is_looked_up_recorded_launched_and_lands_with_its_done_mark(book):
    ex = Exporter()
    target = ex.serve(book)
    prm = ex.export("a", [7, 3, 9], 40)
    got = begin(book, "load-a", prm, [1, 2, 5])
    assert got is not None
    src, dst, n, lane = got
    assert lane is target.lane
    assert src.dtype == np.int64 and src.tolist() == [7, 3, 9] and dst.tolist() == [1, 2, 5] and n == 40
    assert book.pending() == 1 and book.in_flight() == 0, "recorded, not launched yet"
    marked: collections.deque = collections.deque()
    assert complete(book, marked) is None, "not launched yet: poll() does not look at it"
    book.launched("load-a", None)
    assert book.in_flight() == 1
    results, events, late, start, nbytes, calls, lats = complete(book, marked)
    assert results == [] and events == [] and late == [] and calls == 1 and nbytes == 40 * PER_TOKEN
    assert len(lats) == 1 and lats[0] >= 0 and start <= time.perf_counter()
    assert list(marked) == [(123.0, "peer", "a", prm["token"])]  # its notification waits
    assert book.pending() == 0 and book.in_flight() == 0
    out = PollResult()
    book.drain(out)
    assert out.finished_recving == {"load-a"} and not out.failed
    assert done_marks(ex) == [("a", [(0, 1)])]


def test_the_book_records_the_lanes_metrics_into_the_engines(book):
    """After ``Metrics.follow``, each ``complete`` adds its reports' bytes, ops calls, landed
    loads, latencies and busy time (the union of their spans) to what ``snapshot`` says,
    with no call from Python."""
    from kvxfer.metrics import Metrics

    m = Metrics()
    m.record_loads(1.0, 2.0, 100, 1, [0.5])  # the messaged path's, kept by Metrics itself
    m.follow(book)
    ex = Exporter()
    ex.serve(book)
    marked: collections.deque = collections.deque()
    lats = []
    for k, rid in enumerate(("a", "bb")):
        prm = ex.export(rid, [7 + k, 3 + k], 20)
        assert begin(book, f"load-{rid}", prm, [1 + 2 * k, 2 + 2 * k]) is not None
        book.launched(f"load-{rid}", None)
        got = complete(book, marked)
        lats += got[6]
        assert got[4] == 20 * PER_TOKEN and got[5] == 1  # still returned
    nbytes, calls, transfers, latency_sum, busy = book.lane_stats()
    assert (nbytes, calls, transfers) == (2 * 20 * PER_TOKEN, 2, 2) and latency_sum == pytest.approx(
        sum(lats)
    )
    assert 0 < busy <= sum(lats) + 1e-9  # each span [start, end] is at most its load's latency
    snap = m.snapshot()
    assert snap["bytes"] == 100 + nbytes and snap["transfers"] == 3 and snap["ops_calls"] == 3
    assert snap["latency_sum_s"] == pytest.approx(0.5 + sum(lats)) and snap["busy_s"] == pytest.approx(
        1.0 + busy
    )
    assert sorted(m._latency) == sorted([0.5, *lats])  # the window the percentiles read
    with pytest.raises(TypeError, match="extend"):
        book.record_into(3)


def test_a_latency_window_that_changes_the_list_it_is_given_cannot_crash_complete(book):
    """``record_into`` takes anything with ``extend``: one that empties the list it is handed
    (any Python can) leaves the book's sums as they were computed (they were read after it: a
    crash)."""

    class Clearing(collections.deque):
        def extend(self, xs) -> None:
            super().extend(xs)
            xs.clear()

    window = Clearing()
    book.record_into(window)
    ex = Exporter()
    ex.serve(book)
    prm = ex.export("a", [7, 3], 20)
    assert begin(book, "load-a", prm, [1, 2]) is not None
    book.launched("load-a", None)
    got = complete(book, collections.deque())
    assert got is not None and len(window) == 1 and book.lane_stats()[2] == 1
    assert book.lane_stats()[3] == pytest.approx(window[0])


def test_a_rank_without_a_table_to_mark_is_notified_now(book):
    ex = Exporter()
    ex.serve(book, marks_all=False)
    prm = ex.export("a", [7], 5)
    assert begin(book, "x", prm, [1]) is not None
    book.launched("x", None)
    marked: collections.deque = collections.deque()
    results = complete(book, marked)[0]
    assert not marked and results == [(0, results[0][1], "a", prm["token"], "x")]


@pytest.mark.parametrize(
    "why",
    ["token", "ids", "num_tokens", "host", "port", "not ready", "no slot", "too many tokens", "local range",
     "local repeat", "local count", "local type", "pending", "active", "queued", "silent", "groups",
     "session closed", "engine"],
)  # fmt: skip
def test_every_refusal_writes_nothing_and_leaves_the_load_to_the_python_path(book, why):
    ex = Exporter()
    prm = ex.export("a", [7, 3], 20, ready=why != "not ready")
    local: object = [1, 2]
    target = ex.serve(book)
    queued, max_tokens = set(), -1
    if why == "token":
        prm["token"] = prm["token"][:-1] + ("0" if prm["token"][-1] != "0" else "1")
    elif why == "ids":
        prm["block_ids"] = [7, 4]
    elif why == "num_tokens":
        prm["num_tokens"] = 19
    elif why == "host":
        prm["host"] = "10.0.0.1"
    elif why == "port":
        prm["port"] = 5556
    elif why == "no slot":
        ex.release("a", [7, 3])
    elif why == "too many tokens":
        max_tokens = 19
    elif why == "local range":
        local = [1, LOCAL_BLOCKS]
    elif why == "local repeat":
        local = [1, 1]
    elif why == "local count":
        local = [1]
    elif why == "local type":
        local = np.array([1, 2])
    elif why == "pending":
        book.add("x", [9], 0.0)
    elif why == "active":  # another load of the same params in flight
        assert begin(book, "other", prm, [5, 6]) is not None
    elif why == "queued":
        queued = {("P", "a")}
    elif why == "silent":
        ex.table[3] = 1  # the heartbeat, decades ago
    elif why == "groups":
        prm["groups"] = [2]
    elif why == "session closed":
        target.lane = None
    elif why == "engine":
        prm["engine_id"] = "Q"
    pending, flights = book.pending(), book.in_flight()
    assert begin(book, "x", prm, local, queued, max_tokens=max_tokens) is None
    assert book.pending() == pending and book.in_flight() == flights
    assert done_marks(ex) == []


def test_a_release_after_the_lookup_fails_the_load_and_writes_no_mark(book):
    ex = Exporter()
    ex.serve(book)
    prm = ex.export("a", [7, 3], 20)
    assert begin(book, "x", prm, [1, 2]) is not None
    book.launched("x", None)
    ex.release("a", [7, 3])
    marked: collections.deque = collections.deque()
    results, _, _, _, nbytes, calls, lats = complete(book, marked)
    assert not marked and nbytes == 0 and lats == [] and calls == 1
    code, _, prid, token, rid = results[0]
    assert code & 15 == 1 and (prid, token, rid) == ("a", prm["token"], "x")
    assert book.pending() == 1, "a failed load is the caller's to fail (it says why)"
    assert book.fail("x", "released")
    out = PollResult()
    book.drain(out)
    assert out.failed == {"x": [1, 2]} and out.errors == {"x": "released"}


def test_an_exporter_silent_after_the_lookup_fails_the_load(book):
    ex = Exporter()
    ex.serve(book)
    prm = ex.export("a", [7], 5)
    assert begin(book, "x", prm, [1]) is not None
    book.launched("x", None)
    later = time.monotonic_ns() + 3 * STALE_NS  # checked past the heartbeat bound
    code = complete(book, collections.deque(), later)[0][0][0]
    assert code & 15 == 2


def test_a_running_copy_waits_is_late_once_and_lands_when_its_event_completes(book):
    ex = Exporter()
    ex.serve(book)
    prm = ex.export("a", [7], 5)
    assert begin(book, "x", prm, [1], timeout_s=0.0) is not None
    ev = Event()
    book.launched("x", ev)
    assert book.events_of({"x"}) == [ev] and book.events_of(["x"]) == [ev] and book.events_of({"y"}) == []
    marked: collections.deque = collections.deque()
    results, events, late, _, _, calls, _ = complete(book, marked)
    assert results == [] and events == [] and late == ["x"] and calls == 0 and book.in_flight() == 1
    assert complete(book, marked)[2] == [], "late is said once"
    ev.done = True
    results, events, late, _, _, calls, lats = complete(book, marked)
    assert len(events) == 1 and events[0][1] is ev
    assert late == [] and calls == 1 and len(lats) == 1 and len(marked) == 1 and book.in_flight() == 0


def test_a_failed_launch_fails_the_load_and_a_dropped_one_is_forgotten(book):
    ex = Exporter()
    ex.serve(book)
    prm_a, prm_b = ex.export("a", [7], 5), ex.export("b", [8], 5)
    assert begin(book, "x", prm_a, [1]) is not None
    assert begin(book, "y", prm_b, [2]) is not None
    assert book.cancel("x", "copy failed") and not book.cancel("x", "again")
    assert book.drop("y") and not book.drop("y")
    assert book.pending() == 0 and book.in_flight() == 0
    with pytest.raises(KeyError, match="no flight"):
        book.launched("y", None)
    out = PollResult()
    book.drain(out)
    assert out.failed == {"x": [1]} and out.errors == {"x": "copy failed"} and not out.finished_recving
    assert begin(book, "y", prm_b, [2]) is not None, "the dropped load's params are free again"


def test_a_batch_launched_together_counts_its_calls_once(book):
    ex = Exporter()
    ex.serve(book)
    prms = [ex.export(f"r{i}", [7 + i], 5) for i in range(3)]
    for i, prm in enumerate(prms):
        assert begin(book, f"x{i}", prm, [1 + i]) is not None
    assert book.in_flight() == 0, "held for the batch's launch: not in flight yet"
    for i in (2, 1, 0):  # as OneSided launches a batch: the last begun first
        book.launched(f"x{i}", None, 3 if i == 0 else 0)
    assert book.in_flight() == 3
    results, events, late, _, nbytes, calls, lats = complete(book, collections.deque())
    assert calls == 3, "the batch's three ops calls, counted once (not the lane's 1 per load)"
    assert nbytes == 3 * 5 * PER_TOKEN and len(lats) == 3 and results == events == late == []
    assert book.in_flight() == 0
    assert sorted(r for r, _ in done_marks(ex)) == ["r0", "r1", "r2"]


def test_a_batch_is_marked_launched_all_or_none_in_one_call(book):
    ex = Exporter()
    ex.serve(book)
    for i in range(3):
        assert begin(book, f"x{i}", ex.export(f"r{i}", [7 + i], 5), [1 + i]) is not None
    with pytest.raises(KeyError, match="no flight of 'nope'"):
        book.launched(["x0", "nope", "x2"], None, 2)
    assert book.in_flight() == 0, "none marked when one is missing"
    with pytest.raises(TypeError, match="request_id must be a str, got int"):
        book.launched(["x0", 5], None)
    assert book.in_flight() == 0
    book.launched(["x0", "x1", "x2"], None, 2)
    assert book.in_flight() == 3
    with pytest.raises(KeyError, match="no flight of 'x1'"):
        book.launched(["x1"], None)  # launched already
    results, events, late, _, nbytes, calls, lats = complete(book, collections.deque())
    assert calls == 2 and nbytes == 3 * 5 * PER_TOKEN and len(lats) == 3 and results == events == late == []


class FlipEvent:
    """Not complete when first asked, complete when asked again."""

    def __init__(self) -> None:
        self.asked = 0

    def query(self) -> bool:
        self.asked += 1
        return self.asked > 1


def test_a_shared_event_is_asked_once_per_call_so_its_batch_lands_together(book):
    ex = Exporter()
    ex.serve(book)
    for i in range(2):
        assert begin(book, f"x{i}", ex.export(f"r{i}", [7 + i], 5), [1 + i]) is not None
    ev = FlipEvent()
    book.launched(["x0", "x1"], ev, 1)
    marked: collections.deque = collections.deque()
    got = complete(book, marked)
    assert got is not None and got[0] == [] and got[6] == [] and ev.asked == 1, "asked once, not complete"
    assert book.in_flight() == 2, "neither landed: the event was not complete when asked"
    results, events, late, _, _, calls, lats = complete(book, marked)
    assert len(lats) == 2 and calls == 1 and ev.asked == 2, "both landed in one call"
    assert events == [(events[0][0], ev), (events[0][0], ev)] and results == late == []


def test_bad_arguments_raise_naming_them(book):
    ex = Exporter()
    ex.serve(book)
    prm = ex.export("a", [7], 5)
    with pytest.raises(TypeError, match="request_id must be a str"):
        begin(book, 5, prm, [1])
    with pytest.raises(TypeError, match="takes 9 arguments"):
        book.begin("x", prm)
    with pytest.raises(TypeError, match="engine_id must be a str"):
        book.set_target(5, None)
    book.set_target("P", SimpleNamespace(lane=(1, 2)))
    with pytest.raises(TypeError, match="lane must be a tuple of 15"):
        begin(book, "x", prm, [1])
    with pytest.raises(TypeError, match="request_id must be a str, got int"):
        book.launched(5, None)
    with pytest.raises(TypeError, match="takes 2 or 3 arguments"):
        book.launched("x")
    with pytest.raises(ValueError, match="calls must be >= 0"):
        book.launched("x", None, -1)
    with pytest.raises(TypeError, match="request_id must be a str, got bytes"):
        book.cancel(b"x", "why")
    with pytest.raises(TypeError, match="event_done and mark_later must be callable"):
        book.complete(0, 0.0, 0, 1, None, print, 1.0)
    with pytest.raises(TypeError, match="LoadBook\\(limits"):
        type(book)((1, 2), set(), np.frombuffer, np.int64, 0)
    assert book.pending() == 0 and book.in_flight() == 0
