"""The lease-slot table (kvxfer.transports.ipc.slots): every table word is untrusted input (any
process of the same user can map and write it): done counts, generations, heartbeats, ring
entries and header words a stranger wrote count nothing, write nothing outside the table and
raise nothing. Every test runs twice: the loader's side as native calls and in Python."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvxfer.transports.ipc.slots import (
    DONE_TP,
    H_DONE,
    H_OPEN,
    H_READERS,
    H_RING,
    HEADER,
    RING,
    S_GEN,
    SLOT,
    SLOT_BITS,
    ExporterSlots,
    SlotView,
    binding,
    ring_entry,
)

from .slots_helpers import (
    DIGEST,
    TOKEN,
    _epochs,
    _loader_path,  # noqa: F401  (autouse: each test twice, native and python)
    _table,
    _token,
)

# --------------------------------------------------------- every table word is untrusted input
BAD_COUNTS = [-1, -9, -56, -57, -(2**62), -(2**63), 2**63 - 1]


def _guarded(n: int = 64, guard: int = 4096) -> tuple[np.ndarray, ExporterSlots, SlotView]:
    """A table inside a larger array: ``guard`` words before and after it that nothing may
    write (a write outside the table lands there instead of outside the mapping)."""
    big = np.zeros(guard + HEADER + n * SLOT + guard, dtype=np.int64)
    t = big[guard : guard + HEADER + n * SLOT]
    return big, ExporterSlots(t, "inc"), SlotView(t)


def _outside(big: np.ndarray, guard: int = 4096) -> bool:
    return bool(big[:guard].any() or big[-guard:].any())


@pytest.mark.parametrize("count", BAD_COUNTS)
def test_a_bad_done_count_is_no_ring_entry_never_a_write_outside(count, caplog):
    """A done count a stranger wrote (negative, or at int64's end) is not used as a ring index
    nor incremented past int64: the loader's mark lands in its slot only, nothing is written
    outside the table, nothing raises (the native path wrote before the ring, the Python one
    raised on the count's increment); it is logged once, and the exporter still counts the
    mark (it looks at every live slot when the count is not one it can follow)."""
    big, ex, view = _guarded()
    i = ex.open("a", TOKEN, DIGEST, 100.0, True, False)
    g = int(ex.rows[i, S_GEN])
    ex.t[H_DONE] = count
    with caplog.at_level("WARNING", logger="kvxfer.transports.ipc.slots"):
        view.mark_done(i, g, 0, 1)
        view.mark_done(i, g, 0, 1)
    assert not _outside(big), "a table word was used as an index outside the table"
    assert ex.t[H_DONE] == count and not ex.t[H_RING : H_RING + RING].any()
    assert caplog.text.count("done count") == 1, caplog.text
    assert ex.take_done() == [("a", [(0, 1)])]


def test_a_done_count_reaching_int64s_end_stops_there():
    """A count one below int64's end takes one more ring entry; the next mark leaves it there."""
    big, ex, view = _guarded()
    i = ex.open("a", TOKEN, DIGEST, 100.0, True, False)
    ex.t[H_DONE] = 2**63 - 2
    view.mark_done(i, ex.gens[i], 0, 1)
    assert ex.t[H_DONE] == 2**63 - 1 and ex.t[H_RING + (2**63 - 2) % RING] == ring_entry(2**63 - 2, i)
    view.mark_done(i, ex.gens[i], 1, 2)
    assert ex.t[H_DONE] == 2**63 - 1 and not _outside(big)
    assert ex.take_done() == [("a", [(0, 1), (1, 2)])]


@pytest.mark.parametrize("gen", [2**62, 2**63 - 2, -2, -(2**63)])
def test_a_generation_out_of_range_is_no_slot(gen, caplog):
    """A slot whose generation word a stranger set out of range (a done mark of it would not fit
    int64) is no slot: the read falls back by name, logged once; a mark naming such a
    generation writes nothing and raises nothing."""
    big, ex, view = _guarded()
    epochs, ids = _epochs()
    b = binding(TOKEN, DIGEST, "a")
    now = time.monotonic_ns()
    i = ex.open("a", TOKEN, DIGEST, time.monotonic() + 30, True, False)
    ex.rows[i, S_GEN] = gen
    with caplog.at_level("WARNING", logger="kvxfer.transports.ipc.slots"):
        assert view.read(*b, now, 10**9, now, epochs, ids) == "table word out of range"
        assert view.find(*b) == (-1, 0)
        view.mark_done(i, gen, 0, 1)
        view.mark_done(i, gen, 0, 1)
    assert caplog.text.count("generation out of range") == 1, caplog.text  # logged once per view
    assert not _outside(big) and not ex.rows[i, 8:].any() and ex.t[H_DONE] == 0


def test_a_heartbeat_word_at_int64s_end_is_silence_not_an_overflow():
    _, ex, view = _guarded()
    epochs, ids = _epochs()
    b = binding(TOKEN, DIGEST, "a")
    now = time.monotonic_ns()
    ex.open("a", TOKEN, DIGEST, time.monotonic() + 30, True, False)
    ex.t[3] = -(2**63)  # H_BEAT
    assert view.read(*b, now, 10**9, now, epochs, ids) == "exporter closed or silent"
    assert view.alive(10**9, now)


def test_the_exporter_keeps_its_state_private_and_only_publishes():
    """Generations (seqlock words) a stranger wrote near int64's end, or anywhere, do not reach
    the exporter: it opens, closes and counts marks from its own copy (which it publishes), so
    nothing raises and a loader's snapshot under the generation it found still fails its check
    once the slot closed."""
    ex, view = _table()
    epochs, ids = _epochs()
    b = binding(TOKEN, DIGEST, "a")
    now = time.monotonic_ns()
    i = ex.open("a", TOKEN, DIGEST, time.monotonic() + 30, True, False)
    j, g, snap = view.read(*b, now, 10**9, now, epochs, ids)
    assert j == i
    for k in range(ex.num_slots):
        ex.rows[k, S_GEN] = 2**63 - 1 - k % 2
    ex.close(i)  # raised OverflowError when the exporter read its word back
    assert int(ex.rows[i, S_GEN]) == ex.gens[i] == g + 2
    assert view.check(i, g, epochs, ids, snap, now, 10**9) == 1
    k = ex.open("b", _token(2), DIGEST, time.monotonic() + 30, True, False)
    assert int(ex.rows[k, S_GEN]) == ex.gens[k] and ex.gens[k] % 2 == 0
    ex.rows[k, S_GEN] = 123456  # a stranger's value: marks naming it count nothing
    view.mark_done(k, 123456, 0, 1)
    assert ex.take_done() == []
    view.mark_done(k, ex.gens[k], 0, 1)  # a mark naming the exporter's own generation counts
    assert ex.take_done() == [("b", [(0, 1)])]


def test_done_marks_naming_an_impossible_loader_count_nothing():
    """A mark whose loader tp size is 0, past MAX_TP_SIZE, or not above its rank counts nothing
    (the exporter would plan for that size)."""
    ex, _ = _table()
    i = ex.open("a", TOKEN, DIGEST, 100.0, True, False)
    g = ex.gens[i]
    for d, tp in ((0, 0), (1, 1), (2, 300)):
        ex.rows[i, 8 + d] = g * DONE_TP + tp
    w = int(ex.t[H_DONE])
    ex.t[H_RING + w % RING] = ring_entry(w, i)
    ex.t[H_DONE] = w + 1
    assert ex.take_done() == []


def test_a_ring_entry_naming_a_free_slot_counts_nothing():
    """A ring entry naming a slot that is free (its export closed), with a done mark forged to
    name that slot's generation, or naming no slot at all, counts nothing and raises nothing:
    only a slot the exporter gave an export is looked at; and after the ring overflowed only
    used slots are."""
    ex, _ = _table()
    i = ex.open("a", TOKEN, DIGEST, 100.0, True, False)
    ex.close(i)
    ex.rows[i, 8] = int(ex.gens[i]) * DONE_TP + 1  # names the free slot's current generation
    for entry in (i, -1, ex.num_slots, 2**40, 2**63 - 1, None, (1 << SLOT_BITS) - 1):
        w = int(ex.t[H_DONE])
        if entry is None or entry == (1 << SLOT_BITS) - 1:  # tagged: the free slot, no slot at all
            entry = ring_entry(w, i if entry is None else entry)
        ex.t[H_RING + w % RING] = entry
        ex.t[H_DONE] = w + 1
        assert ex.take_done() == [], entry
    ex.t[H_DONE] = int(ex.t[H_DONE]) + RING + 1  # more than the ring holds: every used slot
    assert ex.take_done() == []
    k = ex.open("b", _token(2), DIGEST, 100.0, True, False)
    ex.rows[k, 8] = int(ex.gens[k]) * DONE_TP + 1
    ex.t[H_DONE] = int(ex.t[H_DONE]) - 5  # moved back: no loader does that, every used slot
    assert ex.take_done() == [("b", [(0, 1)])]


def test_the_exporters_header_words_come_back_with_its_beat():
    """Header words a stranger overwrote (magic, version, slot count, incarnation, open) hold
    until the exporter's next beat only; a shut table stays shut; ``readers``, once a loader
    set it, is the exporter's to remember (a stranger clearing it does not stop the slots)."""
    ex, view = _table()
    words = ex.t[:8].copy()
    ex.t[[0, 1, 2, 4, 5]] = [-1, 2**63 - 1, 0, 0, 17]
    assert not view.of("inc-1") and view.alive(10**9, time.monotonic_ns())
    ex.beat()
    assert (ex.t[[0, 1, 2, 4, 5]] == words[[0, 1, 2, 4, 5]]).all() and view.of("inc-1")
    assert view.alive(10**9, time.monotonic_ns()) == ""
    ex.t[H_READERS] = 0
    assert ex.open("r", TOKEN, DIGEST, 100.0, True, False) >= 0
    ex.shut()
    ex.beat()
    assert ex.t[H_OPEN] == 0 and view.alive(10**9, time.monotonic_ns()) == "the exporting engine closed"
