"""Cases for the Triton kernel tests: stamped payloads, poisoned caches and independent expectations.

A case's *truth* is ``[L, KV, heads_local, T, row_bytes]`` raw bytes of one source rank; every
row starts with its origin (layer, kv, head, token low/high byte) so a misplaced row names
itself. Caches are built by plain indexing into byte views (no kvxfer index math), every other
byte is ``POISON``. Expectations for gather/scatter/copy are computed the same plain way, and
every run is also compared with the torch reference backend run on CPU clones of the inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvxfer import KVCacheSpec, Layout, ops
from tests.kvdata import as_bytes, first_difference

POISON = 0xA5

ALL_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
)


@dataclass(frozen=True)
class Case:
    """One transfer. ``dst_*`` fields default to the source's (used by scatter and copy).

    ``misalign`` shifts every cache's first byte by that many bytes (a multiple of the element
    size) so that narrower words must be chosen.
    """

    layout: str = "NHD"  # "NHD", "HND" or "MLA"
    dtype: torch.dtype = torch.bfloat16
    head_dim: int = 64
    block_size: int = 16
    num_tokens: int = 37  # 16-token blocks: 2 full + 1 partial
    num_layers: int = 3
    layers: tuple[int, ...] | None = (2, 0)  # a subset, out of order
    heads_local: int = 4
    head_start: int = 1
    num_heads: int = 2
    dst_layout: str | None = None
    dst_block_size: int | None = None
    dst_heads_local: int | None = None
    dst_head_start: int = 0
    misalign: int = 0
    seed: int = 0

    def spec(self, dst: bool = False) -> KVCacheSpec:
        layout = (self.dst_layout or self.layout) if dst else self.layout
        bs = (self.dst_block_size or self.block_size) if dst else self.block_size
        mla = layout == "MLA"
        heads = 1 if mla else 8
        return KVCacheSpec(
            num_layers=self.num_layers,
            num_kv_heads=heads,
            head_dim=self.head_dim,
            block_size=bs,
            dtype=self.dtype,
            layout=Layout.NHD if mla else Layout(layout),
            use_mla=mla,
        )

    @property
    def mla(self) -> bool:
        return self.layout == "MLA"

    @property
    def heads(self) -> tuple[int, int, int]:
        """(src heads_local, src head_start, num_heads), MLA folded to one head."""
        return (1, 0, 1) if self.mla else (self.heads_local, self.head_start, self.num_heads)

    @property
    def dst_heads(self) -> tuple[int, int]:
        """(dst heads_local, dst head_start)."""
        if self.mla:
            return 1, 0
        return (self.dst_heads_local or self.num_heads), self.dst_head_start

    @property
    def layer_list(self) -> list[int]:
        return list(range(self.num_layers)) if self.layers is None else list(self.layers)

    def with_(self, **kw) -> Case:
        return replace(self, **kw)


def block_ids(spec: KVCacheSpec, num_tokens: int, seed: int) -> tuple[list[int], int]:
    """Distinct, shuffled block ids for the request and a pool size leaving 3 blocks untouched."""
    needed = spec.num_blocks_for(num_tokens)
    num_blocks = needed + 3
    g = torch.Generator().manual_seed(1000 + seed + spec.block_size)
    return torch.randperm(num_blocks, generator=g)[:needed].tolist(), num_blocks


def truth(case: Case) -> torch.Tensor:
    """uint8 ``[L, KV, heads_local, T, row]``: the source rank's rows, stamped with their origin."""
    spec = case.spec()
    heads_local = case.heads[0]
    row = case.head_dim * spec.element_size
    shape = (case.num_layers, spec.num_kv, heads_local, case.num_tokens, row)
    g = torch.Generator().manual_seed(case.seed)
    data = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    idx = torch.meshgrid(*(torch.arange(n) for n in shape[:4]), indexing="ij")
    stamp = torch.stack([*idx, idx[3] >> 8], dim=-1).to(torch.uint8)
    n = min(row, stamp.shape[-1])
    data[..., :n] = stamp[..., :n]
    return data


def poisoned_caches(spec: KVCacheSpec, num_blocks: int, heads_local: int, device, misalign: int):
    """Per-layer caches (every byte ``POISON``), each starting ``misalign`` bytes into its buffer."""
    shape = spec.local_cache_shape(num_blocks, heads_local)
    nbytes = spec.element_size
    for n in shape:
        nbytes *= n
    out = []
    for _ in range(spec.num_layers):
        raw = torch.full((nbytes + misalign,), POISON, dtype=torch.uint8, device=device)
        out.append(raw[misalign:].view(spec.dtype).view(shape))
    return out


def byte_view(cache: torch.Tensor, spec: KVCacheSpec) -> torch.Tensor:
    """Writable ``[KV, blocks, block_size, heads, row]`` uint8 view of one layer."""
    raw = cache.view(torch.uint8)
    if spec.use_mla:
        return raw.unsqueeze(0).unsqueeze(3)
    return raw.transpose(2, 3) if spec.layout is Layout.HND else raw


