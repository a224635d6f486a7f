"""gather_state / scatter_state / copy_state (kvxfer.groups.state_ops): byte-exact against pages
built by plain indexing (tests/statedata.py), poison in every byte that must stay untouched,
across kinds, TP ratios (replicated Mamba2 groups included), conv layouts, the GDN SSM order,
dtypes and page paddings; bad input refused by name before anything is written."""

from __future__ import annotations

import pytest
import torch

from kvxfer.groups import (
    StateSpec,
    UnitRun,
    copy_state,
    gather_state,
    plan_state_reads,
    scatter_state,
)
from tests import statedata as sd

F8 = torch.float8_e4m3fn


def mamba2(tp=1, layout="SD", n_groups=12, conv=torch.bfloat16, ssm=torch.float32, page=None, layers=3):
    return StateSpec.mamba2(
        num_layers=layers,
        num_heads=12,
        head_dim=3,
        n_groups=n_groups,
        d_state=5,
        conv_kernel=4,
        conv_dtype=conv,
        ssm_dtype=ssm,
        tp_size=tp,
        conv_layout=layout,
        page_size_bytes=page,
    )


def gdn(tp=1, layout="SD", transposed=False, conv=torch.bfloat16, ssm=torch.float32, layers=3):
    return StateSpec.gdn(
        num_layers=layers,
        num_k_heads=12,
        num_v_heads=24,
        head_k_dim=4,
        head_v_dim=3,
        conv_kernel=3,
        conv_dtype=conv,
        ssm_dtype=ssm,
        tp_size=tp,
        conv_layout=layout,
        ssm_transposed=transposed,
    )


def mamba1(tp=1, layout="SD", conv=torch.float16, ssm=torch.float32):
    return StateSpec.mamba1(
        num_layers=2, intermediate_size=24, d_state=5, conv_kernel=4, conv_dtype=conv, ssm_dtype=ssm,
        tp_size=tp, conv_layout=layout,
    )  # fmt: skip


def short_conv(tp=1, layout="SD", conv=F8):
    return StateSpec.short_conv(
        num_layers=2, dim=24, conv_kernel=3, conv_dtype=conv, tp_size=tp, conv_layout=layout
    )


KINDS = {
    "mamba2": mamba2,
    "mamba2_replicated": lambda **kw: mamba2(n_groups=1, **kw),
    "gdn": gdn,
    "gdn_transposed_dst": gdn,
    "mamba1": mamba1,
    "short_conv": short_conv,
}
TP_PAIRS = [(1, 1), (1, 2), (2, 1), (1, 4), (4, 1), (2, 3), (3, 2), (4, 4)]


def src_ids_of(num_states, num_blocks):
    return [num_blocks - 1 - 2 * j for j in range(num_states)]  # shuffled, never block 0


def dst_ids_of(num_states):
    return [2 + 3 * j for j in range(num_states)][::-1]


def run_transfer(src, dst, num_states=2, mode="copy", layers=None, src_pad=0, dst_pad=0, values=False,
                 convert=False, backend=None):  # fmt: skip
    """Every destination rank loads ``num_states`` states by the plan; returns (got, want) per
    destination rank and layer: the whole page tensors, poison included."""
    nb_src, nb_dst = 2 * num_states + 3, 3 * num_states + 2
    src_ids, dst_ids = src_ids_of(num_states, nb_src), dst_ids_of(num_states)
    if values:
        vals = sd.values_truth(src, num_states)
        t_src, t_dst = sd.as_bytes(vals, src), sd.as_bytes(vals, dst)
    else:
        t_src = t_dst = sd.truth(src, num_states)
    src_pages = []
    for r in range(src.tp_size):
        pages = sd.empty_pages(src, nb_src, pad=src_pad)
        sd.place(pages, src, r, t_src, src_ids)
        src_pages.append(pages)
    before = [[p.clone() for p in pages] for pages in src_pages]
    dst_pages = [sd.empty_pages(dst, nb_dst, pad=dst_pad) for _ in range(dst.tp_size)]
    plan = plan_state_reads(src, dst)
    for d in range(dst.tp_size):
        for read in plan.reads(d):
            sp = src_pages[read.src_rank]
            if mode == "copy":
                copy_state(
                    sp, src, src_ids, dst_pages[d], dst, dst_ids, read.runs, layers, convert_dtype=convert,
                    backend=backend,
                )  # fmt: skip
            else:
                wire = gather_state(sp, src, src_ids, read.runs, layers, backend=backend)
                scatter_state(
                    wire, dst_pages[d], dst, dst_ids, read.runs, layers, wire_spec=src, convert_dtype=convert,
                    backend=backend,
                )  # fmt: skip
    for pages, orig in zip(src_pages, before):  # the source is only read
        assert all(torch.equal(a, b) for a, b in zip(pages, orig))
    want = []
    for d in range(dst.tp_size):
        pages = sd.empty_pages(dst, nb_dst, pad=dst_pad)
        sd.place(pages, dst, d, t_dst, dst_ids, layers=layers)
        want.append(pages)
    return dst_pages, want


