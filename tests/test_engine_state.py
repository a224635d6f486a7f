"""A hybrid request through real engines: attention groups (full + sliding) and a state group
(GDN or Mamba2) whose running state page moves whole.

The caches are laid out as vLLM's hybrid allocator does (docs/research/vllm-hybrid.md §1.4,
§3.3): one raw byte region per layer index ``j``, shared by layer ``j`` of every group, one page
per block; attention layers see it through an attention view ``[2, blocks, ...]`` whose block
``b`` is page ``b``; a state layer's page holds its conv state, then its SSM state, then
padding. P's state pages hold seeded noise stamped with (layer, block) written through the
state's typed views (conv ``[state_len, conv_dim]``, SSM ``[heads, V, K]``); every other byte
of P is garbage that must never arrive, every byte of D poison. After the load every byte of D
must equal an independently built expectation: the attention groups' live tokens at D's
positions, P's whole state page (padding included) at D's state block, poison elsewhere.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvxfer import AttentionGroup, KVCacheSpec, Layout, StateGroup, StateSpec, TransferEngine
from kvxfer.groups.state_group import page_view
from kvxfer.ports import free_port_base
from kvxfer.transports.ipc.shm import alloc_shm_caches
from kvxfer.transports.nixl.agent import nixl_status

from . import statedata
from .test_engine_groups import GARBAGE, KEY, POISON, _fill, _place, _poll_all, _truth

NB = 40
REGION = [0, 0, 0, 1, 1, 1]  # layer j of every group shares region j (vLLM's KVCacheTensor)
LAYER_GROUP = [0, 1, 2, 0, 1, 2]


def _spec(layout="NHD", bs=4, heads=4, dtype=torch.float16) -> KVCacheSpec:
    return KVCacheSpec(6, heads, 8, bs, dtype, layout=layout)


def _block_bytes(spec: KVCacheSpec, tp: int) -> int:
    return spec.bytes_per_token(spec.heads_per_rank(tp), 1) * spec.block_size


def _state(kind: str, spec: KVCacheSpec, tp: int, **kw) -> StateSpec:
    page = _block_bytes(spec, tp)
    if kind == "gdn":
        return StateSpec.gdn(
            2, 2, 4, 4, 4, 4, torch.float16, torch.float32, tp_size=tp, page_size_bytes=page, **kw
        )
    return StateSpec.mamba2(
        2, 4, 4, 1, 4, 4, torch.bfloat16, torch.float32, tp_size=tp, page_size_bytes=page, **kw
    )


def _groups(state: StateSpec, num_spec: int = 0, positional: bool = False) -> list:
    return [
        AttentionGroup((0, 3)),
        AttentionGroup((1, 4), window=9),
        StateGroup((2, 5), state, num_spec, positional),
    ]


def _regions(
    spec: KVCacheSpec, tp: int, aliased: bool = True
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Raw page regions (uint8 ``[NB, page]``) and each layer index's attention view over them
    (``aliased``: layer j of every group on region j, as vLLM; else a region per layer, so a
    group read through another group's layers shows)."""
    page = _block_bytes(spec, tp)
    h = spec.heads_per_rank(tp)
    if not aliased:
        raws = [torch.empty(NB, page, dtype=torch.uint8) for _ in range(6)]
        inner = (
            (2, spec.block_size, h, spec.head_dim)
            if spec.layout is Layout.NHD
            else (2, h, spec.block_size, spec.head_dim)
        )
        return raws, [r.view(spec.dtype).view(NB, *inner).transpose(0, 1) for r in raws]
    raws = [torch.empty(NB, page, dtype=torch.uint8) for _ in range(2)]
    if spec.layout is Layout.NHD:
        inner = (2, spec.block_size, h, spec.head_dim)
    else:
        inner = (2, h, spec.block_size, spec.head_dim)
    views = [r.view(spec.dtype).view(NB, *inner).transpose(0, 1) for r in raws]
    return raws, [views[REGION[j]] for j in range(6)]


