"""Cache specification: layouts, head ownership per TP rank, per-rank and wire shapes.

Shapes (per rank, one tensor per layer):

    NHD:  [2, num_blocks, block_size, heads_on_rank, head_dim]
    HND:  [2, num_blocks, heads_on_rank, block_size, head_dim]
    MLA:  [num_blocks, block_size, latent_dim]          (head_dim is the latent dim)

Wire (the canonical, layout-independent transfer tensor):

    attention:  [num_heads, num_layers, 2, num_tokens, head_dim]
    MLA:        [num_layers, num_tokens, latent_dim]

This module imports nothing else of kvxfer.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

__all__ = ["KVCacheSpec", "Layout", "dtype_from_name", "dtype_name"]


class Layout(str, enum.Enum):
    """Physical order of one layer's paged cache on a rank."""

    NHD = "NHD"  # [2, blocks, block_size, heads, head_dim]
    HND = "HND"  # [2, blocks, heads, block_size, head_dim]


_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
for _name in ("float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _DTYPES[_name] = getattr(torch, _name)


def dtype_name(dtype: torch.dtype) -> str:
    """Stable wire name of a torch dtype ("bfloat16", "float8_e4m3fn", ...)."""
    for name, dt in _DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"dtype: {dtype} is not supported (supported: {sorted(_DTYPES)})")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; raises ``ValueError`` for an unknown name."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype: unknown dtype name {name!r} (supported: {sorted(_DTYPES)})") from None


