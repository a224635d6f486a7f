"""A state group of a hybrid model's cache (Mamba1/2, Gated DeltaNet, short conv) as an engine is
registered with it: its layers and its :class:`~kvxfer.groups.state.StateSpec`.

vLLM's hybrid allocator (0.32/0.33) gives every layer of a model one shared page per block: the
layers of one *region* (layer ``j`` of every group) alias one tensor, and a state layer's page
``b`` (conv state, then SSM state, then padding) is the same bytes as the attention block ``b``
of its region (docs/research/vllm-hybrid.md §1.4, §3.3). A request holds one running state page
per state layer (:func:`kvxfer.groups.blocks.state_block`).

An engine sees a state layer through an attention-shaped view over its pages (the engine's
``KVCacheSpec``, like every other entry of ``caches``): block ``b`` of that view covers page
``b``. A state group then moves one block per layer, whole (padding included), through the same
planner, transports and ops as attention groups. Whole pages are the identity on bytes only
between engines whose pages are laid out alike: the same block size, attention layout, dtype
and TP size, and equal state specs (:meth:`StateGroup.peer_mismatch`); other peers are refused
at the handshake, by group, and the decode side computes the prompt. Re-sharding a state across
TP sizes and converting its conv layout or SSM order are what :mod:`kvxfer.groups.state_ops`
does on its own pages; the engine does not route through them yet.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .state import StateSpec

__all__ = ["StateGroup"]


@dataclass(frozen=True)
class StateGroup:
    """One state KV cache group.

    Args:
        layers: the engine's layer indices (positions in its ``caches``) of the group's state
            layers, each an attention-shaped view whose block ``b`` holds state page ``b`` (see
            the module doc); in the order of ``state``'s layers.
        state: the group's :class:`~kvxfer.groups.state.StateSpec` at this engine's TP size
            (``num_layers == len(layers)``).
        num_speculative_blocks: scratch blocks vLLM keeps after a request's state block
            (``MambaSpec.num_speculative_blocks``); the state block is the entry before them.
    """

    layers: tuple[int, ...]
    state: StateSpec
    num_speculative_blocks: int = 0

    window = None  # never a sliding window: what attention-group code may read

    def __post_init__(self) -> None:
        layers = tuple(self.layers) if isinstance(self.layers, (list, tuple, range)) else None
        if not layers:
            raise ValueError(f"layers: must be a non-empty sequence of layer indices, got {self.layers!r}")
        for x in layers:
            if isinstance(x, bool) or not isinstance(x, int) or x < 0:
                raise ValueError(f"layers: must be ints >= 0, got {x!r}")
        object.__setattr__(self, "layers", layers)
        if not isinstance(self.state, StateSpec):
            raise ValueError(f"state: expected a StateSpec, got {type(self.state).__name__}")
        if self.state.num_layers != len(layers):
            raise ValueError(
                f"state: describes {self.state.num_layers} layers, the group has {len(layers)} layers"
            )
        n = self.num_speculative_blocks
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"num_speculative_blocks: must be an int >= 0, got {n!r}")

    @property
    def kind(self) -> str:
        """``"state"``."""
        return "state"

    def live_first(self, num_tokens: int) -> int:
        """0: a state group has no token span (what attention-group code may ask)."""
        return 0

    def to_wire(self) -> list[int]:
        """``[0, 0, *layers]``: the handshake's group entry (the state itself is
        :meth:`state_wire`)."""
        return [0, 0, *self.layers]

    def state_wire(self) -> str:
        """The state spec as a handshake carries it (canonical JSON)."""
        return json.dumps(self.state.to_dict(), sort_keys=True, separators=(",", ":"))

    def describe(self) -> str:
        return f"{self.state.kind.value} state, layers {list(self.layers)}"

    def check_pages(self, block_bytes: int, tp_size: int) -> None:
        """``ValueError`` unless a block of the engine's caches (``block_bytes`` per layer and
        rank) holds the state's content and the state is at the engine's ``tp_size``."""
        if self.state.tp_size != tp_size:
            raise ValueError(f"state: its tp_size is {self.state.tp_size}, the engine's {tp_size}")
        if self.state.content_bytes > block_bytes:
            raise ValueError(
                f"state: {self.state.content_bytes} bytes of conv and SSM state per page do not fit one "
                f"block of the caches ({block_bytes} bytes per layer on a rank)"
            )

    @staticmethod
    def peer_mismatch(mine: dict, theirs: dict) -> str | None:
        """Why two engines' specs (``KVCacheSpec.to_dict`` plus ``tp_size``) cannot move whole
        state pages between them (see the module doc), or None."""
        for f in ("block_size", "layout", "dtype", "tp_size"):
            if mine.get(f) != theirs.get(f):
                return (
                    f"state pages move whole only between engines of equal {f} "
                    f"(the peer's {theirs.get(f)!r}, this engine's {mine.get(f)!r})"
                )
        return None
