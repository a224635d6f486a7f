"""The copy-engine (DMA) path: a transfer that needs no conversion, as one ``cuMemcpyBatchAsync``.

A gather, scatter or copy whose bytes lie in the same order on both sides, in runs of whole
blocks, is a list of plain memory copies: the GPU's copy engines can move it without a single
SM, so the model's kernels beside it keep every SM. This module

* builds those runs (:func:`plan_runs`, vectorised with numpy: one address per block and head
  group, adjacent blocks coalesced into one run) or says why a transfer is not such a list
  (host time on the 2-core dev VM, 4K tokens of Llama-3-8B: 40-95 us for an ipc copy's 16384
  block runs, 1.7 ms for an HND gather's 131072 one-head runs);
* chooses per call between them and a kernel (:func:`choose`, the rule below);
* issues the runs through the CUDA driver's batched copy (:class:`BatchCopier`, ctypes; no
  CuPy needed), and keeps per registered cache what was chosen and why (:class:`PathStats`).

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

**The rule** (:func:`choose`): DMA where it applies and the SM budget is small
(``max_sms <= SMALL_BUDGET_SMS``) or the copy is large (``>= LARGE_COPY_BYTES``), and its runs
are not too small for the copy engines (mean ``>= MIN_RUN_BYTES`` after coalescing); a kernel
otherwise. ``dma=True`` asks for DMA wherever it applies (an error naming why where it does not),
``dma=False`` or ``$KVXFER_DMA=0`` never use it. The thresholds are not measured yet:
``profiling/bench_interference.py`` measures both paths on the next GPU session.

**The driver**: ``cuMemcpyBatchAsync`` (CUDA 12.8+). The CUDA 13 driver API names the current
form ``cuMemcpyBatchAsync_v2`` (dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, stream);
the CUDA 12.8 form, still exported under the plain name, takes a ``size_t *failIdx`` before the
stream (``cuda.h`` of CUDA 13.0). One attribute covers every run: the source is read in stream
order, and the copies prefer to overlap compute. The stream must not be the legacy default
stream: on it the batch runs on a side stream ordered after and before it by events. A driver
without the call, or a call that fails, falls back to the kernel with one logged warning.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from . import addrspace
from .base import PagedSide

__all__ = [
    "DMA_ENV",
    "LARGE_COPY_BYTES",
    "MIN_RUN_BYTES",
    "PROTOTYPES",
    "SMALL_BUDGET_SMS",
    "BatchCopier",
    "CUmemLocation",
    "CUmemcpyAttributes",
    "Choice",
    "PathStats",
    "Runs",
    "check_max_sms",
    "choose",
    "copier",
    "install_copier",
    "known_status",
    "plan_runs",
    "run",
    "status",
]

_LOG = logging.getLogger(__name__)

DMA_ENV = "KVXFER_DMA"  # "0"/"off": never; anything else (default): by the rule
# The rule's thresholds, to be set by profiling/bench_interference.py on the next GPU session
# (not measured yet). A budget at or below this many SMs is "small": a kernel that narrow leaves
# bandwidth on the table (sglang #40278 reports host<->device KV at the copy-engine ceiling from
# 4 of 152 SMs, a kernel from many more), so the copy engines move it.
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
class Runs(NamedTuple):
    """The memory copies of one transfer: ``count`` runs, ``dsts[i] <- srcs[i]`` of ``sizes[i]``
    bytes (uint64 arrays, C-contiguous, what the driver call takes), ``nbytes`` in all; ``unit``
    the bytes of one block's run before adjacent ones were coalesced."""

    dsts: np.ndarray
    srcs: np.ndarray
    sizes: np.ndarray
    nbytes: int
    unit: int

    @property
    def count(self) -> int:
        return int(self.sizes.size)


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
    cp, why = copier(device)
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