def _check_positive_int(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{field}: must be a positive int, got {value!r}")


@dataclass(frozen=True)
class KVCacheSpec:
    """The model's paged KV cache, as seen by one engine (all TP ranks alike).

    Args:
        num_layers: attention layers whose KV is moved.
        num_kv_heads: kv heads of the whole model (not per rank); 1 for MLA.
        head_dim: elements per head row; the latent dim for MLA.
        block_size: tokens per cache block.
        dtype: element type; copies are byte copies, so any dtype moves bit-exactly.
        layout: :class:`Layout` of the attention cache (ignored for MLA).
        use_mla: the cache is an MLA latent cache ``[num_blocks, block_size, latent_dim]``,
            replicated on every TP rank.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    layout: Layout = Layout.NHD
    use_mla: bool = False

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            _check_positive_int(field, getattr(self, field))
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"dtype: must be a torch.dtype, got {self.dtype!r}")
        dtype_name(self.dtype)  # raises for unsupported dtypes
        try:
            object.__setattr__(self, "layout", Layout(self.layout))
        except ValueError:
            raise ValueError(f"layout: must be 'NHD' or 'HND', got {self.layout!r}") from None
        if not isinstance(self.use_mla, bool):
            raise ValueError(f"use_mla: must be a bool, got {self.use_mla!r}")
        if self.use_mla and self.num_kv_heads != 1:
            raise ValueError(
                f"num_kv_heads: an MLA spec has one replicated latent 'head', got {self.num_kv_heads}"
            )

    # ----------------------------------------------------------------- sizes
    @property
    def element_size(self) -> int:
        """Bytes per element."""
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def num_kv(self) -> int:
        """2 (K and V) for attention caches, 1 for MLA."""
        return 1 if self.use_mla else 2

    def bytes_per_token(self, num_heads: int | None = None, num_layers: int | None = None) -> int:
        """Wire bytes per token for ``num_heads`` heads (default: all) over ``num_layers`` layers."""
        heads = self.num_kv_heads if num_heads is None else num_heads
        layers = self.num_layers if num_layers is None else num_layers
        return heads * layers * self.num_kv * self.head_dim * self.element_size

    # ------------------------------------------------------- head ownership
    def check_tp(self, tp_size: int) -> None:
        """Raise ``ValueError`` unless ``tp_size`` can shard this cache's heads."""
        _check_positive_int("tp_size", tp_size)
        if self.use_mla:
            return
        h = self.num_kv_heads
        if tp_size <= h and h % tp_size:
            raise ValueError(f"tp_size: {tp_size} does not divide num_kv_heads={h}")
        if tp_size > h and tp_size % h:
            raise ValueError(
                f"tp_size: {tp_size} > num_kv_heads={h} must be a multiple of it to replicate heads"
            )

    def heads_of_rank(self, tp_rank: int, tp_size: int) -> range:
        """Global kv-head ids held by ``tp_rank`` of ``tp_size`` (vLLM/Megatron convention).

        With ``tp_size <= num_kv_heads`` rank r holds ``[r*H/tp, (r+1)*H/tp)``; with more ranks
        than heads rank r holds the single head ``r*H // tp`` (replicated). MLA: ``range(0, 1)``.
        """
        self.check_tp(tp_size)
        if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank: must be in [0, {tp_size}), got {tp_rank!r}")
        if self.use_mla:
            return range(0, 1)
        h = self.num_kv_heads
        if tp_size <= h:
            per = h // tp_size
            return range(tp_rank * per, (tp_rank + 1) * per)
        head = tp_rank * h // tp_size
        return range(head, head + 1)

    def heads_per_rank(self, tp_size: int) -> int:
        """Number of kv heads each rank of ``tp_size`` holds."""
        self.check_tp(tp_size)
        return 1 if self.use_mla else max(1, self.num_kv_heads // tp_size)

    # --------------------------------------------------------------- shapes
    def local_cache_shape(self, num_blocks: int, heads_on_rank: int) -> tuple[int, ...]:
        """One layer's tensor shape for a rank holding ``heads_on_rank`` heads."""
        if self.use_mla:
            return (num_blocks, self.block_size, self.head_dim)
        if self.layout is Layout.NHD:
            return (2, num_blocks, self.block_size, heads_on_rank, self.head_dim)
        return (2, num_blocks, heads_on_rank, self.block_size, self.head_dim)

    def cache_shape(self, num_blocks: int, tp_size: int) -> tuple[int, ...]:
        """One layer's cache tensor shape on one rank of a ``tp_size`` engine."""
        _check_positive_int("num_blocks", num_blocks)
        return self.local_cache_shape(num_blocks, self.heads_per_rank(tp_size))

    def wire_shape(
        self, num_tokens: int, num_heads: int | None = None, num_layers: int | None = None
    ) -> tuple[int, ...]:
        """Wire tensor shape: ``(H, L, 2, T, D)``, or ``(L, T, D)`` for MLA."""
        layers = self.num_layers if num_layers is None else num_layers
        if self.use_mla:
            return (layers, num_tokens, self.head_dim)
        heads = self.num_kv_heads if num_heads is None else num_heads
        return (heads, layers, 2, num_tokens, self.head_dim)

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens (the last one may be partial)."""
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------ serialisation
    def to_dict(self) -> dict:
        """JSON-safe form, for handshakes."""
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "block_size": self.block_size,
            "dtype": dtype_name(self.dtype),
            "layout": self.layout.value,
            "use_mla": self.use_mla,
        }

    @classmethod
    def from_dict(cls, d: dict) -> KVCacheSpec:
        """Inverse of :meth:`to_dict`; ``ValueError`` naming a missing or bad field."""
        if not isinstance(d, dict):
            raise ValueError(f"spec: expected a dict, got {type(d).__name__}")
        fields = ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype", "layout", "use_mla")
        for f in fields:
            if f not in d:
                raise ValueError(f"{f}: missing from spec dict")
        if not isinstance(d["dtype"], str):
            raise ValueError(f"dtype: must be a dtype name, got {d['dtype']!r}")
        return cls(
            num_layers=d["num_layers"],
            num_kv_heads=d["num_kv_heads"],
            head_dim=d["head_dim"],
            block_size=d["block_size"],
            dtype=dtype_from_name(d["dtype"]),
            layout=d["layout"],
            use_mla=d["use_mla"],
        )

    def model_mismatch(self, other: KVCacheSpec) -> str | None:
        """Why the two specs cannot exchange KV (model shape or dtype), or None if they can.

        Layout and block size may differ: transfers convert them.
        """
        for f in ("use_mla", "num_layers", "num_kv_heads", "head_dim", "dtype"):
            a, b = getattr(self, f), getattr(other, f)
            if a != b:
                return f"{f} differs: {a} vs {b}"
        return None
