"""A request as a set of groups (attention and state): its block ids per group, checked, and the
per-group items the load planner plans.

An engine registered with groups (:class:`kvxfer.groups.attention.GroupSet`) takes, for every
request, one positional block list per group (vLLM's ``tuple[list[int], ...]``: entry ``i``
covers tokens ``[i*block_size, (i+1)*block_size)``). Of each list only the *live* positions
move: all of a full-attention group's, a sliding group's from the block of its window's first
token on (:meth:`~kvxfer.groups.attention.AttentionGroup.live_first`); the dead positions may
hold the null block, the live ones may not. A state group's list is vLLM's for that group: its
one live id is the running state block (:func:`kvxfer.groups.blocks.state_block`), whose page
moves whole (:mod:`kvxfer.groups.state_group`).

On the exporter the live ids of every group, concatenated in group order, are the export's
block ids (one lease, one refcount and epoch per block over the union: the groups draw from one
pool, so no id repeats across them), and the params carry how many belong to each group
(``groups``); the token and digest bind both (:func:`kvxfer.auth.content_digest`). On the loader
:func:`load_ids` checks the destination lists the same way and :func:`group_items` makes one
:class:`~kvxfer.batching.Item` per group (positional ids on both sides, the leading dead
positions never read: the item's ``first`` skips them); a state group's item is its one block
on each side, all ``block_size`` tokens of it.
"""

from __future__ import annotations

from collections.abc import Container, Sequence

import numpy as np
import torch

from .batching import Item
from .engine_types import check_block_ids
from .groups.attention import GroupSet
from .groups.blocks import state_block

__all__ = ["export_ids", "group_items", "load_ids"]


def _lists(gs: GroupSet, block_ids) -> list[np.ndarray]:
    """One int64 array per group from ``block_ids`` (a list or tuple of per-group lists,
    arrays or tensors); ``ValueError`` naming ``block_ids`` otherwise."""
    if not isinstance(block_ids, (list, tuple)) or len(block_ids) != len(gs):
        got = len(block_ids) if isinstance(block_ids, (list, tuple)) else type(block_ids).__name__
        raise ValueError(
            f"block_ids: an engine with {len(gs)} KV cache groups takes one block list per group "
            f"(a list or tuple of {len(gs)}), got {got}"
        )
    out = []
    for i, ids in enumerate(block_ids):
        if isinstance(ids, torch.Tensor):
            ids = ids.detach().cpu().numpy()
        arr = np.asarray(ids)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise ValueError(
                f"block_ids[{i}]: must be a 1-D list of ints, got {arr.dtype} {tuple(arr.shape)}"
            )
        out.append(arr.astype(np.int64, copy=False))
    return out


def _state_id(gs: GroupSet, g: int, arr: np.ndarray, num_tokens: int, block_size: int) -> np.ndarray:
    """A state group's running state block (:func:`kvxfer.groups.blocks.state_block`; a
    positional list: the entry of token ``num_tokens - 1``) as a 1-element array;
    ``ValueError`` naming the group."""
    grp = gs.groups[g]
    at = (num_tokens - 1) // block_size if grp.positional else None
    try:
        b = state_block(arr, grp.num_speculative_blocks, gs.null_block, at)
    except ValueError as e:
        raise ValueError(f"block_ids[{g}] ({grp.describe()}): {str(e).removeprefix('block_ids: ')}") from None
    return np.array([b], dtype=np.int64)


