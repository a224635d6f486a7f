"""One-sided ipc reads: how the exporter frees a landed load: its done marks (native or Python)
and the loader's deferred notification (``MARK_GRACE_S`` later, few messages for a steady
stream, freeing also a mark the exporter never counts), either record alone; a loader that
never completes freed at the lease's end; and which leases are read one-sided."""

from __future__ import annotations

import time

import pytest

from kvxfer import TransferEngine, idops
from kvxfer.exports import ExportTracker
from kvxfer.transports.ipc import onesided as onesided_mod
from kvxfer.transports.ipc import slots as slots_mod
from kvxfer.transports.ipc.onesided import LEASE_LEFT_S

from .engine_payload import check
from .onesided_helpers import F16, Ranks, answer_landings, poll_until, python_slot_reads, warm, warmed


def _record_notifications(monkeypatch, engine: TransferEngine) -> list:
    """The notifications ``engine``'s loader sends from now on, as (when, done request ids,
    failed request ids), each still sent."""
    sent: list = []
    real = engine._loader._send_notify  # every notification message goes through it

    def send_notify(peer, rids, bad, toks):
        sent.append((time.monotonic(), list(rids), list(bad)))
        real(peer, rids, bad, toks)

    monkeypatch.setattr(engine._loader, "_send_notify", send_notify)
    return sent


@pytest.mark.parametrize("marks", ["native", "python"])
def test_a_landed_loads_marks_free_it_and_its_notification_is_deferred(marks, monkeypatch):
    """With the native module a landed one-sided load's done marks free it, and its notification
    goes ``MARK_GRACE_S`` later, one message for every load of the window. With the Python
    fallback (whose ring stores two loaders can collide on) each is notified at once."""
    if marks == "native":
        assert idops.ensure(), idops.status()
    else:
        monkeypatch.setattr(slots_mod, "_native", lambda: None)
    with warmed() as (p, d):
        sent = _record_notifications(monkeypatch, d[0])
        landed = {}
        for k in range(3):
            prm = p.export(f"a{k}", [3 + 2 * k, 4 + 2 * k], 12, seed=3 + k)
            landed[f"a{k}"] = time.monotonic()  # before the load: it lands, and is marked, after
            d[0].load(f"a{k}", prm, [20 + 2 * k, 21 + 2 * k])
            assert poll_until(d.engines, {f"a{k}"}, "recv") == {f"a{k}": "done"}
            assert poll_until(p.engines, {f"a{k}"}, "send") == {f"a{k}": "done"}
            assert check(d.caches(0), F16, 0, 1, [20 + 2 * k, 21 + 2 * k], 12, 3 + k)
        if marks == "native":
            assert not sent, "notified before the grace: the marks freed the blocks"
        end = time.monotonic() + 5.0
        while sum(len(x[1]) for x in sent) < 3 and time.monotonic() < end:
            d[0].poll()
            time.sleep(0.01)
        got = {rid: t for t, done, _ in sent for rid in done}
        assert sorted(got) == ["a0", "a1", "a2"] and not [x for x in sent if x[2]], sent
        st = d[0].stats()["onesided"]
        assert st["loads"] == 3, st
        if marks == "native":
            assert st["deferred"] == 3 and len(sent) <= 3, (st, sent)
            assert all(got[r] - landed[r] >= onesided_mod.MARK_GRACE_S for r in got), (got, landed)
        else:
            assert st["deferred"] == 0 and len(sent) == 3, (st, sent)
        assert p[0].stats()["blocks_held"] == 0


def test_a_steady_stream_of_marked_loads_is_notified_in_few_messages(monkeypatch):
    """Loads landing one after another for several grace periods: their deferred notifications
    go in at most one message per ``MARK_GRACE_S`` (not one per load as each one's grace ends),
    each at least the grace after its load landed."""
    assert idops.ensure(), idops.status()
    grace = onesided_mod.MARK_GRACE_S
    with warmed() as (p, d):
        sent = _record_notifications(monkeypatch, d[0])
        landed = {}
        t0 = time.monotonic()
        k = 0
        while time.monotonic() - t0 < 4 * grace:
            rid = f"s{k}"
            prm = p.export(rid, [3, 4], 12, seed=3 + k % 50)
            landed[rid] = time.monotonic()
            d[0].load(rid, prm, [20, 21])
            assert poll_until(d.engines, {rid}, "recv") == {rid: "done"}
            assert poll_until(p.engines, {rid}, "send") == {rid: "done"}
            k += 1
            time.sleep(0.002)
        end = time.monotonic() + 5.0
        while sum(len(x[1]) for x in sent) < k and time.monotonic() < end:
            d[0].poll()
            time.sleep(0.005)
        elapsed = time.monotonic() - t0
        got = {rid: t for t, done, _ in sent for rid in done}
        assert sorted(got) == sorted(landed) and not [x for x in sent if x[2]], (len(got), k)
        assert k >= 20, f"only {k} loads in {4 * grace:.2f} s: too few to tell one message per load"
        assert len(sent) <= elapsed / grace + 1, (len(sent), k, elapsed)
        assert all(got[r] - landed[r] >= grace for r in got)
        assert d[0].stats()["onesided"]["deferred"] == k


