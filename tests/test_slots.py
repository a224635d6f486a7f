"""The lease-slot table (kvxfer.transports.ipc.slots) on its own: the exporter's writes against a
loader's view of the same memory: bindings, finding a live ready slot and nothing else, done
marks and the ring, reads that snapshot epochs and checks that see every change. Every test
runs twice: the loader's reads, checks and marks as native calls (csrc/ctl/lease_slots.h) and as
the same steps in Python. The native calls themselves: ``tests/test_slots_native.py``; table
words a stranger wrote: ``tests/test_slots_untrusted.py``."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvxfer import idops
from kvxfer.transports.ipc import slots
from kvxfer.transports.ipc.slots import (
    DONE_TP,
    H_DONE,
    H_OPEN,
    H_READERS,
    H_RING,
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
    ring_entry,
)

from .slots_helpers import (
    DIGEST,
    FAR,
    TOKEN,
    _epochs,
    _loader_path,  # noqa: F401  (autouse: each test twice, native and python)
    _table,
    _token,
)


def test_binding_tells_exports_contents_and_request_ids_apart():
    b = binding(TOKEN, DIGEST, "r")
    assert binding(TOKEN, DIGEST, "r") == b
    assert binding(_token(1), DIGEST, "r") != b  # another export's token
    assert binding(TOKEN, bytes([1]) + DIGEST[1:], "r") != b  # other ids or token count
    assert binding(TOKEN, DIGEST, "r2") != b  # another request id
    assert all(0 <= w < 1 << 63 for w in b)
    with pytest.raises(ValueError):
        binding("\u00e9" * 48, DIGEST, "r")  # not a token export() made (not ASCII)


def test_native_and_python_bindings_are_blake2b_of_the_same_bytes():
    """The native binding (csrc/ctl/lease_slots.h, with its own BLAKE2b: csrc/ctl/blake2b.h) and
    hashlib's give the same words for every input length (one block and several, an empty
    request id, non-ASCII ones); both refuse a token that is not ASCII and a request id without
    UTF-8 (ValueError)."""
    import hashlib
    import random

    assert idops.ensure(), idops.status()
    native = idops.native().binding
    rng = random.Random(3)
    rids = ["", "r", "cmpl-0", "é" * 40, "请求-" * 30, "x" * 63, "x" * 64, "x" * 65, "y" * 400]
    rids += [
        "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randrange(0, 300))) for _ in range(200)
    ]
    for k, rid in enumerate(rids):
        token = f"{rng.getrandbits(192):048x}"
        digest = rng.randbytes(16)
        h = hashlib.blake2b(digest + token.encode() + rid.encode(), digest_size=16).digest()
        x = int.from_bytes(h, "little")
        want = (x >> 64 & (2**63 - 1), x & (2**63 - 1))
        assert native(token, digest, rid) == slots._py_binding(token, digest, rid) == want, (k, rid)
    for bad in (("é" * 48, DIGEST, "r"), (TOKEN, DIGEST, "\ud800")):
        for f in (native, slots._py_binding):
            with pytest.raises(ValueError):
                f(*bad)


def test_a_binding_cannot_be_reached_from_other_params():
    """The binding is a hash of the token, the digest and the request id together, not a
    combination of them one can solve for: the token that bound the old XOR (token MAC XOR
    digest) of another export's slot to altered ids finds nothing now."""
    dg_x = bytes(range(16, 32))
    mac = int(TOKEN[-32:], 16) ^ int.from_bytes(DIGEST, "little") ^ int.from_bytes(dg_x, "little")
    forged = TOKEN[:16] + f"{mac:032x}"
    assert binding(forged, dg_x, "r") != binding(TOKEN, DIGEST, "r")


def test_no_slot_until_a_loader_reads_one_sided():
    t = np.zeros(HEADER + 64 * SLOT, dtype=np.int64)
    ex = ExporterSlots(t, "inc")
    assert ex.open("r", TOKEN, DIGEST, 100.0, True, False) == -1
    SlotView(t)  # a loader maps it to read one-sided
    assert t[H_READERS] == 1
    assert ex.open("r", TOKEN, DIGEST, 100.0, True, False) >= 0


def test_a_loader_finds_a_live_ready_slot_and_nothing_else():
    ex, view = _table()
    b = binding(TOKEN, DIGEST, "r")
    now = time.monotonic_ns()
    assert view.lookup(*b, now, 10**9, now) == (-1, 0, "no live slot")
    i = ex.open("r", TOKEN, DIGEST, time.monotonic() + 30, False, False)
    assert view.lookup(*b, now, 10**9, now)[2] == "not ready"
    ex.set_ready(i)
    j, g, why = view.lookup(*b, now, 10**9, now)
    assert (j, why) == (i, "") and g % 2 == 0 and g > 0
    assert view.lookup(*b, now, 10**9, FAR)[2] == "lease too short"
    assert view.lookup(*binding(_token(9), DIGEST, "r"), now, 10**9, now)[2] == "no live slot"
    ex.close(i)
    assert view.lookup(*b, now, 10**9, now)[2] == "no live slot"
    assert not view.same(i, g)  # the generation moved on close


