"""Layer-wise streaming and partial loads through the engine (CPU, in process).

P exports a request when its prefill starts (``streaming=True``) and marks groups of layers
ready as they are computed; D pulls each group as soon as it is ready and finishes when the last
layer landed. D may hold a prefix already (``num_computed_tokens``) and pulls only the rest.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from kvxfer import KVCacheSpec, Layout, TransferEngine, ops
from kvxfer.ports import free_port_base
from kvxfer.transports.ipc.shm import alloc_shm_caches

from .engine_payload import check, fill, payload, poison, untouched

L = 6


def _spec(layout="NHD", bs=16, heads=4):
    return KVCacheSpec(L, heads, 16, bs, torch.float16, Layout(layout))


def _drain(eng, want, timeout=10.0, kind="recv") -> dict:
    got: dict = {}
    end = time.monotonic() + timeout
    while set(got) != set(want) and time.monotonic() < end:
        r = eng.poll()
        if kind == "recv":
            got.update({rid: ("done", time.monotonic()) for rid in r.finished_recving})
            got.update({rid: ("failed: " + r.errors.get(rid, ""), time.monotonic()) for rid in r.failed})
        else:
            got.update({rid: ("finished", time.monotonic()) for rid in r.finished_sending})
            got.update({rid: ("expired", time.monotonic()) for rid in r.expired})
        time.sleep(0.002)
    return got


class _Ev:
    """A CUDA-event stand-in (``query()``) the test completes when it likes."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def _engines(transport, src_spec, dst_spec, src_tp=1):
    port = free_port_base(src_tp)
    p_shm = [alloc_shm_caches(src_spec, 40, src_tp) for _ in range(src_tp)]
    ps = [
        TransferEngine(
            src_spec, p_shm[r].caches, r, src_tp, "P", transport=transport, port=port, timeout_s=10.0
        ).start()
        for r in range(src_tp)
    ]
    d_shm = alloc_shm_caches(dst_spec, 80, 1)
    d = TransferEngine(dst_spec, d_shm.caches, 0, 1, "D", transport=transport, timeout_s=10.0).start()
    return ps, p_shm, d, d_shm


def _close(ps, p_shm, d, d_shm):
    d.close()
    for p in ps:
        p.close()
    for s in [*p_shm, d_shm]:
        s.close()


@pytest.mark.parametrize("transport", ["ipc", "pg"])
@pytest.mark.parametrize("groups", [[1] * L, [3, 3], [L]], ids=["by-1", "by-3", "all"])
@pytest.mark.parametrize(
    ("src", "dst", "src_tp"),
    [(("NHD", 16), ("HND", 8), 1), (("HND", 8), ("NHD", 16), 2)],
    ids=["nhd16-hnd8", "tp2-hnd8-nhd16"],
)
def test_layer_groups_stream_and_finish_with_the_last(transport, groups, src, dst, src_tp):
    """D finishes only once the last group is ready; every byte lands exactly, the rest of D's
    cache stays poisoned; P frees the blocks once D is done."""
    src_spec, dst_spec = _spec(*src), _spec(*dst)
    ps, p_shm, d, d_shm = _engines(transport, src_spec, dst_spec, src_tp)
    try:
        n, p_ids, d_ids = 50, [4, 9, 1, 30, 7, 12, 2][: src_spec.num_blocks_for(50)], list(range(20, 27))
        d_ids = d_ids[: dst_spec.num_blocks_for(n)]
        poison(d_shm.caches)
        params = [p.export("r", p_ids, n, streaming=True) for p in ps]
        assert all(pr == params[0] for pr in params)  # the same dict on every rank
        d.load("r", params[0], d_ids)
        got: dict = {}
        first = 0
        events = []
        for k, g in enumerate(groups):
            layers = list(range(first, first + g))
            first += g
            for r, (p, shm) in enumerate(zip(ps, p_shm)):
                ev = _Ev()  # marked while the "compute" is still running: D must not read yet
                events.append(ev)
                p.mark_ready("r", layers, ready=ev)
                time.sleep(0.01)
                for layer in layers:  # the prefill writes this group's layers, on every rank
                    _fill_layer(shm.caches, src_spec, r, src_tp, p_ids, n, layer)
            time.sleep(0.05)
            got = _drain(d, {"r"}, timeout=0.05)
            assert not got, f"finished before group {k} was ready: {got}"
            for ev in events:
                ev.done = True  # the compute that wrote it completed
            if k < len(groups) - 1:
                time.sleep(0.05)
                assert not _drain(d, {"r"}, timeout=0.05)  # still layers to come
        got = _drain(d, {"r"})
        assert got["r"][0] == "done", got
        assert check(d_shm.caches, dst_spec, 0, 1, d_ids, n, seed=77)
        assert untouched(
            d_shm.caches, dst_spec, set(d_ids), {d_ids[-1]: n - (len(d_ids) - 1) * dst_spec.block_size}
        )
        for p in ps:
            assert _drain(p, {"r"}, kind="send")["r"][0] == "finished"
    finally:
        _close(ps, p_shm, d, d_shm)


def _fill_layer(caches, spec, rank, tp, ids, n, layer):
    """Write one layer of request seed 77 (what a prefill's layer ``layer`` would write)."""
    tmp = [torch.zeros_like(c) for c in caches]
    fill(tmp, spec, rank, tp, ids, n, seed=77)
    caches[layer].copy_(tmp[layer])


