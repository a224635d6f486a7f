"""The copy-engine (DMA) path: a transfer that needs no conversion, as one ``cuMemcpyBatchAsync``.

A gather, scatter or copy whose bytes lie in the same order on both sides, in runs of whole
blocks, is a list of plain memory copies: the GPU's copy engines can move it without a single
SM, so the model's kernels beside it keep every SM. This module

* builds those runs (:func:`plan_runs`, vectorised with numpy: one address per block and head
  group, adjacent blocks coalesced into one run) or says why a transfer is not such a list
  (its host time grows with the number of runs, so they are built only once a call is to take
  the copy engines);
* chooses per call between them and a kernel (:func:`choose`, the rule below);
* keeps per registered cache what was chosen and why (:class:`PathStats`).

The runs go to the CUDA driver's batched copy in :mod:`kvxfer.backends.batch_copy` (ctypes; no
CuPy needed): :func:`choose` asks it whether the call exists here, :mod:`kvxfer.ops` enqueues
through it.

**When the runs apply** (each refusal names its reason): every paged side moves whole blocks
(``num_tokens`` a multiple of the block size: a partial last block would need a run that stops
inside a block, which the kernels handle); for ``copy`` both sides have the same block size;
per block the moved bytes of a head group are contiguous on both sides and in the same order.
That is: an ``ipc`` copy between like caches of whole heads (NHD needs every head of the rank,
HND any head slice: a block's heads are contiguous there) in one run per (layer, K/V, block);
and a gather into (scatter from) a wire where one head's tokens are contiguous in a block (HND,
MLA, NHD with one head per rank) in one run per (head, layer, K/V, block). An NHD head slice of
several heads is one 2 x ``head_dim``-byte row per token: no. Nor are token slots (caches
registered with ``token_slots``: one id per token, each a few rows).

**By default a call takes a kernel**: measured on an H200, the batched copy of a 4K-token
transfer with scattered block ids ran at 0.3 % (device copy) and ~10 % (gather to pinned host) of
what a kernel reaches (``DMA_ENV``'s comment has the figures). ``dma=True`` asks for DMA wherever
it applies (an error naming why where it does not). ``$KVXFER_DMA=rule`` applies **the rule**
(:func:`choose`): DMA where it applies and the SM budget is small (``max_sms <=
SMALL_BUDGET_SMS``) or the copy is large (``>= LARGE_COPY_BYTES``), and its runs are not too
small for the copy engines (mean ``>= MIN_RUN_BYTES`` after coalescing); a kernel otherwise.
``dma=False`` or ``$KVXFER_DMA=0`` never use it.

**The driver**: ``cuMemcpyBatchAsync`` (CUDA 12.8+, :mod:`kvxfer.backends.batch_copy`). A
driver without the call, or a call that fails, falls back to the kernel with one logged warning.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from . import addrspace, batch_copy
from .base import PagedSide
from .batch_copy import Runs

__all__ = [
    "DMA_ENV",
    "LARGE_COPY_BYTES",
    "MIN_RUN_BYTES",
    "SMALL_BUDGET_SMS",
    "Choice",
    "PathStats",
    "Runs",
    "check_max_sms",
    "choose",
    "known_status",
    "plan_runs",
    "status",
]

DMA_ENV = "KVXFER_DMA"  # unset (default): never by itself; "rule": by the rule; "0"/"off": never
# Off by default: on an H200 the batched copy moved a 4K-token Llama-3-8B transfer with random
# block ids at 0.3 % of a device copy_ (ipc copy, 16384 runs of 32 KiB: 79 ms against 0.26 ms)
# and an HND gather to pinned host at 9.6-10.5 % of a pinned copy_ (131072 runs of 4 KiB), while
# a kernel capped at 8 SMs kept 93-96 % of the pinned copy (profiling/results/2026-11-28-H200/,
# bench_interference). Until a measured case where the copy engines win, a call takes them only
# when it asks (dma=True) or $KVXFER_DMA=rule applies the rule below.
# The rule's thresholds. A budget at or below this many SMs is "small"; sglang #40278 reports
# host<->device KV at the copy-engine ceiling from 4 of 152 SMs.
SMALL_BUDGET_SMS = 16
# A copy of at least this many bytes is "large": a 4K-token Llama-3-8B transfer is 537 MB, a
# layer group of 4 layers of it 67 MB.
LARGE_COPY_BYTES = 64 << 20
# Mean run size below which a batch is left to the kernels: a copy engine pays per run.
MIN_RUN_BYTES = 4096


def check_max_sms(value, what: str = "max_sms") -> int | None:
    """``value`` if it is None or a positive int; else ``ValueError`` naming ``what``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{what}: must be a positive int (SMs) or None, got {value!r}")
    return int(value)