def place(caches, spec: KVCacheSpec, rows: torch.Tensor, ids: list[int], layers, head_start: int) -> None:
    """Write ``rows`` ``[len(layers), KV, H, T, row]`` into ``ids`` at heads from ``head_start``."""
    rows = rows.to(caches[0].device)
    t = torch.arange(rows.shape[3])
    blocks = torch.tensor(ids, dtype=torch.int64)[t // spec.block_size].to(rows.device)
    offs = (t % spec.block_size).to(rows.device)
    for i, layer in enumerate(layers):
        view = byte_view(caches[layer], spec)
        for h in range(rows.shape[2]):
            view[:, blocks, offs, head_start + h] = rows[i, :, h]


def assert_bytes_equal(got, want, what: str) -> None:
    got, want = as_bytes(got), as_bytes(want)
    assert torch.equal(got, want), f"{what}: {first_difference(got, want)}"


class Source:
    """The source rank of a case: caches holding the truth, poison elsewhere."""

    def __init__(self, case: Case, device) -> None:
        self.case = case
        self.spec = case.spec()
        self.truth = truth(case)
        self.ids, num_blocks = block_ids(self.spec, case.num_tokens, case.seed)
        heads_local, _, _ = case.heads
        self.caches = poisoned_caches(self.spec, num_blocks, heads_local, device, case.misalign)
        place(self.caches, self.spec, self.truth, self.ids, range(case.num_layers), 0)

    def selected(self) -> torch.Tensor:
        """The moved rows ``[len(layers), KV, num_heads, T, row]``."""
        _, hs, nh = self.case.heads
        return self.truth[self.case.layer_list][:, :, hs : hs + nh]

    def expected_wire(self) -> torch.Tensor:
        """Wire bytes ``[H, L, KV, T, row]`` (MLA: ``[L, T, row]``)."""
        w = self.selected().permute(2, 0, 1, 3, 4).contiguous()
        return w[0, :, 0] if self.case.mla else w


class Dest:
    """A poisoned destination rank of a case (dst layout / block size / heads)."""

    def __init__(self, case: Case, device) -> None:
        self.case = case
        self.spec = case.spec(dst=True)
        self.ids, num_blocks = block_ids(self.spec, case.num_tokens, case.seed + 7)
        heads_local, self.head_start = case.dst_heads
        self.caches = poisoned_caches(self.spec, num_blocks, heads_local, device, case.misalign)

    def expected(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """This destination's caches after ``rows`` ``[len(layers), KV, H, T, row]`` land."""
        out = [c.cpu().clone() for c in self.caches]
        place(out, self.spec, rows, self.ids, self.case.layer_list, self.head_start)
        return out


def wire_tensor(rows_wire: torch.Tensor, dtype: torch.dtype, device, pinned: bool = False) -> torch.Tensor:
    """A wire tensor of ``dtype`` holding the given wire bytes ``[..., row]``."""
    w = rows_wire.contiguous().view(dtype)
    if pinned:
        return w.pin_memory()
    return w.to(device)


def clone_cpu(caches) -> list[torch.Tensor]:
    return [c.cpu().clone() for c in caches]


def run_gather(case: Case, device, pinned: bool = False) -> None:
    """Triton gather == plain expectation == torch reference (on CPU clones)."""
    src = Source(case, device)
    _, hs, nh = case.heads
    kw = dict(head_start=hs, num_heads=None if case.mla else nh, layers=case.layers)
    out = None
    if pinned:
        shape = src.spec.wire_shape(case.num_tokens, nh, len(case.layer_list))
        raw = torch.full((*shape[:-1], shape[-1] * src.spec.element_size), POISON, dtype=torch.uint8)
        out = raw.view(case.dtype).pin_memory()
    before = as_bytes(src.caches)
    wire = ops.gather_blocks(src.caches, src.spec, src.ids, case.num_tokens, out=out, backend="triton", **kw)
    assert ops.last_backend() == "triton"
    if device != "cpu":
        torch.cuda.synchronize()
    ref = ops.gather_blocks(clone_cpu(src.caches), src.spec, src.ids, case.num_tokens, backend="torch", **kw)
    assert_bytes_equal([wire], [src.expected_wire().view(case.dtype)], f"gather vs expected {case}")
    assert_bytes_equal([wire], [ref], f"gather vs torch reference {case}")
    assert torch.equal(as_bytes(src.caches), before), "gather wrote to its source"


def run_scatter(case: Case, device, pinned: bool = False) -> None:
    """Scatter the expected wire of ``case`` into a poisoned destination."""
    src = Source(case, device)
    dst = Dest(case, device)
    wire = wire_tensor(src.expected_wire(), case.dtype, device, pinned)
    ref_caches = clone_cpu(dst.caches)
    kw = dict(head_start=dst.head_start, layers=case.layers)
    ops.scatter_blocks(wire, dst.caches, dst.spec, dst.ids, case.num_tokens, backend="triton", **kw)
    assert ops.last_backend() == "triton"
    if device != "cpu":
        torch.cuda.synchronize()
    ops.scatter_blocks(wire.cpu(), ref_caches, dst.spec, dst.ids, case.num_tokens, backend="torch", **kw)
    assert_bytes_equal(dst.caches, dst.expected(src.selected()), f"scatter vs expected {case}")
    assert_bytes_equal(dst.caches, ref_caches, f"scatter vs torch reference {case}")


def run_copy(case: Case, device) -> None:
    """Copy source rows straight into a poisoned destination (other layout / block size)."""
    src = Source(case, device)
    dst = Dest(case, device)
    _, hs, nh = case.heads
    ref_caches = clone_cpu(dst.caches)
    args = (src.spec, src.ids)
    kw = dict(src_head_start=hs, dst_head_start=dst.head_start, num_heads=nh, layers=case.layers)
    ops.copy_blocks(src.caches, *args, dst.caches, dst.spec, dst.ids, case.num_tokens, backend="triton", **kw)
    assert ops.last_backend() == "triton"
    if device != "cpu":
        torch.cuda.synchronize()
    ops.copy_blocks(
        clone_cpu(src.caches), *args, ref_caches, dst.spec, dst.ids, case.num_tokens, backend="torch", **kw
    )
    assert_bytes_equal(dst.caches, dst.expected(src.selected()), f"copy vs expected {case}")
    assert_bytes_equal(dst.caches, ref_caches, f"copy vs torch reference {case}")


RUNNERS = {"gather": run_gather, "scatter": run_scatter, "copy": run_copy}


def matrix() -> list[tuple[str, Case]]:
    """The (op, case) matrix run on CPU under the interpreter and on a GPU."""
    cases: list[tuple[str, Case]] = []
    # every dtype x layout, for gather and scatter: head slice, layer subset, partial last block
    for layout in ("NHD", "HND", "MLA"):
        for dt in ALL_DTYPES:
            cases.append(("gather", Case(layout=layout, dtype=dt)))
            cases.append(
                (
                    "scatter",
                    Case(layout=layout, dtype=dt, dst_block_size=32, dst_head_start=1, dst_heads_local=3),
                )
            )
    # copy: layout and block-size conversions, including non-power-of-two block sizes
    dts = iter(ALL_DTYPES * 4)
    for src_l, dst_l in (("NHD", "HND"), ("HND", "NHD"), ("NHD", "NHD"), ("HND", "HND"), ("MLA", "MLA")):
        for bs, dbs in ((16, 32), (32, 16), (12, 20)):
            cases.append(
                (
                    "copy",
                    Case(
                        layout=src_l,
                        dst_layout=dst_l,
                        block_size=bs,
                        dst_block_size=dbs,
                        dtype=next(dts),
                        dst_heads_local=3,
                        dst_head_start=1,
                    ),
                )
            )
    for dt in ALL_DTYPES:
        cases.append(("copy", Case(layout="NHD", dst_layout="HND", dst_block_size=32, dtype=dt)))
    # one head (a TP slice leaving one head), on both sides
    for op in RUNNERS:
        for layout in ("NHD", "HND"):
            cases.append(
                (
                    op,
                    Case(
                        layout=layout,
                        dst_layout="HND" if layout == "NHD" else "NHD",
                        head_start=3,
                        num_heads=1,
                        dst_heads_local=2,
                        dst_head_start=1,
                    ),
                )
            )
    # odd head_dim (rows of 144/192 bytes etc.) and tiny rows forcing 1- and 2-byte words
    for op in RUNNERS:
        for hd, dt in (
            (96, torch.bfloat16),
            (72, torch.float8_e4m3fn),
            (72, torch.float32),
            (5, torch.int8),
            (3, torch.float16),
        ):
            cases.append((op, Case(head_dim=hd, dtype=dt, layout="HND", dst_layout="NHD", dst_block_size=32)))
    # non-power-of-two block sizes on gather/scatter, all tokens in full blocks or one block only
    for op in ("gather", "scatter"):
        cases.append((op, Case(layout="HND", block_size=12, dst_block_size=24, num_tokens=48)))
        cases.append((op, Case(layout="NHD", block_size=20, dst_block_size=12, num_tokens=7)))
    # misaligned cache bases: words narrower than the row allows
    for op in RUNNERS:
        for dt, off in ((torch.bfloat16, 2), (torch.float32, 4), (torch.int8, 1), (torch.float16, 8)):
            cases.append((op, Case(dtype=dt, misalign=off, layout="HND", dst_layout="NHD")))
    return cases


def case_id(item: tuple[str, Case]) -> str:
    op, c = item
    dt = str(c.dtype).removeprefix("torch.")
    dst = f"-{c.dst_layout or c.layout}{c.dst_block_size or c.block_size}"
    extra = f"-h{c.head_start}+{c.num_heads}" + (f"-mis{c.misalign}" if c.misalign else "")
    return f"{op}-{c.layout}{c.block_size}{dst}-{dt}-d{c.head_dim}-T{c.num_tokens}{extra}"
