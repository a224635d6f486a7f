"""vLLM's KV cache groups as the connector carries them (no vLLM import; duck-typed).

With the hybrid KV cache manager on (the connector declares ``SupportsHMA``), vLLM 0.32/0.33
hand a connector one block list per KV cache group (``KVCacheConfig.kv_cache_groups``; block
ids ``tuple[list[int], ...]``, null block 0 where a sliding window passed). Source:
docs/research/vllm-hybrid.md §1.2-1.6, §2.

:func:`groups_from_config` reads a ``KVCacheConfig`` into :class:`VllmGroup` descriptions:
full-attention and sliding-window groups are carried (a request is a set of groups,
:mod:`kvxfer.grouped`); every other kind (Mamba/GDN/short-conv state, chunked local attention,
MLA next to other kinds, different block sizes) is refused by name, naming the group and why.
A model of one full-attention group keeps the one-list path (None).

:func:`attention_groups` gives the engine's :class:`~kvxfer.groups.attention.AttentionGroup`
list. Each sliding group keeps one token more than vLLM's window: a decode server that loads a
whole prompt computes its last token again (vLLM's ``_update_waiting_for_remote_kv`` sets
``num_computed_tokens = num_tokens - 1``), which attends to one token further back than the
next one would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..groups.attention import AttentionGroup

__all__ = [
    "RECOMPUTED_TOKENS",
    "HybridModelUnsupported",
    "VllmGroup",
    "attention_groups",
    "expand_group_ids",
    "groups_from_config",
]

RECOMPUTED_TOKENS = 1  # tokens of a loaded prompt the decode server computes again


class HybridModelUnsupported(ValueError):
    """The model has a KV cache group kind ``KvxferConnector`` does not carry (state groups:
    Mamba, GDN, short conv; chunked local attention; ...); the message names the group and
    why. Full-attention and sliding-window groups are carried."""


@dataclass(frozen=True)
class VllmGroup:
    """One KV cache group the connector carries.

    ``index``: its position in ``kv_cache_groups`` (and in vLLM's block id tuples);
    ``layer_names``: its layers; ``window``: the sliding window (None: full attention);
    ``extra_retained_tokens``: vLLM's; ``block_size``: the group's (manager) block size."""

    index: int
    layer_names: tuple[str, ...]
    window: int | None
    extra_retained_tokens: int
    block_size: int


def _kind(spec) -> str:
    return type(spec).__name__


def groups_from_config(kv_cache_config, model: str = "?") -> list[VllmGroup] | None:
    """The groups of ``kv_cache_config`` the connector moves (those with
    ``enable_kv_transfer``), or None for a model of one full-attention group (the one-list
    path). :class:`HybridModelUnsupported` names a group that cannot be carried."""
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
            raise HybridModelUnsupported(
                f"{where}: a state group (Mamba/GDN/short-conv: one state page per request and layer) is not "
                "carried by KvxferConnector yet; only full-attention and sliding-window groups are"
            )
        else:
            raise HybridModelUnsupported(
                f"{where}: this kind of KV cache group is not carried by KvxferConnector (full-attention and "
                "sliding-window groups are)"
            )
        out.append(VllmGroup(i, names, window, extra, int(getattr(spec, "block_size", 0) or 0)))
    if not out:
        return None
    sizes = {g.block_size for g in out}
    if len(sizes) > 1:
        raise HybridModelUnsupported(
            f"model {model}: KV cache groups of different block sizes {sorted(sizes)} are not carried yet"
        )
    if len(out) == 1 and out[0].window is None and len(groups) == 1:
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
        layers = tuple(layer_index[(g.index, n)] for n in g.layer_names if (g.index, n) in layer_index)
        if g.window is None:
            out.append(AttentionGroup(layers))
        else:
            out.append(AttentionGroup(layers, g.window, g.extra_retained_tokens + RECOMPUTED_TOKENS))
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
