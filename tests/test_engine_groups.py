"""A request as a set of attention groups (full + sliding window) through real engines.

Every row the model computed is stamped with its origin (group, layer, kv, head, token); P's
caches hold them at each group's own block list (the null block 0 and the dead positions of a
sliding group hold a garbage pattern that must never arrive), every other byte of D is poison.
After the load, each D rank's caches must equal, byte for byte, an independently built
expectation: the live tokens of each group at D's positions of that group, poison elsewhere
(D's null block included).
"""

from __future__ import annotations

import dataclasses
import random
import time

import pytest
import torch

from kvxfer import KVCacheSpec, Layout, TransferEngine
from kvxfer.groups.attention import AttentionGroup
from kvxfer.ports import free_port_base
from kvxfer.transports.ipc.shm import alloc_shm_caches
from kvxfer.transports.nixl.agent import nixl_status

POISON = 0xA5
GARBAGE = 0x5A  # what P's null block and dead positions hold
NB = 48
KEY = "groups-test-key"


def _truth(spec: KVCacheSpec, layer_group: list[int], n: int, seed: int) -> torch.Tensor:
    """uint8 ``[L, KV, H, T, row]``: seeded noise, each row starting with (group, layer, kv,
    head, token lo, token hi)."""
    g = torch.Generator().manual_seed(seed)
    row = spec.head_dim * spec.element_size
    L, H = spec.num_layers, spec.num_kv_heads
    data = torch.randint(0, 256, (L, 2, H, n, row), generator=g, dtype=torch.uint8)
    lay, kv, h, t = torch.meshgrid(
        torch.arange(L), torch.arange(2), torch.arange(H), torch.arange(n), indexing="ij"
    )
    grp = torch.tensor(layer_group)[lay]
    stamp = torch.stack([grp, lay, kv, h, t & 255, t >> 8], dim=-1).to(torch.uint8)
    data[..., :6] = stamp
    return data


def _rows(cache: torch.Tensor, spec: KVCacheSpec) -> torch.Tensor:
    """``[2, blocks, block_size, heads, row_bytes]`` byte view of one layer (writable)."""
    raw = cache.view(torch.uint8)
    return raw.transpose(2, 3) if spec.layout is Layout.HND else raw