def _state_pages(st: StateSpec, raw: torch.Tensor, block: int, layer: int, seed: int) -> None:
    """Write a state into ``raw``'s page ``block`` through the typed views, stamped with
    (layer, block): conv in ``st.conv_shape`` (conv_dtype), then SSM in ``st.ssm_shape``."""
    g = torch.Generator().manual_seed(seed * 1000 + layer * 100 + block)
    conv = raw[block, : st.conv_bytes].view(st.conv_dtype).view(st.conv_shape)
    ssm = raw[block, st.conv_bytes : st.content_bytes].view(st.ssm_dtype).view(st.ssm_shape)
    conv.copy_(torch.randn(st.conv_shape, generator=g).to(st.conv_dtype))
    ssm.copy_(torch.randn(st.ssm_shape, generator=g).to(st.ssm_dtype))
    raw[block, :2] = torch.tensor([layer, block], dtype=torch.uint8)


def _lists(
    rng: random.Random, groups, n: int, bs: int, num_spec: int = 0, align: bool = False
) -> list[list[int]]:
    """Positional lists of the attention groups (a sliding group's dead positions null) and the
    state group's ``[state, *scratch]`` (``align``: vLLM's prefix-caching mode, positional: null
    entries, then the state in the last computed token's block), from one pool without block 0."""
    need = -(-n // bs)
    pool = rng.sample(range(1, NB), need * 2 + 1 + num_spec)
    out = []
    for i, g in enumerate(groups[:2]):
        ids = pool[i * need : (i + 1) * need]
        dead = g.live_first(n) // bs
        out.append([0] * dead + ids[dead:])
    out.append([0] * (need - 1) + pool[2 * need :] if align else pool[2 * need :])
    return out


def _engines(spec, tp, name, transport, kind, num_spec=0, shm=False, port=0, positional=False):
    engs, stores = [], []
    for r in range(tp):
        if shm:  # planes-outer caches in shared memory: a block's bytes are its K and V rows
            two = KVCacheSpec(
                2, spec.num_kv_heads, spec.head_dim, spec.block_size, spec.dtype, layout=spec.layout
            )
            store = alloc_shm_caches(two, NB, tp)
            raws, caches = None, [store.caches[REGION[j]] for j in range(6)]
        else:
            store, (raws, caches) = None, _regions(spec, tp)
        _fill(caches, POISON)
        stores.append((store, raws, caches))
        eng = TransferEngine(
            spec, caches, r, tp, name, transport=transport, lease_s=10.0, port=port, auth_key=KEY,
            groups=_groups(_state(kind, spec, tp), num_spec, positional),
        )  # fmt: skip
        engs.append(eng.start())
    return engs, stores


def _run(transport: str, spec: KVCacheSpec, tp: int, n: int, kind: str = "gdn", first: int = 0, seed: int = 0,
         num_spec: int = 0, shm: bool = False, align: bool = False, positional: bool = False):  # fmt: skip
    rng = random.Random(seed)
    cma = transport == "ipc-cma"
    transport = "ipc" if cma else transport
    ps, pst = _engines(
        spec, tp, "P", transport, kind, 0, shm, free_port_base(tp) if tp > 1 else 0, positional
    )
    ds, dst = _engines(spec, tp, "D", transport, kind, num_spec, shm, free_port_base(tp) if tp > 1 else 0,
                       positional)  # fmt: skip
    try:
        groups = _groups(_state(kind, spec, tp))
        truth = _truth(spec, LAYER_GROUP, n, seed)
        plists = _lists(rng, groups, n, spec.block_size, align=align or positional)
        dlists = _lists(rng, groups, n, spec.block_size, num_spec, align=positional)
        need = -(-n // spec.block_size)
        if positional:  # D allocated one block more (for the token it computes next): not the state's
            used = {b for lst in plists + dlists for b in lst}
            dlists[2].append(next(b for b in range(1, NB) if b not in used))
        for r, (_, raws, caches) in enumerate(pst):
            _fill(caches, GARBAGE)
            heads = spec.heads_of_rank(r, tp)
            for g, grp in enumerate(groups[:2]):
                lo = grp.live_first(n) // spec.block_size * spec.block_size
                _place(caches, spec, truth, grp.layers, heads, plists[g], range(lo, n))
            st = groups[2].state
            for i, layer in enumerate(groups[2].layers):
                if raws is not None:
                    _state_pages(st, raws[REGION[layer]], plists[2][-1], i, seed * 10 + r)
                else:  # shm planes: the state block's K and V rows, stamped
                    gen = torch.Generator().manual_seed(seed * 10 + r + i)
                    blk = caches[layer].view(torch.uint8)[:, plists[2][-1]]
                    blk.copy_(torch.randint(0, 256, blk.shape, generator=gen, dtype=torch.uint8))
        params = [e.export("req", plists, n) for e in ps]
        assert params[0]["groups"][-1] == 1
        assert params[0]["block_ids"][-1] == plists[2][-1]
        for e in ds:
            e.load("req", params[0], dlists, num_computed_tokens=first)
        got = _poll_all(ds, {"req"}, "recv")
        assert got == {"req": "done"}, got
        dstate = dlists[2][need - 1] if positional else dlists[2][len(dlists[2]) - 1 - num_spec]
        for r, ((_, _, pc), (_, _, dc)) in enumerate(zip(pst, dst)):
            heads = spec.heads_of_rank(r, tp)
            regions = [dc[REGION.index(k)].clone() for k in (0, 1)]  # the same strides as D's
            for w in regions:
                w.view(torch.uint8).fill_(POISON)
            want = [regions[REGION[j]] for j in range(6)]
            for g, grp in enumerate(groups[:2]):
                lf = grp.live_first(n)
                lo = max(
                    max(first, lf) // spec.block_size * spec.block_size,
                    lf // spec.block_size * spec.block_size,
                )
                _place(want, spec, truth, grp.layers, heads, dlists[g], range(lo, n))
            for layer in groups[2].layers:  # the state page, whole, at D's state block
                want[layer].view(torch.uint8)[:, dstate] = pc[layer].view(torch.uint8)[:, plists[2][-1]]
            for j in (0, 3):  # each region once
                a, b = dc[j].view(torch.uint8), want[j].view(torch.uint8)
                if not torch.equal(a, b):
                    diff = (a != b).nonzero()
                    raise AssertionError(
                        f"D rank {r} region {REGION[j]}: {diff.shape[0]} bytes differ, first {diff[0].tolist()}"
                    )
        sent = _poll_all(ps, {"req"}, "send")
        assert sent == {"req": "done"}, sent
        assert all(e.stats()["blocks_held"] == 0 for e in ps)
    finally:
        for e in ps + ds:
            e.close()
        for store, _, _ in pst + dst:
            if store is not None:
                store.close()


NIXL = pytest.param(
    "nixl", marks=pytest.mark.skipif(bool(nixl_status()), reason=f"NIXL not importable here: {nixl_status()}")
)


@pytest.fixture(autouse=True)
def _ucx_loopback(monkeypatch):
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")


@pytest.mark.parametrize("transport", ["ipc-cma", "pg", NIXL])
@pytest.mark.parametrize("kind", ["gdn", "mamba2"])
def test_state_group_moves_its_page_whole(transport, kind):
    _run(transport, _spec("NHD"), 1, 29, kind, seed=1)


@pytest.mark.parametrize("transport", ["ipc-cma", "pg"])
def test_state_group_tp2_hnd(transport):
    """Two ranks each: every rank's own state shard moves rank to rank (HND attention)."""
    _run(transport, _spec("HND", bs=8), 2, 37, "mamba2", seed=2)


def test_state_group_on_shared_memory_caches():
    """``ipc`` over shared memory, K and V planes apart: a state block is its K and V rows."""
    _run("ipc", _spec("NHD"), 1, 23, "gdn", seed=3, shm=True)


def test_state_group_speculative_blocks_and_prefix_hit():
    """D's list ends in a speculative scratch block (the state is the entry before it) and D
    holds tokens [0, 8): the state moves whole all the same. P's list is positional (vLLM's
    "align" mode: null entries, then the state)."""
    _run("ipc-cma", _spec("NHD"), 1, 30, "gdn", first=8, seed=4, num_spec=1, align=True)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16, torch.float32])