# --------------------------------------------------------------------------- the driver call
class CUmemLocation(ctypes.Structure):
    """``CUmemLocation`` (cuda.h): a location type (``CUmemLocationType``, an enum) and an id."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class CUmemcpyAttributes(ctypes.Structure):
    """``CUmemcpyAttributes`` (cuda.h, CUDA 12.8+): source access order, location hints of both
    operands (used only for managed or pageable memory), flags."""

    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),  # CUmemcpySrcAccessOrder
        ("srcLocHint", CUmemLocation),
        ("dstLocHint", CUmemLocation),
        ("flags", ctypes.c_uint),
    ]


CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_LOCATION_TYPE_HOST = 2

_P64 = ctypes.POINTER(ctypes.c_uint64)  # CUdeviceptr * (CUdeviceptr: unsigned long long)
_PSZ = ctypes.POINTER(ctypes.c_size_t)
_PATTR = ctypes.POINTER(CUmemcpyAttributes)
# The two forms of the call (cuda.h of CUDA 13.0): 2 = cuMemcpyBatchAsync_v2 (CUDA 13), 1 = the
# CUDA 12.8 cuMemcpyBatchAsync with ``size_t *failIdx`` before the stream. CUresult is an int
# enum, CUstream a pointer. tests/test_dma.py checks both against the toolkit's cuda.h.
ARGTYPES = {
    2: (_P64, _P64, _PSZ, ctypes.c_size_t, _PATTR, _PSZ, ctypes.c_size_t, ctypes.c_void_p),
    1: (_P64, _P64, _PSZ, ctypes.c_size_t, _PATTR, _PSZ, ctypes.c_size_t, _PSZ, ctypes.c_void_p),
}
SYMBOLS = {2: "cuMemcpyBatchAsync_v2", 1: "cuMemcpyBatchAsync"}
PROTOTYPES = {abi: ctypes.CFUNCTYPE(ctypes.c_int, *args) for abi, args in ARGTYPES.items()}
MIN_DRIVER = 12080  # cuDriverGetVersion of CUDA 12.8


class DmaError(RuntimeError):
    """The batched copy returned an error (nothing to trust of what it enqueued)."""


class BatchCopier:
    """One ``cuMemcpyBatchAsync`` per call, through ``fn`` (an instance of ``PROTOTYPES[abi]``:
    the driver's symbol, or a test's fake built from the same prototype). ``serves``: the device
    types whose tensors it copies (``("cuda",)``; a fake on CPU memory: ``("cpu",)``).
    ``bind(device_index)``: a context manager making the device's context current (None: none
    needed). ``error_name(rc)``: the name of a CUresult."""

    def __init__(
        self, fn, abi: int, name: str, serves: tuple[str, ...] = ("cuda",), bind=None, error_name=None
    ):
        if abi not in PROTOTYPES or not isinstance(fn, PROTOTYPES[abi]):
            raise TypeError(f"fn: must be an instance of PROTOTYPES[{abi}]")
        self.fn, self.abi, self.name, self.serves = fn, abi, name, serves
        self._bind, self._error_name = bind, error_name

    def copy(
        self,
        runs: Runs,
        stream: int,
        src_loc: tuple[int, int],
        dst_loc: tuple[int, int],
        device_index: int | None,
    ) -> None:
        """Enqueue ``runs`` on ``stream`` (a CUstream handle, not the legacy default stream).
        ``src_loc``/``dst_loc``: (CUmemLocationType, id) hints. Raises :class:`DmaError`."""
        attr = CUmemcpyAttributes(
            CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            CUmemLocation(*src_loc),
            CUmemLocation(*dst_loc),
            CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE,
        )
        idx = (ctypes.c_size_t * 1)(0)
        args = [
            runs.dsts.ctypes.data_as(_P64),
            runs.srcs.ctypes.data_as(_P64),
            runs.sizes.ctypes.data_as(_PSZ),
            runs.count,
            ctypes.pointer(attr),
            idx,
            1,
        ]
        fail = ctypes.c_size_t(2**64 - 1)  # the 12.8 form's index of a failing copy
        if self.abi == 1:
            args.append(ctypes.pointer(fail))
        args.append(ctypes.c_void_p(stream or None))
        if self._bind is not None and device_index is not None:
            with self._bind(device_index):
                rc = self.fn(*args)
        else:
            rc = self.fn(*args)
        if rc != 0:
            name = self._error_name(rc) if self._error_name else str(rc)
            where = f" at run {fail.value}" if self.abi == 1 and fail.value < runs.count else ""
            raise DmaError(f"{self.name} returned {name}{where} ({runs.count} runs, {runs.nbytes} B)")


class _Driver:
    """libcuda through ctypes: the batched copy and the primary-context binding it needs."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(version)) != 0:
            raise OSError("cuDriverGetVersion failed")
        self.version = version.value
        if self.version < MIN_DRIVER:
            v = self.version
            raise OSError(
                f"the driver supports CUDA {v // 1000}.{v % 1000 // 10}; cuMemcpyBatchAsync needs 12.8"
            )
        for abi in (2, 1):
            if hasattr(lib, SYMBOLS[abi]):
                self.abi, self.fn = abi, PROTOTYPES[abi]((SYMBOLS[abi], lib))
                break
        else:
            raise OSError("the driver exports no cuMemcpyBatchAsync")
        if lib.cuInit(0) != 0:
            raise OSError("cuInit failed")
        self.lib = lib
        self._ctx: dict[int, ctypes.c_void_p] = {}
        self._lock = threading.Lock()

    def error_name(self, rc: int) -> str:
        s = ctypes.c_char_p()
        if self.lib.cuGetErrorName(ctypes.c_int(rc), ctypes.byref(s)) == 0 and s.value:
            return s.value.decode()
        return f"CUresult {rc}"

    def _primary(self, index: int) -> ctypes.c_void_p:
        with self._lock:
            ctx = self._ctx.get(index)
            if ctx is None:  # retained once for the process: torch holds it as long anyway
                dev, ctx = ctypes.c_int(0), ctypes.c_void_p()
                if self.lib.cuDeviceGet(ctypes.byref(dev), index) != 0:
                    raise DmaError(f"cuDeviceGet({index}) failed")
                if self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) != 0:
                    raise DmaError(f"cuDevicePrimaryCtxRetain({index}) failed")
                self._ctx[index] = ctx
            return ctx

    def bind(self, index: int):
        """Context manager: device ``index``'s primary context current on this thread (a fresh
        engine thread may have none bound: ``kvxfer/backends/device_context.py``), the
        thread's previous context restored after."""
        driver = self

        class _Bound:
            def __enter__(self):
                self.prev = ctypes.c_void_p()
                driver.lib.cuCtxGetCurrent(ctypes.byref(self.prev))
                want = driver._primary(index)
                self.swap = self.prev.value != want.value
                if self.swap and driver.lib.cuCtxSetCurrent(want) != 0:
                    raise DmaError(f"cuCtxSetCurrent for device {index} failed")

            def __exit__(self, *exc):
                if self.swap:
                    driver.lib.cuCtxSetCurrent(self.prev)

        return _Bound()