# --------------------------------------------------------------------------- runs


class _Layout(NamedTuple):
    """What the runs need of one paged side, kept in its memo (no ids, no token count)."""

    bases: np.ndarray  # int64 [L] layer base addresses, head_start folded in
    s_kv: int  # bytes
    s_blk: int
    s_head: int
    one_head: bool  # one head's tokens of a block are contiguous (token stride = one row)
    heads_order: str | None  # the order of all moved heads of a block when contiguous: "TH", "HT"
    extent: tuple[int, int]  # [lo, hi) of the bytes the side's layers span


def _layout(side: PagedSide) -> _Layout:
    es = side.element_size
    row = side.row_bytes
    s_kv, s_blk, s_tok, s_head = (
        x * es for x in (side.stride_kv, side.stride_block, side.stride_token, side.stride_head)
    )
    n, bs = side.num_heads, side.block_size
    one_head = s_tok == row or bs == 1
    if n == 1:
        order = "T" if one_head else None
    elif s_head == row and s_tok == n * row:
        order = "TH"  # NHD moving every head of the rank: [tokens, heads, row]
    elif s_tok == row and s_head == bs * row:
        order = "HT"  # HND: [heads, tokens, row]
    else:
        order = None
    ptrs = np.array(side.layer_ptrs(), dtype=np.int64)
    bases = ptrs + side.head_start * s_head
    span = [addrspace.tensor_extent(c) for c in side.caches]
    return _Layout(
        bases, s_kv, s_blk, s_head, one_head, order, (min(e[0] for e in span), max(e[1] for e in span))
    )


def _paged_layout(side: PagedSide) -> _Layout:
    return side.kept("dma", _layout)


@dataclass(frozen=True)
class _Plan:
    """How a transfer splits into runs (or why it does not): ``why`` is "" when it does."""

    why: str
    per_head: bool = False  # one run per (head, layer, kv, block); else per (layer, kv, block)
    unit: int = 0  # bytes of one block's run
    layouts: tuple[_Layout, ...] = ()  # of the paged sides, src first


def _structure(op: str, src: PagedSide | None, dst: PagedSide | None) -> _Plan:
    """Whether ``op`` between ``src`` and ``dst`` (None: the wire) is whole-block runs, and how."""
    side = src if src is not None else dst
    assert side is not None
    paged = [s for s in (src, dst) if s is not None]
    bs = side.block_size
    slotted = next((s for s in paged if s.slot_block > 1), None)
    if slotted is not None:
        return _Plan(f"{slotted.layout} token slots: a slot's rows are not block runs")
    if op == "copy" and src.block_size != dst.block_size:
        return _Plan(f"block sizes differ ({src.block_size} -> {dst.block_size}): tokens change blocks")
    r = side.num_tokens % bs
    if r:
        return _Plan(f"partial last block ({r} of {bs} tokens): whole blocks only")
    lays = tuple(_paged_layout(s) for s in paged)
    row = side.row_bytes
    n = side.num_heads
    if op == "copy":
        a, b = lays
        if a.heads_order is not None and a.heads_order == b.heads_order:
            return _Plan("", per_head=False, unit=n * bs * row, layouts=lays)
        if a.one_head and b.one_head:
            return _Plan("", per_head=True, unit=bs * row, layouts=lays)
        bad = src if not (a.heads_order or a.one_head) else dst
        return _Plan(
            f"{bad.layout} head slice [{bad.head_start}, +{n}) of a block is not contiguous on "
            f"{'the source' if bad is src else 'the destination'}, or the two orders differ"
        )
    (a,) = lays
    if a.one_head:
        return _Plan("", per_head=True, unit=bs * row, layouts=lays)
    return _Plan(
        f"{side.layout}: one head's tokens of a block are {row}-byte rows "
        f"{side.stride_token * side.element_size} bytes apart, not one run"
    )


def _addresses(side: PagedSide, lay: _Layout, per_head: bool) -> np.ndarray:
    """int64 start address of every unit, ``[G, L, KV, nb]`` flattened (G = heads or 1)."""
    nb = side.num_tokens // side.block_size
    ids = side.block_ids[:nb]
    heads = np.arange(side.num_heads if per_head else 1, dtype=np.int64) * lay.s_head
    kv = np.arange(side.num_kv, dtype=np.int64) * lay.s_kv
    a = (
        heads[:, None, None, None]
        + lay.bases[None, :, None, None]
        + kv[None, None, :, None]
        + (ids * lay.s_blk)[None, None, None, :]
    )
    return a.reshape(-1)