def test_a_slot_being_rewritten_is_not_read():
    ex, view = _table()
    b = binding(TOKEN, DIGEST, "r")
    i = ex.open("r", TOKEN, DIGEST, time.monotonic() + 30, True, False)
    ex.rows[i, S_GEN] += 1  # odd: the exporter is in the middle of a rewrite
    assert view.find(*b) == (-1, 0)
    ex.rows[i, S_GEN] += 1
    assert view.find(*b)[0] == i


def test_layerwise_closed_and_silent_exporters_are_refused():
    ex, view = _table()
    b = binding(TOKEN, DIGEST, "r")
    now = time.monotonic_ns()
    ex.open("r", TOKEN, DIGEST, time.monotonic() + 30, True, True)
    assert view.lookup(*b, now, 10**9, now)[2] == "layer-wise export"
    assert view.lookup(*b, now + 5 * 10**9, 10**9, now)[2] == "exporter closed or silent"
    ex.shut()
    assert view.t[H_OPEN] == 0 and view.lookup(*b, now, 10**9, now)[2] == "exporter closed or silent"
    assert view.alive(10**9, now) == "the exporting engine closed"


def test_incarnation_names_the_exporters_start():
    _, view = _table(incarnation="start-1")
    assert view.of("start-1") and not view.of("start-2")


def test_full_probe_window_gives_no_slot():
    ex, _ = _table(n=PROBES)
    got = [ex.open(f"r{k}", _token(k), DIGEST, 100.0, True, False) for k in range(PROBES + 1)]
    assert sorted(got[:PROBES]) == list(range(PROBES)) and got[PROBES] == -1


def test_done_marks_count_once_for_the_current_export_only():
    ex, view = _table()
    i = ex.open("a", TOKEN, DIGEST, 100.0, True, False)
    _, g, _ = view.lookup(*binding(TOKEN, DIGEST, "a"), time.monotonic_ns(), 10**9, 0)
    assert not ex.marked() and ex.take_done() == []
    view.mark_done(i, g, 1, 2)
    assert ex.marked()
    assert ex.take_done() == [("a", [(1, 2)])]
    assert ex.take_done() == []  # taken
    # a mark of the slot's previous export (an older generation) counts nothing
    ex.close(i)
    k = ex.open("a", TOKEN, DIGEST, 100.0, True, False)  # a later export of "a" (same binding here)
    assert k == i
    view.mark_done(i, g, 0, 2)
    assert ex.take_done() == []
    # a forged generation or a slot out of range named in the ring counts nothing
    ex.rows[i, 8] = (g + 100) * DONE_TP + 2
    for entry in (ring_entry(int(ex.t[H_DONE]), i), ring_entry(int(ex.t[H_DONE]), (1 << SLOT_BITS) - 1)):
        w = int(ex.t[H_DONE])
        ex.t[H_RING + w % RING] = entry
        ex.t[H_DONE] = w + 1
        assert ex.take_done() == []


def test_ring_overflow_looks_at_every_live_slot():
    ex, view = _table(n=1024)
    marked = {}
    for k in range(RING + 5):
        i = ex.open(f"r{k}", _token(k), DIGEST, 100.0, True, False)
        assert i >= 0
        g = int(ex.rows[i, S_GEN])
        view.mark_done(i, g, 0, 1)
        marked[f"r{k}"] = [(0, 1)]
    got = dict(ex.take_done())
    assert got == marked


def test_loader_ranks_past_the_marks_notify_only():
    ex, view = _table()
    i = ex.open("a", TOKEN, DIGEST, 100.0, True, False)
    g = int(ex.rows[i, S_GEN])
    assert not view.mark_done(i, g, MAX_DONE, MAX_DONE + 1)  # not marked: the loader notifies
    assert not ex.marked() and ex.take_done() == []


def test_only_a_native_mark_is_the_whole_record(path):
    """``mark_done`` says True (no notification needed) only for a mark whose ring entry the
    native compare-and-swap took: the Python stores can collide with another loader's."""
    ex, view = _table()
    i = ex.open("a", TOKEN, DIGEST, 100.0, True, False)
    assert view.mark_done(i, int(ex.rows[i, S_GEN]), 0, 1) is (path == "native")
    assert ex.t[H_RING] == ring_entry(0, i) and ex.t[H_DONE] == 1
    assert ex.take_done() == [("a", [(0, 1)])]


