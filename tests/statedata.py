"""State-group test payloads that encode their origin, and a naive model of a rank's pages.

The "truth" of ``num_states`` states is, per section (conv part or SSM), a uint8 tensor
``[L, R, U, *unit_shape, element_size]`` in canonical, global order (every unit of the model).
Every contiguous run of a unit (a conv unit's channels in one state row, an SSM head's last
dim) starts with its origin: (layer, section, unit, row, state, unit >> 8), as far as the run
has bytes; the rest is seeded noise, so a misplaced run names itself in a failing comparison.
Pages are filled from the truth by plain indexing and loops, independently of kvxfer's index
math (unit ownership included).
"""

from __future__ import annotations

import math

import torch

from kvxfer.groups import ConvLayout, StateSpec

POISON = 0xA5


def owned(num_units: int, tp: int, rank: int) -> list[int]:
    """Global units of a section held by ``rank`` of ``tp`` (sharded, or one replicated unit)."""
    if num_units >= tp:
        per = num_units // tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank * num_units // tp]


def truth(spec: StateSpec, num_states: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Per section name: uint8 ``[L, R, U, *unit_shape, element_size]`` (see the module doc)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, sec in enumerate(spec.sections):
        es = sec.dtype.itemsize
        shape = (spec.num_layers, num_states, sec.num_units, *sec.unit_shape, es)
        data = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
        runs = data.flatten(-2)  # [..., last dim * es]: one contiguous run per leading index
        lead = runs.shape[:-1]
        grid = torch.meshgrid(*[torch.arange(n) for n in lead], indexing="ij")
        layer, state, unit = grid[0], grid[1], grid[2]
        row = grid[3] if len(grid) > 3 else torch.zeros_like(unit)
        stamp = torch.stack([layer, torch.full_like(layer, i), unit, row, state, unit >> 8], dim=-1)
        n = min(runs.shape[-1], stamp.shape[-1])
        runs[..., :n] = stamp[..., :n].to(torch.uint8)
        out[sec.name] = data
    return out


def values_truth(spec: StateSpec, num_states: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Like :func:`truth` but with finite values (small integers and halves, exact in every
    float dtype incl. fp8 e4m3): for dtype conversions. Per section: ``[L, R, U, *unit_shape]``
    float32."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for sec in spec.sections:
        shape = (spec.num_layers, num_states, sec.num_units, *sec.unit_shape)
        out[sec.name] = torch.randint(-16, 17, shape, generator=g).to(torch.float32) / 2
    return out


def as_bytes(values: dict[str, torch.Tensor], spec: StateSpec) -> dict[str, torch.Tensor]:
    """Value truth (:func:`values_truth`) in ``spec``'s dtypes, as the byte truth layout."""
    out = {}
    for sec in spec.sections:
        v = values[sec.name].to(sec.dtype).contiguous()
        out[sec.name] = v.view(torch.uint8).view(*v.shape, sec.dtype.itemsize)
    return out


def empty_pages(spec: StateSpec, num_blocks: int, fill: int = POISON, pad: int = 0) -> list[torch.Tensor]:
    """Per-layer uint8 pages ``[num_blocks, page_bytes + pad]`` of one rank, every byte ``fill``."""
    return [
        torch.full((num_blocks, spec.page_bytes + pad), fill, dtype=torch.uint8)
        for _ in range(spec.num_layers)
    ]


def page_bytes(cache: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, bytes per block]`` writable uint8 view of one layer's pages."""
    raw = cache if cache.dtype == torch.uint8 else cache.view(torch.uint8)
    return raw.flatten(1)


def rank_state(
    spec: StateSpec, rank: int, t: dict[str, torch.Tensor], layer: int, state: int
) -> torch.Tensor:
    """The bytes one rank's page holds for (layer, state): conv then SSM, ``[content_bytes]``."""
    tp = spec.tp_size
    secs = spec.sections
    chans = []
    for i, part in enumerate(spec.conv_parts):
        units = owned(part.num_units, tp, rank)
        x = t[secs[i].name][layer, state, units]  # [u, S, W, es]
        chans.append(x.permute(1, 0, 2, 3).reshape(spec.state_len, -1, x.shape[-1]))
    conv = torch.cat(chans, dim=1)  # [S, D_local, es]
    if spec.conv_layout is ConvLayout.DS:
        conv = conv.transpose(0, 1)
    parts = [conv.reshape(-1)]
    if spec.ssm_heads:
        heads = owned(spec.ssm_heads, tp, rank)
        s = t["ssm"][layer, state, heads]  # [h, *head, es]
        if spec.ssm_transposed:
            s = s.transpose(-2, -3)
        parts.append(s.reshape(-1))
    return torch.cat(parts)


def place(caches, spec: StateSpec, rank: int, t: dict[str, torch.Tensor], state_ids, layers=None) -> None:
    """Write the truth of every state ``j`` into block ``state_ids[j]`` of ``caches`` (the
    layers ``layers``, default all: layer ``l`` of the truth into ``caches[l]``)."""
    layers = range(spec.num_layers) if layers is None else layers
    for layer in layers:
        pages = page_bytes(caches[layer])
        for j, b in enumerate(state_ids):
            content = rank_state(spec, rank, t, layer, j)
            pages[b, : content.numel()] = content


def wire_of(
    spec: StateSpec, rank: int, t: dict[str, torch.Tensor], runs, layers=None
) -> dict[str, torch.Tensor]:
    """Expected wire sections of a gather from ``rank``: per section name, bytes of
    ``[n, L, R, *unit_shape]`` for the run's units (source half), in canonical order."""
    layers = list(range(spec.num_layers)) if layers is None else list(layers)
    out = {}
    for sec, run in zip(spec.sections, runs):
        units = owned(sec.num_units, spec.tp_size, rank)[run[0] : run[0] + run[2]]
        x = t[sec.name][layers][:, :, units]  # [L, R, n, *unit, es]
        out[sec.name] = x.movedim(2, 0).contiguous().reshape(-1)
    return out


def wire_sections(spec: StateSpec, wire: torch.Tensor, counts, num_layers: int, num_states: int):
    """The wire's sections as flat bytes by name (the alignment gaps left out)."""
    lay = spec.wire_layout(counts, num_layers, num_states)
    out = {}
    for sec, off, shape, dt in zip(spec.sections, lay.offsets, lay.shapes, lay.dtypes):
        out[sec.name] = wire[off : off + math.prod(shape) * dt.itemsize]
    return out