def assert_pages_equal(got, want):
    for d, (g_rank, w_rank) in enumerate(zip(got, want)):
        for layer, (g, w) in enumerate(zip(g_rank, w_rank)):
            if not torch.equal(g, w):
                bad = (g != w).nonzero()[0].tolist()
                raise AssertionError(
                    f"rank {d} layer {layer}: first differing byte at block {bad[0]}, byte {bad[1]}: "
                    f"got {g[bad[0], bad[1]].item():#x}, want {w[bad[0], bad[1]].item():#x}; "
                    f"page bytes there: got {g[bad[0], bad[1] - bad[1] % 8 : bad[1] - bad[1] % 8 + 8].tolist()}, "
                    f"want {w[bad[0], bad[1] - bad[1] % 8 : bad[1] - bad[1] % 8 + 8].tolist()}"
                )


@pytest.mark.parametrize("mode", ["copy", "wire"])
@pytest.mark.parametrize("tps", TP_PAIRS, ids=[f"{a}to{b}" for a, b in TP_PAIRS])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_transfer_across_tp_and_conv_layout(kind, tps, mode):
    """Every kind, every TP ratio its unit counts allow, SD on P and DS on D (and back for odd
    ratios), the GDN SSM transposed on one side: D's pages byte-equal the truth, poison intact."""
    make = KINDS[kind]
    p_tp, d_tp = tps
    src_layout, dst_layout = ("SD", "DS") if (p_tp + d_tp) % 2 else ("DS", "SD")
    kw_src, kw_dst = {}, {}
    if kind == "gdn_transposed_dst":
        kw_dst["transposed"] = True
    elif kind == "gdn":
        kw_src["transposed"] = True
    src = make(tp=p_tp, layout=src_layout, **kw_src)
    dst = make(tp=d_tp, layout=dst_layout, **kw_dst)
    got, want = run_transfer(src, dst, num_states=2, mode=mode)
    assert_pages_equal(got, want)


TRITON_CASES = [("mamba2_replicated", (2, 1)), ("gdn", (1, 2)), ("gdn_transposed_dst", (2, 3)), ("mamba1", (4, 1)),
                ("short_conv", (1, 4))]  # fmt: skip


@pytest.mark.parametrize("mode", ["copy", "wire"])
@pytest.mark.parametrize("kind,tps", TRITON_CASES, ids=[f"{k}-{a}to{b}" for k, (a, b) in TRITON_CASES])
def test_triton_backend_moves_the_same_bytes(kind, tps, mode):
    """The Triton row-table kernel (on CPU under the interpreter), SD on P, DS on D: byte-equal
    like the reference (a kernel that drops a row's first word fails every case)."""
    from kvxfer.groups.state_kernels import unavailable_reason

    why = unavailable_reason(torch.device("cpu"))
    if why:
        pytest.skip(why)
    make = KINDS[kind]
    kw_dst = {"transposed": True} if kind == "gdn_transposed_dst" else {}
    src, dst = make(tp=tps[0], layout="SD"), make(tp=tps[1], layout="DS", **kw_dst)
    got, want = run_transfer(src, dst, num_states=2, mode=mode, backend="triton")
    assert_pages_equal(got, want)


def test_backend_named_is_checked():
    src, dst, sp, dp, read = _setup()
    with pytest.raises(ValueError, match="backend: must be None, 'torch' or 'triton'"):
        copy_state(sp, src, [3], dp, dst, [1], read.runs, backend="cuda")


