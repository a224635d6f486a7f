"""The attention groups of a hybrid model's KV cache, as an engine is registered with them.

vLLM's hybrid allocator (0.32/0.33) splits a model's layers into KV cache groups: full-attention
groups and sliding-window groups share one page spec per layer but each owns its layers and its
own positional block list per request, all drawn from one block pool (vLLM's null block 0
stands for a position whose tokens the window passed). Sources: docs/research/vllm-hybrid.md
§1.3-1.5, §2.

:class:`AttentionGroup` is one group: the engine's layer indices it owns and, for a sliding
group, its window. :class:`GroupSet` is an engine's groups, checked once: every layer in exactly
one group. It gives each group's *live span* of a request (:meth:`GroupSet.live_first`: the
first token the next token still attends to; blocks before it are not moved) and the form a
handshake compares.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .blocks import NULL_BLOCK, window_tokens
from .state_group import StateGroup

__all__ = ["AttentionGroup", "GroupSet"]


def _int(field: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{field}: must be an int >= {low}, got {value!r}")
    return value


@dataclass(frozen=True)
class AttentionGroup:
    """One attention KV cache group.

    Args:
        layers: the engine's layer indices (positions in its ``caches``) this group owns.
        window: the sliding window in tokens (the current token included, vLLM's
            ``SlidingWindowSpec.sliding_window``); None: full attention.
        extra_retained_tokens: tokens vLLM keeps beyond the window
            (``SlidingWindowSpec.extra_retained_tokens``); sliding groups only.
    """

    layers: tuple[int, ...]
    window: int | None = None
    extra_retained_tokens: int = 0

    def __post_init__(self) -> None:
        layers = tuple(self.layers) if isinstance(self.layers, (list, tuple, range)) else None
        if not layers:
            raise ValueError(f"layers: must be a non-empty sequence of layer indices, got {self.layers!r}")
        for x in layers:
            _int("layers", x, 0)
        object.__setattr__(self, "layers", layers)
        if self.window is not None:
            _int("window", self.window, 1)
        _int("extra_retained_tokens", self.extra_retained_tokens, 0)
        if self.window is None and self.extra_retained_tokens:
            raise ValueError("extra_retained_tokens: only a sliding-window group keeps extra tokens")

    @property
    def kind(self) -> str:
        """``"full"`` or ``"sliding"``."""
        return "full" if self.window is None else "sliding"

    def live_first(self, num_tokens: int) -> int:
        """The first token of a request with ``num_tokens`` tokens that this group still holds
        and moves: 0 for full attention, else the window's first token
        (:func:`kvxfer.groups.window_tokens`)."""
        if self.window is None:
            return 0
        return window_tokens(num_tokens, self.window, self.extra_retained_tokens).start

    def to_wire(self) -> list[int]:
        """``[window or 0, extra_retained_tokens, *layers]``: what a handshake compares."""
        return [self.window or 0, self.extra_retained_tokens, *self.layers]

    def describe(self) -> str:
        w = "" if self.window is None else f", window {self.window}"
        return f"{self.kind} attention{w}, layers {list(self.layers)}"


class GroupSet:
    """An engine's groups (see the module doc): attention groups and state groups
    (:class:`~kvxfer.groups.state_group.StateGroup`), checked against ``num_layers``: every
    layer index in ``[0, num_layers)`` in exactly one group.

    ``null_block``: the block id that stands for a dead position (vLLM's null block, 0); no
    group's moved blocks may name it. None: no such id."""

    __slots__ = ("groups", "null_block", "num_layers", "whole")

    def __init__(
        self,
        groups: Sequence[AttentionGroup | StateGroup],
        num_layers: int,
        null_block: int | None = NULL_BLOCK,
    ) -> None:
        if (
            isinstance(groups, (AttentionGroup, StateGroup))
            or not isinstance(groups, (list, tuple))
            or not groups
        ):
            raise ValueError("groups: must be a non-empty list of AttentionGroup or StateGroup")
        for i, g in enumerate(groups):
            if not isinstance(g, (AttentionGroup, StateGroup)):
                raise ValueError(
                    f"groups[{i}]: expected an AttentionGroup or StateGroup, got {type(g).__name__}"
                )
        owner: dict[int, int] = {}
        for i, g in enumerate(groups):
            for x in g.layers:
                if x >= num_layers:
                    raise ValueError(f"groups[{i}]: layer {x} out of range [0, {num_layers})")
                if x in owner:
                    raise ValueError(f"groups[{i}]: layer {x} is already in groups[{owner[x]}]")
                owner[x] = i
        missing = [x for x in range(num_layers) if x not in owner]
        if missing:
            raise ValueError(f"groups: layer {missing[0]} is in no group (every layer must be in one)")
        if null_block is not None:
            _int("null_block", null_block, 0)
        self.groups = tuple(groups)
        self.num_layers = num_layers
        self.null_block = null_block
        # per group: it moves whole blocks (a state group's page), not a token span
        self.whole = tuple(isinstance(g, StateGroup) for g in self.groups)

    @property
    def states(self) -> tuple[StateGroup, ...]:
        """The state groups, in order."""
        return tuple(g for g in self.groups if isinstance(g, StateGroup))

    def states_wire(self) -> list[str] | None:
        """Per group its state spec (:meth:`StateGroup.state_wire`) or "" (attention); None
        without state groups (a handshake field)."""
        if not any(self.whole):
            return None
        return [g.state_wire() if isinstance(g, StateGroup) else "" for g in self.groups]

    def __len__(self) -> int:
        return len(self.groups)

    def to_wire(self) -> list[list[int]]:
        """Every group's :meth:`AttentionGroup.to_wire`, in order (a handshake field)."""
        return [g.to_wire() for g in self.groups]

    def mismatch(self, wire: list | None, states: list | None = None) -> str | None:
        """Why a peer whose groups are ``wire`` (:meth:`to_wire`, None: not grouped) and state
        specs ``states`` (:meth:`states_wire`) cannot exchange requests with this engine; None
        when it can: the same groups in order, each of the same kind (whether two state specs
        can exchange is the handshake's question: :mod:`kvxfer.groups.state_group`)."""
        if wire is None:
            return "the peer registered no KV cache groups, this engine did"
        mine = self.to_wire()
        if len(wire) != len(mine):
            return f"the peer has {len(wire)} KV cache groups, this engine {len(mine)}"
        kinds = list(states) if isinstance(states, list) and len(states) == len(wire) else [""] * len(wire)
        for i, (a, b) in enumerate(zip(wire, mine)):
            if bool(kinds[i]) != self.whole[i]:
                what = (
                    "a state" if kinds[i] else "an attention",
                    "a state" if self.whole[i] else "an attention",
                )
                return f"KV cache group {i}: the peer's is {what[0]} group, this engine's {what[1]} group"
            if list(a) != b:
                return f"KV cache group {i} differs: the peer's {list(a)}, this engine's {b} ([window, extra, *layers])"
        return None