def _place(caches, spec, truth, layers, heads: range, positions: list[int], tokens: range) -> None:
    """Write ``truth``'s rows of ``heads`` (global) for ``tokens`` of ``layers`` at block list
    ``positions`` (token t in ``positions[t // block_size]``); naive indexing."""
    t = torch.tensor(list(tokens), dtype=torch.int64)
    if not t.numel():
        return
    blocks = torch.tensor(positions, dtype=torch.int64)[t // spec.block_size]
    offs = t % spec.block_size
    for layer in layers:
        v = _rows(caches[layer], spec)
        for i, h in enumerate(heads):
            v[:, blocks, offs, i] = truth[layer, :, h][:, t]


ALIAS = [0, 0, 0, 1, 1, 1]  # vLLM: layer j of every group is one tensor (its groups' blocks differ)


def _caches(spec: KVCacheSpec, tp: int, shm: bool, aliased: bool = False):
    """One rank's caches: a tensor per layer, or (``aliased``) the j-th layers of all groups one
    tensor, as vLLM's hybrid allocator lays them out."""
    alloc = dataclasses.replace(spec, num_layers=2) if aliased else spec
    if shm:
        out = alloc_shm_caches(alloc, NB, tp)
        caches = out.caches
    else:
        out = None
        caches = [torch.empty(alloc.cache_shape(NB, tp), dtype=spec.dtype) for _ in range(alloc.num_layers)]
    return out, [caches[i] for i in ALIAS] if aliased else caches


def _fill(caches, byte: int) -> None:
    for c in caches:
        c.view(torch.uint8).fill_(byte)


def _lists(rng: random.Random, groups, n: int, bs: int) -> list[list[int]]:
    """Positional block lists, one per group, from one pool without block 0; a sliding group's
    dead positions hold the null block 0 (as vLLM's lists do once the window passed them)."""
    need = -(-n // bs)
    pool = rng.sample(range(1, NB), need * len(groups))
    out = []
    for i, g in enumerate(groups):
        ids = pool[i * need : (i + 1) * need]
        dead = g.live_first(n) // bs
        out.append([0] * dead + ids[dead:])
    return out


GROUPS = [
    AttentionGroup((0, 3)),  # full attention
    AttentionGroup((1, 4), window=13),
    AttentionGroup((2, 5), window=6),
]
LAYER_GROUP = [0, 1, 2, 0, 1, 2]


def _engines(spec, tp, name, transport, shm, port, aliased=False, **kw):
    engs, stores = [], []
    for r in range(tp):
        store, caches = _caches(spec, tp, shm, aliased)
        _fill(caches, POISON)
        stores.append((store, caches))
        eng = TransferEngine(
            spec, caches, r, tp, name, transport=transport, lease_s=10.0, port=port, auth_key=KEY,
            groups=GROUPS, **kw,
        )  # fmt: skip
        engs.append(eng.start())
    return engs, stores


def _poll_all(engs, want: set[str], key: str, timeout=20.0) -> dict:
    got: dict[str, str] = {}
    per = [dict() for _ in engs]
    end = time.monotonic() + timeout
    while any(set(p) != want for p in per) and time.monotonic() < end:
        for e, p in zip(engs, per):
            r = e.poll()
            if key == "recv":
                for rid in r.finished_recving:
                    p[rid] = "done"
                for rid in r.failed:
                    p[rid] = "failed: " + r.errors.get(rid, "")
            else:
                for rid in r.finished_sending:
                    p[rid] = "done"
                for rid in r.expired:
                    p[rid] = "expired"
        time.sleep(0.003)
    for p in per:
        for rid, what in p.items():
            if got.get(rid, "done") == "done":
                got[rid] = what
    return got


def _run(
    transport: str,
    src: KVCacheSpec,
    dst: KVCacheSpec,
    tp_p: int,
    tp_d: int,
    n: int,
    first: int = 0,
    seed: int = 0,
    aliased: bool = False,
):
    """P (tp_p ranks) exports one grouped request of ``n`` tokens, D (tp_d ranks) loads it
    (holding tokens ``[0, first)`` already); returns None after checking every byte of D."""
    rng = random.Random(seed)
    cma = transport == "ipc-cma"  # plain CPU caches: ipc reads them with cross-memory attach
    transport = "ipc" if cma else transport
    shm = transport == "ipc" and not cma
    base_p, base_d = free_port_base(tp_p), free_port_base(tp_d)
    ps, pst = _engines(src, tp_p, "P", transport, shm, base_p, aliased)
    ds, dst_st = _engines(dst, tp_d, "D", transport, shm, base_d, aliased)
    try:
        truth = _truth(src, LAYER_GROUP, n, seed)
        plists = _lists(rng, GROUPS, n, src.block_size)
        dlists = _lists(rng, GROUPS, n, dst.block_size)
        for r, (_, caches) in enumerate(pst):
            _fill(caches, GARBAGE)
            heads = src.heads_of_rank(r, tp_p)
            for g, grp in enumerate(GROUPS):  # only the live positions hold the request's rows
                lo = grp.live_first(n) // src.block_size * src.block_size
                _place(caches, src, truth, grp.layers, heads, plists[g], range(lo, n))
        params = [e.export("req", plists, n) for e in ps]
        assert all(p == params[0] for p in params), "every P rank's params alike"
        assert params[0]["groups"] == [len(x) - x.count(0) for x in plists]
        # D already holds tokens [0, first) of every group (a prefix hit): they stay poison
        for e in ds:
            e.load("req", params[0], dlists, num_computed_tokens=first)
        got = _poll_all(ds, {"req"}, "recv")
        assert got == {"req": "done"}, got
        assert all(e.stats()["transports"] == {"P": transport} for e in ds)
        if transport == "ipc":
            how = "cross-memory attach" if cma else "shared memory"
            assert all(e.stats()["transport_reasons"]["P"] == f"ipc: {how} on one host" for e in ds)
        for e in ds:  # the wire bytes counted: each group's layers over the tokens it moved
            per_layer = dst.bytes_per_token(num_heads=dst.heads_per_rank(tp_d)) // dst.num_layers
            want = 0
            for grp in GROUPS:
                lf = grp.live_first(n)
                lo = max(
                    max(first, lf) // dst.block_size * dst.block_size, lf // src.block_size * src.block_size
                )
                want += (n - lo) * per_layer * len(grp.layers)
            assert e.stats()["bytes"] == want
        for r, (_, caches) in enumerate(dst_st):
            heads = dst.heads_of_rank(r, tp_d)
            want = [torch.full_like(c.view(torch.uint8), POISON).view(dst.dtype) for c in caches]
            if aliased:
                want = [want[ALIAS.index(j)] for j in ALIAS]
            for g, grp in enumerate(GROUPS):
                # from the D block holding the first token needed, or P's first live token
                lf = grp.live_first(n)
                lo = max(
                    max(first, lf) // dst.block_size * dst.block_size, lf // src.block_size * src.block_size
                )
                _place(want, dst, truth, grp.layers, heads, dlists[g], range(lo, n))
            for layer, (a, b) in enumerate(zip(caches, want)):
                if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
                    diff = (a.view(torch.uint8) != b.view(torch.uint8)).nonzero()
                    raise AssertionError(
                        f"D rank {r} layer {layer}: {diff.shape[0]} bytes differ, first {diff[0].tolist()}"
                    )
        sent = _poll_all(ps, {"req"}, "send")
        assert sent == {"req": "done"}, sent
        assert all(e.stats()["blocks_held"] == 0 for e in ps)
        return ps, ds
    finally:
        for e in ps + ds:
            e.close()
        for store, _ in pst + dst_st:
            if store is not None:
                store.close()


def _spec(layout="NHD", bs=4, dtype=torch.float16, heads=4):
    return KVCacheSpec(6, heads, 8, bs, dtype, layout=layout)


NIXL = pytest.param(
    "nixl", marks=pytest.mark.skipif(bool(nixl_status()), reason=f"NIXL not importable here: {nixl_status()}")
)


@pytest.fixture(autouse=True)
def _ucx_loopback(monkeypatch):
    """UCX (the nixl transport) on loopback, as tests/test_nixl.py runs it."""
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")


@pytest.mark.parametrize("transport", ["ipc", "ipc-cma", "pg", NIXL])
@pytest.mark.parametrize(
    "src_layout,dst_layout,bs_p,bs_d,tp_p,tp_d,n",
    [
        ("NHD", "NHD", 4, 4, 1, 1, 29),
        ("NHD", "HND", 4, 8, 1, 2, 37),
        ("HND", "NHD", 8, 4, 2, 1, 45),
        ("HND", "HND", 16, 4, 2, 2, 33),
    ],
)
def test_groups_move_exactly(transport, src_layout, dst_layout, bs_p, bs_d, tp_p, tp_d, n):
    _run(transport, _spec(src_layout, bs_p), _spec(dst_layout, bs_d), tp_p, tp_d, n, seed=n)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16, torch.float32])