@pytest.mark.parametrize(
    "conv,ssm",
    [
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float32),
        (torch.float16, torch.bfloat16),
        (F8, torch.bfloat16),
        (torch.float8_e5m2, F8),
        (torch.int8, torch.float64),
    ],
)
@pytest.mark.parametrize("mode", ["copy", "wire"])
def test_every_dtype_moves_bit_exactly(conv, ssm, mode):
    src = gdn(tp=2, layout="DS", conv=conv, ssm=ssm)
    dst = gdn(tp=1, layout="SD", conv=conv, ssm=ssm, transposed=True)
    got, want = run_transfer(src, dst, num_states=3, mode=mode)
    assert_pages_equal(got, want)


@pytest.mark.parametrize("mode", ["copy", "wire"])
@pytest.mark.parametrize(
    "src_dtypes,dst_dtypes",
    [
        ((torch.float32, torch.float32), (torch.bfloat16, torch.float32)),
        ((torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)),
        ((torch.float32, torch.float32), (F8, torch.float16)),
    ],
)
def test_dtype_converted_when_asked(src_dtypes, dst_dtypes, mode):
    src = mamba2(tp=1, conv=src_dtypes[0], ssm=src_dtypes[1])
    dst = mamba2(tp=2, layout="DS", conv=dst_dtypes[0], ssm=dst_dtypes[1])
    got, want = run_transfer(src, dst, num_states=2, mode=mode, values=True, convert=True)
    assert_pages_equal(got, want)


def test_differing_dtype_refused_without_convert():
    src, dst = mamba2(conv=torch.float32), mamba2(conv=torch.bfloat16)
    with pytest.raises(ValueError, match=r"conv_dtype differs.*convert_dtype=True"):
        run_transfer(src, dst)


@pytest.mark.parametrize("mode", ["copy", "wire"])
def test_layer_subset_padding_and_many_states(mode):
    """Layers [2, 0] only, pages padded past the spec's page (vLLM's padded page), 4 states."""
    src = mamba2(tp=2, layout="SD", page=2048)
    dst = mamba2(tp=1, layout="DS", page=4096)
    got, want = run_transfer(src, dst, num_states=4, mode=mode, layers=[2, 0], src_pad=24, dst_pad=8)
    assert_pages_equal(got, want)


def test_gather_wire_is_canonical_and_tp_independent():
    """A TP-2 rank's gather equals the slice of the canonical wire holding its units; the two
    ranks' wires together equal a TP-1 gather, section by section."""
    one, two = gdn(tp=1, layout="DS"), gdn(tp=2, layout="SD", transposed=True)
    t = sd.truth(one, 2)
    ids = [4, 1]
    pages1 = sd.empty_pages(one, 6)
    sd.place(pages1, one, 0, t, ids)
    full = gather_state(pages1, one, ids)
    want_full = sd.wire_of(one, 0, t, [(0, 0, s.num_units) for s in one.sections])
    full_secs = sd.wire_sections(one, full, None, 3, 2)
    for name, b in want_full.items():
        assert torch.equal(full_secs[name], b), name
    halves = []
    for r in range(2):
        pages = sd.empty_pages(two, 6)
        sd.place(pages, two, r, t, ids)
        w = gather_state(pages, two, ids)
        counts = [two.local_units(i) for i in range(two.num_sections)]
        halves.append(sd.wire_sections(two, w, counts, 3, 2))
        assert torch.equal(w, gather_state(pages, two, ids, out=torch.full_like(w, 7)))  # gaps zeroed
        odd = torch.empty(w.numel() + 1, dtype=torch.uint8)[1:]  # a misaligned wire: byte words
        assert torch.equal(w, gather_state(pages, two, ids, out=odd))
        back = [p.clone() for p in pages]
        for p in back:
            p[ids] = 0
        scatter_state(odd, back, two, ids)
        assert all(torch.equal(a, b) for a, b in zip(back, pages))
    for name in full_secs:
        assert torch.equal(torch.cat([halves[0][name], halves[1][name]]), full_secs[name]), name
    # typed views of the canonical wire: the SSM is [V, K] whatever the source's order
    views = one.wire_views(full, None, 3, 2)
    assert views["ssm"].shape == (24, 3, 2, 3, 4) and views["q"].shape == (12, 3, 2, 2, 4)


