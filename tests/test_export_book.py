"""The exporter's native records (the control module's ``ExportBook``, ``csrc/ctl/export_book.h``)
against the Python they replace: the same sequence of exports, renewals, done marks and releases
leaves the same lease-slot table (every word), refcounts, epochs, reports and remembered ids on
both; and its calls refuse bad input by name, before anything is written."""

from __future__ import annotations

import numpy as np
import pytest

from kvxfer import exports, idops
from kvxfer.completion import PollResult
from kvxfer.exports import ExportTracker
from kvxfer.transports.ipc.leases import LeaseSlots
from kvxfer.transports.ipc.slots import H_READERS, HEADER, SLOT, ExporterSlots, SlotView, binding

NUM_BLOCKS = 32
TOKEN = "ab" * 24


@pytest.fixture(autouse=True)
def _native():
    assert idops.ensure(), idops.status()


def expected(loader_tp: int, rank: int) -> int | str:
    """Notifications per request from a ``loader_tp``-rank loader: one per rank up to 2 (a
    loader of 3 ranks may not notify at all here: refused by name)."""
    return "refused: no plan" if loader_tp == 3 else min(loader_tp, 2)


class Side:
    """One exporter rank's tracker and lease-slot table, on the native book or on the Python
    listener (``native``)."""

    def __init__(self, native: bool, monkeypatch) -> None:
        with monkeypatch.context() as m:
            if not native:
                m.setattr(exports, "_ctl", lambda: None)
            self.t = ExportTracker(NUM_BLOCKS, 30.0)
        self.table = np.zeros(HEADER + 64 * SLOT, dtype=np.int64)
        self.slots = ExporterSlots(self.table, "inc")
        self.leases = LeaseSlots(self.slots, self.t, lambda rids: [r for r in rids if r.startswith("late")])
        assert self.leases.native is native and (self.t._book is not None) is native
        self.table[H_READERS] = 1
        self.view = SlotView(self.table)
        self.reports: list[tuple[set, set]] = []
        self.tokens: dict[str, str] = {}
        self.before: list[tuple] = []  # the state before each tick

    def export(
        self, rid: str, ids: list[int], n: int, ready: bool = True, layers: int = 0, gen: int = 0
    ) -> None:
        self.tokens[rid] = f"{gen:02d}" * 24
        self.t.add(rid, np.array(ids), n, layers, self.tokens[rid], bytes([len(rid)]) * 16, gen, ready)

    def mark(self, rid: str, rank: int, tp: int) -> None:
        b0, b1 = binding(self.tokens[rid], bytes([len(rid)]) * 16, rid)
        i, g = self.view.find(b0, b1)
        assert i >= 0, rid
        self.view.mark_done(i, g, rank, tp)

    def grant(self, rids: list[str], token: str | None = None) -> list:
        """A grant as the exporter's handler makes it: the book's one call, else the tracker's
        Python (the listener's side always); each id's epochs, or None where refused."""
        toks = [token or self.tokens[r] for r in rids]
        dgs = [bytes([len(r)]) * 16 for r in rids]
        got = self.t.grant_verified(rids, toks, dgs)
        if got is not None:
            return got
        ok, _, _ = self.t.grant(rids, toks, lambda *a: False, dgs)
        return [ok.get(r) for r in rids]

    def notify(self, rids: list[str], rank: int, tp: int) -> int:
        """A notification as the exporter's handler counts it (:meth:`grant`'s two paths)."""
        toks = [self.tokens[r] for r in rids]
        got = self.t.notify_verified(rids, toks, rank, tp, expected)
        if got is not None:
            return got
        return self.t.notify_many(rids, rank, lambda: expected(tp, rank), toks, lambda *a: False, {})

    def tick(self) -> int:
        """The side channel's tick and a poll's drain; what it reports, and the whole state
        before it (so a word written wrong and later cleared still shows), kept."""
        self.before.append(self.state())
        got = self.leases.tick(True, expected)
        out = PollResult()
        self.t.drain(out)
        self.reports.append((set(out.finished_sending), set(out.expired)))
        return got

    def state(self) -> tuple:
        """Everything the two keepers must agree on (the heartbeat word aside)."""
        words = self.table.copy()
        words[3] = 0  # H_BEAT: a clock
        live = {
            rid: (e.block_ids.tolist(), e.num_tokens, e.token, e.digest, e.gen)
            for rid, e in self.t._live.items()
        }
        return (
            words.tolist(),
            self.slots.gens.tolist(),
            bytes(self.slots.used),
            dict(self.slots.owner),
            dict(self.leases._unready),
            self.t.refcount.tolist(),
            self.t.epochs.tolist(),
            live,
            dict(self.t._gone),
            list(self.reports),
            self.t.finished_exports,
        )


