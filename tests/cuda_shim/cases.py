"""The CUDA-kernel test matrix, shared by the host-shim run (g++ + ASan/UBSan) and the GPU run.

A case builds origin-coded source caches (every row's bytes encode layer, K/V, block, token and
head), poison-filled destinations, random block tables with spare blocks that must stay
untouched, and compares the kernel's result byte for byte with the torch reference backend.
``run_case(case, device, kernels)`` takes ``kernels``: any object with the backend functions
``gather(src, wire)``, ``scatter(wire, dst)``, ``copy(src, dst)`` on PagedSide.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvxfer import ops
from kvxfer.spec import KVCacheSpec, Layout

POISON = 0xA5
DTYPES = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "e4m3": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}


@dataclass(frozen=True)
class Case:
    """One transfer. ``src_*`` describe the paged source (gather, copy), ``dst_*`` the paged
    destination (scatter, copy). ``misalign`` shifts every cache tensor (and the wire) by that
    many bytes from its allocation, to force narrow copy units."""

    op: str  # "gather", "scatter" or "copy"
    dtype: str = "bf16"
    layout: str = "NHD"  # "NHD", "HND" or "MLA" (source; and destination unless dst_layout)
    dst_layout: str | None = None
    src_bs: int = 16
    dst_bs: int = 16
    src_heads: int = 4  # heads on the source rank
    dst_heads: int = 4
    src_head_start: int = 0
    dst_head_start: int = 0
    num_heads: int = 4
    head_dim: int = 8
    num_tokens: int = 37
    num_layers: int = 3
    layers: tuple[int, ...] | None = (2, 0)
    misalign: int = 0
    wire_misalign: int = 0
    max_blocks: int = 3  # grid cap (the GPU run uses the device's own)
    seed: int = 0
    # ids are token slots (caches registered with token_slots) on that side: random distinct
    # slots anywhere in the cache; the reference is the torch backend on the same slots
    # (tests/test_token_slots.py checks it against plain indexing)
    src_slots: bool = False
    dst_slots: bool = False

    @property
    def id(self) -> str:
        base = Case(op=self.op)
        parts = [self.op, self.dtype, self.layout]
        for f in (
            "dst_layout",
            "src_bs",
            "dst_bs",
            "src_heads",
            "dst_heads",
            "src_head_start",
            "dst_head_start",
            "num_heads",
            "head_dim",
            "num_tokens",
            "num_layers",
            "layers",
            "misalign",
            "wire_misalign",
            "max_blocks",
            "src_slots",
            "dst_slots",
        ):
            v = getattr(self, f)
            if v != getattr(base, f):
                parts.append(f"{f}={'-'.join(map(str, v)) if isinstance(v, tuple) else v}")
        return ",".join(parts)


def _spec(case: Case, side: str) -> tuple[KVCacheSpec, int]:
    layout = case.layout if side == "src" else (case.dst_layout or case.layout)
    heads = 1 if layout == "MLA" else getattr(case, f"{side}_heads")
    spec = KVCacheSpec(
        num_layers=case.num_layers,
        num_kv_heads=1 if layout == "MLA" else max(case.src_heads, case.dst_heads),
        head_dim=case.head_dim,
        block_size=getattr(case, f"{side}_bs"),
        dtype=DTYPES[case.dtype],
        layout=Layout.NHD if layout == "MLA" else Layout(layout),
        use_mla=layout == "MLA",
    )
    return spec, heads


def _alloc(
    shape: tuple[int, ...], dtype: torch.dtype, misalign: int, device, pin: bool = False
) -> torch.Tensor:
    """A poison-filled tensor in its own allocation, starting ``misalign`` bytes into it."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    raw = torch.full((nbytes + misalign,), POISON, dtype=torch.uint8)
    if pin:
        raw = raw.pin_memory()
    elif torch.device(device).type != "cpu":
        raw = raw.to(device)
    return raw[misalign:].view(dtype).view(shape)


