"""gather_state / scatter_state / copy_state: a state group's pages to and from its canonical wire
(:mod:`kvxfer.groups.state`), or straight from one engine's pages into another's. Torch
reference implementation: exact byte copies, every dtype.

``caches`` is one rank's list of per-layer page tensors of a state group: layer ``l``'s
``caches[l]`` is ``[num_blocks, ...]`` of any dtype whose block ``b`` (``caches[l][b]``) is
contiguous and holds at least the state's content (:attr:`StateSpec.content_bytes`) from its
first byte: the spec's ``(num_blocks, page_bytes)`` uint8 pages, or vLLM's per-layer Mamba view
``[num_blocks, 1, 1, content_bytes]`` (int8, blocks its padded page apart) as it is. All layers
alike in shape, strides, dtype and device; they may be views of one buffer that other groups'
layers share (only the addressed bytes are touched).

``state_ids`` names the state block of each of ``num_states`` states (a request's running state
block: :func:`kvxfer.groups.blocks.state_block`), ``runs`` one :class:`UnitRun` per section
(default: every unit on the rank; a plan's :attr:`StateRead.runs` as they are), ``layers`` the
layers moved, in wire order (default all). A gather reads each section's ``src_start`` run, a
scatter writes each section's ``dst_start`` run; SD <-> DS and the GDN SSM order are converted
on the way, dtypes when ``convert_dtype`` asks (else differing dtypes are refused). Nothing is
written unless every argument is valid; each problem raises ``ValueError`` naming it.

Every section is one ``index_select`` into (or ``index_copy_`` out of) a view of the memory
spanning all selected layers (:mod:`kvxfer.backends.addrspace`), plus one permuting copy where
the page's order is not the wire's, so a call costs a few torch ops per section whatever the
number of layers and states: no per-layer or per-block Python loop. Rows are the longest runs
contiguous in the page (SD conv: a unit's channels of one conv row; DS conv: a whole unit; the
SSM: a whole head, in either order); DS units and transposed SSM heads are then permuted into
wire order (``[state_len, width]``, ``[V, K]``) by torch. CUDA tensors need CuPy to view their
memory, as the torch backend does; ``backend="triton"`` moves the same rows with one launch per
section over an address table instead (:mod:`kvxfer.groups.state_kernels`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from ..backends import addrspace
from ..paged import as_block_ids, check_layers_alike, layer_list
from .state import ConvLayout, StateSpec, UnitRun

__all__ = ["copy_state", "gather_state", "scatter_state"]


@dataclass(frozen=True)
class _Side:
    """One validated side: the selected layers' addresses, the block stride and the state ids."""

    spec: StateSpec
    layer_ptrs: tuple[int, ...]
    block_stride: int  # bytes
    ids: torch.Tensor  # int64 CPU, one per state
    base: int  # first byte of the span covering every selected layer
    end: int  # one past its last byte
    device: torch.device

    @property
    def num_layers(self) -> int:
        return len(self.layer_ptrs)

    @property
    def num_states(self) -> int:
        return int(self.ids.numel())


# --------------------------------------------------------------------------- validation
def _check_pages(caches, spec: StateSpec, name: str) -> tuple[int, int, torch.device]:
    """(num_blocks, block stride in bytes, device) of a rank's per-layer pages, checked."""
    if not isinstance(spec, StateSpec):
        raise ValueError(f"spec: expected a StateSpec, got {type(spec).__name__}")
    if isinstance(caches, torch.Tensor) or not isinstance(caches, Sequence):
        raise ValueError(f"{name}: must be a list of per-layer page tensors")
    if len(caches) != spec.num_layers:
        raise ValueError(f"{name}: spec has {spec.num_layers} layers, got {len(caches)} tensors")
    first = caches[0]
    if not isinstance(first, torch.Tensor):
        raise ValueError(f"{name}[0]: must be a tensor, got {type(first).__name__}")
    if first.dim() < 2 or first.shape[0] < 1:
        raise ValueError(f"{name}[0]: expected [num_blocks, ...] pages, got shape {tuple(first.shape)}")
    es = first.element_size()
    expect = 1
    for size, stride in reversed(list(zip(first.shape[1:], first.stride()[1:]))):
        if size != 1 and stride != expect:
            raise ValueError(f"{name}[0]: a block's page must be contiguous, got strides {first.stride()}")
        expect *= size
    page = expect * es
    need = spec.content_bytes
    if page < need:
        raise ValueError(
            f"{name}[0]: a block holds {page} bytes, the state needs {need} "
            f"({spec.conv_bytes} conv + {spec.ssm_bytes} SSM at tp_size={spec.tp_size})"
        )
    block_stride = first.stride(0) * es
    if first.shape[0] > 1 and block_stride < need:
        raise ValueError(f"{name}[0]: blocks {block_stride} bytes apart overlap the {need}-byte state")
    check_layers_alike(caches, name)
    return first.shape[0], block_stride, first.device


