"""Loads whose params were made before the export, and ``TransferEngine.release``.

A serving integration (vLLM) makes the params in its scheduler one step before its worker
exports, so a loader may ask before the exporter knows the request: the loader asks again
(bounded by ``timeout_s``). A loader that will never load a request releases it, so the
exporter frees the blocks at once instead of at the end of the lease.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvxfer import KVCacheSpec, TransferEngine
from kvxfer.params import params_dict
from kvxfer.ports import free_port_base
from kvxfer.transports.ipc.shm import alloc_shm_caches

from .engine_payload import check, fill, poison

SPEC = KVCacheSpec(2, 2, 16, 8, torch.float16)


def _wait(eng, want: set[str], key: str, timeout=10.0) -> dict[str, str]:
    """Poll until every id of ``want`` is reported on side ``key`` ("recv"/"send"); id -> outcome."""
    got: dict[str, str] = {}
    end = time.monotonic() + timeout
    while set(got) != want and time.monotonic() < end:
        r = eng.poll()
        if key == "recv":
            got.update(dict.fromkeys(r.finished_recving, "done"))
            got.update({rid: "failed:" + r.errors.get(rid, "") for rid in r.failed})
        else:
            got.update(dict.fromkeys(r.finished_sending, "done"))
            got.update(dict.fromkeys(r.expired, "expired"))
        time.sleep(0.005)
    return got


def _early_params(p: TransferEngine, rid: str, ids: list[int], n: int) -> dict:
    """The params ``p.export(rid, ids, n)`` will return, made before it is called."""
    return p.params_for(rid, ids, n)


@pytest.fixture
def pair():
    shm, dshm = alloc_shm_caches(SPEC, 32, 1), alloc_shm_caches(SPEC, 32, 1)
    poison(dshm.caches)
    p = TransferEngine(SPEC, shm.caches, 0, 1, "P", lease_s=30.0, timeout_s=3.0).start()
    d = TransferEngine(SPEC, dshm.caches, 0, 1, "D", lease_s=30.0, timeout_s=3.0).start()
    yield p, d, shm, dshm
    for o in (p, d, shm, dshm):
        o.close()


def test_load_before_export_waits_then_delivers(pair):
    p, d, shm, dshm = pair
    fill(shm.caches, SPEC, 0, 1, [3, 4], 12, seed=7)
    prm = _early_params(p, "r", [3, 4], 12)
    d.load("r", prm, [10, 11])
    timer = threading.Timer(0.4, lambda: p.export("r", [3, 4], 12))
    t0 = time.monotonic()
    timer.start()
    try:
        got = _wait(d, {"r"}, "recv")
    finally:
        timer.join(5)
    assert got == {"r": "done"}, got
    assert time.monotonic() - t0 >= 0.4  # it did wait for the export
    assert check(dshm.caches, SPEC, 0, 1, [10, 11], 12, seed=7)
    real = p.export("r2", [3, 4], 12)  # the early params are what export makes (r2's token is r2's)
    assert prm == real | {"request_id": "r", "token": prm["token"]} and prm["token"] != real["token"]
    assert _wait(p, {"r"}, "send") == {"r": "done"}


def test_a_batch_lands_what_is_exported_at_once_and_the_rest_when_it_is(pair):
    """One poll's batch of two loads, one exported, one not yet: the first round grants one, so
    the batch goes on in rounds; the exported one lands in the first round, without waiting for
    the other, which lands once exported. Both byte for byte, nothing else written."""
    p, d, shm, dshm = pair
    fill(shm.caches, SPEC, 0, 1, [3, 4], 12, seed=8)
    fill(shm.caches, SPEC, 0, 1, [6, 7], 12, seed=9)
    d.load("now", p.export("now", [3, 4], 12), [10, 11])
    d.load("later", _early_params(p, "later", [6, 7], 12), [20, 21])
    timer = threading.Timer(0.6, lambda: p.export("later", [6, 7], 12))
    t0 = time.monotonic()
    timer.start()
    try:
        first = _wait(d, {"now"}, "recv")
        t_first = time.monotonic() - t0
        second = _wait(d, {"later"}, "recv")
    finally:
        timer.join(5)
    assert first == {"now": "done"} and second == {"later": "done"}, (first, second)
    assert t_first < 0.6, t_first  # not held back by the load still waiting for its export
    assert check(dshm.caches, SPEC, 0, 1, [10, 11], 12, seed=8)
    assert check(dshm.caches, SPEC, 0, 1, [20, 21], 12, seed=9)
    untouched = [b for b in range(32) if b not in (10, 11, 20, 21)]
    assert bool((dshm.caches[0].view(torch.uint8)[:, untouched] == 0x5A).all())


def test_load_of_never_exported_request_fails_after_timeout(pair):
    p, d, _, dshm = pair
    d.load("ghost", _early_params(p, "ghost", [1], 4), [5])
    t0 = time.monotonic()
    got = _wait(d, {"ghost"}, "recv")
    took = time.monotonic() - t0
    assert got["ghost"].startswith("failed:") and "unknown" in got["ghost"], got
    assert 3.0 <= took < 8.0, took  # bounded by timeout_s=3
    assert bool((dshm.caches[0].view(torch.uint8) == 0x5A).all())  # nothing written


def test_release_frees_exporter_before_lease(pair):
    p, d, _, _ = pair
    prm = p.export("r", [1, 2, 3], 20)
    assert p.stats()["blocks_held"] == 3
    d.release(prm)
    d.poll()  # the release goes out with this poll's batch
    got = _wait(p, {"r"}, "send", timeout=5)
    assert got == {"r": "done"}, got  # finished, not expired: lease_s is 30
    assert p.stats()["blocks_held"] == 0 and p.stats()["expirations"] == 0
    assert d.stats()["loads_pending"] == 0 and d.poll().empty()  # nothing reported on D


@pytest.mark.parametrize("polled", [False, True])
def test_a_release_made_just_before_close_still_frees_the_exporter(pair, polled):
    """release() and then close(), with or without a poll between (the worker may not have
    taken the release yet): the release still goes, bounded by close(), so the exporter frees
    the blocks now rather than at lease end (or never, while another holder renews the lease)."""
    p, d, _, _ = pair
    d.load("warm", p.export("warm", [4], 5), [9])  # handshaken: the release needs no handshake
    assert _wait(d, {"warm"}, "recv") == {"warm": "done"}
    assert _wait(p, {"warm"}, "send") == {"warm": "done"}
    prm = p.export("r", [1, 2, 3], 20)
    d.release(prm)
    if polled:
        d.poll()
    t0 = time.monotonic()
    d.close()
    assert time.monotonic() - t0 < 6.0  # close()'s bound
    got = _wait(p, {"r"}, "send", timeout=5)
    assert got == {"r": "done"}, got  # finished, not expired: lease_s is 30
    assert p.stats()["blocks_held"] == 0


def test_release_before_export_waits_for_it(pair):
    p, d, _, _ = pair
    d.release(_early_params(p, "r", [5, 6], 9))
    d.poll()
    time.sleep(0.3)
    p.export("r", [5, 6], 9)  # the release is still asking: it must free this export
    got = _wait(p, {"r"}, "send", timeout=5)
    assert got == {"r": "done"}, got
    assert p.stats()["blocks_held"] == 0


def test_release_n_children_list(pair):
    p, d, _, _ = pair
    prms = [p.export(f"c{i}", [1, 2 + i], 12) for i in range(3)]
    assert p.stats()["blocks_held"] == 4  # block 1 shared by the three children
    d.release(prms)
    d.poll()
    assert _wait(p, {"c0", "c1", "c2"}, "send", timeout=5) == dict.fromkeys(["c0", "c1", "c2"], "done")
    assert p.stats()["blocks_held"] == 0


def test_release_validates_params(pair):
    p, d, _, _ = pair
    good = p.export("x", [1], 4)
    with pytest.raises(ValueError, match="port"):
        d.release({**good, "port": "80"})
    with pytest.raises(ValueError, match="request_id"):
        d.release({**good, "request_id": ""})


def test_release_unreachable_exporter_is_bounded_and_logged(caplog):
    dc = [torch.zeros(SPEC.cache_shape(8, 1), dtype=SPEC.dtype) for _ in range(2)]
    d = TransferEngine(SPEC, dc, 0, 1, "D", timeout_s=0.5).start()
    try:
        port = free_port_base(1)  # nobody listens there
        d.release(params_dict("r", "P", "127.0.0.1", port, 1, [1], 4, "0" * 48))
        t0 = time.monotonic()
        with caplog.at_level("WARNING", logger="kvxfer.releases"):
            d.poll()
            while "release of ['r']" not in caplog.text and time.monotonic() - t0 < 5:
                time.sleep(0.02)
        assert "handshake with P failed" in caplog.text, caplog.text
        assert time.monotonic() - t0 < 5
    finally:
        d.close()


def _tp_engines(spec, tp, engine_id, nb=16, **kw):
    port = free_port_base(tp)
    out = []
    for r in range(tp):
        caches = [torch.zeros(spec.cache_shape(nb, tp), dtype=spec.dtype) for _ in range(spec.num_layers)]
        out.append(
            (TransferEngine(spec, caches, r, tp, engine_id, port=port, lease_s=30.0, **kw).start(), caches)
        )
    return out


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)])
def test_release_heterogeneous_tp_frees_every_exporter_rank_after_every_loader_rank(p_tp, d_tp):
    ps = _tp_engines(SPEC, p_tp, "P")
    ds = _tp_engines(SPEC, d_tp, "D")
    try:
        prms = [e.export("r", [1, 2], 10) for e, _ in ps]  # every exporter rank holds it
        prm = prms[0]
        for r, (d, _) in enumerate(ds):
            d.release(prm)
            d.poll()
            if r < d_tp - 1:  # not every loader rank released yet: every exporter rank still holds
                time.sleep(0.3)
                assert all(e.stats()["blocks_held"] == 2 for e, _ in ps)
        for e, _ in ps:
            assert _wait(e, {"r"}, "send", timeout=5) == {"r": "done"}
            assert e.stats()["blocks_held"] == 0
    finally:
        for e, _ in ps + ds:
            e.close()


@pytest.mark.parametrize("transport", ["ipc", "pg"])
def test_partial_load_of_the_tokens_after_a_held_prefix_and_sliced_params_refused(transport):
    """Loading only the tokens after a prefix the loader already holds (a prefix-cache hit on
    D): the whole params with ``num_computed_tokens``. Exact bytes, the prefix blocks untouched;
    the exporter still frees the request on the notification. Params *sliced* at a block
    boundary (what the vLLM connector once sent) name other ids than the export's: refused by
    name, nothing written."""
    from kvxfer import ops

    from .engine_payload import payload

    shm, dshm = alloc_shm_caches(SPEC, 32, 1), alloc_shm_caches(SPEC, 32, 1)
    poison(dshm.caches)
    p = TransferEngine(SPEC, shm.caches, 0, 1, "P", transport=transport, timeout_s=3.0).start()
    d = TransferEngine(SPEC, dshm.caches, 0, 1, "D", transport=transport, timeout_s=3.0).start()
    try:
        fill(shm.caches, SPEC, 0, 1, [3, 4, 5], 20, seed=3)
        prm = p.export("r", [3, 4, 5], 20)
        sliced = {**prm, "block_ids": prm["block_ids"][1:], "num_tokens": 12}  # tokens 8..19
        d.load("s", sliced, [24, 25])
        got = _wait(d, {"s"}, "recv")
        assert "differ from the export" in got["s"], got
        assert bool((dshm.caches[0].view(torch.uint8)[:, 24:26] == 0x5A).all())  # nothing written
        d.load("r", prm, [20, 21, 22], num_computed_tokens=8)
        assert _wait(d, {"r"}, "recv") == {"r": "done"}
        got = ops.gather_blocks(dshm.caches, SPEC, [21, 22], 12)
        want = payload(SPEC, 3, 20, range(2))[:, :, :, 8:]
        assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8))
        assert _wait(p, {"r"}, "send") == {"r": "done"}
        assert bool((dshm.caches[0].view(torch.uint8)[:, 20] == 0x5A).all())  # the held prefix untouched
    finally:
        for o in (p, d, shm, dshm):
            o.close()


def test_ipc_load_naming_more_blocks_than_exported_fails(pair):
    p, d, _, _ = pair
    prm = p.export("r", [3, 4], 12)
    d.load("r", {**prm, "block_ids": [3, 4, 5], "num_tokens": 20}, [1, 2, 6])
    got = _wait(d, {"r"}, "recv")
    assert got["r"].startswith("failed:") and "differ from the export" in got["r"], got
