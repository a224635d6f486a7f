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
at the handshake, by group, unless the transport can re-shard.

A peer laid out otherwise (another TP size, block size, attention layout or dtype, or a state
spec with another conv layout, SSM order or page size, for the same model and state dtypes)
gets a :class:`StateRoute`: the ``ipc`` transport, which maps the exporter's pages, copies the
units each destination rank needs from each source rank with
:func:`kvxfer.groups.state_ops.copy_state` (:func:`~kvxfer.groups.state_plan.plan_state_reads`),
through :func:`page_view` of both sides' caches. Other transports refuse such a peer by name.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..spec import KVCacheSpec, Layout
from ..views import CacheViews
from .state import StateSpec, UnitRun
from .state_ops import copy_state

__all__ = ["StateGroup", "StateLanding", "StateRoute", "page_view"]


class StateRoute(NamedTuple):
    """How one state group moves from a peer laid out otherwise (see the module doc): the
    peer's spec ``src``, this engine's ``dst``, the unit runs this rank reads from each source
    rank (``runs``), and ``why`` pages cannot move whole."""

    src: StateSpec
    dst: StateSpec
    runs: dict[int, tuple[UnitRun, ...]]
    why: str

    def nbytes(self, num_layers: int, num_states: int, s: int) -> int:
        """Bytes read from source rank ``s`` for ``num_states`` states of ``num_layers`` layers."""
        runs = self.runs.get(s, ())
        per = sum(
            r.num_units * math.prod(sec.unit_shape) * sec.dtype.itemsize
            for r, sec in zip(runs, self.src.sections)
        )
        return per * num_layers * num_states

    def copy(self, s: int, src_pages: list, src_ids: list[int], dst_caches, group_layers, dst_ids: list[int],
             layers: list[int]) -> None:  # fmt: skip
        """Copy this rank's units of source rank ``s`` (``runs[s]``) out of ``src_pages`` (the
        source rank's pages of the group's layers, in order) into ``dst_caches`` (this engine's
        caches, the group's layers ``group_layers`` viewed as pages), state ``src_ids[j]`` into
        ``dst_ids[j]``, over ``layers`` (engine layer indices of the group)."""
        copy_state(
            src_pages, self.src, src_ids, [page_view(dst_caches[x]) for x in group_layers], self.dst, dst_ids,
            self.runs[s], layers=[group_layers.index(x) for x in layers],
        )  # fmt: skip


class StateLanding:
    """Where a staged transport (``pg``, ``nixl`` staged) lands a state group's pages from one
    source rank before they are re-sharded: ``num_states`` pages per layer laid out as the
    source rank's (its spec, block size and heads), for the group's ``layers`` (engine layer
    indices; the other layers of the list alias the first, never written). Its ``views``,
    ``spec`` and ``num_blocks`` are what a stream's scatter takes
    (:func:`kvxfer.transports.streams.stream_scatters`); :meth:`pages` what
    :func:`~kvxfer.groups.state_ops.copy_state` reads."""

    __slots__ = ("caches", "layers", "num_blocks", "spec", "views")

    def __init__(
        self, spec: KVCacheSpec, tp_size: int, layers: tuple[int, ...], num_states: int, device: torch.device
    ) -> None:
        heads = spec.heads_per_rank(tp_size)
        page = spec.bytes_per_token(heads, 1) * spec.block_size
        if spec.use_mla:
            inner = (spec.block_size, spec.head_dim)
        elif spec.layout is Layout.NHD:
            inner = (2, spec.block_size, heads, spec.head_dim)
        else:
            inner = (2, heads, spec.block_size, spec.head_dim)
        own = {}
        for x in layers:
            raw = torch.empty(num_states, page, dtype=torch.uint8, device=device)
            view = raw.view(spec.dtype).view(num_states, *inner)
            own[x] = view if spec.use_mla else view.transpose(0, 1)
        first = own[layers[0]]
        self.caches = [own.get(x, first) for x in range(spec.num_layers)]
        self.layers = layers
        self.spec = spec
        self.num_blocks = num_states
        self.views = CacheViews(self.caches, spec)

    def pages(self) -> list[torch.Tensor]:
        """The group's layers' pages (:func:`page_view`), in the group's order."""
        return [page_view(self.caches[x]) for x in self.layers]


def page_view(cache: torch.Tensor) -> torch.Tensor:
    """One layer's state pages, uint8 ``[num_blocks, page_bytes]``, from its attention-shaped
    view (``[2, num_blocks, ...]`` or MLA ``[num_blocks, ...]``) whose every block is one
    contiguous page (vLLM's hybrid layout); ``ValueError`` naming why not (K and V planes
    apart, padded rows)."""
    raw = cache if cache.dtype == torch.uint8 else cache.view(torch.uint8)
    bdim = 1 if raw.dim() == 5 else 0
    blocks = raw.shape[bdim]
    block = raw.select(bdim, 0)
    page = block.numel()
    dims = sorted(((st, n) for st, n in zip(block.stride(), block.shape) if n > 1), reverse=True)
    want = 1
    for st, n in reversed(dims):
        if st != want:
            raise ValueError(
                f"caches: a block of shape {tuple(cache.shape)} strides {tuple(cache.stride())} is not one "
                "contiguous page (its K and V planes lie apart): state pages need vLLM's hybrid layout"
            )
        want *= n
    if blocks > 1 and raw.stride(bdim) < page:
        raise ValueError(f"caches: blocks overlap (block stride {raw.stride(bdim)} bytes < page {page})")
    return torch.as_strided(raw, (blocks, page), (raw.stride(bdim), 1), raw.storage_offset())


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
        positional: the list is positional, one entry per block of tokens (vLLM's prefix-caching
            "align" mode, where the engine's block size is the state group's): the state block
            is the entry of the request's last token, ``(num_tokens - 1) // block_size``.
    """

    layers: tuple[int, ...]
    state: StateSpec
    num_speculative_blocks: int = 0
    positional: bool = False

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
        if not isinstance(self.positional, bool):
            raise ValueError(f"positional: must be a bool, got {self.positional!r}")

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