def test_groups_every_dtype(dtype):
    _run("ipc", _spec("NHD", 4, dtype), _spec("HND", 8, dtype), 1, 1, 27, seed=3)


@pytest.mark.parametrize("transport", ["ipc", "ipc-cma", "pg", NIXL])
def test_groups_on_aliased_layers(transport):
    """Caches laid out as vLLM's hybrid allocator does: the j-th layers of all groups one tensor
    (each group's blocks its own), on both sides. (Here a group's blocks read through another
    group's layers land the same: the cases above, one tensor per layer, catch that mix-up.)"""
    _run(transport, _spec("NHD", 4), _spec("HND", 8), 1, 2, 39, seed=9, aliased=True)


def test_groups_tp_1_to_4_and_short_prompt():
    """TP 1 -> 4 (one head per D rank) and a prompt shorter than every window (nothing dead)."""
    _run("ipc", _spec("NHD", 4), _spec("NHD", 8), 1, 4, 5, seed=5)


@pytest.mark.parametrize("transport", ["ipc", "pg", NIXL])
def test_groups_prefix_hit_on_d(transport):
    """D holds the first 16 tokens: only [16, n) of the full group, the sliding groups' windows
    (all after 16 here) move."""
    _run(transport, _spec("NHD", 4), _spec("HND", 8), 1, 1, 41, first=16, seed=7)