def test_state_group_every_kv_dtype(dtype):
    _run("pg", _spec("NHD", heads=8, dtype=dtype), 1, 17, "gdn", seed=5)


# ----------------------------------------------------------------------------- refusals
def test_state_group_checks_its_pages_and_layers():
    spec = _spec()
    _, caches = _regions(spec, 1)
    with pytest.raises(ValueError, match="do not fit one block"):
        TransferEngine(
            spec, caches, 0, 1, "x", groups=_groups(StateSpec.gdn(2, 8, 8, 8, 8, 4, torch.float32))
        )
    with pytest.raises(ValueError, match="its tp_size is 2, the engine's 1"):
        TransferEngine(spec, caches, 0, 1, "x", groups=_groups(_state("gdn", spec, 2)))
    with pytest.raises(ValueError, match="describes 2 layers, the group has 1"):
        StateGroup((2,), _state("gdn", spec, 1))
    with pytest.raises(ValueError, match="layer 2 is already in groups"):
        TransferEngine(spec, caches, 0, 1, "x", groups=[AttentionGroup((0, 1, 2, 3, 4, 5)),
                                                          StateGroup((2, 5), _state("gdn", spec, 1))])  # fmt: skip


def test_export_refuses_a_null_or_missing_state_block():
    spec = _spec()
    _, caches = _regions(spec, 1)
    p = TransferEngine(spec, caches, 0, 1, "P", groups=_groups(_state("gdn", spec, 1), 1)).start()
    try:
        full, w9 = list(range(1, 9)), [0, 0, 0, 0, 0, 11, 12, 13]
        with pytest.raises(
            ValueError,
            match=r"block_ids\[2\] \(gdn state, layers \[2, 5\]\): the state block .* is the null block",
        ):
            p.export("a", [full, w9, [0, 30]], 30)
        with pytest.raises(ValueError, match=r"block_ids\[2\] \(gdn state.*1 entries"):
            p.export("b", [full, w9, [30]], 30)
        with pytest.raises(ValueError, match=r"repeated block id"):
            p.export("c", [full, w9, [8, 31]], 30)
        params = p.export("d", [full, w9, [30, 31]], 30)
        assert params["block_ids"][-1] == 30 and params["groups"] == [8, 3, 1]
        assert p.stats()["blocks_held"] == 12
    finally:
        p.close()


