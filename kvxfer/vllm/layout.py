"""vLLM's registered KV caches as kvxfer caches: strided views, never copies.

vLLM 0.32/0.33 hand ``register_kv_caches`` one tensor per layer whose logical shape is
``[B, H, N, C]`` (blocks, kv heads on this rank, tokens per block, content), carved out of one
buffer with the strides of the resolved ``KVCacheLayout``. What ``C`` holds depends on the
attention backend, so the view depends on it too:

* **K and V in the content** (FlashAttention, FlashInfer, Triton, FlexAttention: the kernels
  split ``C`` at ``head_size``): ``C = 2 * head_size``, K of token n then its V. kvxfer view:
  ``t.unflatten(-1, (2, d)).permute(3, 0, 1, 2, 4)`` -> ``[2, B, H, N, d]`` (HND).
* **CPU_ATTN**: the kernel views each layer as ``[B, H, 2 * N, d]`` and takes the first ``N``
  rows as K and the next ``N`` as V (``vllm/v1/attention/backends/cpu_attn.py``: ``view``, then
  ``chunk(2, dim=2)``): per (block, head) the K rows of the block's tokens, then their V rows.
  kvxfer view: ``t.view(B, H, 2, N, d).permute(2, 0, 1, 3, 4)`` -> ``[2, B, H, N, d]`` (HND);
  this needs each (block, head) page contiguous, which the backend's only layout (LBHNC) is.
* **MLA**: ``H == 1`` and ``C`` is the latent dim: ``t[:, 0]`` -> ``[B, N, C]``.

Layers that share one tensor (cross-layer KV sharing) are moved once. Backends that pack K
and V some other way (e.g. NVFP4 head groups, ROCm AITER's ``[B, 2, N, H*d]``) are rejected
with a ``ValueError`` naming the backend rather than moved wrongly.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..spec import KVCacheSpec, Layout

__all__ = ["CPU_BACKENDS", "caches_from_vllm", "kvxfer_view"]

CPU_BACKENDS = frozenset({"CPU_ATTN"})
_REJECTED = ("ROCM_AITER", "NVFP4")  # backends whose K/V packing is neither of the above


def kvxfer_view(t: torch.Tensor, backend: str, head_size: int, use_mla: bool) -> torch.Tensor:
    """One layer's ``[B, H, N, C]`` tensor as a kvxfer cache view (``[2, B, H, N, d]`` HND, or
    ``[B, N, C]`` for MLA); shares ``t``'s memory. ``ValueError`` names what does not fit."""
    if not isinstance(t, torch.Tensor) or t.dim() != 4:
        raise ValueError(
            f"kv cache: expected a 4-D [blocks, heads, block_size, content] tensor (vLLM 0.32/0.33), "
            f"got {getattr(t, 'shape', type(t).__name__)}"
        )
    b, h, n, c = t.shape
    if use_mla:
        if h != 1:
            raise ValueError(f"kv cache: an MLA cache has one latent head, got shape {tuple(t.shape)}")
        return t[:, 0]
    if any(tag in backend.upper() for tag in _REJECTED):
        raise ValueError(f"attention backend {backend}: its K/V packing is not supported by kvxfer")
    if c != 2 * head_size:
        raise ValueError(
            f"kv cache: backend {backend} content dim is {c}, expected 2 * head_size = {2 * head_size} "
            "(K then V; quantized caches with per-token scales are not supported)"
        )
    if backend in CPU_BACKENDS:
        if t.stride(3) != 1 or t.stride(2) != c:
            raise ValueError(
                f"kv cache: {backend} needs each (block, head) page contiguous, got strides {t.stride()}"
            )
        return t.view(b, h, 2, n, head_size).permute(2, 0, 1, 3, 4)
    return t.unflatten(-1, (2, head_size)).permute(3, 0, 1, 2, 4)


def caches_from_vllm(
    kv_caches: Mapping[str, torch.Tensor],
    *,
    backend: str,
    head_size: int,
    total_kv_heads: int,
    tp_size: int,
    use_mla: bool,
) -> tuple[KVCacheSpec, list[torch.Tensor], list[str]]:
    """(spec, per-layer kvxfer views, layer names) of one rank's registered caches.

    ``spec.block_size`` is the registered tensors' token dim (vLLM's kernel block size, which
    may divide the manager's block size); ``spec.num_kv_heads`` is the model's total.
    """
    if not kv_caches:
        raise ValueError("kv_caches: no KV cache tensors were registered")
    seen: dict[tuple, str] = {}
    names: list[str] = []
    views: list[torch.Tensor] = []
    for name, t in kv_caches.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"kv_caches[{name!r}]: expected a tensor, got {type(t).__name__}")
        key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
        if key in seen:  # a layer that reuses another layer's cache: moved once
            continue
        seen[key] = name
        try:
            views.append(kvxfer_view(t, backend, head_size, use_mla))
        except ValueError as e:
            raise ValueError(f"kv_caches[{name!r}]: {e}") from None
        names.append(name)
    first = views[0]
    shapes = {tuple(v.shape) for v in views}
    if len(shapes) != 1 or len({v.dtype for v in views}) != 1:
        raise ValueError(f"kv_caches: layers differ in shape or dtype ({sorted(shapes)}); kvxfer needs one")
    if use_mla:
        spec = KVCacheSpec(
            len(views), 1, first.shape[-1], first.shape[1], first.dtype, Layout.NHD, use_mla=True
        )
    else:
        spec = KVCacheSpec(len(views), total_kv_heads, head_size, first.shape[3], first.dtype, Layout.HND)
        want = spec.heads_per_rank(tp_size)
        if first.shape[2] != want:
            raise ValueError(
                f"kv_caches: {first.shape[2]} kv heads per rank, but {total_kv_heads} heads over "
                f"tp_size={tp_size} give {want}"
            )
    return spec, views, names
