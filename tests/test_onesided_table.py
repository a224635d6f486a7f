"""One-sided ipc reads against words a stranger wrote in the exporter's lease-slot table (any
process of the same user can map and write it): out-of-range done counts and generations never
crash D nor leak P's blocks; poll() reads the table only while an export is live; an exporter
seen stopped after the copy fails the load naming what the check saw."""

from __future__ import annotations

import pytest

from kvxfer.transports.ipc import slots as slots_mod

from .engine_payload import check
from .onesided_helpers import F16, Ranks, answer_landings, poll_until, python_slot_reads, warmed


# ------------------------------------------------------------- words a stranger wrote in the table
def table_of(p: Ranks, r: int = 0):
    """Exporter rank ``r``'s lease-slot table as it maps it: the memory any process of the same
    user can map (``/dev/shm/kvx_ls_*``) and write."""
    return p[r]._transports["ipc"].slots.t


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_table_words_a_stranger_wrote_never_crash_d_nor_leak_p(native):
    """Done counts a stranger wrote into P's table (negative: D's native mark wrote outside the
    mapping, SIGSEGV; at int64's end: D's Python mark raised out of poll()) and generations
    near 2**63 in every slot (P read them back, raised on release and leaked the blocks): D's
    loads land exactly and its poll() raises nothing; P releases and reports every export once
    and holds no block after."""
    with warmed() as (p, d):
        if not native:
            python_slot_reads(d)
        t = table_of(p)
        for k, count in enumerate([-(2**62), 2**63 - 1, -1, -(2**63)]):
            t[slots_mod.H_DONE] = count
            rid = f"c{k}"
            prm = p.export(rid, [3, 4], 12, seed=10 + k)
            d[0].load(rid, prm, [5, 6])
            assert poll_until(d.engines, {rid}, "recv") == {rid: "done"}
            assert check(d.caches(0), F16, 0, 1, [5, 6], 12, 10 + k)
            assert poll_until(p.engines, {rid}, "send") == {rid: "done"}
        assert d.onesided() == [4]
        t[slots_mod.H_DONE] = 0
        prms = {f"g{k}": p.export(f"g{k}", [7 + 2 * k, 8 + 2 * k], 12, seed=20 + k) for k in range(3)}
        rows = t[slots_mod.HEADER :].reshape(-1, slots_mod.SLOT)
        rows[:, slots_mod.S_GEN] = 2**63 - 2  # even: a stable slot's, but out of range
        assert p[0].abort_export("g0")
        for k in (1, 2):  # their slots' generations are out of range: the messaged path loads them
            d[0].load(f"g{k}", prms[f"g{k}"], [20 + 2 * k, 21 + 2 * k])
        assert poll_until(d.engines, {"g1", "g2"}, "recv") == {"g1": "done", "g2": "done"}
        for k in (1, 2):
            assert check(d.caches(0), F16, 0, 1, [20 + 2 * k, 21 + 2 * k], 12, 20 + k)
        assert poll_until(p.engines, set(prms), "send") == dict.fromkeys(prms, "done")
        assert p[0].stats()["blocks_held"] == 0 and p[0].stats()["exports_live"] == 0
        fallbacks = d[0].stats()["onesided"]["fallbacks"]
        assert fallbacks.get("table word out of range") == 2, fallbacks


def test_poll_reads_the_slot_table_only_while_an_export_is_live(monkeypatch):
    """poll() of an engine with no live export (a decode engine) does not tick its lease-slot
    table: there is no ready flag to set nor mark to count. With one live, it does, and the
    export's mark still frees it at P's poll."""
    from kvxfer.transports.ipc import leases

    by_poll: list[bool] = []  # per tick from poll() (not the server thread's beat): export live
    real = leases.LeaseSlots.tick

    def tick(self, beat, expected):
        if not beat:
            by_poll.append(not self._exports.idle())
        return real(self, beat, expected)

    with warmed() as (p, d):
        monkeypatch.setattr(leases.LeaseSlots, "tick", tick)
        for _ in range(3):
            d[0].poll()
            p[0].poll()
        assert by_poll == []
        prm = p.export("t", [3, 4], 12, seed=3)
        d[0].load("t", prm, [5, 6])
        assert poll_until(d.engines, {"t"}, "recv") == {"t": "done"}
        assert poll_until(p.engines, {"t"}, "send") == {"t": "done"}  # freed by its mark
        assert by_poll and all(by_poll), by_poll


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_an_exporter_seen_stopped_after_the_copy_fails_the_load_naming_what_was_seen(monkeypatch, native):
    """The check after a copy found the exporter closed or silent, and a second read finds it
    alive again (a stranger overwrote a header word, the exporter's beat restored it): the load
    fails, and its reason says what the check saw, not a bare "stopped"."""
    with warmed() as (p, d):
        if native:
            answer_landings(d, 2)  # the one native call: source 0's exporter stopped
        else:
            python_slot_reads(d)
            monkeypatch.setattr(slots_mod.SlotView, "check", lambda self, *a: 2)
        prm = p.export("s", [3, 4], 12, seed=3)
        d[0].load("s", prm, [5, 6])
        got = poll_until(d.engines, {"s"}, "recv")
        assert got["s"].startswith("failed:") and "no heartbeat when checked after the copy" in got["s"], got
        assert d[0].stats()["onesided"]["loads"] == 1
        monkeypatch.undo()
        assert poll_until(p.engines, {"s"}, "send") == {"s": "done"}  # notified failed: freed
