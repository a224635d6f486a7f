"""vLLM's registered KV caches as kvxfer caches: strided views, never copies.

vLLM 0.32 and 0.33 hand ``register_kv_caches`` one tensor per layer whose logical shape is
``[B, H, N, C]`` (blocks, kv heads on this rank, tokens per block, content), carved out of one
buffer with the strides of the resolved ``KVCacheLayout`` (``LBNHC``, ``LBHNC`` or ``BLHNC``:
``C`` is innermost in all of them). What ``C`` and a block hold depends on the attention
backend. The facts below were read from vLLM's sources (the file named with each) and are the
same in 0.32 and 0.33 unless said otherwise.

**Token-row backends** (each token's K and its V are ``head_size`` contiguous elements):

* ``FLASH_ATTN`` (``vllm/v1/attention/backends/flash_attn.py``: ``kv_cache.transpose(1, 2)
  .split(head_size, dim=-1)``), ``FLASHINFER`` (``flashinfer.py``: the same split of the
  permuted cache), ``TRITON_ATTN`` (``triton_attn.py``: the same split) and ``FLEX_ATTENTION``
  (``flex_attention.py``: the same split, layout ``LBNHC`` only): ``C = 2 * head_size``, the K
  row of token n then its V row. kvxfer view: ``t.unflatten(-1, (2, d)).permute(3, 0, 1, 2, 4)``
  -> ``[2, B, H, N, d]`` (HND, strided).
* MLA backends (``FLASHMLA``, ``TRITON_MLA``, ``CUTLASS_MLA``, ``FLASH_ATTN_MLA``,
  ``FLASHINFER_MLA``, ``CPU_MLA``, ``AMX_MLA``): ``H == 1`` and ``C`` is one token's latent row
  (``vllm/v1/attention/backends/mla/amx_mla.py`` reads the cache as ``view(-1, 1, head_size)``,
  one row per token): ``t[:, 0]`` -> ``[B, N, C]``.

Between two token-row layouts kvxfer moves token rows, so block size, physical order and TP may
differ between P and D, and a partial last block moves exactly.

**CPU_ATTN** (``vllm/v1/attention/backends/cpu_attn.py``): layout ``LBHNC`` only; each layer is
viewed as ``[B, H, 2N, head_size]`` and ``chunk(2, dim=2)`` gives the key and value caches, so
every (block, head) *page* is ``2 * N * head_size`` contiguous elements: the K half, then the V
half. Inside a half, the order is the ISA's, written by ``cpu_attn_reshape_and_cache``
(``csrc/cpu/cpu_attn_*.hpp``, ``reshape_and_cache``):

==========================  ====================================  ==================================
ISA (kernel file)           K half (element of token t, dim i)    V half
==========================  ====================================  ==================================
``vec`` (``_vec.hpp``),     ``[d, N]``: ``i * N + t``             ``[N, d]``: ``t * d + i``
``vec16`` (``_vec16.hpp``),
``neon`` fp32/fp16
(``_neon.hpp``)
``amx`` (``_amx.hpp``),     4-byte words (``w = 4 / elem`` dims   ``[d/16, N/w, 16, w]``:
bf16, head_size % 32        each) in groups of 16 tokens:         ``(i // 16) * 16N +
== 0                        ``[N/16, d/w, 16, w]``                (t // w) * 16w + (i % 16) * w
                                                                  + t % w``
``neon`` bf16 with BFMMLA   ``[N/8, d/4, 32]`` (token groups      ``[d/2, N/4, 8]``
(``_neon_bfmmla.hpp``; on   of 8, dims in fours)
vLLM's main branch)
==========================  ====================================  ==================================

``cpu_attn.py`` (``_get_attn_isa``, the same in 0.32 and 0.33) picks the ISA per process:
``vec16`` when ``head_size % 32 != 0``; ``amx`` on an AMX machine for bf16 and
``block_size % 32 == 0``; ``neon`` on Arm; ``vec`` for ``block_size % 32 == 0`` on x86 (``rvv``,
``vxe``, ``vsx`` on those architectures); else ``vec16``. ``vec``, ``vec16`` and ``neon``
fp32/fp16 keep V as token rows, and no ISA keeps K so: **a CPU_ATTN page is not made of token
rows**.
kvxfer therefore moves CPU_ATTN caches as whole pages: the view
``t.view(B, H, 2, N, d).permute(2, 0, 1, 3, 4)`` -> ``[2, B, H, N, d]`` treats each half as
``N`` rows of ``d`` elements, which is the page's bytes in order but *not* token ``n``'s K in
row ``n``; moved whole (every row of every block, the partial last block included, see
:attr:`KVLayout.whole_blocks`) between two identical layouts, every byte lands where the
reading kernel expects it. Any other pairing is refused with :class:`KVLayoutMismatch`.

Other backends and cache dtypes (NVFP4, per-token-head quantization, TurboQuant, ROCm's own
packings, ...) are refused with a ``ValueError`` naming them rather than moved wrongly. Layers
that share one tensor (cross-layer KV sharing) are moved once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

import torch

from ..spec import KVCacheSpec, Layout

__all__ = [
    "CPU_BACKENDS",
    "MLA_BACKENDS",
    "ROW_BACKENDS",
    "KVLayout",
    "KVLayoutMismatch",
    "caches_from_vllm",
    "check_pair",
    "kvxfer_view",
]

CPU_BACKENDS = frozenset({"CPU_ATTN"})
ROW_BACKENDS = frozenset({"FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION"})
MLA_BACKENDS = frozenset(
    {"FLASHMLA", "TRITON_MLA", "CUTLASS_MLA", "FLASH_ATTN_MLA", "FLASHINFER_MLA", "CPU_MLA", "AMX_MLA"}
)
# Cache dtypes whose elements are stored as they are (one scale per tensor at most): the pages
# keep the layout above. Others add per-token scales or pack several values per byte.
PLAIN_CACHE_DTYPES = frozenset({"auto", "float16", "bfloat16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2"})


class KVLayoutMismatch(ValueError):
    """Two engines' KV layouts cannot be moved between without writing a wrong byte (one side
    keeps its pages whole, and the other side's layout is not identical)."""