def test_vllm_views_of_one_shared_buffer():
    """vLLM's layout: one int8 buffer, layer-outer, each layer's Mamba view ``[B, 1, 1,
    content]`` with the padded page as block stride, beside an attention group's layers
    aliasing the same regions: only the state's bytes of its block change."""
    spec = mamba2(tp=1, layout="DS", page=2048, layers=2)
    nb, page = 6, 2048
    buf = torch.full((2 * nb * page,), sd.POISON, dtype=torch.uint8).view(torch.int8)
    views = [
        torch.as_strided(buf, (nb, 1, 1, spec.content_bytes), (page, spec.content_bytes, spec.content_bytes, 1), j * nb * page)
        for j in range(2)
    ]  # fmt: skip
    src = mamba2(tp=2, layout="SD", layers=2)
    t = sd.truth(src, 1)
    src_pages = [sd.empty_pages(src, 3) for _ in range(2)]
    for r in range(2):
        sd.place(src_pages[r], src, r, t, [2])
    for read in plan_state_reads(src, spec).reads(0):
        copy_state(src_pages[read.src_rank], src, [2], views, spec, [5], read.runs)
    want = torch.full((2, nb, page), sd.POISON, dtype=torch.uint8).view(torch.int8)
    for j in range(2):
        want[j, 5, : spec.content_bytes] = sd.rank_state(spec, 0, t, j, 0).view(torch.int8)
    assert torch.equal(buf.view(2, nb, page), want)


def test_float_pages_and_zero_units_or_states_are_noops():
    spec = mamba2(tp=2)
    pages = [torch.zeros(4, spec.page_bytes // 4 + 1, dtype=torch.float32) for _ in range(3)]
    before = [p.clone() for p in pages]
    wire = gather_state(pages, spec, [])
    assert wire.numel() == spec.wire_nbytes([spec.local_units(i) for i in range(4)], 3, 0)
    none = [UnitRun(0, 0, 0)] * 4
    empty = gather_state(pages, spec, [1], none)
    scatter_state(empty, pages, spec, [1], none)
    assert all(torch.equal(a, b) for a, b in zip(pages, before))


# ------------------------------------------------------------------------------ refusals
def _setup():
    src, dst = mamba2(tp=2, layout="SD"), mamba2(tp=1, layout="DS")
    t = sd.truth(src, 1)
    sp = sd.empty_pages(src, 4)
    sd.place(sp, src, 0, t, [3])
    dp = sd.empty_pages(dst, 4)
    read = plan_state_reads(src, dst).reads(0)[0]
    return src, dst, sp, dp, read


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(dst_ids=[4]), r"dst_state_ids: block id 4 out of range \[0, 4\)"),
        (dict(dst_ids=[1, 1], src_ids=[3, 2]), "dst_state_ids: repeated block id 1"),
        (dict(dst_ids=[1, 2]), "dst_state_ids: 2 states, src_state_ids 1"),
        (dict(src_ids=[[3]]), "src_state_ids: must be 1-D"),
        (dict(src_ids=[1.5]), "src_state_ids: must hold integers"),
        (dict(runs="bad"), "runs: must be a sequence"),
        (dict(runs=[(0, 0, 7), (0, 0, 6), (0, 0, 6), (0, 0, 6)]), r"runs\[x\]: units \[0, 7\) are not within the 6 on a source rank \(tp_size=2\)"),
        (dict(runs=[(0, 0, 1)] * 3), "runs: one run per section"),
        (dict(runs=[(0, 12, 1), (0, 0, 1), (0, 0, 1), (0, 0, 1)]), r"runs\[x\]: units \[12, 13\) are not within the 12 on a destination rank"),
        (dict(runs=[(-1, 0, 1), (0, 0, 1), (0, 0, 1), (0, 0, 1)]), r"runs\[x\]: src_start must be an int >= 0"),
        (dict(runs=None), "runs: x has 6 units per rank on the source"),
        (dict(layers=[0, 0]), "layers: repeated layer index"),
        (dict(layers=[3]), r"layers: layer 3 out of range \[0, 3\)"),
        (dict(layers=[]), "layers: must not be empty"),
        (dict(dst_spec=gdn()), "incompatible state groups: kind differs"),
        (dict(dst_spec=mamba2(layers=2)), "incompatible state groups: num_layers differs"),
        (dict(dst_spec=mamba2(conv=torch.float16)), "conv_dtype differs"),
        (dict(dst_spec=mamba2(ssm=torch.bfloat16)), "ssm_dtype differs"),
        (dict(convert=1), "convert_dtype: must be True or False"),
    ],
)  # fmt: skip
def test_copy_refuses_before_writing(change, match):
    src, dst, sp, dp, read = _setup()
    before = [p.clone() for p in dp]
    kw = dict(src_ids=[3], dst_ids=[1], runs=read.runs, layers=None, dst_spec=dst, convert=False)
    kw.update(change)
    with pytest.raises(ValueError, match=match):
        copy_state(sp, src, kw["src_ids"], dp, kw["dst_spec"], kw["dst_ids"], kw["runs"], kw["layers"],
                   convert_dtype=kw["convert"])  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(dp, before))