def _live(
    gs: GroupSet,
    lists: list[np.ndarray],
    firsts: list[int],
    need: int,
    block_size: int,
    num_blocks: int,
    num_tokens: int,
):
    """Each attention group's ids at positions ``[firsts[g] // block_size, need)`` and each
    state group's state block, checked: enough of them, no null block among them, and over all
    groups together in range with no id repeated. Returns (the live arrays, their
    concatenation)."""
    live = []
    for g, (arr, first) in enumerate(zip(lists, firsts)):
        if gs.whole[g]:
            live.append(_state_id(gs, g, arr, num_tokens, block_size))
            continue
        if arr.size < need:
            raise ValueError(
                f"block_ids[{g}]: {gs.groups[g].describe()} needs {need} blocks of {block_size} tokens, "
                f"got {arr.size}"
            )
        part = arr[first // block_size : need]
        if gs.null_block is not None:
            bad = np.flatnonzero(part == gs.null_block)
            if bad.size:
                pos = first // block_size + int(bad[0])
                raise ValueError(
                    f"block_ids[{g}]: position {pos} holds the null block ({gs.null_block}) but holds "
                    f"tokens the request still needs ({gs.groups[g].describe()}, tokens [{first}, ...))"
                )
        live.append(part)
    flat = np.concatenate(live)
    try:
        ids = check_block_ids(flat, flat.size, num_blocks, str(flat.size), unique=True)
    except ValueError as e:
        raise ValueError(
            f"{e} (over the live blocks of all {len(gs)} groups, which share one pool)"
        ) from None
    return live, ids


def export_ids(
    gs: GroupSet, block_ids, num_tokens: int, block_size: int, num_blocks: int, computed: int | None = None
) -> tuple[np.ndarray, list[int]]:
    """The export's block ids (int64, every group's live ids in group order) and the count per
    group, from one positional list per group; ``ValueError`` naming the group and position of
    a missing, null, repeated or out-of-range id. ``computed``: the tokens the windows end at
    (default ``num_tokens``; less when whole blocks are moved past the last computed token)."""
    lists = _lists(gs, block_ids)
    need = -(-num_tokens // block_size)
    end = num_tokens if computed is None else computed
    firsts = [g.live_first(end) for g in gs.groups]
    live, ids = _live(gs, lists, firsts, need, block_size, num_blocks, num_tokens)
    return ids, [int(p.size) for p in live]


def load_ids(
    gs: GroupSet,
    block_ids,
    num_tokens: int,
    first: int,
    block_size: int,
    num_blocks: int,
    computed: int | None = None,
) -> tuple[np.ndarray, list[tuple[np.ndarray, int]]]:
    """A load's destination blocks: (every group's written ids concatenated, int64; per group
    (its positional ids for the request's ``ceil(num_tokens / block_size)`` positions, the
    first token it needs)). A group needs tokens from ``max(first, its live first)`` on (the
    window measured at ``computed``, default ``num_tokens``) and is written from the start of
    that token's block (:func:`group_items`); positions before are never written (their
    entries are zeroed here)."""
    lists = _lists(gs, block_ids)
    need = -(-num_tokens // block_size)
    end = num_tokens if computed is None else computed
    firsts = [max(first, g.live_first(end)) for g in gs.groups]
    live, ids = _live(gs, lists, firsts, need, block_size, num_blocks, num_tokens)
    per = []
    for g, (arr, f) in enumerate(zip(lists, firsts)):
        if gs.whole[g]:
            per.append((live[g], 0))  # the state block, written whole
            continue
        pos = np.array(arr[:need], dtype=np.int64)
        pos[: f // block_size] = 0
        per.append((pos, f))
    return ids, per


def group_items(
    gs: GroupSet,
    request_id: str,
    src_ids: np.ndarray,
    sizes: Sequence[int] | None,
    num_tokens: int,
    per_group: list[tuple[np.ndarray, int]],
    src_block_size: int,
    dst_block_size: int,
    resharded: Container[int] = (),
) -> list[Item] | str:
    """One planner item per group of a load: the exporter's live ids (``src_ids`` split by the
    params' ``sizes``: a group's are its last positions) placed at their positions for
    ``src_block_size``, the destination's positional ids (``per_group``, :func:`load_ids`).
    A group moves from the start of the destination block holding the first token it needs
    (whole blocks where a window starts inside one: their earlier tokens are the request's
    own on both sides), or from the exporter's first live token if that is later. Returns why
    not (a str) when the params' groups do not fit this engine's, or the exporter's live
    blocks do not hold every token a group needs. ``resharded``: the state groups copied unit
    by unit (their item names the two state blocks, ``num_tokens`` 0: no planner call)."""
    if sizes is None:
        return f"params.groups: missing; this engine has {len(gs)} KV cache groups"
    if len(sizes) != len(gs):
        return f"params.groups: {len(sizes)} groups, this engine has {len(gs)}"
    need = -(-num_tokens // src_block_size)
    out: list[Item] = []
    at = 0
    for g, (grp, n, (dst, needed)) in enumerate(zip(gs.groups, sizes, per_group)):
        if gs.whole[g]:
            if n != 1:
                return f"params.groups[{g}]: {n} block ids, {grp.describe()} moves its one state block"
            if g in resharded:  # copied unit by unit (kvxfer.groups.state_group.StateRoute)
                out.append(Item(request_id, src_ids[at : at + 1].copy(), dst, 0, 0, 0))
                at += 1
                continue
            if src_block_size != dst_block_size:
                return (
                    f"{grp.describe()}: state pages move whole only between equal block sizes "
                    f"(the exporter's {src_block_size}, this engine's {dst_block_size})"
                )
            out.append(Item(request_id, src_ids[at : at + 1].copy(), dst, dst_block_size, 0, 0))
            at += 1
            continue
        if n > need:
            return f"params.groups[{g}]: {n} block ids, {num_tokens} tokens fill {need} blocks of {src_block_size}"
        start = (need - n) * src_block_size  # the exporter's first live token
        if start > needed:
            return (
                f"params.groups[{g}]: the exporter holds tokens [{start}, {num_tokens}) of {grp.describe()}, "
                f"this load needs them from token {needed}"
            )
        first = max(start, needed // dst_block_size * dst_block_size)
        src = np.zeros(need, dtype=np.int64)
        src[need - n :] = src_ids[at : at + n]
        at += n
        out.append(Item(request_id, src, dst, num_tokens, 0, first))
    if at != src_ids.size:
        return f"params.groups: count {at} block ids, params.block_ids has {src_ids.size}"
    return out