@dataclass(frozen=True)
class KVLayout:
    """How one engine's KV cache is laid out, as far as moving it between engines matters.

    Args:
        backend: vLLM's attention backend name (``FLASH_ATTN``, ``CPU_ATTN``, ...).
        block_size: tokens per registered (kernel) block.
        token_rows: whether each token's K and V are ``head_size`` contiguous elements (any
            block size, TP and physical order can be converted); False for CPU_ATTN.
        isa: the CPU attention ISA (``vec``, ``vec16``, ``amx``, ``neon``, ...) for CPU_ATTN,
            None elsewhere (or when it could not be found: such a layout is never paired).
        cache_dtype: vLLM's ``cache_dtype`` (``auto``, ``fp8``, ...).
    """

    backend: str
    block_size: int
    token_rows: bool
    isa: str | None = None
    cache_dtype: str = "auto"

    @property
    def whole_blocks(self) -> bool:
        """Whether exports of this layout move whole blocks (the partial last one included)."""
        return not self.token_rows

    def to_dict(self) -> dict:
        """JSON-safe form (goes into the params and the handshake metadata)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: object) -> KVLayout:
        """Parse :meth:`to_dict`'s form; ``ValueError`` naming the field."""
        if not isinstance(d, dict):
            raise ValueError(f"kv_layout: must be a dict, got {type(d).__name__}")
        backend, bs, rows = d.get("backend"), d.get("block_size"), d.get("token_rows")
        isa, dt = d.get("isa"), d.get("cache_dtype", "auto")
        if not isinstance(backend, str) or not backend:
            raise ValueError(f"kv_layout.backend: must be a non-empty string, got {backend!r}")
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
            raise ValueError(f"kv_layout.block_size: must be a positive int, got {bs!r}")
        if not isinstance(rows, bool):
            raise ValueError(f"kv_layout.token_rows: must be a bool, got {rows!r}")
        if isa is not None and not isinstance(isa, str):
            raise ValueError(f"kv_layout.isa: must be a string or null, got {isa!r}")
        if not isinstance(dt, str):
            raise ValueError(f"kv_layout.cache_dtype: must be a string, got {dt!r}")
        return cls(backend, bs, rows, isa, dt)

    def describe(self) -> str:
        isa = f"/{self.isa}" if self.backend in CPU_BACKENDS else ""
        return f"{self.backend}{isa} block {self.block_size} cache_dtype {self.cache_dtype}"


