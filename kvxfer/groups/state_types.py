"""The vocabulary a state group's :class:`~kvxfer.groups.state.StateSpec` is written in: its
kind and conv layout, the parts of its conv state, the sections and unit runs of its canonical
wire, and the wire's layout (the module doc of :mod:`kvxfer.groups.state` says what each is);
with the field checks and sizes the spec shares. Imports nothing of kvxfer.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = [
    "PART_NAMES",
    "WIRE_ALIGN",
    "ConvLayout",
    "ConvPart",
    "Section",
    "StateKind",
    "UnitRun",
    "WireLayout",
    "check_int",
    "check_positive_int",
    "element_size",
    "wire_aligned",
]

WIRE_ALIGN = 16  # every wire section starts at a multiple of this many bytes


class StateKind(str, enum.Enum):
    """Which mixer the state belongs to (vLLM's ``MambaAttentionBackendEnum`` names)."""

    MAMBA1 = "mamba1"
    MAMBA2 = "mamba2"
    GDN = "gdn"
    SHORT_CONV = "short_conv"


class ConvLayout(str, enum.Enum):
    """Orientation of the conv state in a page (vLLM's ``VLLM_SSM_CONV_STATE_LAYOUT``)."""

    SD = "SD"  # [state_len, conv_dim_local]: every row holds all channels
    DS = "DS"  # [conv_dim_local, state_len]: each channel's history contiguous


# The parts each kind's conv state is made of, in channel order (vLLM's MambaConvSplitInfo).
PART_NAMES = {
    StateKind.MAMBA1: ("x",),
    StateKind.MAMBA2: ("x", "B", "C"),
    StateKind.GDN: ("q", "k", "v"),
    StateKind.SHORT_CONV: ("bx",),
}


def check_positive_int(field: str, value: object) -> None:
    """``ValueError`` naming ``field`` unless ``value`` is an int (not a bool) ``> 0``."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{field}: must be a positive int, got {value!r}")


def check_int(field: str, value: object, low: int = 0) -> None:
    """``ValueError`` naming ``field`` unless ``value`` is an int (not a bool) ``>= low``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{field}: must be an int >= {low}, got {value!r}")


def element_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


def wire_aligned(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`WIRE_ALIGN`."""
    return -(-n // WIRE_ALIGN) * WIRE_ALIGN


@dataclass(frozen=True)
class ConvPart:
    """One sub-projection of the conv state: ``num_units`` units of ``unit_width`` channels.

    Args:
        name: the part's name (``"x"``, ``"B"``, ``"C"``, ``"q"``, ``"k"``, ``"v"``, ``"bx"``).
        num_units: units of the whole model (not per rank): heads, or Mamba2's groups.
        unit_width: channels per unit (head_dim, d_state, head_k_dim, ...; 1 for per-channel
            parts).
        replicate: with more TP ranks than units, every rank holds a whole unit (vLLM's Mamba2
            B and C when ``n_groups < tp``); otherwise ``tp`` must divide ``num_units``.
    """

    name: str
    num_units: int
    unit_width: int
    replicate: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"conv part name: must be a non-empty str, got {self.name!r}")
        check_positive_int(f"conv part {self.name}: num_units", self.num_units)
        check_positive_int(f"conv part {self.name}: unit_width", self.unit_width)
        if not isinstance(self.replicate, bool):
            raise ValueError(f"conv part {self.name}: replicate must be a bool, got {self.replicate!r}")

    @property
    def width(self) -> int:
        """Channels of the whole model: ``num_units * unit_width``."""
        return self.num_units * self.unit_width


class Section(NamedTuple):
    """One section of a state (a conv part, or the SSM state), in canonical terms.

    ``unit_shape``: one unit's elements in wire order (conv: ``(state_len, unit_width)``; SSM:
    ``ssm_head_shape``). ``replicate``: see :class:`ConvPart` (always False for the SSM).
    """

    name: str
    num_units: int
    unit_shape: tuple[int, ...]
    dtype: torch.dtype
    replicate: bool
    is_conv: bool


class UnitRun(NamedTuple):
    """``num_units`` units of one section: rank-local ``[src_start, +num_units)`` on the source
    land at rank-local ``[dst_start, +num_units)`` on the destination (a gather uses the source
    half, a scatter the destination half)."""

    src_start: int
    dst_start: int
    num_units: int


class WireLayout(NamedTuple):
    """Where each section of a wire lies: byte ``offsets`` and typed ``shapes`` per section (in
    :attr:`StateSpec.sections` order), the section ``dtypes``, and the wire's ``nbytes``."""

    offsets: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    nbytes: int
