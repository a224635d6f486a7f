"""The lease-slot table's native calls themselves (csrc/ctl/lease_slots.h through
kvxfer.transports.ipc.slots), once each: marks writing the same words as Python's, loaders
marking at once losing no ring entry, arguments checked before reading, one call reading and
landing every source as the steps do, and a native module of another layout not used."""

from __future__ import annotations

import mmap
import os
import signal
import time

import numpy as np
import pytest

from kvxfer import idops
from kvxfer.transports.ipc import slots
from kvxfer.transports.ipc.slots import (
    H_DONE,
    HEADER,
    MAX_DONE,
    PROBES,
    RING,
    S_GEN,
    SLOT,
    SLOT_BITS,
    ExporterSlots,
    SlotView,
    binding,
)

from .slots_helpers import DIGEST, FAR, TOKEN, _epochs, _table, _token

_NATIVE = slots._native  # before the fixture replaces it (the Python runs)


class TestNative:
    """The native calls themselves (once each: not the loader's path under test)."""

    @pytest.fixture(autouse=True)
    def path(self):
        assert idops.ensure(), idops.status()
        return "native"

    def test_native_and_python_marks_write_the_same_words(self):
        tables = []
        for native in (True, False):
            t = np.zeros(HEADER + 1024 * SLOT, dtype=np.int64)
            ex, view = ExporterSlots(t, "inc"), SlotView(t)
            if not native:
                view.ctl = None
            assert (view.ctl is not None) == native
            ex.beat = lambda: None  # the heartbeat is a time: equal tables need equal words
            t[3] = 0
            for k in range(RING + 3):
                i = ex.open(f"r{k}", _token(k), DIGEST, 100.0, True, False)
                view.mark_done(i, int(ex.rows[i, S_GEN]), k % 3, 3)
            tables.append(t.copy())
        assert np.array_equal(tables[0], tables[1])

    def test_loaders_marking_at_once_lose_no_ring_entry(self):
        """Two loader processes marking at the same instant (both spin on a start word, then
        each marks its half of 56 slots 20 times over, 100 rounds): every mark took its own
        ring count, and the exporter names every slot marked each round. Two plain stores (read
        the count, write the entry and the count + 1) lost counts here in every run; the
        compare-and-swap takes each count once."""
        num_children, per, repeat, rounds = 2, RING // 2, 20, 100
        words = HEADER + 1024 * SLOT
        buf = mmap.mmap(-1, (words + 8) * 8)  # shared with the forked children
        t = np.frombuffer(buf, dtype=np.int64, count=words)
        sync = np.frombuffer(buf, dtype=np.int64, count=8, offset=words * 8)  # go, done per child
        ex, view = ExporterSlots(t, "inc"), SlotView(t)
        names = [f"r{k}" for k in range(num_children * per)]
        mine = [ex.open(n, _token(k), DIGEST, 100.0, True, False) for k, n in enumerate(names)]
        gens = [int(ex.rows[i, S_GEN]) for i in mine]
        pids = []
        for c in range(num_children):
            pid = os.fork()
            if pid == 0:  # child: no pytest machinery, exit by os._exit only
                code = 1
                try:
                    ctl, deadline = view.ctl, time.monotonic() + 60
                    for r in range(1, rounds + 1):
                        while sync[0] < r:
                            if time.monotonic() > deadline:
                                raise TimeoutError
                        for _ in range(repeat):
                            for k in range(c * per, (c + 1) * per):
                                ctl.slot_mark(t, mine[k], gens[k], 0, 1)
                        sync[1 + c] = r
                    code = 0
                finally:
                    os._exit(code)
            pids.append(pid)
        try:
            deadline = time.monotonic() + 60
            for r in range(1, rounds + 1):
                sync[0] = r
                while any(sync[1 + c] < r for c in range(num_children)):
                    assert time.monotonic() < deadline, "the marking children did not finish"
                    time.sleep(0)
                assert t[H_DONE] == r * len(names) * repeat, f"round {r}: ring counts lost"
                got = dict(ex.take_done())
                assert sorted(got) == sorted(names), f"round {r}: {sorted(set(names) - set(got))} lost"
            for pid in pids:
                assert os.waitpid(pid, 0)[1] == 0
            pids = []
        finally:
            for pid in pids:  # a failed round: no child outlives the test
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)

    def test_native_slot_calls_check_their_arguments_before_reading(self):
        _, view = _table()
        ctl, t = view.ctl, view.t
        epochs, ids = _epochs()
        with pytest.raises(IndexError, match="out of range"):
            ctl.slot_read(t, epochs, np.array([40], dtype=np.int64), 1, 2, 0, 1, 0)
        with pytest.raises(ValueError, match="fewer than"):
            ctl.slot_read(t[: HEADER + SLOT], epochs, ids, 1, 2, 0, 1, 0)
        with pytest.raises(TypeError, match="8-byte ints"):
            ctl.slot_read(t, epochs.astype(np.int32), ids, 1, 2, 0, 1, 0)
        with pytest.raises(IndexError, match="slot 64 of 64"):
            ctl.slot_check(t, epochs, ids, epochs[ids].tobytes(), 64, 0, 0, 1)
        with pytest.raises(IndexError, match="slot -1"):
            ctl.slot_mark(t, -1, 2, 0, 1)
        with pytest.raises(ValueError, match="loader rank 2 of 2"):
            ctl.slot_mark(t, 0, 2, 2, 2)
        assert not t[HEADER:].any() and t[H_DONE] == 0  # nothing written

    @staticmethod
    def _sources(n: int = 2, rid: str = "r"):
        """``n`` exporter ranks' tables with export ``rid`` opened ready in each, their views,
        and per rank epochs that name rank and block (a snapshot of the wrong rank's fails)."""
        exs, views, eps = [], [], []
        for r in range(n):
            ex, view = _table(64, f"inc-{r}")
            ex.open(rid, TOKEN, DIGEST, time.monotonic() + 30, True, False)
            exs.append(ex)
            views.append(view)
            eps.append(np.arange(40, dtype=np.int64) * 1000 + 7 + r * 10**6)
        return exs, views, eps

    def test_one_call_reads_every_source_as_the_steps_do(self):
        """``onesided_read``: the binding and each source rank's ``slot_read`` in one call, and
        the load's own id checks; a refusal names its code and the source rank that refused."""
        exs, views, eps = self._sources(3)
        ctl, ids = views[0].ctl, np.array([5, 3, 39], dtype=np.int64)
        tables = tuple(v.t for v in views)
        now = time.monotonic_ns()

        def read(ids=ids, num_tokens=40, token=TOKEN, rid="r", need=now, at=now, epochs=tuple(eps)):
            return ctl.onesided_read(
                tables, epochs, ids, num_tokens, 16, 40, token, DIGEST, rid, at, 10**9, need
            )

        b = binding(TOKEN, DIGEST, "r")
        steps = tuple(v.read(*b, now, 10**9, now, e, ids) for v, e in zip(views, eps))
        assert all(type(x) is tuple for x in steps)
        got = read()
        assert got[:2] == b and got[2] == steps  # slots, generations and snapshots alike
        assert [bytes(x[2]) for x in got[2]] == [e[ids].tobytes() for e in eps]
        assert read(num_tokens=49) == 7 and read(num_tokens=32) == 7  # 4 ids, 2 ids needed: not 3
        assert type(read(num_tokens=33)) is tuple and type(read(num_tokens=48)) is tuple  # 3 ids
        assert read(ids=np.array([5, 3, 40], dtype=np.int64)) == 7  # past the exporter's 40 blocks
        assert read(ids=np.array([5, -1, 3], dtype=np.int64)) == 7
        assert read(token="\u00e9" + TOKEN[1:]) == 7  # no bytes to bind: the messaged path names it
        assert read(rid="\ud800") == 7
        assert read(rid="other") == 2  # no slot bound to these params (source 0 says so first)
        assert read(at=now + 5 * 10**9) == 1  # every exporter silent: source 0 first
        exs[2].close(got[2][2][0])
        exs[2].open("r", TOKEN, DIGEST, time.monotonic() + 30, False, False)  # not ready on rank 2
        assert read() == 4 | 2 << 4
        assert read(need=FAR) == 5  # lease too short, on rank 0 already
        with pytest.raises(IndexError, match="out of range"):  # the ids index every source's epochs
            read(epochs=(eps[0], eps[1], eps[2][:39]))
        with pytest.raises(TypeError, match="tuples of one length"):
            read(epochs=tuple(eps[:2]))

    def test_one_call_lands_as_the_checks_and_marks_do(self):
        """``onesided_land``: each source rank's ``slot_check``, then the done marks of the ranks
        the load notifies (in a source's slot, or found by the binding in a rank that is not a
        source); nothing written when a check fails."""
        exs, views, eps = self._sources(3)
        ctl, ids = views[0].ctl, np.array([5, 3, 39], dtype=np.int64)
        now = time.monotonic_ns()
        b0, b1 = binding(TOKEN, DIGEST, "r")
        srcs = (views[0].t, views[1].t)  # ranks 0 and 1 are read; rank 2 is only notified
        got = ctl.onesided_read(srcs, tuple(eps[:2]), ids, 40, 16, 40, TOKEN, DIGEST, "r", now, 10**9, now)
        reads = got[2]
        marks = ((views[0].t, 0), (views[2].t, -1))  # rank 0 in its read slot, rank 2 by binding

        def land(at=now, epochs=tuple(eps[:2]), marks=marks, rank=1, tp=2):
            return ctl.onesided_land(srcs, epochs, ids, reads, marks, b0, b1, rank, tp, at, 10**9)

        eps[1][39] += 1  # released on rank 1 during the copy
        assert land() == 1 | 1 << 4
        eps[1][39] -= 1
        assert land(at=now + 5 * 10**9) == 2  # rank 0 stopped beating
        assert [int(v.t[H_DONE]) for v in views] == [0, 0, 0]  # no mark written by a failed landing
        assert land() == 0
        assert [dict(ex.take_done()) for ex in exs] == [{"r": [(1, 2)]}, {}, {"r": [(1, 2)]}]
        assert land(rank=MAX_DONE, tp=MAX_DONE + 1) == 3  # a rank past the marks: notified instead
        views[2].t[H_DONE] = -1  # a done count a stranger wrote in rank 2's table (mark 1)
        assert land() == 3 | 32 | 1 << 6  # rank 0 marked; rank 2's mark named with its index
        assert dict(exs[0].take_done()) == {"r": [(1, 2)]}
        views[2].t[H_DONE] = 1
        exs[2].close(reads[0][0])  # the same probe start in every table: the same slot
        assert land() == 3  # rank 2's export gone: no slot to mark there
        assert dict(exs[0].take_done()) == {"r": [(1, 2)]} and exs[2].take_done() == []
        with pytest.raises(ValueError, match="loader rank 2 of 2"):
            land(rank=2)
        with pytest.raises(TypeError, match="one read per source"):
            ctl.onesided_land(srcs, tuple(eps[:2]), ids, reads[:1], marks, b0, b1, 0, 1, now, 10**9)
        with pytest.raises(IndexError, match="source 2 of 2"):  # the good first mark not written either
            land(marks=((views[0].t, 0), (views[2].t, 2)))
        with pytest.raises(TypeError, match="writable"):
            land(marks=((views[0].t, 0), (bytes(8 * views[2].t.size), -1)))
        assert [int(v.t[H_DONE]) for v in views] == [3, 0, 1]  # the failed calls wrote nothing

    def test_a_native_module_of_another_layout_is_not_used(self, monkeypatch, caplog):
        class Other:
            @staticmethod
            def slot_layout():
                return (HEADER, SLOT + 1, PROBES, RING, MAX_DONE, SLOT_BITS)

        monkeypatch.setattr(slots, "_logged_layout", False)
        monkeypatch.setattr(idops, "native", lambda: Other)
        with caplog.at_level("WARNING", logger="kvxfer.transports.ipc.slots"):
            assert _NATIVE() is None
        assert "the slot reads run in Python" in caplog.text
        monkeypatch.setattr(idops, "native", lambda: None)
        assert _NATIVE() is None