# ----------------------------------------------------------------------------- refusals
def _pair_1(transport="ipc", dst_groups=GROUPS, **kw):
    spec = _spec()
    pst, pc = _caches(spec, 1, True)
    dst_, dc = _caches(spec, 1, True)
    _fill(pc, GARBAGE)
    _fill(dc, POISON)
    p = TransferEngine(spec, pc, 0, 1, "P", transport=transport, lease_s=5.0, groups=GROUPS, **kw).start()
    d = TransferEngine(spec, dc, 0, 1, "D", transport=transport, lease_s=5.0, groups=dst_groups, **kw).start()
    return p, d, [pst, dst_]


def _close(objs):
    for o in objs:
        o.close()


def test_export_refuses_null_missing_repeated_by_group():
    p, d, st = _pair_1()
    try:
        n = 30  # window 13: tokens [18, 30) live, positions 4..7 of blocks of 4; window 6: [25, 30)
        full, w13, w6 = list(range(1, 9)), [0, 0, 0, 0, 11, 12, 13, 14], [0] * 6 + [21, 22]
        params = p.export("ok", [full, w13, w6], n)
        assert params["groups"] == [8, 4, 2]
        assert params["block_ids"] == [*full, 11, 12, 13, 14, 21, 22]
        with pytest.raises(ValueError, match=r"block_ids\[1\]: position 5 holds the null block"):
            p.export(
                "null", [[31, 32, 33, 34, 35, 36, 37, 38], [0, 0, 0, 0, 41, 0, 43, 44], [0] * 6 + [45, 46]], n
            )
        with pytest.raises(ValueError, match=r"block_ids\[2\]: .*needs 8 blocks"):
            p.export("short", [list(range(31, 39)), [0] * 4 + [41, 42, 43, 44], [45, 46]], n)
        with pytest.raises(ValueError, match=r"repeated block id .*share one pool"):
            p.export("twice", [list(range(31, 39)), [0] * 4 + [41, 42, 43, 38], [0] * 6 + [45, 46]], n)
        with pytest.raises(ValueError, match="one block list per group"):
            p.export("flat", list(range(31, 39)), n)
        # the full group's block 0 is the null block too
        with pytest.raises(ValueError, match=r"block_ids\[0\]: position 0 holds the null block"):
            p.export("zero", [[0, *range(32, 39)], [0] * 4 + [41, 42, 43, 44], [0] * 6 + [45, 46]], n)
        with pytest.raises(ValueError, match=r"block_ids\[1\]: position 4 holds the null block"):
            d.load("x", params, [list(range(1, 9)), [0] * 8, [0] * 6 + [21, 22]])
        assert p.stats()["blocks_held"] == 14  # only "ok"
    finally:
        _close([p, d, *st])


@pytest.mark.parametrize("transport", ["ipc", "pg"])
def test_altered_groups_refused(transport):
    """The token binds how the ids split into groups: params whose group boundaries moved, or
    whose two equal-sized groups swapped their ids, are refused, and nothing is written."""
    p, d, st = _pair_1(transport)
    try:
        n = 30
        lists = [list(range(1, 9)), [0] * 4 + [11, 12, 13, 14], [0] * 6 + [21, 22]]
        params = p.export("r", lists, n)
        moved = dict(params, groups=[7, 5, 2])
        ids = params["block_ids"]
        swapped = dict(params, block_ids=[*ids[:4], *ids[8:12], *ids[4:8], *ids[12:]])  # two halves swapped
        dl = [list(range(30, 38)), [0] * 4 + [40, 41, 42, 43], [0] * 6 + [44, 45]]
        d.load("moved", moved, dl)
        got = _poll_all([d], {"moved"}, "recv")
        assert got["moved"].startswith("failed"), got
        d.load("swapped", swapped, dl)
        got = _poll_all([d], {"swapped"}, "recv")
        assert got["swapped"].startswith("failed"), got
        assert all(torch.all(c.view(torch.uint8) == POISON) for c in st[1].caches), "nothing written"
        d.load("good", params, dl)
        assert _poll_all([d], {"good"}, "recv") == {"good": "done"}
    finally:
        _close([p, d, *st])


