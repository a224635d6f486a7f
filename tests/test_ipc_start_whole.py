"""``IpcSession.start_whole``: a lone whole load of the messaged ipc path moves through the
prepared whole-block copies with nothing planned; ids a copy would read other than as given
get None with nothing written (the planner then plans the load), and the metrics count the
load's wire bytes once."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from kvxfer import KVCacheSpec, TransferEngine
from kvxfer.engine_types import LoadItem
from kvxfer.params import KVTransferParams
from kvxfer.transports.ipc.shm import alloc_shm_caches

from .engine_payload import check, fill, poison, untouched

SRC = KVCacheSpec(2, 2, 16, 8, torch.float16)
DST = KVCacheSpec(2, 2, 16, 16, torch.float16, layout="HND")  # another block size and layout
NB = 32


@pytest.fixture
def pair():
    shm, dshm = alloc_shm_caches(SRC, NB, 1), alloc_shm_caches(DST, NB, 1)
    poison(shm.caches)
    poison(dshm.caches)
    p = TransferEngine(SRC, shm.caches, 0, 1, "P", transport="ipc", lease_s=5.0).start()
    d = TransferEngine(DST, dshm.caches, 0, 1, "D", transport="ipc", lease_s=5.0, onesided=False).start()
    try:
        yield p, d, shm, dshm
    finally:
        d.close()
        p.close()
        shm.close()
        dshm.close()


def _done(d: TransferEngine, *rids: str) -> None:
    """Poll until every one of ``rids`` is reported finished (none failed)."""
    want, end = set(rids), time.monotonic() + 10
    while time.monotonic() < end:
        r = d.poll()
        assert not r.failed, r.errors
        want -= r.finished_recving
        if not want:
            return
        time.sleep(0.005)
    raise AssertionError(f"{sorted(want)} not reported by the deadline")


def test_a_lone_load_moves_whole_and_counts_its_bytes_once(pair):
    p, d, shm, dshm = pair
    calls: list = []
    real = type(d._loader.planner).plan
    d._loader.planner.plan = lambda *a, **k: calls.append(a) or real(d._loader.planner, *a, **k)
    for k, (n, src, dst) in enumerate([(37, [3, 9, 1, 20, 7], [5, 2, 11]), (16, [30, 4], [0])]):
        fill(shm.caches, SRC, 0, 1, src, n, seed=k)
        b0 = d.stats()["bytes"]
        d.load(f"r{k}", p.export(f"r{k}", src, n), dst)
        _done(d, f"r{k}")
        assert check(dshm.caches, DST, 0, 1, dst, n, seed=k), k
        assert d.stats()["bytes"] - b0 == n * DST.bytes_per_token(), k
    assert not calls  # nothing was planned: both went through start_whole
    used = {5, 2, 11, 0}
    assert untouched(dshm.caches, DST, used, {11: 37 - 32, 0: 16})


def test_ids_a_copy_would_misread_get_none_and_nothing_is_written(pair):
    p, d, shm, dshm = pair
    fill(shm.caches, SRC, 0, 1, [1, 2, 3], 20, seed=3)
    d.load("h", p.export("h", [4], 8), [9])  # a first load: the handshake and the mapping
    _done(d, "h")
    session = d._loader.peer("P").session
    params = KVTransferParams.from_dict(p.export("x", [1, 2, 3], 20))
    before = [c.clone() for c in dshm.caches]
    bad = {
        "one id too many": np.array([6, 7, 8], dtype=np.int64),
        "one id too few": np.array([6], dtype=np.int64),
        "not int64": np.array([6, 7], dtype=np.int32),
        "not contiguous": np.array([6, 0, 7, 0], dtype=np.int64)[::2],
    }
    for why, ids in bad.items():
        assert (
            session.start_whole(0, LoadItem("x", params, ids, time.monotonic() + 5), time.monotonic() + 5)
            is None
        ), why
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, dshm.caches))
    got = session.start_whole(
        0, LoadItem("x", params, np.array([6, 7], dtype=np.int64)), time.monotonic() + 5
    )
    assert got is not None
    done, nbytes = got
    out = done.wait(time.monotonic() + 5)
    assert out.landed == {"x"} and out.calls == 1 and nbytes == 20 * DST.bytes_per_token()
    assert check(dshm.caches, DST, 0, 1, [6, 7], 20, seed=3)
    # the peer forgotten (its session closed): the copy is refused by name, nothing written
    session.close()
    before = [c.clone() for c in dshm.caches]
    with pytest.raises(RuntimeError, match="closed"):
        session.start_whole(
            0, LoadItem("x", params, np.array([12, 13], dtype=np.int64)), time.monotonic() + 5
        )
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, dshm.caches))


def test_only_a_lone_whole_load_of_every_layer_skips_the_plan(pair, monkeypatch):
    """Planner.read hands start_whole exactly the reads it may take: one load, every layer,
    nothing held here; a partial load, a batch of two and a layer-wise export's reads of some
    layers are planned (and still land byte for byte)."""
    from kvxfer import planner as planner_mod
    from kvxfer.transports.ipc.session import IpcSession

    p, d, shm, dshm = pair
    reads: list = []  # (loads, layers, firsts, went whole)
    real_read, real_whole = planner_mod.Planner.read, IpcSession.start_whole

    def read(self, peer, s, loads, granted, deadline, layers=None):
        reads.append([len(loads), layers, [it.first for it in loads], False])
        return real_read(self, peer, s, loads, granted, deadline, layers)

    def whole(self, source, load, deadline):
        reads[-1][3] = True
        return real_whole(self, source, load, deadline)

    monkeypatch.setattr(planner_mod.Planner, "read", read)
    monkeypatch.setattr(IpcSession, "start_whole", whole)
    # a lone whole load
    fill(shm.caches, SRC, 0, 1, [1, 2, 3], 20, seed=1)
    d.load("w", p.export("w", [1, 2, 3], 20), [4, 5])
    _done(d, "w")
    # a partial load: D holds the first 16 tokens (one of its blocks)
    fill(shm.caches, SRC, 0, 1, [6, 7, 8, 9], 30, seed=2)
    d.load("part", p.export("part", [6, 7, 8, 9], 30), [10, 11], num_computed_tokens=16)
    _done(d, "part")
    # two loads in one batch (queued before one poll)
    fill(shm.caches, SRC, 0, 1, [12, 13], 16, seed=3)
    fill(shm.caches, SRC, 0, 1, [14, 15], 16, seed=4)
    d.load("b1", p.export("b1", [12, 13], 16), [16])
    d.load("b2", p.export("b2", [14, 15], 16), [17])
    _done(d, "b1", "b2")
    # a layer-wise export whose second layer becomes ready only after the first was read
    fill(shm.caches, SRC, 0, 1, [18, 19], 16, seed=5)
    prm = p.export("lw", [18, 19], 16, streaming=True)
    p.mark_ready("lw", [0])
    d.load("lw", prm, [20])
    end = time.monotonic() + 10
    while not any(r[1] == [0] for r in reads) and time.monotonic() < end:
        d.poll()
        time.sleep(0.005)
    p.mark_ready("lw", [1])
    _done(d, "lw")
    for k, (rid, ids, n) in enumerate(
        [("w", [4, 5], 20), ("b1", [16], 16), ("b2", [17], 16), ("lw", [20], 16)]
    ):
        assert check(dshm.caches, DST, 0, 1, ids, n, seed=[1, 3, 4, 5][k]), rid
    eligible = [n == 1 and layers is None and firsts == [0] for n, layers, firsts, _ in reads]
    assert [r[3] for r in reads] == eligible, reads
    assert eligible[0] and not all(eligible)
    assert (
        any(r[1] == [0] for r in reads) and any(r[0] == 2 for r in reads) and any(r[2] == [16] for r in reads)
    )