def _fill_origin(cache: torch.Tensor, layer: int, layout: str, rank: int) -> None:
    """Write into each row bytes that encode (rank, layer, kv, block, token, head)."""
    rows = cache.view(torch.uint8)
    rb = rows.shape[-1]
    if layout == "MLA":
        nb, bs = rows.shape[:2]
        kv, blk, tok, head = 0, torch.arange(nb).view(-1, 1), torch.arange(bs).view(1, -1), 0
        hl = 1
    elif layout == "NHD":
        _, nb, bs, hl, _ = rows.shape
        kv = torch.arange(2).view(2, 1, 1, 1)
        blk, tok = torch.arange(nb).view(1, -1, 1, 1), torch.arange(bs).view(1, 1, -1, 1)
        head = torch.arange(hl).view(1, 1, 1, -1)
    else:
        _, nb, hl, bs, _ = rows.shape
        kv = torch.arange(2).view(2, 1, 1, 1)
        blk, head = torch.arange(nb).view(1, -1, 1, 1), torch.arange(hl).view(1, 1, -1, 1)
        tok = torch.arange(bs).view(1, 1, 1, -1)
    code = (((((rank * 64 + layer) * 2 + kv) * nb + blk) * bs + tok) * hl + head) + 1
    i = torch.arange(rb)
    pattern = ((code.unsqueeze(-1) >> (8 * (i % 4))) + 29 * i) & 255
    rows.copy_(pattern.to(torch.uint8))


def _fill_wire(wire: torch.Tensor) -> None:
    """Origin-coded wire: row (h, l, kv, t) bytes encode its wire coordinates."""
    rows = wire.view(torch.uint8).view(-1, wire.shape[-1] * wire.element_size())
    code = torch.arange(rows.shape[0]).view(-1, 1) + 7
    i = torch.arange(rows.shape[1])
    rows.copy_((((code >> (8 * (i % 4))) + 31 * i) & 255).to(torch.uint8))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8).reshape(-1)


def _check_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    g, w = _bytes(got), _bytes(want)
    if not torch.equal(g, w):
        bad = (g != w).nonzero().view(-1)
        first = int(bad[0])
        raise AssertionError(
            f"{what}: {bad.numel()} of {g.numel()} bytes differ; first at byte {first} of shape "
            f"{tuple(got.shape)} (row {first // (got.shape[-1] * got.element_size())}): "
            f"got {g[first : first + 8].tolist()} want {w[first : first + 8].tolist()}"
        )


def _caches(case: Case, side: str, device, origin: bool) -> tuple[list[torch.Tensor], KVCacheSpec, list[int]]:
    spec, heads = _spec(case, side)
    layout = "MLA" if spec.use_mla else spec.layout.value
    needed = spec.num_blocks_for(case.num_tokens)
    num_blocks = needed + 3  # spare blocks: must stay poison
    g = torch.Generator().manual_seed(case.seed * 1000 + (1 if side == "src" else 2))
    block_ids = torch.randperm(num_blocks, generator=g)[:needed].tolist()
    slots = getattr(case, f"{side}_slots")
    if slots:  # one id per token: distinct slots anywhere, in random order
        block_ids = torch.randperm(num_blocks * spec.block_size, generator=g)[: case.num_tokens].tolist()
    shape = spec.local_cache_shape(num_blocks, heads)
    caches = []
    for layer in range(case.num_layers):
        c = _alloc(shape, spec.dtype, case.misalign, "cpu")
        if origin:
            _fill_origin(c, layer, layout, rank=1 if side == "src" else 2)
        if torch.device(device).type != "cpu":
            c = _alloc(shape, spec.dtype, case.misalign, device).copy_(c)
        caches.append(c)
    if slots:
        caches = ops.register_caches(caches, spec, token_slots=True)
        spec = caches.spec
    return caches, spec, block_ids


def _clone(caches) -> list[torch.Tensor]:
    """Clones of ``caches``, registered as they are (token slots stay token slots)."""
    out = [c.clone() for c in caches]
    if isinstance(caches, ops.PagedCache) and caches.info.slot_block > 1:
        physical = replace(caches.spec, block_size=caches.info.slot_block)
        return ops.register_caches(out, physical, token_slots=True)
    return out


