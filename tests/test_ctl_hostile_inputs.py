"""The control module (``csrc/ctl``) against inputs whose Python code runs inside its calls or
whose memory it could misuse: an id's ``__hash__`` or ``__index__`` changing what the call
walks, a ``__repr__`` that raises, ids sharing memory with the arrays written, a request id
listed twice, an error halfway through ``complete``, an allocation that fails. Each case once
crashed the process, wrote outside an array, leaked a reference or lost a report."""

from __future__ import annotations

import collections
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from kvxfer import idops
from kvxfer.completion import PollResult

from . import test_load_book as T

pytestmark = pytest.mark.skipif(not idops.ensure(), reason=f"control module not built: {idops.status()}")


def _mod():
    return idops.native()


def test_finish_many_survives_an_id_whose_hash_empties_the_list():
    book = T.native_load_book(set(), T.STALE_NS)

    class R:
        def __hash__(self):
            ids.clear()  # the list finish_many walks
            return 1

    ids = [R(), "x", "y"]
    assert book.finish_many(ids) == []  # nothing pending: none finished, nothing read freed


def test_an_item_whose_repr_raises_is_named_by_its_type():
    class Bad:
        def __repr__(self):
            raise RuntimeError("no repr")

    with pytest.raises(TypeError, match="item 0 is a Bad"):
        _mod().ids_from_seq([Bad()], 1, 10, False)


def test_hold_and_release_refuse_ids_sharing_memory_with_what_they_write():
    buf = np.zeros(16, dtype=np.int64)
    rc, ids = buf.view(np.int32), buf[:2]
    ids[:] = (2, 31)  # in range: the writes to rc would change them after the check
    with pytest.raises(ValueError, match="share memory"):
        _mod().hold(rc, ids)
    ep = np.zeros(32, dtype=np.int64)
    with pytest.raises(ValueError, match="share memory"):
        _mod().release(rc, ep, ids)
    assert ids.tolist() == [2, 31] and not rc[4:].any()


def test_onesided_land_uses_the_slot_it_checked():
    """A read's slot whose ``__index__`` answers 0 first and -3 after: the mark goes to slot 0,
    never into the header word the second answer would name."""
    m = _mod()
    header, slot_words, *_ = m.slot_layout()
    t = np.zeros(header + 64 * slot_words, dtype=np.int64)
    t[4], t[3] = 1, time.monotonic_ns()  # open, beating
    before = t[:header].copy()

    class Slot:
        n = 0

        def __index__(self):
            Slot.n += 1
            return 0 if Slot.n == 1 else -3

    ep, ids = np.zeros(8, dtype=np.int64), np.zeros(0, dtype=np.int64)
    got = m.onesided_land(
        (t,), (ep,), ids, ((Slot(), 0, b""),), ((t, 0),), 1, 1, 0, 1, time.monotonic_ns(), 10**9
    )
    assert got == 0 and t[0] == before[0]  # marked in slot 0, not in the header


def test_launched_takes_a_flight_once_per_call():
    book = T.native_load_book(set(), T.STALE_NS)
    ex = T.Exporter()
    ex.serve(book)
    assert T.begin(book, "a", ex.export("pa", [1], 10), [1]) is not None
    assert T.begin(book, "b", ex.export("pb", [2], 10), [2]) is not None
    ev = T.Event(done=True)
    refs = sys.getrefcount(ev)
    with pytest.raises(KeyError, match="no flight of 'a'"):
        book.launched(["a", "b", "a"], ev)  # two flights of "a" are needed: none marked
    assert book.in_flight() == 0 and sys.getrefcount(ev) == refs
    book.launched(["a", "b"], ev)
    T.complete(book, collections.deque())
    assert book.in_flight() == 0 and sys.getrefcount(ev) == refs  # released with the flights


def test_an_error_halfway_through_complete_fails_the_loads_it_took():
    """A's blocks were released (its report is the caller's), then B's deferred notification
    raises: A is failed by name, not left pending and unreported."""
    book = T.native_load_book(set(), T.STALE_NS)
    ex = T.Exporter()
    ex.serve(book)
    assert T.begin(book, "A", ex.export("pa", [1], 10), [1]) is not None
    assert T.begin(book, "B", ex.export("pb", [2], 10), [2]) is not None
    book.launched("A", None)
    book.launched("B", None)
    ex.release("pa", [1])

    def mark_later(row):
        raise MemoryError("simulated")

    with pytest.raises(MemoryError):
        book.complete(time.monotonic_ns(), time.perf_counter(), 0, 1, T.event_done, mark_later, 1.0)
    out = PollResult()
    book.drain(out)
    assert book.pending() == 0 and set(out.failed) == {"A"} and "lost to an error" in out.errors["A"]


def test_begin_re_entered_from_an_ids_index_records_one_flight():
    book = T.native_load_book(set(), T.STALE_NS)
    ex = T.Exporter()
    ex.serve(book)
    prm = ex.export("pa", [1], 10)
    inner = []

    class Id:
        def __index__(self):
            if not inner:
                inner.append(T.begin(book, "A", prm, [3]) is not None)
            return 1

    assert T.begin(book, "A", prm, [Id()]) is None  # the inner begin took "A": the outer one leaves it
    assert inner == [True] and book.pending() == 1
    book.launched("A", None)
    with pytest.raises(KeyError):
        book.launched("A", None)  # one flight of "A"


def test_a_failed_allocation_raises_memory_error_not_abort():
    """Run apart, with the address space capped: std::bad_alloc inside the module becomes
    MemoryError (it once terminated the process)."""
    code = textwrap.dedent(
        """
        import resource
        import numpy as np
        from kvxfer import idops
        assert idops.ensure()
        m = idops.native()
        ep, ids = np.zeros(4, dtype=np.int64), np.zeros(1, dtype=np.int64)
        n = 2 * 10**7
        lists = [ids] * n, [b"\\0" * 8] * n
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        used = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (used + (256 << 20), hard))
        try:
            m.moved(ep, *lists)
        except MemoryError:
            print("MemoryError")
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "MemoryError", (r.returncode, r.stdout, r.stderr[-2000:])