def script(s: Side) -> None:
    """Exports (one layer-wise, one whose compute is not done, blocks shared), renewals, marks of
    lone, counted, repeated and refused loader ranks, an abort, a release of ids not live."""
    s.export("a", [1, 2, 3], 40)
    s.export("bb", [3, 4], 20)
    s.export("late", [5, 6], 30, ready=False)
    s.export("lw", [7], 10, layers=4)
    s.t.grant(["a", "late"])  # renewals
    s.t.heartbeat(["bb", "zzz"])
    s.mark("a", 0, 1)  # a lone loader rank: released
    assert s.tick() == 1
    s.mark("bb", 0, 2)  # one of two
    s.mark("bb", 0, 2)  # repeated: counts once
    assert s.tick() == 0
    s.mark("late", 1, 3)  # a rank that may not notify here
    assert s.tick() == 0
    s.mark("bb", 1, 2)  # the second: released
    assert s.tick() == 1
    assert s.t.abort("lw")
    with s.t.lock:
        s.t._release_many(["late", "late", "nope"])
    s.export("a", [9, 10], 20, gen=1)  # a released id again: the next generation's slot
    s.tick()
    s.export("gr", [11, 12], 20)
    assert all(s.grant(["gr", "a"]))  # both slots' deadlines renewed
    assert s.grant(["gr"], token="zz" * 24) == [None]  # refused: nothing renewed
    s.tick()
    assert s.notify(["gr", "gr"], 0, 2) == 0  # one of two, counted once
    assert s.notify(["gr"], 1, 3) == 0  # a rank that may not notify here
    assert s.notify(["gr"], 1, 2) == 1  # the second: released
    s.tick()


class Clock:
    """``exports``' clock: the same deadlines on both sides."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        self.now += 0.5
        return self.now


def run(native: bool, monkeypatch) -> Side:
    """:func:`script` on one side, on a clock of its own that starts where the other's did."""
    monkeypatch.setattr(exports, "time", Clock())
    s = Side(native, monkeypatch)
    script(s)
    return s


def test_the_book_and_the_listener_leave_the_same_table_counts_and_reports(monkeypatch):
    native, python = run(True, monkeypatch), run(False, monkeypatch)
    assert len(native.before) == 7 and native.before == python.before
    assert native.state() == python.state()
    assert native.reports[0] == ({"a"}, set()) and native.t.held_blocks() == 2


def test_a_mutated_native_close_is_caught_by_the_comparison(monkeypatch):
    """The comparison above fails on one wrong word: here the book's release leaves one slot's
    generation a step behind (what a close that skipped its second write would leave)."""
    native, python = run(True, monkeypatch), run(False, monkeypatch)
    native.slots.gens[int(np.flatnonzero(native.slots.gens)[0])] -= 1
    assert native.state() != python.state()


def test_a_full_table_leaves_the_export_without_a_slot_logged_once(monkeypatch, caplog):
    s = Side(True, monkeypatch)
    s.slots.used[:] = b"\x01" * len(s.slots.used)  # every slot taken
    with caplog.at_level("WARNING", logger="kvxfer.transports.ipc.slots"):
        s.export("a", [1], 10)
        s.export("b", [2], 10)
    assert s.t.lookup("a").slot == -1 and caplog.text.count("all taken") == 1
    assert s.t.held_blocks() == 2


# ------------------------------------------------------------------------ refusals, by name
def book():
    """A native book of 8 blocks (remembering 4 released ids, forgotten 2 at a time), its
    refcounts and epochs."""
    rc = np.zeros(8, dtype=np.int32)
    ep = np.zeros(8, dtype=np.int64)
    return idops.native().ExportBook(rc, ep, 4, 2), rc, ep


def add(b, rid="a", ids=(1, 2), token=TOKEN, digest=bytes(16), ready=True):
    return b.add(rid, np.array(ids, dtype=np.int64), 20, 1.0, token, digest, 0, None, None, ready)


@pytest.mark.parametrize(
    "args, err, words",
    [
        ({"ids": (1, 8)}, IndexError, "block id 8"),
        ({"ids": (-1,)}, IndexError, "block id -1"),
        ({"token": b"x"}, TypeError, "token must be str"),
        ({"digest": "x"}, TypeError, "digest bytes"),
    ],
)
def test_add_refuses_bad_input_before_writing(args, err, words):
    b, rc, _ = book()
    with pytest.raises(err, match=words):
        add(b, **args)
    assert not b.live and not rc.any()


def test_add_refuses_ids_of_another_width_a_live_id_and_a_token_used_before():
    b, rc, ep = book()
    with pytest.raises(TypeError, match="8-byte ints"):
        b.add("a", np.array([1], dtype=np.int32), 20, 1.0, TOKEN, bytes(16), 0, None, None, True)
    add(b)
    with pytest.raises(ValueError, match="already exported"):
        add(b)
    assert b.release_many(["a"]) == ["a"] and rc.tolist() == [0] * 8 and ep.tolist()[1:3] == [1, 1]
    with pytest.raises(ValueError, match="already used by an earlier export"):
        add(b)
    assert not b.live and not rc.any()