@pytest.mark.parametrize("transport", ["ipc", "pg"])
@pytest.mark.parametrize(
    ("src", "dst"),
    [
        (("NHD", 16), ("NHD", 16)),
        (("HND", 16), ("NHD", 8)),
        (("NHD", 12), ("HND", 8)),
        (("HND", 32), ("HND", 16)),
    ],
    ids=["nhd16-nhd16", "hnd16-nhd8", "nhd12-hnd8", "hnd32-hnd16"],
)
@pytest.mark.parametrize("which", ["zero", "one-block", "all-but-one"])
def test_partial_load_pulls_only_the_missing_tokens(transport, src, dst, which):
    """D holds tokens [0, k) already (here: a marker of its own); only [k, n) is pulled: D's
    prefix blocks keep their bytes, the rest is P's, nothing else is written."""
    src_spec, dst_spec = _spec(*src), _spec(*dst)
    ps, p_shm, d, d_shm = _engines(transport, src_spec, dst_spec)
    try:
        n, bs = 70, dst_spec.block_size
        k = {"zero": 0, "one-block": bs, "all-but-one": (n - 1) // bs * bs}[which]
        p_ids = list(range(3, 3 + src_spec.num_blocks_for(n)))
        d_ids = list(range(40, 40 + dst_spec.num_blocks_for(n)))
        fill(p_shm[0].caches, src_spec, 0, 1, p_ids, n, seed=5)
        poison(d_shm.caches)
        if k:
            fill(d_shm.caches, dst_spec, 0, 1, d_ids[: k // bs], k, seed=999)  # D's own prefix
        before = [c.clone() for c in d_shm.caches]
        d.load("r", ps[0].export("r", p_ids, n), d_ids, num_computed_tokens=k)
        got = _drain(d, {"r"})
        assert got["r"][0] == "done", got
        wire = ops.gather_blocks(d_shm.caches, dst_spec, d_ids, n)
        want = payload(dst_spec, 5, n, range(dst_spec.num_kv_heads))
        assert torch.equal(wire[..., k:, :].view(torch.int16), want[..., k:, :].view(torch.int16))
        for c, b0 in zip(d_shm.caches, before):  # the prefix blocks were not written
            for blk in d_ids[: k // bs]:
                assert torch.equal(c[:, blk].view(torch.int16), b0[:, blk].view(torch.int16))
        assert untouched(d_shm.caches, dst_spec, set(d_ids), {d_ids[-1]: n - (len(d_ids) - 1) * bs})
        assert d.stats()["bytes"] == (n - k) * dst_spec.bytes_per_token()
    finally:
        _close(ps, p_shm, d, d_shm)


def test_lease_ending_mid_stream_fails_the_request_and_delivers_nothing_stale():
    """Half the layers landed, then P's export ends (an abort is the same release as a lease
    expiry): D fails the request by its deadline, never reports it finished."""
    spec = _spec()
    ps, p_shm, d, d_shm = _engines("ipc", spec, spec)
    try:
        p = ps[0]
        params = p.export("r", [1, 2, 3], 40, streaming=True)
        d.load("r", params, [5, 6, 7])
        p.mark_ready("r", range(3))
        time.sleep(0.2)
        assert not _drain(d, {"r"}, timeout=0.05)
        assert p.abort_export("r")
        got = _drain(d, {"r"})
        assert got["r"][0].startswith("failed:") and "released" in got["r"][0], got
    finally:
        _close(ps, p_shm, d, d_shm)


def test_bad_layer_marks_and_partial_loads_are_named_errors():
    spec = _spec()
    ps, p_shm, d, d_shm = _engines("ipc", spec, spec)
    try:
        p = ps[0]
        p.export("r", [1, 2], 20, streaming=True)
        p.mark_ready("r", [0, 1])
        with pytest.raises(ValueError, match="layer 1 of 'r' is already marked ready"):
            p.mark_ready("r", [1, 2])
        with pytest.raises(ValueError, match=r"layer 6 out of range \[0, 6\)"):
            p.mark_ready("r", [6])
        with pytest.raises(ValueError, match="repeated layer"):
            p.mark_ready("r", [3, 3])
        with pytest.raises(ValueError, match="non-empty"):
            p.mark_ready("r", [])
        whole = p.export("w", [3], 10)
        with pytest.raises(ValueError, match="exported whole, not layer-wise"):
            p.mark_ready("w", [0])
        p.abort_export("r")
        with pytest.raises(ValueError, match="is not exported here"):
            p.mark_ready("r", [4])
        for k, msg in (
            (8, "not a multiple of the block size 16"),
            (32, r"in \[0, 10\)"),
            (-16, r"in \[0, 10\)"),
        ):
            with pytest.raises(ValueError, match=msg):
                d.load("x", whole, [9], num_computed_tokens=k)
        assert d.stats()["loads_pending"] == 0  # nothing queued by the refused loads
    finally:
        _close(ps, p_shm, d, d_shm)


@pytest.mark.parametrize("num_layers", [1, 7, 8, 9, 32, 61, 80])
def test_int_layer_masks_are_packbits_on_the_wire(num_layers):
    """The loader keeps layer sets as ints whose big-endian bytes are numpy.packbits of the flags."""
    from kvxfer.engine_types import full_layer_mask as _full_mask
    from kvxfer.engine_types import mask_layers as _mask_layers

    rng = np.random.default_rng(num_layers)
    nbytes = (num_layers + 7) // 8
    full = _full_mask(num_layers)
    assert full.to_bytes(nbytes, "big") == np.packbits(np.ones(num_layers, bool)).tobytes()
    for _ in range(20):
        flags = rng.random(num_layers) < 0.5
        packed = np.packbits(flags).tobytes()
        mask = int.from_bytes(packed, "big")
        assert mask & full == mask and mask.to_bytes(nbytes, "big") == packed
        assert _mask_layers(mask, num_layers) == np.flatnonzero(flags).tolist()