def test_handshake_refuses_other_groups():
    other = [AttentionGroup((0, 3)), AttentionGroup((1, 4), window=12), AttentionGroup((2, 5), window=6)]
    p, d, st = _pair_1(dst_groups=other)
    try:
        params = p.export("r", [list(range(1, 9)), [0] * 4 + [11, 12, 13, 14], [0] * 6 + [21, 22]], 30)
        d.load("r", params, [list(range(30, 38)), [0] * 4 + [40, 41, 42, 43], [0] * 6 + [44, 45]])
        got = _poll_all([d], {"r"}, "recv")
        assert "KV cache group 1 differs" in got["r"], got
    finally:
        _close([p, d, *st])


def test_ungrouped_loader_refuses_grouped_exporter():
    spec = _spec()
    pst, pc = _caches(spec, 1, True)
    dst_, dc = _caches(spec, 1, True)
    p = TransferEngine(spec, pc, 0, 1, "P", transport="ipc", groups=GROUPS).start()
    d = TransferEngine(spec, dc, 0, 1, "D", transport="ipc").start()
    try:
        params = p.export("r", [list(range(1, 9)), [0] * 4 + [11, 12, 13, 14], [0] * 6 + [21, 22]], 30)
        d.load("r", params, list(range(30, 38)))
        got = _poll_all([d], {"r"}, "recv")
        assert "KV cache groups" in got["r"], got
    finally:
        _close([p, d, pst, dst_])


def test_group_set_checks():
    spec = _spec()
    caches = [torch.zeros(spec.cache_shape(4, 1), dtype=spec.dtype) for _ in range(6)]
    with pytest.raises(ValueError, match="layer 3 is already in groups"):
        TransferEngine(
            spec, caches, 0, 1, "E", groups=[AttentionGroup((0, 1, 2, 3)), AttentionGroup((3, 4, 5))]
        )
    with pytest.raises(ValueError, match="layer 5 is in no group"):
        TransferEngine(spec, caches, 0, 1, "E", groups=[AttentionGroup((0, 1, 2, 3, 4))])
    with pytest.raises(ValueError, match="layer 6 out of range"):
        TransferEngine(spec, caches, 0, 1, "E", groups=[AttentionGroup(range(7))])
    with pytest.raises(ValueError, match="window"):
        AttentionGroup((0,), window=0)
    with pytest.raises(ValueError, match="extra_retained_tokens: only a sliding-window group"):
        AttentionGroup((0,), extra_retained_tokens=1)