def test_gone_keeps_the_newest_releases_only():
    b = book()[0]
    sizes = []
    for k in range(7):
        add(b, rid=f"r{k}", ids=(k,), token=f"{k:02d}" * 24)
        b.release_many([f"r{k}"])
        sizes.append(len(b.gone))
    assert sizes == [1, 2, 3, 4, 5, 6, 4] and list(b.gone) == ["r3", "r4", "r5", "r6"]


def test_take_marks_and_renew_refuse_by_name_and_records_are_not_made_from_python():
    b = book()[0]
    mod = idops.native()
    with pytest.raises(TypeError, match="callable"):
        b.take_marks(None)
    assert b.take_marks(expected) == []  # no table followed: nothing to take
    with pytest.raises(TypeError, match="ExportRecord"):
        b.renew(object(), 2.0)
    with pytest.raises(TypeError):
        mod.ExportRecord()
    r = add(b)
    assert b.renew(r, 2.0) and not b.renew(r, 1.5) and r.deadline == 2.0


def test_attach_refuses_a_table_of_other_sizes_and_a_second_table():
    b = book()[0]
    table = np.zeros(HEADER + 64 * SLOT, dtype=np.int64)
    with pytest.raises(ValueError, match="gens holds"):
        b.attach(table, np.zeros(3, dtype=np.int64), bytearray(64), {}, {}, None)
    b.attach(table, np.zeros(64, dtype=np.int64), bytearray(64), {}, {}, None)
    with pytest.raises(ValueError, match="already followed"):
        b.attach(table, np.zeros(64, dtype=np.int64), bytearray(64), {}, {}, None)


@pytest.mark.parametrize("answer", [RuntimeError("plan failed"), 2.5, -1])
def test_an_expected_that_raises_or_answers_nonsense_releases_nothing(monkeypatch, answer):
    s = Side(True, monkeypatch)
    s.export("a", [1, 2], 20)
    s.mark("a", 0, 1)

    def bad(tp: int, rank: int):
        if isinstance(answer, Exception):
            raise answer
        return answer

    with pytest.raises((RuntimeError, TypeError, ValueError)):
        s.t.take_marks(bad)
    assert s.t.num_live() == 1 and s.t.held_blocks() == 2


def test_an_expected_that_releases_the_export_it_is_asked_about_does_not_crash(monkeypatch):
    """The records the count reads are held while ``expected`` runs: one that releases the
    export (any Python can) leaves nothing freed under the count."""
    s = Side(True, monkeypatch)
    s.export("a", [1, 2], 20)
    s.mark("a", 0, 2)

    def releasing(tp: int, rank: int) -> int:
        s.t.abort("a")
        return 2

    assert s.t.take_marks(releasing) == 0
    assert s.t.num_live() == 0 and s.t.held_blocks() == 0


def test_a_record_whose_counts_were_replaced_is_refused_not_read(monkeypatch):
    s = Side(True, monkeypatch)
    s.export("a", [1, 2], 20)
    s.t.lookup("a").notified_by = [1, 2]
    s.mark("a", 0, 2)
    with pytest.raises(TypeError, match="notified_by"):
        s.t.take_marks(expected)
    assert s.t.num_live() == 1


def test_a_records_ids_token_and_generation_cannot_be_replaced():
    """What a release reads back (the ids it releases, the token and generation it remembers)
    cannot be deleted or replaced from Python: a deleted ``block_ids`` crashed the release, a
    replaced one released other blocks."""
    b, rc, _ = book()
    r = add(b)
    for name in ("block_ids", "token", "digest", "gen", "num_tokens", "groups", "slot"):
        with pytest.raises(AttributeError):
            setattr(r, name, None)
        with pytest.raises((AttributeError, TypeError)):
            delattr(r, name)
    r.deadline, r.marked, r.gates = 3.0, None, []  # what the tracker's Python writes
    assert b.release_many(["a"]) == ["a"] and not rc.any()


@pytest.mark.parametrize("lease_s", [float("inf"), float("nan"), 1e10, 0.0, -1.0])
def test_a_lease_no_table_can_hold_is_refused_at_construction(lease_s):
    with pytest.raises(ValueError, match="lease_s"):
        ExportTracker(NUM_BLOCKS, lease_s)


def test_a_deadline_past_int64_nanoseconds_is_published_clamped(monkeypatch):
    """A deadline beyond int64 nanoseconds (a clock read in the far future) is written as the
    largest one, not as what an undefined cast makes of it (INT64_MIN on x86: every loader
    refused the slot as expiring)."""
    s = Side(True, monkeypatch)
    s.export("a", [1], 10)
    e = s.t.lookup("a")
    assert s.t._book.renew(e, 1e12)  # 1e21 ns
    assert s.table[HEADER + e.slot * SLOT + 3] == 2**63 - 1