def test_a_mark_the_exporter_never_counts_is_freed_by_the_deferred_notification(monkeypatch):
    """A landed load's done mark that the exporter does not count (here P reads no marks at all:
    as if a stranger had overwritten them in the table) holds the blocks only until the
    deferred notification arrives, ``MARK_GRACE_S`` after the mark; close() sends the
    notifications still in their grace."""
    assert idops.ensure(), idops.status()
    monkeypatch.setattr(slots_mod.ExporterSlots, "marked", lambda self: False)  # the listener's reads
    monkeypatch.setattr(ExportTracker, "take_marks", lambda self, expected: 0)  # the native book's
    with warmed() as (p, d):
        prm = p.export("a", [3, 4], 12, seed=3)
        d[0].load("a", prm, [5, 6])
        t0 = time.monotonic()
        assert poll_until(d.engines, {"a"}, "recv") == {"a": "done"}
        assert poll_until(p.engines, {"a"}, "send", timeout=0.05) == {}  # the mark is not counted
        freed, end = set(), time.monotonic() + 5.0
        while "a" not in freed and time.monotonic() < end:  # D's polls notify once the grace ended
            d[0].poll()
            freed |= p[0].poll().finished_sending
            time.sleep(0.005)
        assert freed == {"a"}
        assert time.monotonic() - t0 >= onesided_mod.MARK_GRACE_S
        assert d[0].stats()["onesided"]["deferred"] == 1
        assert p[0].stats()["blocks_held"] == 0
        # in its grace when D closes: notified by close()
        prm = p.export("b", [7, 8], 12, seed=4)
        d[0].load("b", prm, [9, 10])
        assert poll_until(d.engines, {"b"}, "recv") == {"b": "done"}
        d[0].close()
        assert d[0].stats()["onesided"]["deferred"] == 2
        assert poll_until(p.engines, {"b"}, "send") == {"b": "done"}


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_done_mark_frees_without_the_notification_and_the_notification_without_the_mark(monkeypatch, native):
    """P frees from the done mark alone (the notification lost), and from the notification alone
    (the mark not written): either record is enough, and neither frees twice."""
    with warmed() as (p, d):
        d[0]._hooks["notify"] = lambda addr, msg: None  # notifications dropped
        prm = p.export("a", [3, 4], 12, seed=3)
        d[0].load("a", prm, [5, 6])
        assert poll_until(d.engines, {"a"}, "recv") == {"a": "done"}
        assert poll_until(p.engines, {"a"}, "send") == {"a": "done"}
        del d[0]._hooks["notify"]
        if native:
            answer_landings(d, 3)  # the one native call: landed, a rank not marked
        else:
            python_slot_reads(d)
            monkeypatch.setattr(slots_mod.SlotView, "mark_done", lambda *a: None)
        prm = p.export("b", [7, 8], 12, seed=4)
        d[0].load("b", prm, [9, 10])
        assert poll_until(d.engines, {"b"}, "recv") == {"b": "done"}
        assert poll_until(p.engines, {"b"}, "send") == {"b": "done"}
        assert d.onesided() == [2]


def test_loader_that_never_completes_is_freed_at_lease_end():
    """D launches a one-sided copy and stops (never polls again: no mark, no notification): P
    frees the blocks when the lease ends."""
    p, d = Ranks(F16, 1, "P", lease_s=1.0), Ranks(F16, 1, "D", timeout_s=0.3)
    try:
        warm(p, d)
        prm = p.export("a", [3, 4], 12, seed=3)
        d[0].load("a", prm, [5, 6])
        assert d.onesided() == [1]
        t0 = time.monotonic()
        assert poll_until(p.engines, {"a"}, "send", timeout=5.0) == {"a": "expired"}
        assert 0.5 < time.monotonic() - t0 < 3.0
    finally:
        p.close()
        d.close()


def test_short_lease_takes_the_messaged_path():
    """A lease shorter than the load's timeout is not read one-sided (the grant renews it)."""
    p, d = Ranks(F16, 1, "P", lease_s=1.0), Ranks(F16, 1, "D", timeout_s=2.0)
    try:
        warm(p, d)
        prm = p.export("a", [3, 4], 12, seed=3)
        d[0].load("a", prm, [5, 6])
        assert d[0].stats()["onesided"]["fallbacks"]["lease too short"] == 1
        assert poll_until(d.engines, {"a"}, "recv") == {"a": "done"}
        assert check(d.caches(0), F16, 0, 1, [5, 6], 12, 3)
    finally:
        p.close()
        d.close()


def test_lease_as_long_as_the_timeout_is_read_onesided():
    """The connector's defaults (lease 30 s, timeout 30 s): an export loaded a moment after it
    was made has a little less than the timeout left, and is still read one-sided (the read
    needs ``min(timeout, LEASE_LEFT_S)``: a copy takes milliseconds)."""
    assert LEASE_LEFT_S < 8.0
    p, d = Ranks(F16, 1, "P", lease_s=8.0), Ranks(F16, 1, "D", timeout_s=8.0)
    try:
        warm(p, d)
        prm = p.export("a", [3, 4], 12, seed=3)
        time.sleep(0.05)  # the router's hop: the lease has less than the timeout left
        d[0].load("a", prm, [5, 6])
        assert d.onesided() == [1], d[0].stats()["onesided"]
        assert poll_until(d.engines, {"a"}, "recv") == {"a": "done"}
        assert check(d.caches(0), F16, 0, 1, [5, 6], 12, 3)
    finally:
        p.close()
        d.close()
