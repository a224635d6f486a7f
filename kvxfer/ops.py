"""gather_blocks / scatter_blocks / copy_blocks: validate everything (:mod:`kvxfer.paged`), then
dispatch.

``caches`` is always one rank's list of per-layer tensors (see :mod:`kvxfer.spec` for their
shapes); head offsets are local to that rank. Nothing is written unless every argument is
valid; each problem raises ``ValueError`` naming it.

Backends: ``"torch"`` (reference; CPU and GPU), ``"triton"`` (:mod:`kvxfer.kernels`),
``"cuda"`` (:mod:`kvxfer.backends.cuda`) and ``"cpu"`` (:mod:`kvxfer.backends.cpu`, native and
threaded; CPU tensors). ``backend=None`` picks ``"triton"`` on CUDA tensors when it loads, else
``"cuda"``, else ``"torch"`` (``$KVXFER_CUDA_BACKENDS`` reorders them); on CPU tensors ``"cpu"``
when its library loads (else a warning, once, and ``"torch"``).
:func:`last_backend` says which one ran the latest call on this thread (``"dma"`` when the copy
engines did); the choice, its reasons and ``$KVXFER_BACKEND`` live in
:mod:`kvxfer.backends.registry`.

SM budget and copy engines: ``max_sms=`` (per call, or carried by caches registered with
:func:`register_caches`) caps the Triton and CUDA C++ kernels at that many CTAs; on CUDA tensors
a call whose bytes are whole-block runs may go to the copy engines instead, as one
``cuMemcpyBatchAsync`` (no SM at all), by the rule of :mod:`kvxfer.backends.dma` (``dma=``
overrides it). What was chosen and why is counted per registered cache (:func:`path_stats`) and
names the call's NVTX range while a tool listens.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from . import tracing
from .backends import batch_copy as _batch_copy
from .backends import dma as _dma
from .backends import registry as _registry
from .backends.base import PagedSide
from .backends.registry import (  # noqa: F401  (_MODULES: tests swap a backend module in)
    _MODULES,
    BACKENDS,
    FORCE_ENV,
    backend_status,
    last_backend,
    reset_backends,
    resolve_backend,
)
from .backends.registry import module as _module
from .backends.registry import run as _run
from .paged import (  # the validation every op makes (re-exported: the ops' public names)
    CheckedIds,
    PagedCache,
    as_block_ids,
    check_caches,
    check_wire,
    make_side,
    path_stats,
    register_caches,
)
from .spec import KVCacheSpec

__all__ = [
    "BACKENDS",
    "HOST_WIRE_MAX_SMS",
    "CheckedIds",
    "PagedCache",
    "PreparedCopy",
    "backend_status",
    "copy_blocks",
    "gather_blocks",
    "host_wire_budget",
    "last_backend",
    "make_side",
    "path_stats",
    "register_caches",
    "reset_backends",
    "resolve_backend",
    "scatter_blocks",
    "warmup",
]


# --------------------------------------------------------------------------- dispatch


def _budget(max_sms, a, b=None) -> int | None:
    """The call's SM budget: ``max_sms`` when given (validated), else the smaller of the budgets
    registered caches ``a`` and ``b`` carry (None: no budget)."""
    if max_sms is not None:
        return _dma.check_max_sms(max_sms)
    return _registered_budget(a, b)


def _cap(max_sms, src: PagedSide | None, dst: PagedSide | None, a, b=None) -> int | None:
    """Put the call's budget (:func:`_budget`, ``max_sms`` already checked) on its paged sides,
    where the kernels read it (:class:`kvxfer.backends.base.PagedSide`); returns it."""
    budget = max_sms if max_sms is not None else _registered_budget(a, b)
    if budget is not None:
        if src is not None:
            src.max_sms = budget
        if dst is not None:
            dst.max_sms = budget
    return budget


# SM budget of a gather into (scatter from) a pinned host wire on a GPU when the call and its
# caches set none. Such a call is bound by PCIe, not by SMs: on an H200 an uncapped gather of a
# 4K-token Llama-3-8B request held every SM for its ~10 ms and a bf16 GEMM beside it took 8.6x as
# long, while Triton capped at 16 SMs kept 93 % of a pinned copy_ and slowed the GEMM by 26 %
# (profiling/results/2026-11-28-H200/, bench_interference). $KVXFER_HOST_WIRE_MAX_SMS overrides
# it (0: no budget).
HOST_WIRE_MAX_SMS = 16
HOST_WIRE_ENV = "KVXFER_HOST_WIRE_MAX_SMS"


def host_wire_budget() -> int | None:
    """The SM budget a host-wire gather or scatter on a GPU takes when none is set
    (:data:`HOST_WIRE_MAX_SMS`, or ``$KVXFER_HOST_WIRE_MAX_SMS``; None when that is 0)."""
    raw = os.environ.get(HOST_WIRE_ENV, "").strip()
    if not raw:
        return HOST_WIRE_MAX_SMS
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"${HOST_WIRE_ENV}={raw!r}: not an integer") from None
    if value < 0:
        raise ValueError(f"${HOST_WIRE_ENV}={value}: must be 0 (no budget) or a positive SM count")
    return value or None


def _wire_cap(budget: int | None, side: PagedSide, wire: torch.Tensor) -> int | None:
    """``budget``, or for a GPU side with a host-memory wire and no budget set, the host-wire
    budget (put on ``side``, where the kernels read it)."""
    if budget is None and side.device.type == "cuda" and wire.device.type == "cpu":
        budget = host_wire_budget()
        side.max_sms = budget
    return budget


def _registered_budget(a, b=None) -> int | None:
    x = a.max_sms if type(a) is PagedCache else None
    y = b.max_sms if type(b) is PagedCache else None
    if x is None:
        return y
    return x if y is None else min(x, y)


def _check_args(max_sms, dma) -> None:
    """``max_sms`` and ``dma`` of an op call, checked before anything is written."""
    if max_sms is not None:
        _dma.check_max_sms(max_sms)
    if dma is not None and type(dma) is not bool:
        raise ValueError(f"dma: must be None (the rule), True or False, got {dma!r}")


def _record(op: str, choice: _dma.Choice, a, b=None) -> None:
    sa = a.path_stats if type(a) is PagedCache else None
    sb = b.path_stats if type(b) is PagedCache else None
    if sa is not None:
        sa.record(op, choice)
    if sb is not None and sb is not sa:
        sb.record(op, choice)


def _move(
    op: str,
    backend: str | None,
    device: torch.device,
    args: tuple,
    src: PagedSide | None,
    dst: PagedSide | None,
    wire: torch.Tensor | None,
    budget: int | None,
    dma: bool | None,
    caches_a,
    caches_b=None,
) -> None:
    """Run a validated op on CUDA tensors (or on CPU ones for a test's fake driver): on the copy
    engines when :func:`kvxfer.backends.dma.choose` says so (``backend=None`` or ``dma=True``),
    else on the backend's kernel under the budget; record the choice on the registered caches
    involved (``budget``: the call's, already on the sides). CPU tensors skip this (no SM to
    spare, no copy engine, nothing to choose) and record nothing: choosing and recording there
    would add about an eighth to an engine-path copy call's host time (profiling/results/README.md,
    "Figures recorded without a run folder")."""
    if backend is not None and dma is None:
        choice = _dma.Choice("kernel", "backend named", backend)
    else:
        wire_ptr = wire.data_ptr() if wire is not None else None
        choice = _dma.choose(op, src, dst, wire_ptr, budget, dma, device)
    if choice.path == "dma":
        host = wire is not None and wire.device.type != device.type  # a pinned host wire
        with tracing.trace(op, str, choice):
            done = _batch_copy.run(
                choice.runs, device, src_host=host and op == "scatter", dst_host=host and op == "gather"
            )
        if done:
            _registry.note_backend("dma")
            _record(op, choice, caches_a, caches_b)
            return
        choice = _dma.Choice("kernel", "dma call failed", _dma.known_status())
    with tracing.trace(op, str, choice):
        _run(backend, device, op, *args)
    _record(op, choice, caches_a, caches_b)


# --------------------------------------------------------------------------- public ops
def gather_blocks(
    caches: Sequence[torch.Tensor],
    spec: KVCacheSpec,
    block_ids,
    num_tokens: int,
    head_start: int = 0,
    num_heads: int | None = None,
    layers=None,
    out: torch.Tensor | None = None,
    backend: str | None = None,
    max_sms: int | None = None,
    dma: bool | None = None,
) -> torch.Tensor:
    """Gather a request's KV out of a paged cache into a wire tensor.

    Args:
        caches: this rank's per-layer caches, each ``spec.cache_shape``-like:
            NHD ``[2, num_blocks, block_size, heads_local, head_dim]``,
            HND ``[2, num_blocks, heads_local, block_size, head_dim]``,
            MLA ``[num_blocks, block_size, latent_dim]``.
        spec: the cache spec (layout, block size, dtype, MLA).
        block_ids: the request's blocks in token order (list, array or int tensor); at least
            ``ceil(num_tokens / block_size)``, extra ones are ignored.
        num_tokens: tokens to move; the last block may be partial.
        head_start, num_heads: rank-local head slice (default: all heads on the rank).
        layers: layer indices to move, in wire order (default: all).
        out: optional contiguous destination of the wire shape; on the caches' device or, for
            CUDA caches, in pinned host memory.
        backend: ``None`` (auto), ``"torch"``, ``"triton"``, ``"cuda"`` or ``"cpu"``.
        max_sms: SM budget of the call: the Triton and CUDA C++ kernels launch at most this
            many CTAs (a positive int; default: the registered caches' budget, else none).
        dma: ``None``: copy engines or kernel by :func:`kvxfer.backends.dma.choose`'s rule
            (CUDA tensors, ``backend=None``); ``True``: the copy engines (``ValueError`` naming
            why not when the gather is not whole-block runs); ``False``: a kernel.

    Returns:
        The wire tensor ``[num_heads, L, 2, num_tokens, head_dim]`` (MLA: ``[L, num_tokens,
        latent_dim]``), ``out`` when given.
    """
    _check_args(max_sms, dma)
    side = make_side(caches, spec, block_ids, num_tokens, head_start, num_heads, layers)
    device = side.device
    if out is None:
        out = torch.empty(
            spec.wire_shape(num_tokens, side.num_heads, side.num_layers), dtype=side.dtype, device=device
        )
    else:
        check_wire(out, side, spec, "out")
    if num_tokens:
        wire = out.view(side.wire_view_shape())
        budget = _wire_cap(_cap(max_sms, side, None, caches), side, wire)
        if device.type == "cuda" or _batch_copy.serves_cpu():
            _move("gather", backend, device, (side, wire), side, None, wire, budget, dma, caches)
        else:
            _run(backend, device, "gather", side, wire)
    return out


def scatter_blocks(
    wire: torch.Tensor,
    caches: Sequence[torch.Tensor],
    spec: KVCacheSpec,
    block_ids,
    num_tokens: int,
    head_start: int = 0,
    layers=None,
    backend: str | None = None,
    max_sms: int | None = None,
    dma: bool | None = None,
) -> None:
    """Scatter a wire tensor into a paged cache (the inverse of :func:`gather_blocks`).

    ``wire`` is ``[num_heads, L, 2, num_tokens, head_dim]`` (MLA: ``[L, num_tokens,
    latent_dim]``); its heads land at rank-local heads ``[head_start, head_start +
    num_heads)`` of the layers ``layers`` (default all, in wire order) of the blocks
    ``block_ids`` (token order; repeated ids are rejected). Only the addressed rows are written:
    the rest of a partial last block and every other block stay untouched. ``max_sms`` and
    ``dma`` as for :func:`gather_blocks`.
    """
    _check_args(max_sms, dma)
    if not isinstance(wire, torch.Tensor):
        raise ValueError(f"wire: must be a tensor, got {type(wire).__name__}")
    if spec.use_mla:
        num_heads = 1
    elif wire.dim() == 5:
        num_heads = wire.shape[0]
    else:
        raise ValueError(f"wire: expected a 5-D wire tensor, got shape {tuple(wire.shape)}")
    side = make_side(caches, spec, block_ids, num_tokens, head_start, num_heads, layers, unique_blocks=True)
    check_wire(wire, side, spec, "wire")
    if num_tokens:
        device = side.device
        w = wire.view(side.wire_view_shape())
        budget = _wire_cap(_cap(max_sms, None, side, caches), side, w)
        if device.type == "cuda" or _batch_copy.serves_cpu():
            _move("scatter", backend, device, (w, side), None, side, w, budget, dma, caches)
        else:
            _run(backend, device, "scatter", w, side)


def copy_blocks(
    src_caches: Sequence[torch.Tensor],
    src_spec: KVCacheSpec,
    src_block_ids,
    dst_caches: Sequence[torch.Tensor],
    dst_spec: KVCacheSpec,
    dst_block_ids,
    num_tokens: int,
    src_head_start: int = 0,
    dst_head_start: int = 0,
    num_heads: int | None = None,
    backend: str | None = None,
    layers=None,
    max_sms: int | None = None,
    dma: bool | None = None,
) -> None:
    """Copy a request's KV from one paged cache straight into another (no wire tensor).

    The two sides may differ in layout and block size; their model shapes must match.
    ``num_heads`` heads (default: all from ``src_head_start`` on the source rank) move from
    source-local ``src_head_start`` to destination-local ``dst_head_start``. ``layers``
    selects the same layers on both sides (default all). Both caches live on one device (the
    source may be another process's memory mapped into this one). ``max_sms`` and ``dma`` as
    for :func:`gather_blocks` (the budget of two registered caches: the smaller).
    """
    _check_args(max_sms, dma)
    if (
        type(src_block_ids) is CheckedIds
        and type(dst_block_ids) is CheckedIds
        and type(num_tokens) is int
        and num_tokens > 0
        and isinstance(src_caches, PagedCache)
        and isinstance(dst_caches, PagedCache)
        and src_caches.spec is src_spec
        and dst_caches.spec is dst_spec
    ):  # the engine's path: caches registered, ids checked by their producer
        src, dst, device = _checked_sides(
            src_caches,
            src_block_ids,
            dst_caches,
            dst_block_ids,
            num_tokens,
            src_head_start,
            dst_head_start,
            num_heads,
            layers,
        )
        budget = _cap(max_sms, src, dst, src_caches, dst_caches)
        if src_caches.info.cuda or _batch_copy.serves_cpu():
            _move("copy", backend, device, (src, dst), src, dst, None, budget, dma, src_caches, dst_caches)
        else:
            _run(backend, device, "copy", src, dst)
        return
    same = src_spec is dst_spec
    mismatch = src_spec.model_mismatch(dst_spec) if not same and isinstance(dst_spec, KVCacheSpec) else None
    if mismatch:
        raise ValueError(f"incompatible caches: {mismatch}")
    src = make_side(
        src_caches, src_spec, src_block_ids, num_tokens, src_head_start, num_heads, layers, name="src_caches"
    )
    dst = make_side(
        dst_caches,
        dst_spec,
        dst_block_ids,
        num_tokens,
        dst_head_start,
        src.num_heads,
        layers,
        unique_blocks=True,
        name="dst_caches",
    )
    device = src.device
    if device != dst.device:
        raise ValueError(f"dst_caches: on {dst.device}, src_caches on {device}; copy needs one device")
    if num_tokens:
        budget = _cap(max_sms, src, dst, src_caches, dst_caches)
        if device.type == "cuda" or _batch_copy.serves_cpu():
            _move("copy", backend, device, (src, dst), src, dst, None, budget, dma, src_caches, dst_caches)
        else:
            _run(backend, device, "copy", src, dst)


class PreparedCopy:
    """:func:`copy_blocks` between two registered caches (:func:`register_caches`) for one head
    slice and layer set, with what that call checks per call on the engine's path (the specs
    compatible, both caches on one device, the two sides' templates) checked once here. A call
    passes ids and a token count only: ``copy(src_ids, dst_ids, num_tokens)``, ids as
    :func:`copy_blocks` takes them (:class:`CheckedIds` skip their checks as there; other ids are
    checked). A call skips what :func:`copy_blocks` checks per call (type checks, memo keys),
    about a quarter of its host cost with a no-op kernel (profiling/results/README.md, "Figures
    recorded without a run folder"); the one-sided ipc load makes one per remote.

    Args:
        src_caches, dst_caches: registered caches (:class:`PagedCache`).
        src_head_start, dst_head_start, num_heads, layers: as for :func:`copy_blocks`.
        backend: as for :func:`copy_blocks` (None: the device's default, or the copy engines
            when the rule says so).

    Raises ``ValueError`` as :func:`copy_blocks` would for these arguments.
    """

    __slots__ = ("_cuda", "_device", "_dst", "_dst_caches", "_src", "_src_caches", "backend")

    def __init__(
        self,
        src_caches: PagedCache,
        dst_caches: PagedCache,
        src_head_start: int = 0,
        dst_head_start: int = 0,
        num_heads: int | None = None,
        layers=None,
        backend: str | None = None,
    ) -> None:
        if not isinstance(src_caches, PagedCache) or not isinstance(dst_caches, PagedCache):
            raise ValueError(
                "PreparedCopy: src_caches and dst_caches must be registered caches (register_caches)"
            )
        _, self._src, self._dst, self._device = _pair(
            src_caches, dst_caches, src_head_start, dst_head_start, num_heads, layers
        )
        self._src_caches, self._dst_caches = src_caches, dst_caches
        self._cuda = src_caches.info.cuda
        self.backend = backend

    def __call__(self, src_block_ids, dst_block_ids, num_tokens: int) -> None:
        if type(num_tokens) is not int or num_tokens < 0:
            raise ValueError(f"num_tokens: must be an int >= 0, got {num_tokens!r}")
        if not num_tokens:
            return
        src, dst = _copy_sides(self._src, self._dst, src_block_ids, dst_block_ids, num_tokens)
        a, b = self._src_caches, self._dst_caches
        budget = _cap(None, src, dst, a, b)
        if self._cuda or _batch_copy.serves_cpu():
            _move("copy", self.backend, self._device, (src, dst), src, dst, None, budget, None, a, b)
        else:
            _run(self.backend, self._device, "copy", src, dst)


def _template(caches: PagedCache, head_start: int, num_heads: int | None, layers, name: str) -> PagedSide:
    """The side of registered ``caches`` for a head slice and layer set, validated once by
    :func:`make_side` and kept on the caches object (without ids: :func:`_with_ids` adds them)."""
    memo = caches.__dict__.get("_sides")
    if memo is None:
        memo = caches.__dict__["_sides"] = {}
    key = (head_start, num_heads, None if layers is None else tuple(layers))
    t = memo.get(key)
    if t is None:
        t = memo[key] = make_side(caches, caches.spec, [], 0, head_start, num_heads, layers, name=name)
    return t


def _with_ids(t: PagedSide, ids: torch.Tensor, num_tokens: int) -> PagedSide:
    return PagedSide(
        t.caches,
        ids,
        num_tokens,
        t.block_size,
        t.num_blocks,
        t.head_start,
        t.num_heads,
        t.head_dim,
        t.num_kv,
        t.stride_kv,
        t.stride_block,
        t.stride_token,
        t.stride_head,
        t.layout,
        t.memo,
        t.max_sms,
        t.slot_block,
    )


def _pair(
    src_caches: PagedCache,
    dst_caches: PagedCache,
    src_head_start: int,
    dst_head_start: int,
    num_heads,
    layers,
) -> tuple[PagedCache, PagedSide, PagedSide, torch.device]:
    """What :func:`_checked_sides` keeps per (destination, heads, layers) of a registered source:
    the destination, both validated templates (:func:`_template`) and the device, once the specs
    are found compatible and both sides on one device."""
    ss, ds = src_caches.spec, dst_caches.spec
    mismatch = None if ss is ds else ss.model_mismatch(ds)
    if mismatch:
        raise ValueError(f"incompatible caches: {mismatch}")
    st = _template(src_caches, src_head_start, num_heads, layers, "src_caches")
    dt = _template(dst_caches, dst_head_start, st.num_heads, layers, "dst_caches")
    device, dst_device = st.device, dt.device  # a tensor's .device is a torch call: made once here
    if dst_device != device:
        raise ValueError(f"dst_caches: on {dst_device}, src_caches on {device}; copy needs one device")
    return dst_caches, st, dt, device


def _checked_sides(
    src_caches: PagedCache,
    src_ids: CheckedIds,
    dst_caches: PagedCache,
    dst_ids: CheckedIds,
    num_tokens: int,
    src_head_start: int,
    dst_head_start: int,
    num_heads: int | None,
    layers,
) -> tuple[PagedSide, PagedSide, torch.device]:
    """:func:`copy_blocks`'s two sides (and their device) from memoised templates: the same checks as
    :func:`make_side`, each made once per (destination, heads, layers) of a source (kept on the
    source's ``PagedCache``), except the ids' (see :class:`CheckedIds`, still checked when their
    promise does not cover the op). No torch call: the ids stay numpy and the device is kept
    (``profiling/bench_engine.py``: the ops call of a 4K-token request ~18 us with a cold
    cache, ~50-65 us with those torch calls)."""
    pairs = src_caches.__dict__.get("_pairs")
    if pairs is None:
        pairs = src_caches.__dict__["_pairs"] = {}
    key = (
        id(dst_caches),
        src_head_start,
        dst_head_start,
        num_heads,
        None if layers is None else tuple(layers),
    )
    got = pairs.get(key)
    if got is None or got[0] is not dst_caches:
        if len(pairs) >= 256:  # destinations come and go (offset views of partial loads): bounded
            pairs.clear()
        got = pairs[key] = _pair(src_caches, dst_caches, src_head_start, dst_head_start, num_heads, layers)
    _, st, dt, device = got
    src, dst = _copy_sides(st, dt, src_ids, dst_ids, num_tokens)
    return src, dst, device


def _copy_sides(
    st: PagedSide, dt: PagedSide, src_ids, dst_ids, num_tokens: int
) -> tuple[PagedSide, PagedSide]:
    """A copy's two sides from their templates (:func:`_template`) and ids, the ids checked as
    :func:`as_block_ids` checks them (the destination's for repeats too)."""
    src = _with_ids(
        st,
        as_block_ids(src_ids, st.num_blocks, -(-num_tokens // st.block_size), "src_block_ids", False),
        num_tokens,
    )
    dst = _with_ids(
        dt,
        as_block_ids(dst_ids, dt.num_blocks, -(-num_tokens // dt.block_size), "dst_block_ids", True),
        num_tokens,
    )
    return src, dst


def warmup(
    caches: Sequence[torch.Tensor], spec: KVCacheSpec, backend: str | None = None, max_sms: int | None = None
) -> str:
    """Prepare the kernels the ops will launch on ``caches`` (load the CUDA C++ module, or
    compile the Triton variants of this cache shape family for every request size, under the
    SM budget ``max_sms`` or the registered caches' own: a capped grid is its own variant)
    without running them or touching the caches, and without holding request-sized memory.
    Returns the backend prepared; an engine's ``start()`` calls it so the first request does
    not pay for compilation."""
    budget = _budget(max_sms, caches)
    info = caches.info if isinstance(caches, PagedCache) else check_caches(caches, spec, "caches")
    name = resolve_backend(info.device, backend)
    fn = getattr(_module(name), "warmup", None)
    if fn is None:
        return name
    # Every power of two of tokens up to 4096 (or what the cache holds): the Triton tiles come in
    # power-of-two token buckets between 16 and a full tile, and a bucket left cold would compile
    # on the request path (~1 s); sizes that share a bucket cost a cache lookup.
    # A warm-up launches nothing, so one wire of a single token stands in for every size (a
    # 4K-token wire is 537 MB for Llama-3-8B: torch's allocator would keep it after start()).
    one = make_side(caches, spec, [0], 1)
    wire = torch.empty(one.wire_view_shape(), dtype=one.dtype, device=info.device)
    most = min(4096, info.num_blocks * spec.block_size)
    # Without a budget, a gather into or scatter from pinned host memory takes the host-wire one
    # (its own capped variant: compiled too, the copy excepted, which never has a host wire).
    wire_budget = host_wire_budget() if budget is None and info.device.type == "cuda" else None
    for tokens in sorted({1 << k for k in range(most.bit_length())} | {most}):
        side = make_side(caches, spec, list(range(spec.num_blocks_for(tokens))), tokens)
        side.max_sms = budget
        fn(side, wire)
        if wire_budget is not None:
            side.max_sms = wire_budget
            fn(side, wire, copy=False)
    return name
