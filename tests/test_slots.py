"""The lease-slot table (kvxfer.transports.ipc.slots) on its own: the exporter's writes against a
loader's view of the same memory, and every mark or entry that must count nothing. Every test
runs twice: the loader's reads, checks and marks as native calls (csrc/ctl/lease_slots.h) and as
the same steps in Python."""

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

TOKEN = "0011223344556677" + "8899aabbccddeeff0123456789abcdef"
DIGEST = bytes(range(16))
FAR = 10**18  # a lease end no check reaches
_NATIVE = slots._native  # before the fixture replaces it (the Python runs)


@pytest.fixture(autouse=True, params=["native", "python"])
def path(request, monkeypatch):
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


def _epochs(num_blocks: int = 40) -> tuple[np.ndarray, np.ndarray]:
    """Epochs that name their block (a snapshot of the wrong blocks cannot pass), and ids."""
    return np.arange(num_blocks, dtype=np.int64) * 1000 + 7, np.array([5, 3, 39, 0, 17], dtype=np.int64)


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