def run_case(case: Case, device, kernels, pinned_wire: bool = False) -> None:
    """Run ``case`` through ``kernels`` on ``device`` and compare bytes with the torch reference."""
    device = torch.device(device)
    layers = list(case.layers) if case.layers is not None else None
    if case.op == "gather":
        caches, spec, ids = _caches(case, "src", device, origin=True)
        side = ops.make_side(caches, spec, ids, case.num_tokens, case.src_head_start, case.num_heads, layers)
        want = ops.gather_blocks(
            caches, spec, ids, case.num_tokens, case.src_head_start, case.num_heads, layers, backend="torch"
        )
        got = _alloc(tuple(want.shape), want.dtype, case.wire_misalign, device, pin=pinned_wire)
        kernels.gather(side, got.view(side.wire_view_shape()))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        _check_equal(got, want, f"gather {case.id}")
        return
    if case.op == "scatter":
        caches, spec, ids = _caches(case, "dst", device, origin=False)
        ref = _clone(caches)
        num_heads = 1 if spec.use_mla else case.num_heads
        wire_shape = spec.wire_shape(case.num_tokens, num_heads, len(layers) if layers else case.num_layers)
        wire = _alloc(wire_shape, spec.dtype, case.wire_misalign, "cpu")
        _fill_wire(wire)
        wire_dev = (
            wire
            if device.type == "cpu"
            else _alloc(wire_shape, spec.dtype, case.wire_misalign, device, pin=pinned_wire).copy_(wire)
        )
        ops.scatter_blocks(
            wire_dev, ref, spec, ids, case.num_tokens, case.dst_head_start, layers, backend="torch"
        )
        side = ops.make_side(
            caches, spec, ids, case.num_tokens, case.dst_head_start, num_heads, layers, unique_blocks=True
        )
        kernels.scatter(wire_dev.view(side.wire_view_shape()), side)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        for i, (c, r) in enumerate(zip(caches, ref)):
            _check_equal(c, r, f"scatter {case.id} layer {i}")
        return
    src_caches, src_spec, src_ids = _caches(case, "src", device, origin=True)
    dst_caches, dst_spec, dst_ids = _caches(case, "dst", device, origin=False)
    ref = _clone(dst_caches)
    num_heads = 1 if src_spec.use_mla else case.num_heads
    ops.copy_blocks(
        src_caches,
        src_spec,
        src_ids,
        ref,
        dst_spec,
        dst_ids,
        case.num_tokens,
        case.src_head_start,
        case.dst_head_start,
        num_heads,
        backend="torch",
        layers=layers,
    )
    src = ops.make_side(
        src_caches, src_spec, src_ids, case.num_tokens, case.src_head_start, num_heads, layers
    )
    dst = ops.make_side(
        dst_caches,
        dst_spec,
        dst_ids,
        case.num_tokens,
        case.dst_head_start,
        num_heads,
        layers,
        unique_blocks=True,
    )
    kernels.copy(src, dst)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    for i, (c, r) in enumerate(zip(dst_caches, ref)):
        _check_equal(c, r, f"copy {case.id} layer {i}")