def test_a_ring_entry_taken_but_not_written_yet_is_not_lost():
    """A loader that has written its mark and taken the ring's count but not stored the entry
    yet (the exporter reads in between): the entry's tag is not its count, so the exporter looks
    at every used slot and counts that mark, and the slots the ring did name."""
    ex, view = _table()
    a = ex.open("a", TOKEN, DIGEST, 100.0, True, False)
    b = ex.open("b", _token(1), DIGEST, 100.0, True, False)
    view.mark_done(a, int(ex.rows[a, S_GEN]), 0, 1)  # entry 0, written
    ex.rows[b, 8] = int(ex.rows[b, S_GEN]) * DONE_TP + 1  # b's mark, then its count taken
    ex.t[H_DONE] = 2  # entry 1 still zero
    assert dict(ex.take_done()) == {"a": [(0, 1)], "b": [(0, 1)]}
    ex.close(a)
    a = ex.open("a2", _token(2), DIGEST, 100.0, True, False)
    view.mark_done(a, int(ex.rows[a, S_GEN]), 0, 1)  # entry 2 written; then entry 3 of a lap ago
    ex.t[H_RING + 3 % RING] = ring_entry(3 - RING, b)
    ex.t[H_DONE] = 4
    assert dict(ex.take_done()) == {"a2": [(0, 1)], "b": [(0, 1)]}


def test_a_view_refuses_what_is_not_a_table():
    with pytest.raises(ValueError, match="not a lease-slot table"):
        SlotView(np.zeros(HEADER + 16 * SLOT, dtype=np.int64))


def test_the_path_in_use_is_the_one_named(path):
    _, view = _table()
    assert (view.ctl is not None) == (path == "native")


def test_read_snapshots_the_epochs_of_a_live_slot_and_check_sees_every_change():
    ex, view = _table()
    epochs, ids = _epochs()
    b = binding(TOKEN, DIGEST, "r")
    now = time.monotonic_ns()
    assert view.read(*b, now, 10**9, now, epochs, ids) == "no live slot"
    i = ex.open("r", TOKEN, DIGEST, time.monotonic() + 30, False, False)
    assert view.read(*b, now, 10**9, now, epochs, ids) == "not ready"
    ex.set_ready(i)
    assert view.read(*b, now, 10**9, FAR, epochs, ids) == "lease too short"
    j, g, snap = view.read(*b, now, 10**9, now, epochs, ids)
    assert j == i and g == ex.rows[i, S_GEN] and bytes(snap) == epochs[ids].tobytes()
    assert view.check(i, g, epochs, ids, snap, now, 10**9) == 0
    epochs[39] += 1  # one block released meanwhile
    assert view.check(i, g, epochs, ids, snap, now, 10**9) == 1
    epochs[39] -= 1
    assert view.check(i, g, epochs, ids[:-1], snap, now, 10**9) == 1  # a snapshot of other ids
    assert view.check(i, g, epochs, ids, snap, now + 5 * 10**9, 10**9) == 2  # silent since
    ex.close(i)
    assert view.check(i, g, epochs, ids, snap, now, 10**9) == 1  # the slot moved on
    k = ex.open("r", TOKEN, DIGEST, time.monotonic() + 30, True, False)
    assert k == i and view.check(i, g, epochs, ids, snap, now, 10**9) == 1  # reused: a newer generation


def test_read_refuses_rewritten_layerwise_closed_and_silent():
    ex, view = _table()
    epochs, ids = _epochs()
    b = binding(TOKEN, DIGEST, "r")
    now = time.monotonic_ns()
    i = ex.open("r", TOKEN, DIGEST, time.monotonic() + 30, True, False)
    ex.rows[i, S_GEN] += 1  # odd: mid-rewrite
    assert view.read(*b, now, 10**9, now, epochs, ids) == "no live slot"
    ex.rows[i, S_GEN] += 1
    assert view.read(*b, now, 10**9, now, epochs, ids)[0] == i
    assert view.read(*binding(_token(3), DIGEST, "r"), now, 10**9, now, epochs, ids) == "no live slot"
    assert view.read(*b, now + 5 * 10**9, 10**9, now, epochs, ids) == "exporter closed or silent"
    ex.close(i)
    ex.open("r", TOKEN, DIGEST, time.monotonic() + 30, True, True)
    assert view.read(*b, now, 10**9, now, epochs, ids) == "layer-wise export"
    ex.shut()
    assert view.read(*b, now, 10**9, now, epochs, ids) == "exporter closed or silent"