_lock = threading.Lock()
_copiers: dict[str, BatchCopier | None] = {}
_why: dict[str, str] = {}
_installed: BatchCopier | None = None


def install_copier(c: BatchCopier | None) -> None:
    """Use ``c`` for the device types it serves (tests: a fake driver); None: back to the real
    driver, looked up again on next use."""
    global _installed, _serves_cpu
    with _lock:
        _installed = c
        _serves_cpu = c is not None and "cpu" in c.serves
        _copiers.clear()
        _why.clear()


def serves_cpu() -> bool:
    """Whether an installed copier moves CPU tensors (a test's fake): ops then consider the DMA
    path on CPU tensors too; never in production."""
    return _serves_cpu


_serves_cpu = False


def copier(device: torch.device) -> tuple[BatchCopier | None, str]:
    """The batched copy for tensors on ``device`` and "" (looked up once per device type), or
    None and why not (logged once as a warning)."""
    kind = device.type
    got = _copiers.get(kind, False)
    if got is not False:
        return got, _why.get(kind, "")
    with _lock:
        if kind in _copiers:
            return _copiers[kind], _why.get(kind, "")
        c, why = None, ""
        if _installed is not None and kind in _installed.serves:
            c = _installed
        elif kind != "cuda":
            why = f"the copy engines move CUDA memory, not {kind} tensors"
        else:
            try:
                d = _Driver()
                c = BatchCopier(d.fn, d.abi, SYMBOLS[d.abi], ("cuda",), d.bind, d.error_name)
                _LOG.info("kvxfer DMA path: %s (driver CUDA %d)", SYMBOLS[d.abi], d.version)
            except (OSError, AttributeError, DmaError) as e:
                why = f"{type(e).__name__}: {e}"
                _LOG.warning("kvxfer DMA path unavailable, transfers use the kernels: %s", why)
        _copiers[kind], _why[kind] = c, why
        return c, why