@pytest.mark.parametrize(
    "pages,match",
    [
        (lambda s: [torch.zeros(4, s.page_bytes, dtype=torch.uint8)] * 2, "dst_caches: spec has 3 layers, got 2"),
        (lambda s: torch.zeros(3, 4, s.page_bytes, dtype=torch.uint8), "dst_caches: must be a list"),
        (lambda s: [torch.zeros(4, s.content_bytes - 1, dtype=torch.uint8)] * 3, r"dst_caches\[0\]: a block holds \d+ bytes, the state needs"),
        (lambda s: [torch.zeros(4, 2 * s.page_bytes, dtype=torch.uint8)[:, ::2]] * 3, r"dst_caches\[0\]: a block's page must be contiguous"),
        (lambda s: [torch.zeros(s.page_bytes, dtype=torch.uint8)] * 3, r"dst_caches\[0\]: expected \[num_blocks, ...\] pages"),
        (lambda s: [torch.zeros(4, s.page_bytes, dtype=torch.uint8).as_strided((4, s.page_bytes), (8, 1))] * 3, "overlap"),
        (lambda s: [torch.zeros(4, s.page_bytes, dtype=torch.uint8), torch.zeros(5, s.page_bytes, dtype=torch.uint8), torch.zeros(4, s.page_bytes, dtype=torch.uint8)], r"dst_caches\[1\]: shape/strides"),
        (lambda s: [torch.zeros(4, s.page_bytes, dtype=torch.uint8), torch.zeros(4, s.page_bytes, dtype=torch.int8), torch.zeros(4, s.page_bytes, dtype=torch.uint8)], r"dst_caches\[1\]: dtype"),
        (lambda s: [torch.zeros(4, s.page_bytes, dtype=torch.uint8), "x", None], r"dst_caches\[1\]: must be a tensor"),
    ],
)  # fmt: skip
def test_bad_pages_refused(pages, match):
    src, dst, sp, _, read = _setup()
    with pytest.raises(ValueError, match=match):
        copy_state(sp, src, [3], pages(dst), dst, [1], read.runs)


def test_scatter_and_gather_refuse_a_bad_wire_before_writing():
    src, dst, sp, dp, read = _setup()
    before = [p.clone() for p in dp]
    wire = gather_state(sp, src, [3], read.runs)
    for bad, match in [
        (wire[:-1], "wire: expected"),
        (wire.view(torch.int8), "wire: must be a contiguous 1-D uint8"),
        (wire.view(1, -1), "wire: must be a contiguous 1-D uint8"),
        ([1, 2], "wire: must be a tensor"),
    ]:
        with pytest.raises(ValueError, match=match):
            scatter_state(bad, dp, dst, [1], read.runs, wire_spec=src)
    with pytest.raises(ValueError, match="wire_spec: expected a StateSpec"):
        scatter_state(wire, dp, dst, [1], read.runs, wire_spec="x")
    with pytest.raises(ValueError, match="incompatible state groups: kind differs"):
        scatter_state(wire, dp, dst, [1], read.runs, wire_spec=gdn(tp=2))
    assert all(torch.equal(a, b) for a, b in zip(dp, before))
    with pytest.raises(ValueError, match="out: expected"):
        gather_state(sp, src, [3], read.runs, out=torch.empty(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="spec: expected a StateSpec"):
        gather_state(sp, "spec", [3])
