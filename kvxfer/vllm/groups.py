"""vLLM's KV cache groups as the connector carries them (no vLLM import; duck-typed).

With the hybrid KV cache manager on (the connector declares ``SupportsHMA``), vLLM 0.32/0.33
hand a connector one block list per KV cache group (``KVCacheConfig.kv_cache_groups``; block
ids ``tuple[list[int], ...]``, null block 0 where a sliding window passed). Source:
docs/research/vllm-hybrid.md §1.2-1.6, §2.

:func:`groups_from_config` reads a ``KVCacheConfig`` into :class:`VllmGroup` descriptions:
full-attention, sliding-window and state groups (``MambaSpec``: Mamba1, Mamba2, GDN, short
conv; their :class:`~kvxfer.groups.state.StateSpec` from :mod:`kvxfer.vllm.state`) are carried
(a request is a set of groups, :mod:`kvxfer.grouped`); every other kind (chunked local attention,
MLA next to other kinds, attention groups of different block sizes, linear attention/KDA, a model
with no attention group) is refused by name, naming the
group and why. A model of one full-attention group keeps the one-list path (None).

:func:`engine_groups` gives the engine's groups (:class:`~kvxfer.groups.attention.AttentionGroup`
and ``StateGroup``). Each sliding group keeps one token more than vLLM's window: a decode server
that loads a whole prompt computes its last token again (vLLM's ``_update_waiting_for_remote_kv``
sets ``num_computed_tokens = num_tokens - 1``), which attends to one token further back than the
next one would. A model with state groups hands off N−1 of N prompt tokens instead
(:mod:`kvxfer.vllm.backoff`): the state holds h(N−1) and the decode server computes token N.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..groups.attention import AttentionGroup
from ..groups.state import ConvLayout, StateSpec
from .state import state_spec_from_vllm

__all__ = [
    "RECOMPUTED_TOKENS",
    "HybridModelUnsupported",
    "VllmGroup",
    "attention_groups",
    "engine_groups",
    "expand_group_ids",
    "groups_from_config",
    "has_state",
]

RECOMPUTED_TOKENS = 1  # tokens of a loaded prompt the decode server computes again


class HybridModelUnsupported(ValueError):
    """The model has a KV cache group kind ``KvxferConnector`` does not carry (chunked local
    attention, linear attention/KDA, ...); the message names
    the group and why. Full-attention, sliding-window and state groups are carried."""


@dataclass(frozen=True)
class VllmGroup:
    """One KV cache group the connector carries.

    ``index``: its position in ``kv_cache_groups`` (and in vLLM's block id tuples);
    ``layer_names``: its layers; ``window``: the sliding window (None: full attention or a
    state group); ``extra_retained_tokens``: vLLM's; ``block_size``: the group's (manager)
    block size; ``state``: a state group's :class:`StateSpec` (None: an attention group);
    ``num_speculative_blocks``: a state group's scratch blocks after its state block;
    ``positional``: a state group's list is positional (prefix caching, vLLM's "align" mode:
    the state lies in the block of the last computed token)."""

    index: int
    layer_names: tuple[str, ...]
    window: int | None
    extra_retained_tokens: int
    block_size: int
    state: StateSpec | None = None
    num_speculative_blocks: int = 0
    positional: bool = False

    @property
    def is_state(self) -> bool:
        """Whether this is a state group (one state page per request and layer)."""
        return self.state is not None

    def describe(self) -> str:
        """``full``, ``sliding <w>`` or the state kind, with the layer count."""
        if self.state is not None:
            kind = self.state.kind.value
        else:
            kind = "full" if self.window is None else f"sliding {self.window}"
        return f"{kind} x{len(self.layer_names)}"


def has_state(groups: Sequence[VllmGroup] | None) -> bool:
    """Whether any of ``groups`` is a state group (the N−1 flow applies)."""
    return any(g.is_state for g in groups or ())


def _kind(spec) -> str:
    return type(spec).__name__


def groups_from_config(
    kv_cache_config,
    model: str = "?",
    *,
    tp_size: int = 1,
    hf_config=None,
    conv_layout: ConvLayout | str = ConvLayout.SD,
    gdn_ssm_transposed: bool = False,
) -> list[VllmGroup] | None:
    """The groups of ``kv_cache_config`` the connector moves (those with
    ``enable_kv_transfer``), or None for a model of one full-attention group (the one-list
    path). :class:`HybridModelUnsupported` names a group that cannot be carried. State groups
    take ``tp_size``, ``hf_config``, ``conv_layout`` and ``gdn_ssm_transposed``
    (:func:`kvxfer.vllm.state.state_spec_from_vllm`)."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    out: list[VllmGroup] = []
    for i, g in enumerate(groups):
        spec = getattr(g, "kv_cache_spec", None)
        kind = _kind(spec)
        if not getattr(g, "enable_kv_transfer", True):
            continue
        names = tuple(getattr(g, "layer_names", ()) or ())
        where = f"model {model}: KV cache group {i} ({kind}, layers {list(names)[:4]}{' ...' if len(names) > 4 else ''})"
        if kind == "SlidingWindowSpec":
            window = int(spec.sliding_window)
            extra = int(getattr(spec, "extra_retained_tokens", 0) or 0)
        elif kind == "FullAttentionSpec" or kind == "MLAAttentionSpec":
            if getattr(spec, "attention_chunk_size", None) and len(groups) > 1:
                raise HybridModelUnsupported(f"{where}: chunked local attention groups are not carried yet")
            window, extra = None, 0
        elif hasattr(spec, "shapes") and hasattr(spec, "dtypes"):  # MambaSpec and kin
            try:
                state = state_spec_from_vllm(
                    spec, len(names), tp_size, hf_config=hf_config, conv_layout=conv_layout,
                    gdn_ssm_transposed=gdn_ssm_transposed,
                )  # fmt: skip
            except ValueError as e:
                raise HybridModelUnsupported(f"{where}: state group not carried: {e}") from None
            nspec = int(getattr(spec, "num_speculative_blocks", 0) or 0)
            bs = int(getattr(spec, "block_size", 0) or 0)
            align = str(getattr(spec, "mamba_cache_mode", "none")) == "align"
            out.append(VllmGroup(i, names, None, 0, bs, state, nspec, align))
            continue
        else:
            raise HybridModelUnsupported(
                f"{where}: this kind of KV cache group is not carried by KvxferConnector (full-attention and "
                "sliding-window groups are)"
            )
        out.append(VllmGroup(i, names, window, extra, int(getattr(spec, "block_size", 0) or 0)))
    if not out:
        return None
    if all(g.is_state for g in out):
        raise HybridModelUnsupported(
            f"model {model}: only state groups, no attention group: not carried (the engine's cache spec "
            "comes from the attention layers)"
        )
    sizes = {g.block_size for g in out if not g.is_state}  # a state group has one block per request
    if len(sizes) > 1:
        raise HybridModelUnsupported(
            f"model {model}: KV cache groups of different block sizes {sorted(sizes)} are not carried yet"
        )
    for g in out:  # a positional state list counts the attention groups' blocks
        if g.positional and sizes and g.block_size not in sizes:
            raise HybridModelUnsupported(
                f"model {model}: KV cache group {g.index} (state, prefix caching on) has blocks of "
                f"{g.block_size} tokens, the attention groups {sorted(sizes)}: not carried"
            )
    if len(out) == 1 and out[0].window is None and not out[0].is_state and len(groups) == 1:
        return None  # one full-attention group: block ids as one list, as before
    if any(_kind(getattr(g, "kv_cache_spec", None)) == "MLAAttentionSpec" for g in groups):
        raise HybridModelUnsupported(
            f"model {model}: MLA in a model of several KV cache groups is not carried yet"
        )
    return out


