"""State groups of hybrid models (Mamba1, Mamba2, Gated DeltaNet, short conv): the spec, its
per-rank page layout and its canonical wire.

A state group holds, per request and per layer, one state *page* (vLLM's ``MambaSpec`` block;
``docs/research/vllm-hybrid.md`` §3), the layer's pages ``page_bytes`` apart:

    page (bytes):  [ conv state | SSM state | padding ]
    conv state:    SD  [state_len, conv_dim_local]   (dim contiguous; vLLM's default)
                   DS  [conv_dim_local, state_len]                                  conv_dtype
    SSM state:     [ssm_heads_local, *ssm_head_shape]; with ``ssm_transposed`` its last two
                   dims swapped (GDN on vLLM's CPU backend and in transformers)       ssm_dtype

``conv_dim_local`` is the concatenation of the rank's shard of each conv *part*, in the order
of :attr:`StateSpec.conv_parts`: Mamba2 ``[x | B | C]``, GDN ``[q | k | v]``, Mamba1 ``[x]``,
short conv ``[bx]``. A part is ``num_units`` units (heads, or Mamba2's groups) of
``unit_width`` channels. Under TP a part is sharded by unit (rank ``r`` of ``tp`` holds units
``[r*U/tp, (r+1)*U/tp)``) or, for a part that allows it (Mamba2's B and C when ``n_groups <
tp``), replicated (rank ``r`` holds unit ``r*U // tp``: the KV-head rule of
:class:`kvxfer.spec.KVCacheSpec`). The SSM state is sharded by head the same way.

The **sections** of a state are its conv parts, in order, then the SSM state (none for short
conv). The **wire** of ``num_states`` states of ``num_layers`` layers is one contiguous uint8
tensor holding each section in turn, each starting at a multiple of 16 bytes, in the source's
dtypes:

    conv part p:  [units_p, num_layers, num_states, state_len, unit_width_p]   (conv_dtype)
    SSM:          [heads, num_layers, num_states, *ssm_head_shape]            (ssm_dtype)

``ssm_head_shape`` is in the canonical order: Mamba2 ``(head_dim, d_state)``, GDN
``(head_v_dim, head_k_dim)`` (vLLM's spec shape ``[h, V, K]``, the CUDA kernels' order), Mamba1
``(d_state,)``. The wire does not depend on TP, conv layout, SSM order or page size: units lead
each section, so the units one destination rank needs from one source rank are one slice of
each section.

The vocabulary these are written in (:class:`StateKind`, :class:`ConvPart`, :class:`Section`,
:class:`UnitRun`, :class:`WireLayout`, ...) is :mod:`kvxfer.groups.state_types`, re-exported
here; the rules each kind's fields and TP size follow are :mod:`kvxfer.groups.state_rules`.
The three import nothing of kvxfer but :mod:`kvxfer.spec`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ..spec import dtype_from_name, dtype_name
from .state_rules import check_kind, check_tp
from .state_types import (
    PART_NAMES,
    WIRE_ALIGN,
    ConvLayout,
    ConvPart,
    Section,
    StateKind,
    UnitRun,
    WireLayout,
    check_int,
    check_positive_int,
    element_size,
    wire_aligned,
)

__all__ = [
    "WIRE_ALIGN",
    "ConvLayout",
    "ConvPart",
    "Section",
    "StateKind",
    "StateSpec",
    "UnitRun",
    "WireLayout",
]


@dataclass(frozen=True)
class StateSpec:
    """One state group as an engine holds it: the model's state shapes, the engine's TP size,
    conv layout, SSM order, dtypes and page size. Every rank of the engine alike.

    Prefer the constructors :meth:`mamba2`, :meth:`gdn`, :meth:`mamba1`, :meth:`short_conv`;
    the fields are checked against the kind either way (``ValueError`` naming the field).

    Args:
        kind: :class:`StateKind`.
        num_layers: layers of the group whose state is moved.
        conv_parts: the conv state's parts in channel order (:class:`ConvPart`; names fixed per
            kind: mamba2 x, B, C; gdn q, k, v; mamba1 x; short_conv bx).
        state_len: conv rows per state: ``conv_kernel - 1 + num_speculative_tokens``.
        ssm_heads: heads of the SSM state of the whole model (0 for short conv).
        ssm_head_shape: one head's SSM state in canonical order (``()`` for short conv).
        conv_dtype, ssm_dtype: element types (``ssm_dtype`` is ignored for short conv).
        tp_size: the engine's tensor-parallel size.
        conv_layout: :class:`ConvLayout` of the conv state in a page.
        ssm_transposed: the page holds each SSM head's last two dims swapped (GDN only: vLLM's
            CPU backend reads ``[h, K, V]`` where the canonical and CUDA order is ``[h, V, K]``).
        page_size_bytes: bytes from one page to the next as vLLM sizes it (its padded page);
            None: the content, conv plus SSM bytes. Must hold the content.
    """

    kind: StateKind
    num_layers: int
    conv_parts: tuple[ConvPart, ...]
    state_len: int
    ssm_heads: int
    ssm_head_shape: tuple[int, ...]
    conv_dtype: torch.dtype
    ssm_dtype: torch.dtype
    tp_size: int = 1
    conv_layout: ConvLayout = ConvLayout.SD
    ssm_transposed: bool = False
    page_size_bytes: int | None = None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", StateKind(self.kind))
        except ValueError:
            raise ValueError(
                f"kind: must be one of {[k.value for k in StateKind]}, got {self.kind!r}"
            ) from None
        try:
            object.__setattr__(self, "conv_layout", ConvLayout(self.conv_layout))
        except ValueError:
            raise ValueError(f"conv_layout: must be 'SD' or 'DS', got {self.conv_layout!r}") from None
        check_positive_int("num_layers", self.num_layers)
        check_positive_int("state_len", self.state_len)
        check_positive_int("tp_size", self.tp_size)
        for field in ("conv_dtype", "ssm_dtype"):
            dt = getattr(self, field)
            if not isinstance(dt, torch.dtype):
                raise ValueError(f"{field}: must be a torch.dtype, got {dt!r}")
            try:
                dtype_name(dt)
            except ValueError as e:
                raise ValueError(f"{field}: {e}") from None
        if not isinstance(self.ssm_transposed, bool):
            raise ValueError(f"ssm_transposed: must be a bool, got {self.ssm_transposed!r}")
        parts = self.conv_parts
        if not isinstance(parts, tuple) or not all(isinstance(p, ConvPart) for p in parts):
            raise ValueError(f"conv_parts: must be a tuple of ConvPart, got {parts!r}")
        names = tuple(p.name for p in parts)
        want = PART_NAMES[self.kind]
        if names != want:
            raise ValueError(f"conv_parts: a {self.kind.value} state has parts {want}, got {names}")
        shape = self.ssm_head_shape
        if not isinstance(shape, tuple):
            raise ValueError(f"ssm_head_shape: must be a tuple of ints, got {shape!r}")
        for d in shape:
            check_positive_int("ssm_head_shape", d)
        check_int("ssm_heads", self.ssm_heads)
        check_kind(self)
        check_tp(self)
        if self.page_size_bytes is not None:
            check_positive_int("page_size_bytes", self.page_size_bytes)
            if self.page_size_bytes < self.content_bytes:
                raise ValueError(
                    f"page_size_bytes: {self.page_size_bytes} is less than the state's content at "
                    f"tp_size={self.tp_size} ({self.conv_bytes} conv + {self.ssm_bytes} SSM bytes)"
                )

    # ------------------------------------------------------------ constructors
    @classmethod
    def mamba2(
        cls,
        num_layers: int,
        num_heads: int,
        head_dim: int,
        n_groups: int,
        d_state: int,
        conv_kernel: int,
        conv_dtype: torch.dtype,
        ssm_dtype: torch.dtype | None = None,
        tp_size: int = 1,
        conv_layout: ConvLayout | str = ConvLayout.SD,
        num_speculative_tokens: int = 0,
        page_size_bytes: int | None = None,
    ) -> StateSpec:
        """A Mamba2 state (``MambaMixer2``): conv ``[x | B | C]`` with x = ``num_heads`` heads of
        ``head_dim`` and B, C = ``n_groups`` groups of ``d_state`` (replicated when ``n_groups <
        tp_size``); SSM ``[num_heads, head_dim, d_state]``. ``ssm_dtype`` defaults to
        ``conv_dtype``."""
        check_positive_int("conv_kernel", conv_kernel)
        check_int("num_speculative_tokens", num_speculative_tokens)
        return cls(
            kind=StateKind.MAMBA2,
            num_layers=num_layers,
            conv_parts=(
                ConvPart("x", num_heads, head_dim),
                ConvPart("B", n_groups, d_state, replicate=True),
                ConvPart("C", n_groups, d_state, replicate=True),
            ),
            state_len=conv_kernel - 1 + num_speculative_tokens,
            ssm_heads=num_heads,
            ssm_head_shape=(head_dim, d_state),
            conv_dtype=conv_dtype,
            ssm_dtype=conv_dtype if ssm_dtype is None else ssm_dtype,
            tp_size=tp_size,
            conv_layout=conv_layout,
            page_size_bytes=page_size_bytes,
        )

    @classmethod
    def gdn(
        cls,
        num_layers: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int,
        conv_dtype: torch.dtype,
        ssm_dtype: torch.dtype | None = None,
        tp_size: int = 1,
        conv_layout: ConvLayout | str = ConvLayout.SD,
        ssm_transposed: bool = False,
        num_speculative_tokens: int = 0,
        page_size_bytes: int | None = None,
    ) -> StateSpec:
        """A Gated DeltaNet state (Qwen3-Next, Qwen3.5): conv ``[q | k | v]`` with q, k =
        ``num_k_heads`` heads of ``head_k_dim`` and v = ``num_v_heads`` heads of ``head_v_dim``;
        SSM ``[num_v_heads, head_v_dim, head_k_dim]`` (``ssm_transposed``: ``[.., K, V]`` in the
        page)."""
        check_positive_int("conv_kernel", conv_kernel)
        check_int("num_speculative_tokens", num_speculative_tokens)
        return cls(
            kind=StateKind.GDN,
            num_layers=num_layers,
            conv_parts=(
                ConvPart("q", num_k_heads, head_k_dim),
                ConvPart("k", num_k_heads, head_k_dim),
                ConvPart("v", num_v_heads, head_v_dim),
            ),
            state_len=conv_kernel - 1 + num_speculative_tokens,
            ssm_heads=num_v_heads,
            ssm_head_shape=(head_v_dim, head_k_dim),
            conv_dtype=conv_dtype,
            ssm_dtype=conv_dtype if ssm_dtype is None else ssm_dtype,
            tp_size=tp_size,
            conv_layout=conv_layout,
            ssm_transposed=ssm_transposed,
            page_size_bytes=page_size_bytes,
        )

    @classmethod
    def mamba1(
        cls,
        num_layers: int,
        intermediate_size: int,
        d_state: int,
        conv_kernel: int,
        conv_dtype: torch.dtype,
        ssm_dtype: torch.dtype | None = None,
        tp_size: int = 1,
        conv_layout: ConvLayout | str = ConvLayout.SD,
        num_speculative_tokens: int = 0,
        page_size_bytes: int | None = None,
    ) -> StateSpec:
        """A Mamba1 state (``MambaMixer``): conv ``[x]`` of ``intermediate_size`` channels, SSM
        ``[intermediate_size, d_state]``, both sharded by channel."""
        check_positive_int("conv_kernel", conv_kernel)
        check_int("num_speculative_tokens", num_speculative_tokens)
        return cls(
            kind=StateKind.MAMBA1,
            num_layers=num_layers,
            conv_parts=(ConvPart("x", intermediate_size, 1),),
            state_len=conv_kernel - 1 + num_speculative_tokens,
            ssm_heads=intermediate_size,
            ssm_head_shape=(d_state,),
            conv_dtype=conv_dtype,
            ssm_dtype=conv_dtype if ssm_dtype is None else ssm_dtype,
            tp_size=tp_size,
            conv_layout=conv_layout,
            page_size_bytes=page_size_bytes,
        )

    @classmethod
    def short_conv(
        cls,
        num_layers: int,
        dim: int,
        conv_kernel: int,
        conv_dtype: torch.dtype,
        tp_size: int = 1,
        conv_layout: ConvLayout | str = ConvLayout.SD,
        num_speculative_tokens: int = 0,
        page_size_bytes: int | None = None,
    ) -> StateSpec:
        """A short-conv state (LFM2's ``ShortConv``): conv ``[bx]`` of ``dim`` channels, no SSM."""
        check_positive_int("conv_kernel", conv_kernel)
        check_int("num_speculative_tokens", num_speculative_tokens)
        return cls(
            kind=StateKind.SHORT_CONV,
            num_layers=num_layers,
            conv_parts=(ConvPart("bx", dim, 1),),
            state_len=conv_kernel - 1 + num_speculative_tokens,
            ssm_heads=0,
            ssm_head_shape=(),
            conv_dtype=conv_dtype,
            ssm_dtype=conv_dtype,
            tp_size=tp_size,
            conv_layout=conv_layout,
            page_size_bytes=page_size_bytes,
        )

    # --------------------------------------------------------------- sections
    @functools.cached_property
    def sections(self) -> tuple[Section, ...]:
        """The conv parts in channel order, then the SSM state (if any)."""
        secs = [
            Section(p.name, p.num_units, (self.state_len, p.unit_width), self.conv_dtype, p.replicate, True)
            for p in self.conv_parts
        ]
        if self.ssm_heads:
            secs.append(Section("ssm", self.ssm_heads, self.ssm_head_shape, self.ssm_dtype, False, False))
        return tuple(secs)

    @property
    def num_sections(self) -> int:
        """Conv parts plus one for the SSM state (if any)."""
        return len(self.conv_parts) + (1 if self.ssm_heads else 0)

    def local_units(self, section: int) -> int:
        """Units of section ``section`` on each rank (1 for a replicated part with more ranks than
        units)."""
        return max(1, self.sections[section].num_units // self.tp_size)

    def units_of_rank(self, section: int, tp_rank: int) -> range:
        """Global units of section ``section`` held by ``tp_rank`` (see the module doc)."""
        if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not 0 <= tp_rank < self.tp_size:
            raise ValueError(f"tp_rank: must be in [0, {self.tp_size}), got {tp_rank!r}")
        u, tp = self.sections[section].num_units, self.tp_size
        if u >= tp:
            per = u // tp
            return range(tp_rank * per, (tp_rank + 1) * per)
        unit = tp_rank * u // tp
        return range(unit, unit + 1)

    # ------------------------------------------------------------ page layout
    @property
    def conv_element_size(self) -> int:
        """Bytes per conv element."""
        return element_size(self.conv_dtype)

    @property
    def ssm_element_size(self) -> int:
        """Bytes per SSM element (0 for short conv: no SSM state)."""
        return element_size(self.ssm_dtype) if self.ssm_heads else 0

    @property
    def conv_dim_local(self) -> int:
        """Conv channels on a rank: the sum of its shards of every part."""
        return sum(self.local_units(i) * p.unit_width for i, p in enumerate(self.conv_parts))

    def conv_part_offset(self, section: int) -> int:
        """First channel of conv part ``section`` among a rank's ``conv_dim_local`` channels."""
        if not 0 <= section < len(self.conv_parts):
            raise ValueError(f"section: {section} is not a conv part (0..{len(self.conv_parts) - 1})")
        return sum(self.local_units(i) * p.unit_width for i, p in enumerate(self.conv_parts[:section]))

    @property
    def conv_shape(self) -> tuple[int, int]:
        """A rank's conv state as stored: SD ``(state_len, conv_dim_local)``, DS the transpose."""
        if self.conv_layout is ConvLayout.SD:
            return (self.state_len, self.conv_dim_local)
        return (self.conv_dim_local, self.state_len)

    @property
    def ssm_shape(self) -> tuple[int, ...]:
        """A rank's SSM state as stored: ``(heads_local, *head)``, the head's last two dims swapped
        with ``ssm_transposed``; ``()`` without an SSM state."""
        if not self.ssm_heads:
            return ()
        head = self.ssm_head_shape
        if self.ssm_transposed:
            head = (*head[:-2], head[-1], head[-2])
        return (self.local_units(self.num_sections - 1), *head)

    def vllm_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The per-rank ``MambaSpec.shapes`` vLLM reports for this state: the conv state in its
        layout, then the SSM state in vLLM's spec order (GDN ``[h, V, K]`` whatever the byte
        order the backend reads)."""
        if not self.ssm_heads:
            return (self.conv_shape,)
        return (self.conv_shape, (self.local_units(self.num_sections - 1), *self.ssm_head_shape))

    @property
    def conv_bytes(self) -> int:
        """Bytes of a rank's conv state (at the start of each page)."""
        return self.state_len * self.conv_dim_local * self.conv_element_size

    @property
    def ssm_bytes(self) -> int:
        """Bytes of a rank's SSM state (right after the conv state)."""
        return math.prod(self.ssm_shape) * self.ssm_element_size if self.ssm_heads else 0

    @property
    def content_bytes(self) -> int:
        """Bytes a page holds for one state on a rank: conv plus SSM (vLLM's
        ``real_page_size_bytes``); only these move."""
        return self.conv_bytes + self.ssm_bytes

    @property
    def page_bytes(self) -> int:
        """Bytes from one page to the next: ``page_size_bytes``, else the content."""
        return self.content_bytes if self.page_size_bytes is None else self.page_size_bytes

    def cache_shape(self, num_blocks: int) -> tuple[int, int]:
        """One layer's pages on a rank as a uint8 tensor: ``(num_blocks, page_bytes)``."""
        check_positive_int("num_blocks", num_blocks)
        return (num_blocks, self.page_bytes)

    # ------------------------------------------------------------------ wire
    def _counts(self, counts) -> tuple[int, ...]:
        if counts is None:
            return tuple(s.num_units for s in self.sections)
        counts = tuple(counts)
        if len(counts) != self.num_sections:
            raise ValueError(
                f"counts: one unit count per section ({self.num_sections}: "
                f"{[s.name for s in self.sections]}), got {len(counts)}"
            )
        for s, n in zip(self.sections, counts):
            check_int(f"counts[{s.name}]", n)
        return counts

    def wire_layout(self, counts=None, num_layers: int | None = None, num_states: int = 1) -> WireLayout:
        """The wire of ``counts[i]`` units of each section (default: every unit of the model),
        ``num_layers`` layers (default all) and ``num_states`` states (see the module doc)."""
        counts = self._counts(counts)
        layers = self.num_layers if num_layers is None else num_layers
        check_int("num_layers", layers)
        check_int("num_states", num_states)
        offsets, shapes, dtypes, pos = [], [], [], 0
        for sec, n in zip(self.sections, counts):
            shape = (n, layers, num_states, *sec.unit_shape)
            offsets.append(pos)
            shapes.append(shape)
            dtypes.append(sec.dtype)
            pos = wire_aligned(pos + math.prod(shape) * element_size(sec.dtype))
        return WireLayout(tuple(offsets), tuple(shapes), tuple(dtypes), pos)

    def wire_nbytes(self, counts=None, num_layers: int | None = None, num_states: int = 1) -> int:
        """Bytes of the wire :meth:`wire_layout` describes."""
        return self.wire_layout(counts, num_layers, num_states).nbytes

    def wire_views(
        self, wire: torch.Tensor, counts=None, num_layers: int | None = None, num_states: int = 1
    ) -> dict[str, torch.Tensor]:
        """Typed views of a wire's sections by name: conv parts ``[n, L, R, state_len,
        unit_width]`` (conv_dtype), ``"ssm"`` ``[n, L, R, *ssm_head_shape]`` (ssm_dtype).
        ``wire``: a contiguous uint8 tensor of :meth:`wire_nbytes` bytes, 16-byte aligned."""
        lay = self.wire_layout(counts, num_layers, num_states)
        if not isinstance(wire, torch.Tensor) or wire.dtype != torch.uint8 or not wire.is_contiguous():
            raise ValueError("wire: must be a contiguous uint8 tensor")
        if wire.numel() != lay.nbytes:
            raise ValueError(f"wire: expected {lay.nbytes} bytes, got {wire.numel()}")
        flat = wire.reshape(-1)
        out = {}
        for sec, off, shape, dt in zip(self.sections, lay.offsets, lay.shapes, lay.dtypes):
            n = math.prod(shape) * element_size(dt)
            out[sec.name] = flat[off : off + n].view(dt).view(shape)
        return out

    # ------------------------------------------------------ compatibility
    def model_mismatch(self, other: StateSpec) -> str | None:
        """Why the two specs cannot exchange state (the model's shapes differ), or None if they
        can. TP size, conv layout, SSM order, page size and dtypes may differ: transfers convert
        them (dtypes when asked)."""
        if not isinstance(other, StateSpec):
            return f"not a state spec: {type(other).__name__}"
        for f in ("kind", "num_layers", "conv_parts", "state_len", "ssm_heads", "ssm_head_shape"):
            a, b = getattr(self, f), getattr(other, f)
            if a != b:
                return f"{f} differs: {a} vs {b}"
        return None

    def dtype_mismatch(self, other: StateSpec) -> str | None:
        """Which dtype differs between the two specs (None: none does)."""
        if self.conv_dtype != other.conv_dtype:
            return f"conv_dtype differs: {self.conv_dtype} vs {other.conv_dtype}"
        if self.ssm_heads and self.ssm_dtype != other.ssm_dtype:
            return f"ssm_dtype differs: {self.ssm_dtype} vs {other.ssm_dtype}"
        return None

    # ------------------------------------------------------- serialisation
    def to_dict(self) -> dict:
        """JSON-safe form, for handshakes."""
        return {
            "kind": self.kind.value,
            "num_layers": self.num_layers,
            "conv_parts": [[p.name, p.num_units, p.unit_width, p.replicate] for p in self.conv_parts],
            "state_len": self.state_len,
            "ssm_heads": self.ssm_heads,
            "ssm_head_shape": list(self.ssm_head_shape),
            "conv_dtype": dtype_name(self.conv_dtype),
            "ssm_dtype": dtype_name(self.ssm_dtype),
            "tp_size": self.tp_size,
            "conv_layout": self.conv_layout.value,
            "ssm_transposed": self.ssm_transposed,
            "page_size_bytes": self.page_size_bytes,
        }

    @classmethod
    def from_dict(cls, d: dict) -> StateSpec:
        """Inverse of :meth:`to_dict`; ``ValueError`` naming a missing or bad field."""
        if not isinstance(d, dict):
            raise ValueError(f"state spec: expected a dict, got {type(d).__name__}")
        fields = (
            "kind",
            "num_layers",
            "conv_parts",
            "state_len",
            "ssm_heads",
            "ssm_head_shape",
            "conv_dtype",
            "ssm_dtype",
            "tp_size",
            "conv_layout",
            "ssm_transposed",
            "page_size_bytes",
        )
        for f in fields:
            if f not in d:
                raise ValueError(f"{f}: missing from state spec dict")
        for f in ("conv_dtype", "ssm_dtype"):
            if not isinstance(d[f], str):
                raise ValueError(f"{f}: must be a dtype name, got {d[f]!r}")
        parts = d["conv_parts"]
        if not isinstance(parts, list) or not all(isinstance(p, list) and len(p) == 4 for p in parts):
            raise ValueError(
                f"conv_parts: must be a list of [name, num_units, unit_width, replicate], got {parts!r}"
            )
        shape = d["ssm_head_shape"]
        if not isinstance(shape, list):
            raise ValueError(f"ssm_head_shape: must be a list, got {shape!r}")
        return cls(
            kind=d["kind"],
            num_layers=d["num_layers"],
            conv_parts=tuple(ConvPart(*p) for p in parts),
            state_len=d["state_len"],
            ssm_heads=d["ssm_heads"],
            ssm_head_shape=tuple(shape),
            conv_dtype=dtype_from_name(d["conv_dtype"]),
            ssm_dtype=dtype_from_name(d["ssm_dtype"]),
            tp_size=d["tp_size"],
            conv_layout=d["conv_layout"],
            ssm_transposed=d["ssm_transposed"],
            page_size_bytes=d["page_size_bytes"],
        )
