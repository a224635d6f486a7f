"""KV cache groups of hybrid models beyond full attention: state groups (Mamba1, Mamba2, Gated
DeltaNet, short conv) and the in-window blocks of sliding-window groups.

* :mod:`kvxfer.groups.state`: :class:`StateSpec` (a state group's shapes, TP sharding, page
  layout) and its canonical wire; the types it is written in (:class:`StateKind`,
  :class:`ConvPart`, :class:`Section`, ...) are :mod:`kvxfer.groups.state_types`, the rules its
  fields follow per kind :mod:`kvxfer.groups.state_rules`;
* :mod:`kvxfer.groups.state_plan`: :func:`plan_state_reads` (which source rank's unit slices
  each destination rank reads);
* :mod:`kvxfer.groups.state_ops`: :func:`gather_state`, :func:`scatter_state`,
  :func:`copy_state` (torch reference; :mod:`kvxfer.groups.state_kernels`: their Triton
  row-table kernel);
* :mod:`kvxfer.groups.attention`: :class:`AttentionGroup` (a full-attention or sliding-window
  group: its layers, its window) and :class:`GroupSet` (an engine's groups, checked), what
  :class:`kvxfer.TransferEngine` is registered with (``groups=``);
* :mod:`kvxfer.groups.state_group`: :class:`StateGroup` (a state group: its layers, its
  :class:`StateSpec`), registered with an engine beside the attention groups; its pages move
  whole between engines laid out alike;
* :mod:`kvxfer.groups.blocks`: :func:`select_window_blocks` (a sliding-window group's in-window
  blocks on both sides, and their token slots), :func:`state_block`.

See docs/DESIGN.md, "Hybrid models: attention and state groups".
"""

from __future__ import annotations

from .attention import AttentionGroup, GroupSet
from .blocks import NULL_BLOCK, WindowBlocks, select_window_blocks, state_block, window_tokens
from .state import WIRE_ALIGN, ConvLayout, ConvPart, Section, StateKind, StateSpec, UnitRun, WireLayout
from .state_group import StateGroup
from .state_ops import copy_state, gather_state, scatter_state
from .state_plan import StatePlan, StateRead, plan_state_reads

__all__ = [
    "NULL_BLOCK",
    "WIRE_ALIGN",
    "AttentionGroup",
    "ConvLayout",
    "ConvPart",
    "GroupSet",
    "Section",
    "StateGroup",
    "StateKind",
    "StatePlan",
    "StateRead",
    "StateSpec",
    "UnitRun",
    "WindowBlocks",
    "WireLayout",
    "copy_state",
    "gather_state",
    "plan_state_reads",
    "scatter_state",
    "select_window_blocks",
    "state_block",
    "window_tokens",
]