def _wire_addresses(shape: PagedSide, wire_ptr: int, per_head: bool) -> np.ndarray:
    """int64 start address of every unit on the dense wire ``[H, L, KV, T, row]``."""
    h, n_layers, kv, t, _ = shape.wire_view_shape()
    row = shape.row_bytes
    nb = t // shape.block_size
    groups = np.arange(h * n_layers * kv, dtype=np.int64) * (t * row)
    blocks = np.arange(nb, dtype=np.int64) * (shape.block_size * row)
    assert per_head
    return (wire_ptr + groups[:, None] + blocks[None, :]).reshape(-1)


def _overlap(srcs: np.ndarray, dsts: np.ndarray, sizes: np.ndarray) -> bool:
    """Whether any source run overlaps any destination run (destination runs are disjoint)."""
    order = np.argsort(dsts, kind="stable")
    d_lo, d_hi = dsts[order], dsts[order] + sizes[order]
    s_lo, s_hi = srcs, srcs + sizes
    k = np.searchsorted(d_lo, s_hi, side="left") - 1  # the last destination run starting below
    ok = k < 0
    kk = np.where(ok, 0, k)
    return bool(np.any(~ok & (d_hi[kk] > s_lo)))


def plan_runs(
    op: str, src: PagedSide | None, dst: PagedSide | None, wire_ptr: int | None = None
) -> Runs | str:
    """The memory copies of ``op`` (``"gather"``: ``src`` -> the wire at ``wire_ptr``;
    ``"scatter"``: the wire -> ``dst``; ``"copy"``: ``src`` -> ``dst``), adjacent blocks
    coalesced into one run where both sides continue; or a string saying why the transfer is not
    plain copies (see the module docstring). The wire is the dense ``[H, L, KV, T, row]``."""
    return _runs(op, src, dst, wire_ptr, _structure(op, src, dst))


def _runs(
    op: str, src: PagedSide | None, dst: PagedSide | None, wire_ptr: int | None, plan: _Plan
) -> Runs | str:
    """:func:`plan_runs` once the structure is known."""
    if plan.why:
        return plan.why
    shape = src if src is not None else dst
    assert shape is not None
    lays = iter(plan.layouts)
    if src is not None:
        a = _addresses(src, next(lays), plan.per_head)
    else:
        a = _wire_addresses(shape, int(wire_ptr), plan.per_head)
    if dst is not None:
        b = _addresses(dst, next(lays), plan.per_head)
    else:
        b = _wire_addresses(shape, int(wire_ptr), plan.per_head)
    u = plan.unit
    n = a.size
    if n == 0:
        return "nothing to move"
    # a run continues where both sides continue: the next unit starts where this one ends
    cont = np.diff(a) == u
    cont &= np.diff(b) == u
    if cont.any():
        starts = np.flatnonzero(~cont) + 1
        starts = np.concatenate((np.zeros(1, dtype=np.int64), starts))
        sizes = np.diff(np.append(starts, n)).astype(np.uint64) * np.uint64(u)
        srcs, dsts = a[starts], b[starts]
    else:  # nothing to coalesce (HND blocks of several heads, say): the units are the runs
        srcs, dsts, sizes = a, b, np.full(n, u, dtype=np.uint64)
    if op == "copy":
        la, lb = plan.layouts[0].extent, plan.layouts[1].extent
        if la[0] < lb[1] and lb[0] < la[1] and _overlap(srcs, dsts, sizes.astype(np.int64)):
            return "source and destination runs overlap (a batch's copies run in no set order)"
    # int64 -> uint64 of the same (non-negative) addresses: views, no copy
    return Runs(dsts.view(np.uint64), srcs.view(np.uint64), sizes, n * u, u)


# --------------------------------------------------------------------------- the rule
class Choice(NamedTuple):
    """The path of one call: ``"dma"`` or ``"kernel"``, a short reason key (stats counts by it)
    and its details; ``runs`` when the path is DMA."""

    path: str
    key: str
    detail: str
    runs: Runs | None = None

    def __str__(self) -> str:
        return f"{self.path}: {self.key}" + (f" ({self.detail})" if self.detail else "")


def _env_off() -> bool:
    return os.environ.get(DMA_ENV, "").strip().lower() in ("0", "off", "false", "no")


def _rule_on() -> bool:
    return os.environ.get(DMA_ENV, "").strip().lower() == "rule"