def attention_groups(
    groups: Sequence[VllmGroup], layer_index: dict[tuple[int, str], int]
) -> list[AttentionGroup]:
    """The engine's groups: each group's layers as indices into the registered caches
    (``layer_index``: (group index, layer name) -> position), a sliding group's window kept
    :data:`RECOMPUTED_TOKENS` longer (see the module doc)."""
    out = []
    for g in groups:
        if g.is_state:
            raise ValueError(f"KV cache group {g.index} is a state group: use engine_groups")
        layers = tuple(layer_index[(g.index, n)] for n in g.layer_names if (g.index, n) in layer_index)
        if g.window is None:
            out.append(AttentionGroup(layers))
        else:
            out.append(AttentionGroup(layers, g.window, g.extra_retained_tokens + RECOMPUTED_TOKENS))
    return out


def engine_groups(groups: Sequence[VllmGroup], layer_index: dict[tuple[int, str], int]) -> list:
    """The engine's groups in vLLM's group order: :func:`attention_groups` for attention groups,
    a ``StateGroup`` (its layers' indices, its :class:`StateSpec` and scratch block count) for
    each state group."""
    out: list = []
    for g in groups:
        if g.is_state:
            from ..groups import StateGroup  # the engine's state groups

            layers = tuple(layer_index[(g.index, n)] for n in g.layer_names if (g.index, n) in layer_index)
            out.append(StateGroup(layers, g.state, g.num_speculative_blocks, g.positional))
        else:
            out.extend(attention_groups([g], layer_index))
    return out


def expand_group_ids(block_ids, ratio: int, null_block: int = 0) -> list[int]:
    """One group's manager block ids -> kernel block ids (``ratio`` kernel blocks each), a null
    manager block staying null in every kernel position; the identity for ``ratio == 1``."""
    if ratio == 1:
        return list(block_ids)
    ids = np.asarray(block_ids, dtype=np.int64)
    out = ids[:, None] * ratio + np.arange(ratio)
    out[ids == null_block] = null_block
    return out.reshape(-1).tolist()