def check_pair(src: KVLayout, dst: KVLayout) -> None:
    """Raise :class:`KVLayoutMismatch` unless KV exported in layout ``src`` can be loaded into
    layout ``dst`` exactly: both token rows (kvxfer converts block size, order and TP), or both
    the same whole-block layout (backend, ISA, block size, cache dtype; TP may differ, since a
    page holds one head)."""
    if src.token_rows and dst.token_rows:
        return
    diffs = []
    if not (src.token_rows or dst.token_rows):
        for name in ("backend", "isa", "block_size", "cache_dtype"):
            a, b = getattr(src, name), getattr(dst, name)
            if a != b:
                diffs.append(f"{name} {a} vs {b}")
        if src.isa is None and src.backend in CPU_BACKENDS:
            diffs.append("the CPU attention ISA is unknown")
        if not diffs:
            return
    else:
        diffs.append("one side keeps whole pages (not token rows), the other token rows")
    raise KVLayoutMismatch(
        f"KV layouts cannot be paired: exporter {src.describe()}, loader {dst.describe()} "
        f"({'; '.join(diffs)}); CPU_ATTN pages move only between identical layouts"
    )


def kvxfer_view(t: torch.Tensor, backend: str, head_size: int, use_mla: bool) -> torch.Tensor:
    """One layer's ``[B, H, N, C]`` tensor as a kvxfer cache view (``[2, B, H, N, d]`` HND, or
    ``[B, N, C]`` for MLA); shares ``t``'s memory. ``ValueError`` names what does not fit.

    For ``CPU_ATTN`` the view's rows are the page's bytes in order, not tokens (see the module
    doc): move such caches in whole blocks only."""
    if not isinstance(t, torch.Tensor) or t.dim() != 4:
        raise ValueError(
            f"kv cache: expected a 4-D [blocks, heads, block_size, content] tensor (vLLM 0.32/0.33), "
            f"got {getattr(t, 'shape', type(t).__name__)}"
        )
    b, h, n, c = t.shape
    if use_mla:
        if backend not in MLA_BACKENDS:
            raise ValueError(
                f"attention backend {backend}: an MLA backend kvxfer does not know the layout of "
                f"(supported: {sorted(MLA_BACKENDS)})"
            )
        if h != 1:
            raise ValueError(f"kv cache: an MLA cache has one latent head, got shape {tuple(t.shape)}")
        return t[:, 0]
    if backend not in ROW_BACKENDS and backend not in CPU_BACKENDS:
        raise ValueError(
            f"attention backend {backend}: its K/V layout is not supported by kvxfer "
            f"(supported: {sorted(ROW_BACKENDS | CPU_BACKENDS)})"
        )
    if c != 2 * head_size:
        raise ValueError(
            f"kv cache: backend {backend} content dim is {c}, expected 2 * head_size = {2 * head_size} "
            "(K then V; quantized caches with per-token scales are not supported)"
        )
    if t.stride(3) != 1:
        raise ValueError(
            f"kv cache: backend {backend} needs the content dim contiguous, got strides {t.stride()}"
        )
    if backend in CPU_BACKENDS:
        if t.stride(2) != c:
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
    isa: str | None = None,
    cache_dtype: str = "auto",
    scopes: Mapping[str, int] | None = None,
) -> tuple[KVCacheSpec, list[torch.Tensor], list[str], KVLayout]:
    """(spec, per-layer kvxfer views, layer names, layout) of one rank's registered caches.

    ``spec.block_size`` is the registered tensors' token dim (vLLM's kernel block size, which
    may divide the manager's block size); ``spec.num_kv_heads`` is the model's total. ``isa``:
    the CPU attention ISA of ``CPU_ATTN`` caches (see the module doc). ``scopes``: layer name
    -> KV cache group; layers share one view only within a group (vLLM's hybrid allocator
    gives the j-th layers of all groups one tensor, each group its own blocks of it).
    """
    if not kv_caches:
        raise ValueError("kv_caches: no KV cache tensors were registered")
    if cache_dtype not in PLAIN_CACHE_DTYPES:
        raise ValueError(
            f"cache_dtype {cache_dtype!r}: its packing (per-token scales or packed values) is not "
            f"supported by kvxfer (supported: {sorted(PLAIN_CACHE_DTYPES)})"
        )
    seen: dict[tuple, str] = {}
    names: list[str] = []
    views: list[torch.Tensor] = []
    for name, t in kv_caches.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"kv_caches[{name!r}]: expected a tensor, got {type(t).__name__}")
        key = (scopes.get(name) if scopes else None, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
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
    cpu = backend in CPU_BACKENDS and not use_mla
    layout = KVLayout(backend, spec.block_size, not cpu, isa if cpu else None, cache_dtype)
    return spec, views, names, layout