def choose(
    op: str,
    src: PagedSide | None,
    dst: PagedSide | None,
    wire_ptr: int | None,
    max_sms: int | None,
    dma: bool | None,
    device: torch.device,
) -> Choice:
    """The path of one validated call (see the module docstring for the rule).

    ``dma``: None applies the rule, True asks for DMA (``ValueError`` naming why it cannot be
    used), False never. The runs are built only once the rule wants DMA."""
    if dma is False:
        return Choice("kernel", "dma=False", "")
    if dma is None and _env_off():
        return Choice("kernel", f"${DMA_ENV} off", "")
    if dma is None and not _rule_on():
        return Choice(
            "kernel",
            "copy engines not by default",
            f"measured slower than the kernels; dma=True or ${DMA_ENV}=rule takes them",
        )
    shape = src if src is not None else dst
    assert shape is not None
    nbytes = shape.num_heads * shape.num_layers * shape.num_kv * shape.num_tokens * shape.row_bytes
    if dma is None:
        small = max_sms is not None and max_sms <= SMALL_BUDGET_SMS
        large = nbytes >= LARGE_COPY_BYTES
        if not (small or large):
            budget = "all" if max_sms is None else str(max_sms)
            return Choice(
                "kernel",
                "budget not small, copy not large",
                f"budget {budget} SMs > {SMALL_BUDGET_SMS}, {nbytes} B < {LARGE_COPY_BYTES} B",
            )
    plan = _structure(op, src, dst)
    if plan.why:
        if dma:
            raise ValueError(f"dma=True: this {op} is not whole-block copies: {plan.why}")
        return Choice("kernel", "dma does not apply", plan.why)
    cp, why = batch_copy.copier(device)
    if cp is None:
        if dma:
            raise ValueError(f"dma=True: no batched copy here: {why}")
        return Choice("kernel", "no cuMemcpyBatchAsync", why)
    runs = _runs(op, src, dst, wire_ptr, plan)
    if isinstance(runs, str):
        if dma:
            raise ValueError(f"dma=True: {runs}")
        return Choice("kernel", "dma does not apply", runs)
    if dma:
        return Choice("dma", "dma=True", f"{runs.count} runs", runs)
    mean = runs.nbytes // runs.count
    if mean < MIN_RUN_BYTES:
        return Choice("kernel", "runs too small", f"{runs.count} runs of {mean} B < {MIN_RUN_BYTES} B", None)
    if max_sms is not None and max_sms <= SMALL_BUDGET_SMS:
        return Choice("dma", "budget small", f"{max_sms} SMs <= {SMALL_BUDGET_SMS}; {runs.count} runs", runs)
    return Choice("dma", "copy large", f"{nbytes} B >= {LARGE_COPY_BYTES} B; {runs.count} runs", runs)


# --------------------------------------------------------------------------- on or off
def status(device: torch.device | str = "cuda") -> str:
    """``"on: <call>"`` or ``"off: <why>"`` for tensors on ``device`` (looks the driver up)."""
    if _env_off():
        return f"off: ${DMA_ENV} says so"
    c, why = batch_copy.copier(torch.device(device))
    return f"on: {c.name}" if c is not None else f"off: {why}"


def known_status() -> str:
    """:func:`status` of the device types looked up so far, without looking anything up
    (``"not looked up yet"`` before a call wanted DMA)."""
    if _env_off():
        return f"off: ${DMA_ENV} says so"
    parts = [
        f"{kind} " + (f"on: {name}" if name is not None else f"off: {why}")
        for kind, name, why in batch_copy.looked_up()
    ]
    return "; ".join(parts) if parts else "not looked up yet"


# --------------------------------------------------------------------------- stats
class PathStats:
    """What the ops on one engine's caches chose: per (op, path, reason) a count, the last choice
    and the SM budget. Shared by the views of one :func:`kvxfer.views.cache_views`."""

    __slots__ = ("counts", "last", "max_sms")

    def __init__(self, max_sms: int | None = None) -> None:
        self.max_sms = max_sms
        self.counts: dict[tuple[str, str, str], int] = {}
        self.last: tuple[str, Choice] | None = None

    def record(self, op: str, choice: Choice) -> None:
        key = (op, choice.path, choice.key)
        self.counts[key] = self.counts.get(key, 0) + 1
        self.last = (op, choice)

    def snapshot(self) -> dict:
        """``{"max_sms", "dma", "kernel" (calls), "reasons" ("<op> <path>: <why>" -> calls),
        "last" ("<op> <path>: <why> (<details>)")}``."""
        calls = {"dma": 0, "kernel": 0}
        reasons: dict[str, int] = {}
        for (op, path, key), n in sorted(self.counts.items()):
            calls[path] = calls.get(path, 0) + n
            reasons[f"{op} {path}: {key}"] = n
        last = None if self.last is None else f"{self.last[0]} {self.last[1]}"
        return {
            "max_sms": self.max_sms,
            **calls,
            "reasons": reasons,
            "last": last,
            "dma_path": known_status(),
        }