def matrix() -> list[Case]:
    """Every dtype x layout x op, then the odd shapes, slices, block sizes and alignments."""
    cases: list[Case] = []
    for op in ("gather", "scatter", "copy"):
        for dtype in DTYPES:
            for layout in ("NHD", "HND", "MLA"):
                heads = (
                    dict(num_heads=1)
                    if layout == "MLA"
                    else dict(src_head_start=1, num_heads=2, dst_head_start=2)
                )
                cases.append(Case(op=op, dtype=dtype, layout=layout, head_dim=16, **heads))
    more = [
        # head_dim 96/72 (bf16 rows of 192/144 bytes: 16- and 16-byte units), non-power-of-two bs
        dict(head_dim=96, src_bs=16, dst_bs=32),
        dict(head_dim=72, src_bs=32, dst_bs=16, num_tokens=70),
        dict(head_dim=72, layout="HND", src_bs=5, dst_bs=7, num_tokens=36),
        # one head of many (TP slice), first and last head
        dict(num_heads=1, src_head_start=3, dst_head_start=0, dst_heads=1),
        dict(num_heads=1, layout="HND", src_heads=8, src_head_start=0, dst_head_start=5, dst_heads=8),
        # narrow units: fp16 head_dim 3 (6-byte rows: 2-byte units), 4- and 8-byte rows
        dict(dtype="fp16", head_dim=3),
        dict(dtype="fp16", head_dim=3, layout="HND", src_bs=16, dst_bs=32),
        dict(dtype="fp16", head_dim=3, layout="MLA", num_heads=1),
        dict(dtype="fp32", head_dim=1, src_bs=4, dst_bs=6),
        dict(dtype="fp16", head_dim=4, layout="HND"),
        # misaligned bases: odd byte offsets (int8/fp8) and 2/4/8-byte offsets
        dict(dtype="int8", head_dim=16, misalign=1, wire_misalign=3),
        dict(dtype="e4m3", head_dim=128, layout="HND", misalign=5, wire_misalign=0),
        dict(dtype="fp16", head_dim=64, misalign=2, wire_misalign=6),
        dict(dtype="bf16", head_dim=64, layout="HND", misalign=4),
        dict(dtype="fp32", head_dim=32, layout="MLA", num_heads=1, misalign=8, wire_misalign=8),
        dict(dtype="fp32", head_dim=32, misalign=0, wire_misalign=4),
        # partial / exact / single-token transfers, all layers, grid of 1 block and a wide grid
        dict(num_tokens=1),
        dict(num_tokens=32, src_bs=16, dst_bs=32),
        dict(num_tokens=33, src_bs=32, dst_bs=16, layers=None, max_blocks=1),
        dict(num_tokens=200, head_dim=128, src_heads=8, dst_heads=8, num_heads=8, max_blocks=64),
    ]
    for op in ("gather", "scatter", "copy"):
        for kw in more:
            cases.append(Case(op=op, **kw))
    # copy across layouts
    cases.append(
        Case(
            op="copy",
            layout="NHD",
            dst_layout="HND",
            src_bs=16,
            dst_bs=32,
            src_head_start=1,
            num_heads=2,
            dst_head_start=0,
            dst_heads=2,
        )
    )
    cases.append(
        Case(
            op="copy",
            layout="HND",
            dst_layout="NHD",
            src_bs=32,
            dst_bs=16,
            dtype="e5m2",
            head_dim=96,
            num_tokens=65,
        )
    )
    # token slots (one id per token, any layout): each layout and op, odd block sizes, mixed
    # with block ids on the other side of a copy, a misaligned base
    dtypes = iter(("bf16", "e4m3", "fp32", "int8", "fp16", "e5m2", "bf16", "e4m3", "fp16"))
    for op in ("gather", "scatter", "copy"):
        for layout in ("NHD", "HND", "MLA"):
            heads = dict(num_heads=1) if layout == "MLA" else dict(src_head_start=1, num_heads=2)
            cases.append(
                Case(
                    op=op,
                    dtype=next(dtypes),
                    layout=layout,
                    src_bs=5,
                    dst_bs=7,
                    head_dim=16,
                    num_tokens=23,
                    src_slots=op != "scatter",
                    dst_slots=op != "gather",
                    **heads,
                )
            )
    cases.append(Case(op="copy", layout="NHD", dst_layout="HND", dst_bs=32, num_tokens=41, dst_slots=True))
    cases.append(Case(op="copy", layout="HND", dst_layout="NHD", src_bs=8, src_slots=True, head_dim=72))
    cases.append(Case(op="gather", layout="HND", dtype="fp16", head_dim=64, misalign=2, src_slots=True))
    return [replace(c, seed=i) for i, c in enumerate(cases)]
