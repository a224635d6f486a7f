"""gather_blocks / scatter_blocks / copy_blocks: validate everything (:mod:`kvxfer.paged`), then
dispatch (:func:`kvxfer.dispatch.launch`, the one tail of every op).

A copy between registered caches with producer-checked ids (:class:`CheckedIds`: the engine's
call) runs through the :class:`PreparedCopy` its source keeps per destination, head slice and
layer set (:mod:`kvxfer.prepared`), which also moves a batch of requests in CSR form
(:meth:`PreparedCopy.batch`); any other call validates both sides per call.

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

from collections.abc import Sequence

import torch

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
from .dispatch import (  # noqa: F401  (HOST_WIRE_ENV: the host-wire budget's variable)
    HOST_WIRE_ENV,
    HOST_WIRE_MAX_SMS,
    Launch,
    call_budget,
    cap,
    check_args,
    host_wire_budget,
    launch,
    launch_of,
    wire_cap,
)
from .paged import (  # the validation every op makes (re-exported: the ops' public names)
    CheckedIds,
    PagedCache,
    check_caches,
    check_wire,
    make_side,
    path_stats,
    register_caches,
    side_and_info,
)
from .prepared import PreparedCopy, prepared_copy
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
    check_args(max_sms, dma)
    side, info = side_and_info(caches, spec, block_ids, num_tokens, head_start, num_heads, layers)
    device = info.device
    if out is None:
        out = torch.empty(
            spec.wire_shape(num_tokens, side.num_heads, side.num_layers), dtype=side.dtype, device=device
        )
    else:
        check_wire(out, side, spec, "out", caches)
    if num_tokens:
        wire = out.view(side.wire_view_shape())
        got = wire_cap(cap(max_sms, side, None, caches), side, wire)
        launch(launch_of("gather", backend, caches, info), side, wire, got, dma)
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
    check_args(max_sms, dma)
    if not isinstance(wire, torch.Tensor):
        raise ValueError(f"wire: must be a tensor, got {type(wire).__name__}")
    if spec.use_mla:
        num_heads = 1
    elif wire.dim() == 5:
        num_heads = wire.shape[0]
    else:
        raise ValueError(f"wire: expected a 5-D wire tensor, got shape {tuple(wire.shape)}")
    side, info = side_and_info(
        caches, spec, block_ids, num_tokens, head_start, num_heads, layers, unique_blocks=True
    )
    check_wire(wire, side, spec, "wire", caches)
    if num_tokens:
        w = wire.view(side.wire_view_shape())
        got = wire_cap(cap(max_sms, None, side, caches), side, w)
        launch(launch_of("scatter", backend, caches, info), w, side, got, dma)


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
    check_args(max_sms, dma)
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
        prepared_copy(src_caches, dst_caches, src_head_start, dst_head_start, num_heads, layers).run(
            src_block_ids, dst_block_ids, num_tokens, max_sms, dma, backend
        )
        return
    same = src_spec is dst_spec
    if not isinstance(src_spec, KVCacheSpec):
        raise ValueError(f"src_spec: expected a KVCacheSpec, got {type(src_spec).__name__}")
    mismatch = src_spec.model_mismatch(dst_spec) if not same and isinstance(dst_spec, KVCacheSpec) else None
    if mismatch:
        raise ValueError(f"incompatible caches: {mismatch}")
    src, info = side_and_info(
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
    device = info.device
    if device != dst.device:
        raise ValueError(f"dst_caches: on {dst.device}, src_caches on {device}; copy needs one device")
    if num_tokens:
        got = cap(max_sms, src, dst, src_caches, dst_caches)
        launch(Launch("copy", backend, device, info.engines, src_caches, dst_caches), src, dst, got, dma)


def warmup(
    caches: Sequence[torch.Tensor], spec: KVCacheSpec, backend: str | None = None, max_sms: int | None = None
) -> str:
    """Prepare the kernels the ops will launch on ``caches`` (load the CUDA C++ module, or
    compile the Triton variants of this cache shape family for every request size, under the
    SM budget ``max_sms`` or the registered caches' own: a capped grid is its own variant)
    without running them or touching the caches, and without holding request-sized memory.
    Returns the backend prepared; an engine's ``start()`` calls it so the first request does
    not pay for compilation."""
    budget = call_budget(max_sms, caches)
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