@pytest.mark.parametrize("transport", ["ipc", "pg"])
def test_groups_layer_wise_export(transport):
    """A layer-wise export of a grouped request: D pulls each group's layers as P marks them."""
    spec = _spec("NHD", 4)
    pst, pc = _caches(spec, 1, transport == "ipc")
    dst_, dc = _caches(spec, 1, transport == "ipc")
    _fill(pc, GARBAGE)
    _fill(dc, POISON)
    p = TransferEngine(spec, pc, 0, 1, "P", transport=transport, groups=GROUPS).start()
    d = TransferEngine(spec, dc, 0, 1, "D", transport=transport, groups=GROUPS).start()
    try:
        n = 30
        truth = _truth(spec, LAYER_GROUP, n, 11)
        pl = [list(range(1, 9)), [0] * 4 + [11, 12, 13, 14], [0] * 6 + [21, 22]]
        dl = [list(range(30, 38)), [0] * 4 + [40, 41, 42, 43], [0] * 6 + [44, 45]]
        params = p.export("r", pl, n, streaming=True)
        d.load("r", params, dl)
        for layers in ([0, 1, 2], [3, 4, 5]):
            for g, grp in enumerate(GROUPS):
                lo = grp.live_first(n) // 4 * 4
                _place(pc, spec, truth, [x for x in grp.layers if x in layers], range(4), pl[g], range(lo, n))
            d.poll()
            p.mark_ready("r", layers)
        assert _poll_all([d], {"r"}, "recv") == {"r": "done"}
        want = [torch.full_like(c.view(torch.uint8), POISON).view(spec.dtype) for c in dc]
        for g, grp in enumerate(GROUPS):
            _place(want, spec, truth, grp.layers, range(4), dl[g], range(grp.live_first(n) // 4 * 4, n))
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(dc, want))
    finally:
        _close([p, d] + ([pst, dst_] if pst is not None else []))


def test_windows_end_at_computed_tokens():
    """Whole blocks exported past the last computed token (vLLM's CPU pages): the windows end
    at ``computed_tokens``, so the blocks they need move even when ``num_tokens`` rounds up; a
    loader that needs earlier tokens than the exporter holds fails, naming the group."""
    p, d, st = _pair_1()
    spec = _spec()
    try:
        n, c = 32, 27  # window 6 ends at 27: tokens [22, 27) needed, in blocks 5 and 6
        truth = _truth(spec, LAYER_GROUP, n, 13)
        pl = [list(range(1, 9)), [0] * 3 + [11, 12, 13, 14, 15], [0] * 5 + [21, 22, 23]]
        dl = [list(range(30, 38)), [0] * 3 + [40, 41, 42, 43, 44], [0] * 5 + [45, 46, 47]]
        for g, grp in enumerate(GROUPS):
            lo = grp.live_first(c) // 4 * 4
            _place(st[0].caches, spec, truth, grp.layers, range(4), pl[g], range(lo, n))
        params = p.export("r", pl, n, computed_tokens=c)
        assert params["groups"] == [8, 5, 3]
        d.load("r", params, dl, computed_tokens=c)
        assert _poll_all([d], {"r"}, "recv") == {"r": "done"}
        want = [torch.full_like(x.view(torch.uint8), POISON).view(spec.dtype) for x in st[1].caches]
        for g, grp in enumerate(GROUPS):
            _place(want, spec, truth, grp.layers, range(4), dl[g], range(grp.live_first(c) // 4 * 4, n))
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(st[1].caches, want))
        # measured at 32, P holds window 13's blocks from token 20 on; a loader measuring at 27
        # needs token 15 on
        params = p.export("late", [list(range(1, 9)), [0] * 4 + [11, 12, 13, 14], [0] * 6 + [21, 22]], n)
        d.load("late", params, dl, computed_tokens=c)
        got = _poll_all([d], {"late"}, "recv")
        assert "params.groups[1]: the exporter holds tokens [20, 32)" in got["late"], got
        assert "this load needs them from token 15" in got["late"], got
        with pytest.raises(ValueError, match="computed_tokens: must be an int in"):
            p.export("bad", pl, n, computed_tokens=33)
    finally:
        _close([p, d, *st])


def test_one_lease_over_the_union_and_a_released_export_is_not_delivered():
    """The export holds every group's live blocks (one count each: 8 + 4 + 2); an export
    released before the load is never delivered, and nothing of D is written (the first load
    of a peer handshakes: the messaged path)."""
    p, d, st = _pair_1()
    try:
        pl = [list(range(1, 9)), [0] * 4 + [11, 12, 13, 14], [0] * 6 + [21, 22]]
        params = p.export("r", pl, 30)
        assert p.stats()["blocks_held"] == 14
        assert p._rt.exports.refcount[[*range(1, 9), 11, 12, 13, 14, 21, 22]].tolist() == [1] * 14
        assert int(p._rt.exports.refcount.sum()) == 14
        assert p.abort_export("r")
        assert p.stats()["blocks_held"] == 0
        d.load("r", params, [list(range(30, 38)), [0] * 4 + [40, 41, 42, 43], [0] * 6 + [44, 45]])
        got = _poll_all([d], {"r"}, "recv")
        assert got["r"].startswith("failed"), got
        assert all(torch.all(c.view(torch.uint8) == POISON) for c in st[1].caches)
        assert d.stats()["onesided"]["fallbacks"] == {"not handshaken": 1}
    finally:
        _close([p, d, *st])


@pytest.mark.parametrize("transport", ["ipc", "pg", NIXL])
def test_several_grouped_loads_in_one_batch(transport):
    """Three grouped requests of different lengths loaded before one poll (one batch: per
    group, the planner packs all three), P blocks of 4 and D blocks of 8; params_for gives the
    params export then returns."""
    src, dst = _spec("NHD", 4), _spec("HND", 8)
    shm = transport == "ipc"
    pst, pc = _caches(src, 1, shm)
    dst_, dc = _caches(dst, 1, shm)
    _fill(pc, GARBAGE)
    _fill(dc, POISON)
    p = TransferEngine(src, pc, 0, 1, "P", transport=transport, groups=GROUPS).start()
    d = TransferEngine(dst, dc, 0, 1, "D", transport=transport, groups=GROUPS).start()
    rng = random.Random(4)
    try:
        reqs = []
        pool_p, pool_d = list(range(1, NB)), list(range(1, NB))
        rng.shuffle(pool_p)
        rng.shuffle(pool_d)
        for i, n in enumerate((29, 8, 21)):
            truth = _truth(src, LAYER_GROUP, n, 20 + i)
            pl, dl = [], []
            for grp in GROUPS:
                need_p, need_d = -(-n // 4), -(-n // 8)
                dead_p, dead_d = grp.live_first(n) // 4, grp.live_first(n) // 8
                pl.append([0] * dead_p + [pool_p.pop() for _ in range(need_p - dead_p)])
                dl.append([0] * dead_d + [pool_d.pop() for _ in range(need_d - dead_d)])
            for g, grp in enumerate(GROUPS):
                _place(pc, src, truth, grp.layers, range(4), pl[g], range(grp.live_first(n) // 4 * 4, n))
            before = p.params_for(f"r{i}", pl, n)
            params = p.export(f"r{i}", pl, n)
            assert params == before
            reqs.append((f"r{i}", n, truth, params, dl))
        for rid, _, _, params, dl in reqs:
            d.load(rid, params, dl)
        assert _poll_all([d], {r[0] for r in reqs}, "recv") == dict.fromkeys([r[0] for r in reqs], "done")
        want = [torch.full_like(c.view(torch.uint8), POISON).view(dst.dtype) for c in dc]
        for _, n, truth, _, dl in reqs:
            for g, grp in enumerate(GROUPS):
                lf = grp.live_first(n)
                lo = max(lf // 8 * 8, lf // 4 * 4)
                _place(want, dst, truth, grp.layers, range(4), dl[g], range(lo, n))
        for layer, (a, b) in enumerate(zip(dc, want)):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"layer {layer}"
        assert _poll_all([p], {r[0] for r in reqs}, "send") == dict.fromkeys([r[0] for r in reqs], "done")
        assert p.stats()["blocks_held"] == 0
    finally:
        _close([d, p] + [x for x in (pst, dst_) if x is not None])


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_grouped_one_sided_reads_land_straight_in_d_over_cma(layout):
    """Plain CPU caches laid out alike on P and D (vLLM's served case): the second grouped
    request is read one-sided by cross-memory attach straight into D's caches (no mirror),
    each group's live blocks from its first needed block, the partial last block's later rows
    left as they were; every byte of D checked against the expectation."""
    spec = _spec(layout, 4)
    rng = random.Random(5)
    ps, pst = _engines(spec, 1, "P", "ipc", False, free_port_base(1))
    ds, dst_st = _engines(spec, 1, "D", "ipc", False, free_port_base(1))
    p, d, pc, dc = ps[0], ds[0], pst[0][1], dst_st[0][1]
    try:
        want = [torch.full_like(c.view(torch.uint8), POISON).view(spec.dtype) for c in dc]
        used: set[int] = set()
        for k, n in enumerate([22, 27]):  # the first handshakes (messaged), the second is one-sided
            truth = _truth(spec, LAYER_GROUP, n, seed=40 + k)
            plists = _lists(rng, GROUPS, n, spec.block_size)  # P's first export was freed: reused
            dlists = _lists(rng, GROUPS, n, spec.block_size)
            fresh = iter(b for b in range(1, NB) if b not in used)  # D's: none of the first's
            dlists = [[next(fresh) if b else 0 for b in x] for x in dlists]
            used |= {b for x in dlists for b in x if b}
            _fill(pc, GARBAGE)
            for g, grp in enumerate(GROUPS):
                lo = grp.live_first(n) // spec.block_size * spec.block_size
                _place(pc, spec, truth, grp.layers, range(spec.num_kv_heads), plists[g], range(lo, n))
                _place(want, spec, truth, grp.layers, range(spec.num_kv_heads), dlists[g], range(lo, n))
            prm = p.export(f"r{k}", plists, n)
            d.load(f"r{k}", prm, dlists)
            assert _poll_all([d], {f"r{k}"}, "recv") == {f"r{k}": "done"}
            assert _poll_all([p], {f"r{k}"}, "send") == {f"r{k}": "done"}
        st = d.stats()["onesided"]
        assert (st["loads"], st["direct"]) == (1, 1), st
        for layer, (a, b) in enumerate(zip(dc, want)):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"layer {layer}"
    finally:
        _close([p, d])
