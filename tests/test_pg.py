"""Pair groups: a failed or timed-out pair is aborted explicitly, never left to a watchdog."""

from __future__ import annotations

import logging

from kvxfer.transports.pg import groups as pg


class _Group:
    def __init__(self, fail=()):
        self.calls: list[str] = []
        self.fail = set(fail)

    def abort(self):
        self.calls.append("abort")
        if "abort" in self.fail:
            raise RuntimeError("abort refused")

    def shutdown(self):
        self.calls.append("shutdown")
        if "shutdown" in self.fail:
            raise RuntimeError("shutdown refused")


def test_discard_pair_aborts():
    g = _Group()
    pg.discard_pair(g, "peer died")
    assert g.calls == ["abort"]
    pg.discard_pair(None)  # nothing to discard


def test_discard_pair_falls_back_to_shutdown_and_logs_refusals(caplog):
    g = _Group(fail=["abort", "shutdown"])
    with caplog.at_level(logging.WARNING, logger="kvxfer.transports.pg.groups"):
        pg.discard_pair(g, "send timed out")  # never raises
    assert g.calls == ["abort", "shutdown"]
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2 and all("send timed out" in m for m in msgs), msgs


def test_gloo_pair_can_be_aborted_in_process():
    """A real Gloo pair (both ranks in this process) aborts without raising."""
    import threading

    store = pg.serve_store("127.0.0.1", 10.0)
    out = {}

    def join(rank):
        s = store if rank == 0 else pg.connect_store("127.0.0.1", store.port, 10.0)
        out[rank] = pg.new_pair(s, "k", rank, "127.0.0.1", 10.0, "gloo")

    ts = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(20)
    assert set(out) == {0, 1}
    for g in out.values():
        pg.discard_pair(g, "test")