def _disable(device: torch.device, why: str) -> None:
    with _lock:
        _copiers[device.type], _why[device.type] = None, why


def status(device: torch.device | str = "cuda") -> str:
    """``"on: <call>"`` or ``"off: <why>"`` for tensors on ``device`` (looks the driver up)."""
    if _env_off():
        return f"off: ${DMA_ENV} says so"
    c, why = copier(torch.device(device))
    return f"on: {c.name}" if c is not None else f"off: {why}"


def known_status() -> str:
    """:func:`status` of the device types looked up so far, without looking anything up
    (``"not looked up yet"`` before a call wanted DMA)."""
    if _env_off():
        return f"off: ${DMA_ENV} says so"
    parts = [
        f"{kind} " + (f"on: {c.name}" if c is not None else f"off: {_why.get(kind, '')}")
        for kind, c in sorted(_copiers.items())
    ]
    return "; ".join(parts) if parts else "not looked up yet"


_side_streams: dict[int, torch.cuda.Stream] = {}


def _location(t_device: torch.device, host: bool) -> tuple[int, int]:
    if host:
        return (CU_MEM_LOCATION_TYPE_HOST, 0)
    return (CU_MEM_LOCATION_TYPE_DEVICE, t_device.index or 0)


def run(runs: Runs, device: torch.device, src_host: bool = False, dst_host: bool = False) -> bool:
    """Enqueue ``runs`` on torch's current stream of ``device``; True when done, False (after
    one warning; DMA then stays off for this device type) when the driver refused them, so the
    caller runs its kernel instead: the same bytes again, in stream order after whatever the
    refused call may have enqueued."""
    c, _ = copier(device)
    if c is None:
        return False
    try:
        if device.type != "cuda":  # a test's fake on CPU memory
            c.copy(runs, 0, _location(device, True), _location(device, True), None)
            return True
        index = device.index if device.index is not None else torch.cuda.current_device()
        src_loc, dst_loc = _location(device, src_host), _location(device, dst_host)
        cur = torch.cuda.current_stream(device)
        if cur.cuda_stream != 0:
            c.copy(runs, cur.cuda_stream, src_loc, dst_loc, index)
            return True
        # the legacy default stream is refused by the call: a side stream ordered after the work
        # queued so far and before whatever follows
        side = _side_streams.get(index)
        if side is None:
            side = _side_streams[index] = torch.cuda.Stream(device)
        side.wait_stream(cur)
        c.copy(runs, side.cuda_stream, src_loc, dst_loc, index)
        cur.wait_stream(side)
        return True
    except DmaError as e:
        why = str(e)
        _LOG.warning("kvxfer DMA path: %s; this and later transfers use the kernels", why)
        _disable(device, why)
        return False


# --------------------------------------------------------------------------- stats
class PathStats:
    """What the ops on one engine's caches chose: per (op, path, reason) a count, the last choice
    and the SM budget. Shared by the views of one :func:`kvxfer.transports.batching.cache_views`."""

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
