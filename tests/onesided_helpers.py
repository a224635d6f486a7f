"""Helpers of the one-sided ipc read tests (``tests/test_onesided_*.py`` and others): ``tp``
engine ranks of one engine in this process over shared-memory caches, polling engines until
every rank reported, a P and D pair with D warmed (handshaken and mapped), and D's one-sided
reads forced through the Python steps, or through a native landing that answers a chosen code."""

from __future__ import annotations

import contextlib
import time

import torch

from kvxfer import KVCacheSpec, TransferEngine
from kvxfer.transports.ipc.shm import alloc_shm_caches

from .engine_payload import fill, poison
from .engine_procs import free_port_base

F16 = KVCacheSpec(2, 2, 16, 8, torch.float16)


# ----------------------------------------------------------------------------- helpers
class Ranks:
    """``tp`` engine ranks of one engine in this process, over shared-memory caches."""

    def __init__(self, spec: KVCacheSpec, tp: int, name: str, nb: int = 48, **kw) -> None:
        self.spec, self.tp, self.name = spec, tp, name
        port = free_port_base(tp)
        self.shm = [alloc_shm_caches(spec, nb, tp) for _ in range(tp)]
        for s in self.shm:
            poison(s.caches)
        self.engines = []
        try:
            for r in range(tp):
                kw.setdefault("lease_s", 30.0)
                e = TransferEngine(spec, self.shm[r].caches, r, tp, name, port=port if tp > 1 else 0, **kw)
                self.engines.append(e.start())
        except BaseException:
            self.close()
            raise

    def __getitem__(self, r: int) -> TransferEngine:
        return self.engines[r]

    def caches(self, r: int):
        return self.shm[r].caches

    def export(self, rid: str, ids: list[int], n: int, seed: int, **kw) -> dict:
        """Fill and export ``rid`` on every rank; the params (checked equal on every rank)."""
        params = []
        for r, e in enumerate(self.engines):
            fill(self.caches(r), self.spec, r, self.tp, ids, n, seed)
            params.append(e.export(rid, ids, n, **kw))
        assert all(p == params[0] for p in params)
        return params[0]

    def onesided(self) -> list[int]:
        return [e.stats()["onesided"]["loads"] for e in self.engines]

    def native(self) -> list[int]:
        """Per rank, the one-sided loads the native lane looked up (``LoadBook.begin``)."""
        return [e.stats()["onesided"]["native"] for e in self.engines]

    def close(self) -> None:
        for e in self.engines:
            e.close()
        for s in self.shm:
            s.close()


def poll_until(engines, want: set[str], side: str, timeout: float = 10.0) -> dict[str, str]:
    """Poll every engine of ``engines`` until each of them reported every id of ``want`` on
    ``side`` ("recv" or "send"); per id the outcomes ("done", "failed: why", "expired") of all
    ranks, which must agree. Each rank reports an id once."""
    got: list[dict[str, str]] = [{} for _ in engines]
    end = time.monotonic() + timeout
    while any(set(g) != want for g in got) and time.monotonic() < end:
        for e, g in zip(engines, got):
            r = e.poll()
            if side == "recv":
                out = {rid: "done" for rid in r.finished_recving}
                out.update({rid: "failed: " + r.errors.get(rid, "") for rid in r.failed})
            else:
                out = {rid: "done" for rid in r.finished_sending}
                out.update(dict.fromkeys(r.expired, "expired"))
            for rid, what in out.items():
                assert rid not in g, f"{rid} reported twice"
                g[rid] = what
        time.sleep(0.001)
    merged: dict[str, str] = {}
    for g in got:
        for rid, what in g.items():
            if merged.setdefault(rid, what) != what:
                merged[rid] = f"ranks disagree: {merged[rid]} / {what}"
    return merged


def warm(p: Ranks, d: Ranks) -> None:
    """One request through the messaged path: D handshakes and maps P (the one-sided path needs
    both); not counted as one-sided."""
    prm = p.export("warm", [0], 1, seed=1)
    for e in d.engines:
        e.load("warm", prm, [0])
    assert poll_until(d.engines, {"warm"}, "recv") == {"warm": "done"}
    assert poll_until(p.engines, {"warm"}, "send") == {"warm": "done"}
    assert d.onesided() == [0] * d.tp


@contextlib.contextmanager
def warmed(src: KVCacheSpec = F16, dst: KVCacheSpec = F16):
    """A single-rank P and D, D warmed (handshaken and mapped: :func:`warm`); both closed after."""
    p = Ranks(src, 1, "P")
    try:
        d = Ranks(dst, 1, "D")
        try:
            warm(p, d)
            yield p, d
        finally:
            d.close()
    finally:
        p.close()


def python_slot_reads(d: Ranks) -> None:
    """D's slot views take the Python steps (as with ``KVXFER_NATIVE_CTL=0``), and so do its
    one-sided targets (a step per view, not one native call over all of them)."""
    for e in d.engines:
        for peer in e._loader.peers.all():
            for v in peer.session.slot_views:
                if v is not None:
                    v.ctl = None
            if peer.session.onesided is not None:
                peer.session.onesided.ctl = None
                peer.session.onesided.lane = None  # no native lane either


class NativeLanding:
    """The native module, but its ``onesided_land`` answers ``code`` (what the one call over
    every source rank returns) without reading or writing a table."""

    def __init__(self, mod, code: int) -> None:
        self.mod, self.code = mod, code

    def __getattr__(self, name: str):
        return getattr(self.mod, name)

    def onesided_land(self, *args) -> int:
        return self.code


def answer_landings(d: Ranks, code: int) -> None:
    """D's one-sided targets land loads through :class:`NativeLanding` answering ``code``."""
    for e in d.engines:
        for peer in e._loader.peers.all():
            t = e._onesided._target(peer)  # made at the first one-sided load, else now
            assert t is not None and t.ctl is not None, "no native one-sided target"
            t.ctl = NativeLanding(t.ctl, code)
            t.lane = None  # Target.land's call, not the native lane's