def _refused(
    dst_spec: KVCacheSpec, dst_state: StateSpec, match: str, transport: str = "pg", planes=False
) -> None:
    src = _spec()
    _, pc = _regions(src, 1)
    _, dc = _regions(dst_spec, 1)
    if planes:
        dc = [torch.empty(dst_spec.cache_shape(NB, 1), dtype=dst_spec.dtype) for _ in range(6)]
    _fill(pc, GARBAGE)
    _fill(dc, POISON)
    p = TransferEngine(src, pc, 0, 1, "P", transport=transport, lease_s=5.0, auth_key=KEY,
                       groups=_groups(_state("gdn", src, 1))).start()  # fmt: skip
    d = TransferEngine(dst_spec, dc, 0, 1, "D", transport=transport, lease_s=5.0, auth_key=KEY,
                       groups=_groups(dst_state)).start()  # fmt: skip
    try:
        n = 20
        params = p.export("r", [list(range(1, 6)), [0, 0, 0, 9, 10], [20]], n)
        nb = -(-n // dst_spec.block_size)
        d.load("r", params, [list(range(1, 1 + nb)), [0] * (nb - 2) + [21, 22], [30]])
        got = _poll_all([d], {"r"}, "recv")
        assert got["r"].startswith("failed") and "KV cache group" in got["r"], got
        assert match in got["r"], got
        for c in dc:
            assert torch.equal(c.view(torch.uint8), torch.full_like(c.view(torch.uint8), POISON))
    finally:
        p.close()
        d.close()


def test_another_state_dtype_is_refused_by_name():
    other = StateSpec.gdn(2, 2, 4, 4, 4, 4, torch.bfloat16, torch.float32, page_size_bytes=512)
    _refused(_spec(), other, "conv_dtype differs")


def test_resharding_needs_whole_pages():
    """D's caches keep K and V planes apart (not vLLM's hybrid layout) and its layout differs
    from P's: the state cannot be copied unit by unit into them, and the handshake says why."""
    _refused(_spec("HND"), _state("gdn", _spec("HND"), 1), "not one contiguous page", planes=True)


# ------------------------------------------------------------------ re-sharded over ipc
def _many_lists(rng: random.Random, groups, n: int, bs: int, count: int) -> list[list[list[int]]]:
    """:func:`_lists` for ``count`` requests, from one pool: no block in two of them."""
    need = -(-n // bs)
    pool = iter(rng.sample(range(1, NB), (2 * need + 1) * count))
    out = []
    for _ in range(count):
        ids = [next(pool) for _ in range(2 * need + 1)]
        one = random.Random(0)
        one.sample = lambda _range, k, ids=ids: ids[:k]  # draw this request's own ids in order
        out.append(_lists(one, groups, n, bs))
    return out


def _run_resharded(src: KVCacheSpec, tp_p: int, dst: KVCacheSpec, tp_d: int, kind: str, n: int, seed: int = 0,
                   src_kw: dict | None = None, dst_kw: dict | None = None, transport: str = "ipc",
                   requests: int = 1, aliased: bool = True):  # fmt: skip
    """P and D laid out otherwise (TP, block size, layout, conv layout, SSM order): the state
    group's units are copied out of P's mapped pages into D's layout; every byte of D checked
    against the naive model of :mod:`tests.statedata` (the state content at D's state block,
    the page's padding and every other byte poison; laid out alike, P's whole page). ``requests`` are exported and loaded one
    after another (the second finds P mapped: one-sided over ``ipc``); returns D rank 0's
    stats."""
    rng = random.Random(seed)
    ps_state = _state(kind, src, tp_p, **(src_kw or {}))
    ds_state = _state(kind, dst, tp_d, **(dst_kw or {}))
    t = statedata.truth(ps_state, requests, seed)
    whole = (src, tp_p, ps_state.to_dict()) == (dst, tp_d, ds_state.to_dict())
    rids = [f"req{k}" for k in range(requests)]

    def engines(spec, tp, name, st):
        base = free_port_base(tp) if tp > 1 else 0
        out, regions = [], []
        for r in range(tp):
            raws, caches = _regions(spec, tp, aliased)
            _fill(caches, POISON)
            regions.append((raws, caches))
            eng = TransferEngine(spec, caches, r, tp, name, transport=transport, lease_s=30.0, port=base,
                                 auth_key=KEY, groups=_groups(st))  # fmt: skip
            out.append(eng.start())
        return out, regions

    ps, pst = engines(src, tp_p, "P", ps_state)
    ds, dst_ = engines(dst, tp_d, "D", ds_state)
    try:
        groups = _groups(ps_state)
        truths = [_truth(src, LAYER_GROUP, n, seed + k) for k in range(requests)]
        plists = _many_lists(rng, groups, n, src.block_size, requests)
        dlists = _many_lists(rng, groups, n, dst.block_size, requests)
        for r, (_raws, caches) in enumerate(pst):
            _fill(caches, GARBAGE)
            heads = src.heads_of_rank(r, tp_p)
            for k in range(requests):
                for g, grp in enumerate(groups[:2]):
                    lo = grp.live_first(n) // src.block_size * src.block_size
                    _place(caches, src, truths[k], grp.layers, heads, plists[k][g], range(lo, n))
            pages = [page_view(caches[x]) for x in groups[2].layers]
            statedata.place(pages, ps_state, r, t, [pl[2][-1] for pl in plists])
        for k, rid in enumerate(rids):
            params = [e.export(rid, plists[k], n) for e in ps]
            for e in ds:
                e.load(rid, params[0], dlists[k])
            got = _poll_all(ds, {rid}, "recv")
            assert got == {rid: "done"}, got
        assert all(e.stats()["transports"] == {"P": transport} for e in ds)
        for r, (_, dc) in enumerate(dst_):
            heads = dst.heads_of_rank(r, tp_d)
            region = REGION if aliased else list(range(6))
            regions = [dc[region.index(k)].clone() for k in sorted(set(region))]
            for w in regions:
                w.view(torch.uint8).fill_(POISON)
            want = [regions[region[j]] for j in range(6)]
            for k in range(requests):
                for g, grp in enumerate(groups[:2]):
                    lf = grp.live_first(n)
                    lo = max(lf // dst.block_size * dst.block_size, lf // src.block_size * src.block_size)
                    _place(want, dst, truths[k], grp.layers, heads, dlists[k][g], range(lo, n))
            wpages = [page_view(want[x]) for x in groups[2].layers]
            if whole:  # laid out alike: the page moves whole, P's padding included
                ppages = [page_view(pst[r][1][x]) for x in groups[2].layers]
                for wp, pp in zip(wpages, ppages):
                    for pl, dl in zip(plists, dlists):
                        wp[dl[2][-1]] = pp[pl[2][-1]]
            else:
                statedata.place(wpages, ds_state, r, t, [dl[2][-1] for dl in dlists])
            for j in sorted({region.index(k) for k in region}):  # each region once
                a, b = dc[j].view(torch.uint8), want[j].view(torch.uint8)
                if not torch.equal(a, b):
                    diff = (a != b).nonzero()
                    raise AssertionError(f"D rank {r} region {region[j]}: {diff.shape[0]} bytes differ, first {diff[0].tolist()}")  # fmt: skip
        sent = _poll_all(ps, set(rids), "send")
        assert sent == dict.fromkeys(rids, "done"), sent
        assert all(e.stats()["blocks_held"] == 0 for e in ps)
        return ds[0].stats()
    finally:
        for e in ps + ds:
            e.close()


@pytest.mark.parametrize(
    "kind,src_layout,bs_p,tp_p,dst_layout,bs_d,tp_d,src_kw,dst_kw",
    [
        ("gdn", "NHD", 4, 2, "NHD", 4, 1, {}, {}),  # TP 2 -> 1
        (
            "gdn",
            "HND",
            8,
            1,
            "NHD",
            4,
            2,
            {},
            {"conv_layout": "DS", "ssm_transposed": True},
        ),  # 1 -> 2, every layout
        ("mamba2", "NHD", 4, 1, "HND", 4, 2, {}, {"conv_layout": "DS"}),  # B and C replicated on D
        ("mamba2", "HND", 4, 2, "NHD", 8, 1, {"conv_layout": "DS"}, {}),  # 2 -> 1, replicas read once
        ("gdn", "NHD", 4, 1, "NHD", 4, 1, {}, {"conv_layout": "DS"}),  # same TP, another conv layout
    ],
)
def test_state_group_resharded_over_ipc(kind, src_layout, bs_p, tp_p, dst_layout, bs_d, tp_d, src_kw, dst_kw):
    _run_resharded(_spec(src_layout, bs_p), tp_p, _spec(dst_layout, bs_d), tp_d, kind, 33, 7, src_kw, dst_kw)


@pytest.mark.parametrize("transport", ["pg", NIXL])
@pytest.mark.parametrize(
    "kind,src_layout,bs_p,tp_p,dst_layout,bs_d,tp_d,src_kw,dst_kw",
    [
        ("gdn", "NHD", 4, 2, "HND", 8, 1, {}, {"conv_layout": "DS", "ssm_transposed": True}),  # 2 -> 1
        ("mamba2", "HND", 8, 1, "NHD", 4, 2, {"conv_layout": "DS"}, {}),  # 1 -> 2, B and C replicated
    ],
)
def test_state_group_resharded_over_a_staged_stream(
    transport, kind, src_layout, bs_p, tp_p, dst_layout, bs_d, tp_d, src_kw, dst_kw
):
    """``pg`` and staged ``nixl``: each source rank streams its whole state pages into a landing
    laid out as its own, and D's units are copied out of it."""
    _run_resharded(
        _spec(src_layout, bs_p), tp_p, _spec(dst_layout, bs_d), tp_d, kind, 29, 9, src_kw, dst_kw, transport
    )


def test_another_state_model_is_refused_by_name():
    _refused(_spec(), StateSpec.gdn(2, 2, 4, 4, 4, 3, torch.float16, torch.float32, page_size_bytes=512),
             "state_len differs", transport="ipc")  # fmt: skip


@pytest.mark.parametrize("resharded", [False, True])
def test_grouped_loads_read_one_sided(resharded):
    """The second of two hybrid requests finds P mapped and reads one-sided over ``ipc`` (no
    message before the copy): every group planned as the messaged path plans it, a re-sharded
    state's units copied from the mapped pages; every byte checked as above."""
    if resharded:
        st = _run_resharded(_spec("NHD"), 2, _spec("HND", bs=8), 1, "gdn", 27, 11, {}, {"conv_layout": "DS"},
                            requests=2)  # fmt: skip
    else:
        st = _run_resharded(_spec("NHD"), 1, _spec("NHD"), 1, "mamba2", 27, 12, requests=2, aliased=False)
    assert st["onesided"]["loads"] >= 1, st["onesided"]


@pytest.mark.parametrize("transport", ["ipc-cma", "pg"])
def test_state_group_positional_lists(transport):
    """vLLM's prefix-caching "align" mode: the lists are positional (null entries, then the
    state in the block of the last token), and D allocated one block more for the token it
    computes next: the state lands in the block of token ``n - 1``, not in D's last entry."""
    _run(transport, _spec("NHD"), 1, 28, "gdn", seed=13, positional=True)