def _state_ids(state_ids, num_blocks: int, unique: bool, what: str) -> torch.Tensor:
    """Every id of ``state_ids`` (one state block per state), checked as the paged ops check
    block ids (:func:`kvxfer.paged.as_block_ids`)."""
    try:
        n = state_ids.numel() if isinstance(state_ids, torch.Tensor) else len(state_ids)
    except TypeError:
        raise ValueError(f"{what}: must be a sequence of block ids, got {type(state_ids).__name__}") from None
    return torch.from_numpy(as_block_ids(state_ids, num_blocks, n, what, unique))


def _make_side(caches, spec: StateSpec, state_ids, layers, unique: bool, name: str) -> _Side:
    num_blocks, block_stride, device = _check_pages(caches, spec, name)
    picked = layer_list(layers, spec.num_layers)
    ids = _state_ids(state_ids, num_blocks, unique, name.replace("caches", "state_ids"))
    selected = [caches[i] for i in picked]
    extents = [addrspace.tensor_extent(c) for c in selected]
    return _Side(
        spec=spec,
        layer_ptrs=tuple(c.data_ptr() for c in selected),
        block_stride=block_stride,
        ids=ids,
        base=min(e[0] for e in extents),
        end=max(e[1] for e in extents),
        device=device,
    )


def _check_runs(runs, src: StateSpec | None, dst: StateSpec | None) -> tuple[UnitRun, ...]:
    """The runs, one per section, each within the source's (``src``) and/or destination's
    (``dst``) units on a rank. ``None``: every unit, when both sides hold the same number."""
    spec = src if src is not None else dst
    secs = spec.sections
    if runs is None:
        out = []
        for i, sec in enumerate(secs):
            n = spec.local_units(i)
            if src is not None and dst is not None and dst.local_units(i) != n:
                raise ValueError(
                    f"runs: {sec.name} has {n} units per rank on the source (tp_size={src.tp_size}) "
                    f"and {dst.local_units(i)} on the destination (tp_size={dst.tp_size}); pass a "
                    "plan's runs (plan_state_reads)"
                )
            out.append(UnitRun(0, 0, n))
        return tuple(out)
    if isinstance(runs, (torch.Tensor, str, bytes)) or not isinstance(runs, Sequence):
        raise ValueError(f"runs: must be a sequence of (src_start, dst_start, num_units), got {runs!r}")
    if len(runs) != len(secs):
        raise ValueError(
            f"runs: one run per section ({len(secs)}: {[s.name for s in secs]}), got {len(runs)}"
        )
    out = []
    for i, (sec, r) in enumerate(zip(secs, runs)):
        try:
            a, b, n = r
        except (TypeError, ValueError):
            raise ValueError(
                f"runs[{sec.name}]: must be (src_start, dst_start, num_units), got {r!r}"
            ) from None
        for field, v in (("src_start", a), ("dst_start", b), ("num_units", n)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise ValueError(f"runs[{sec.name}]: {field} must be an int >= 0, got {v!r}")
        a, b, n = int(a), int(b), int(n)
        for side, start, which in ((src, a, "source"), (dst, b, "destination")):
            if side is not None and start + n > side.local_units(i):
                raise ValueError(
                    f"runs[{sec.name}]: units [{start}, {start + n}) are not within the "
                    f"{side.local_units(i)} on a {which} rank (tp_size={side.tp_size})"
                )
        out.append(UnitRun(a, b, n))
    return tuple(out)


def _check_pair(src: StateSpec, dst: StateSpec, convert_dtype: bool) -> bool:
    """Raise unless ``src``'s state can land in ``dst``'s pages; True when dtypes convert."""
    if type(convert_dtype) is not bool:
        raise ValueError(f"convert_dtype: must be True or False, got {convert_dtype!r}")
    mismatch = src.model_mismatch(dst)
    if mismatch:
        raise ValueError(f"incompatible state groups: {mismatch}")
    dmis = src.dtype_mismatch(dst)
    if dmis and not convert_dtype:
        raise ValueError(f"incompatible state groups: {dmis} (convert_dtype=True converts)")
    return dmis is not None


def _check_wire(wire, nbytes: int, device: torch.device, name: str) -> None:
    if not isinstance(wire, torch.Tensor):
        raise ValueError(f"{name}: must be a tensor, got {type(wire).__name__}")
    if wire.dtype != torch.uint8 or wire.dim() != 1 or not wire.is_contiguous():
        raise ValueError(
            f"{name}: must be a contiguous 1-D uint8 tensor, got {wire.dtype} {tuple(wire.shape)}"
        )
    if wire.numel() != nbytes:
        raise ValueError(
            f"{name}: expected {nbytes} bytes for these runs, layers and states, got {wire.numel()}"
        )
    if wire.device != device:
        pinned_host = device.type == "cuda" and wire.device.type == "cpu" and wire.is_pinned()
        if not pinned_host:
            raise ValueError(
                f"{name}: on {wire.device}, caches on {device} (a CPU wire for CUDA caches must be pinned)"
            )


def _check_backend(backend, device: torch.device) -> str:
    """``backend`` checked: None or "torch" (the reference), or "triton" where it runs."""
    if backend is None or backend == "torch":
        return "torch"
    if backend != "triton":
        raise ValueError(f"backend: must be None, 'torch' or 'triton', got {backend!r}")
    from .state_kernels import unavailable_reason

    why = unavailable_reason(device)
    if why:
        raise ValueError(f"backend: triton cannot run on {device} here: {why}")
    return backend


# --------------------------------------------------------------------------- addressing
def _geometry(spec: StateSpec, section: int) -> tuple[int, int, list[int], list[int], int]:
    """Section ``section`` in a rank's page: (byte offset of its unit 0, unit stride, the unit's
    sizes and strides in wire order, element size); strides in elements."""
    sec = spec.sections[section]
    if sec.is_conv:
        es = spec.conv_element_size
        s_len, width = sec.unit_shape
        first = spec.conv_part_offset(section)
        if spec.conv_layout is ConvLayout.SD:  # [state_len, conv_dim_local]
            return first * es, width, [s_len, width], [spec.conv_dim_local, 1], es
        return first * s_len * es, width * s_len, [s_len, width], [1, s_len], es  # DS
    es = spec.ssm_element_size
    shape = list(sec.unit_shape)
    strides = [math.prod(shape[k + 1 :]) for k in range(len(shape))]
    if spec.ssm_transposed:  # the page holds [.., b, a] for canonical [.., a, b]
        a = shape[-2]
        strides[-2], strides[-1] = 1, a
    return spec.conv_bytes, math.prod(shape), shape, strides, es


class _Rows(NamedTuple):
    """One section's run on one side, addressed: byte ``offsets`` (from ``side.base``) of every
    row in page order ``[units, layers, states, *outer]``, ``row_bytes`` each, ``unit`` bytes
    dividing every offset and the row length; ``page_shape`` the run's elements in page order
    (``[units, layers, states, *unit dims in page order]``) and ``to_wire`` the permutation of
    those dims into wire order (None: already the wire's)."""

    offsets: torch.Tensor
    row_bytes: int
    unit: int
    page_shape: tuple[int, ...]
    to_wire: tuple[int, ...] | None
    element_size: int


_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _elements(t: torch.Tensor, es: int) -> torch.Tensor:
    """Contiguous uint8 ``t`` as one word per ``es``-byte element where aligned (a permutation
    then moves words, not bytes), else as bytes."""
    if es in _WORDS and t.data_ptr() % es == 0:
        return t.view(_WORDS[es])
    return t


def _rows(side: _Side, section: int, start: int, count: int) -> _Rows:
    """Address ``count`` units of ``section`` from rank-local ``start``. The unit's dims are
    read in the page's order (descending strides) and the trailing ones contiguous there fold
    into one row: SD conv a unit's channels of one row, DS conv a whole unit, the SSM a whole
    head in either order; a permutation then puts them in wire order."""
    page_off, ustride, sizes, strides, es = _geometry(side.spec, section)
    order = sorted(range(len(sizes)), key=lambda k: -strides[k])  # page order, outer to inner
    p_sizes, p_strides = [sizes[k] for k in order], [strides[k] for k in order]
    outer, row = len(p_sizes), 1
    while outer and p_strides[outer - 1] == row:  # fold the trailing contiguous dims into a row
        outer -= 1
        row *= p_sizes[outer]
    row_bytes = row * es
    first = page_off + start * ustride * es
    layer = torch.tensor(side.layer_ptrs, dtype=torch.int64) - side.base
    units = torch.arange(count, dtype=torch.int64) * (ustride * es) + first
    off = units.view(-1, 1, 1) + layer.view(1, -1, 1) + (side.ids * side.block_stride).view(1, 1, -1)
    for size, stride in zip(p_sizes[:outer], p_strides[:outer]):
        off = off.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * (stride * es)
    unit = math.gcd(
        row_bytes,
        first,
        ustride * es,
        side.block_stride,
        *(p - side.base for p in side.layer_ptrs),
        *(s * es for s in p_strides[:outer]),
    )
    lead = (count, side.num_layers, side.num_states)
    to_wire = None
    if order != sorted(order):
        to_wire = (0, 1, 2, *(3 + order.index(k) for k in range(len(order))))
    return _Rows(off.reshape(-1), row_bytes, unit, (*lead, *p_sizes), to_wire, es)


def _read(side: _Side, rows: _Rows, out: torch.Tensor, backend: str) -> None:
    """The run's elements into contiguous uint8 ``out`` (on the side's device), in wire order.
    torch: rows through an overlapping view (row i starts at word i), one index entry each;
    triton: one launch over an address table."""
    offsets, row_bytes = rows.offsets, rows.row_bytes
    stage = out if rows.to_wire is None else torch.empty_like(out)
    dtype = addrspace.word_for(rows.unit, side.base, stage.data_ptr())
    word = torch.empty((), dtype=dtype).element_size()
    if backend == "triton":
        from .state_kernels import copy_rows

        dst = stage.data_ptr() + torch.arange(offsets.numel(), dtype=torch.int64) * row_bytes
        copy_rows(offsets + side.base, dst, row_bytes, word, side.device)
    else:
        flat = addrspace.unit_rows(side.base, side.end, word, dtype, side.device).view(-1)
        rw = row_bytes // word
        view = flat.as_strided((flat.numel() - rw + 1, rw), (1, 1))
        idx = (offsets // word).to(side.device, non_blocking=True)
        torch.index_select(view, 0, idx, out=stage.view(dtype).view(-1, rw))
    if rows.to_wire is not None:
        es = rows.element_size if out.data_ptr() % rows.element_size == 0 else 1  # stage is aligned
        paged = _elements(stage, es).view(*rows.page_shape, -1)  # an element's bytes (or word) last
        wired = paged.permute(*rows.to_wire, len(rows.page_shape))
        _elements(out, es).view(wired.shape).copy_(wired)


def _write(side: _Side, rows: _Rows, src: torch.Tensor, backend: str) -> None:
    """Contiguous uint8 ``src`` (wire order, on the side's device) into the run's rows."""
    if rows.to_wire is not None:  # wire order -> page order
        n = len(rows.page_shape)
        wire_shape = [rows.page_shape[k] for k in rows.to_wire]
        back = [rows.to_wire.index(k) for k in range(n)]
        src = _elements(src, rows.element_size).view(*wire_shape, -1).permute(*back, n).contiguous()
        src = src.view(torch.uint8).view(-1)
    offsets, row_bytes, unit = rows.offsets, rows.row_bytes, rows.unit
    dtype = addrspace.word_for(unit, side.base, src.data_ptr())
    word = torch.empty((), dtype=dtype).element_size()
    if backend == "triton":
        from .state_kernels import copy_rows

        addr = src.data_ptr() + torch.arange(offsets.numel(), dtype=torch.int64) * row_bytes
        copy_rows(addr, offsets + side.base, row_bytes, word, side.device)
        return
    view = addrspace.unit_rows(side.base, side.end, unit, dtype, side.device)
    per = torch.arange(row_bytes // unit, dtype=torch.int64)
    idx = (offsets.view(-1, 1) // unit + per).reshape(-1).to(side.device, non_blocking=True)
    view.index_copy_(0, idx, src.view(dtype).view(-1, unit // word))


def _convert(data: torch.Tensor, src: torch.dtype, dst: torch.dtype) -> torch.Tensor:
    """uint8 bytes of ``src`` elements as the bytes of the same values in ``dst``."""
    if src == dst:
        return data
    typed = torch.empty(
        data.numel() // torch.empty((), dtype=src).element_size(), dtype=src, device=data.device
    )
    typed.view(torch.uint8).copy_(data)
    return typed.to(dst).view(torch.uint8)


# --------------------------------------------------------------------------- public ops
def gather_state(
    caches: Sequence[torch.Tensor],
    spec: StateSpec,
    state_ids,
    runs: Sequence[UnitRun] | None = None,
    layers=None,
    out: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Gather states out of one rank's pages into a wire.

    Args:
        caches: the rank's per-layer pages (see the module doc).
        spec: the state group as this engine holds it.
        state_ids: the state block of each of ``num_states`` states.
        runs: per section, the units read from ``src_start`` (default: all on the rank).
        layers: layers to move, in wire order (default all).
        out: optional destination: a contiguous uint8 ``[wire_nbytes]`` tensor on the caches'
            device (CUDA caches: or pinned host memory).
        backend: None or ``"torch"`` (the reference), or ``"triton"``
            (:mod:`kvxfer.groups.state_kernels`; ``ValueError`` where it cannot run).

    Returns:
        The wire (uint8 ``[spec.wire_nbytes(counts, num_layers, num_states)]``, ``counts`` the
        runs' unit counts; :meth:`StateSpec.wire_views` types its sections), ``out`` when given.
    """
    side = _make_side(caches, spec, state_ids, layers, False, "caches")
    runs = _check_runs(runs, spec, None)
    backend = _check_backend(backend, side.device)
    lay = spec.wire_layout([r.num_units for r in runs], side.num_layers, side.num_states)
    if out is None:
        out = torch.empty(lay.nbytes, dtype=torch.uint8, device=side.device)
    else:
        _check_wire(out, lay.nbytes, side.device, "out")
    stage = out if out.device == side.device else torch.empty_like(out, device=side.device)
    for i, shape in enumerate(lay.shapes):  # the alignment gaps: zeros, not stale memory
        end = lay.offsets[i] + math.prod(shape) * lay.dtypes[i].itemsize
        stage[end : lay.offsets[i + 1] if i + 1 < len(lay.offsets) else lay.nbytes].zero_()
    for i, r in enumerate(runs):
        if not r.num_units or not side.num_states:
            continue
        rows = _rows(side, i, r.src_start, r.num_units)
        n = rows.offsets.numel() * rows.row_bytes
        _read(side, rows, stage[lay.offsets[i] : lay.offsets[i] + n], backend)
    if stage is not out:
        out.copy_(stage)
    return out


def scatter_state(
    wire: torch.Tensor,
    caches: Sequence[torch.Tensor],
    spec: StateSpec,
    state_ids,
    runs: Sequence[UnitRun] | None = None,
    layers=None,
    wire_spec: StateSpec | None = None,
    convert_dtype: bool = False,
    backend: str | None = None,
) -> None:
    """Scatter a wire into one rank's pages (the inverse of :func:`gather_state`).

    ``wire`` holds, per section, ``runs[i].num_units`` units in ``wire_spec``'s dtypes (the
    source engine's spec; default ``spec``); they land at rank-local ``runs[i].dst_start`` of
    the layers ``layers`` (default all, in wire order) of the blocks ``state_ids`` (repeats
    refused). ``convert_dtype``: convert ``wire_spec``'s dtypes to ``spec``'s (else a differing
    dtype is refused). Only the addressed units' bytes are written: the rest of each page, its
    padding and every other block stay untouched. ``backend`` as for :func:`gather_state`.
    """
    wire_spec = spec if wire_spec is None else wire_spec
    if not isinstance(wire_spec, StateSpec):
        raise ValueError(f"wire_spec: expected a StateSpec, got {type(wire_spec).__name__}")
    if not isinstance(spec, StateSpec):
        raise ValueError(f"spec: expected a StateSpec, got {type(spec).__name__}")
    _check_pair(wire_spec, spec, convert_dtype)
    side = _make_side(caches, spec, state_ids, layers, True, "caches")
    runs = _check_runs(runs, None, spec)
    backend = _check_backend(backend, side.device)
    lay = wire_spec.wire_layout([r.num_units for r in runs], side.num_layers, side.num_states)
    _check_wire(wire, lay.nbytes, side.device, "wire")
    if wire.device != side.device:
        wire = wire.to(side.device, non_blocking=True)
    for i, (r, sec) in enumerate(zip(runs, spec.sections)):
        if not r.num_units or not side.num_states:
            continue
        rows = _rows(side, i, r.dst_start, r.num_units)
        n = rows.offsets.numel() * rows.row_bytes * wire_spec.sections[i].dtype.itemsize // sec.dtype.itemsize
        data = _convert(wire[lay.offsets[i] : lay.offsets[i] + n], wire_spec.sections[i].dtype, sec.dtype)
        _write(side, rows, data, backend)


def copy_state(
    src_caches: Sequence[torch.Tensor],
    src_spec: StateSpec,
    src_state_ids,
    dst_caches: Sequence[torch.Tensor],
    dst_spec: StateSpec,
    dst_state_ids,
    runs: Sequence[UnitRun] | None = None,
    layers=None,
    convert_dtype: bool = False,
    backend: str | None = None,
) -> None:
    """Copy states from one rank's pages straight into another's (no wire): per section, the
    units ``runs[i]`` (source-local ``src_start`` to destination-local ``dst_start``; default:
    every unit, when both ranks hold the same units) of the layers ``layers`` (default all)
    of block ``src_state_ids[j]`` into block ``dst_state_ids[j]``. The two sides may differ in
    TP size, conv layout, SSM order and page size (and dtypes with ``convert_dtype``); both on
    one device (the source may be another process's memory mapped into this one). ``backend``
    as for :func:`gather_state`.
    """
    for what, s in (("src_spec", src_spec), ("dst_spec", dst_spec)):
        if not isinstance(s, StateSpec):
            raise ValueError(f"{what}: expected a StateSpec, got {type(s).__name__}")
    _check_pair(src_spec, dst_spec, convert_dtype)
    src = _make_side(src_caches, src_spec, src_state_ids, layers, False, "src_caches")
    dst = _make_side(dst_caches, dst_spec, dst_state_ids, layers, True, "dst_caches")
    if src.num_states != dst.num_states:
        raise ValueError(
            f"dst_state_ids: {dst.num_states} states, src_state_ids {src.num_states}; one block each"
        )
    if src.device != dst.device:
        raise ValueError(f"dst_caches: on {dst.device}, src_caches on {src.device}; copy needs one device")
    runs = _check_runs(runs, src_spec, dst_spec)
    backend = _check_backend(backend, src.device)
    for i, (r, ssec, dsec) in enumerate(zip(runs, src_spec.sections, dst_spec.sections)):
        if not r.num_units or not src.num_states:
            continue
        rows = _rows(src, i, r.src_start, r.num_units)
        vals = torch.empty(rows.offsets.numel() * rows.row_bytes, dtype=torch.uint8, device=src.device)
        _read(src, rows, vals, backend)
        vals = _convert(vals, ssec.dtype, dsec.dtype)
        _write(dst, _rows(dst, i, r.dst_start, r.num_units), vals, backend)
