"""Which blocks of a request's group block list move: the in-window blocks of a sliding-window
group, and the running state block of a state group.

vLLM (0.32/0.33) keeps one block list per KV cache group, positional: entry ``i`` of an attention
group covers tokens ``[i*block_size, (i+1)*block_size)``. A sliding-window group replaces the
blocks its window has passed with the *null block* (block id 0, never a request's own): after
``c`` computed tokens the next token attends to tokens ``[c - window + 1, c]``, so tokens before
``c - window + 1 - extra_retained_tokens`` are dead and the blocks holding only them may be
null (``SlidingWindowManager.get_num_skipped_tokens``). A state group's list is its running
state block, then ``num_speculative_blocks`` scratch blocks (``clip_ssm_state_blocks``: the
last non-speculative entry; in prefix-caching "align" mode the list is positional and the
earlier entries are null or stale). Sources: ``docs/research/vllm-hybrid.md`` §2, §3.6, §4.2.

Moving a sliding-window group moves exactly the tokens ``[first_token, num_tokens)`` the next
token needs. Block sizes may differ between the two sides, so the window starts inside a
block on either side: :class:`WindowBlocks` gives both sides' in-window block ids and the
token slots of the window's tokens (``block_id * block_size + offset``) for the ops on caches
registered with ``token_slots`` (:func:`kvxfer.ops.register_caches`), and, when some token at
or before the window's first is block-aligned on both sides and covered by real blocks on
both, the block-id form for the plain ops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..paged import int_array

__all__ = ["NULL_BLOCK", "WindowBlocks", "select_window_blocks", "state_block", "window_tokens"]

NULL_BLOCK = 0  # vLLM's null block (BlockPool: the pool's first block, never a request's own)


def _check_int(field: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{field}: must be an int >= {low}, got {value!r}")
    return int(value)


def _ids(block_ids, what: str) -> np.ndarray:
    """Block ids as int64 (:func:`kvxfer.paged.int_array`), none negative (no cache bound here)."""
    arr = int_array(block_ids, what)
    if arr.size and int(arr.min()) < 0:
        raise ValueError(f"{what}: negative block id {int(arr.min())}")
    return arr


def window_tokens(num_tokens: int, window: int, extra_retained_tokens: int = 0) -> range:
    """The tokens of a request with ``num_tokens`` computed tokens that the next token attends
    to through a sliding window of ``window`` tokens (the last ``window - 1``, plus
    ``extra_retained_tokens`` vLLM keeps): ``range(max(0, num_tokens - window + 1 - extra),
    num_tokens)``."""
    n = _check_int("num_tokens", num_tokens, 0)
    w = _check_int("window", window, 1)
    extra = _check_int("extra_retained_tokens", extra_retained_tokens, 0)
    return range(max(0, n - w + 1 - extra), n)


@dataclass(frozen=True)
class WindowBlocks:
    """The in-window part of one sliding-window group of one request, on both sides.

    ``first_token``..``num_tokens``: the tokens that move (:func:`window_tokens`).
    ``src_first_block`` / ``dst_first_block``: position in each side's block list of the block
    holding ``first_token``; ``src_block_ids`` / ``dst_block_ids``: that side's blocks from
    there to the block of the last token (int64, none null, no repeats).
    ``aligned_start``: the latest token ``<= first_token`` at a block start on both sides whose
    blocks from there on are real (not null, distinct) on both, or None when there is none
    (then only the token slots can carry the window); ``src_aligned_ids`` /
    ``dst_aligned_ids``: each side's blocks from there (empty without one); see
    :meth:`src_aligned` / :meth:`dst_aligned`.
    """

    first_token: int
    num_tokens: int
    src_block_size: int
    dst_block_size: int
    src_first_block: int
    dst_first_block: int
    src_block_ids: np.ndarray
    dst_block_ids: np.ndarray
    aligned_start: int | None
    src_aligned_ids: np.ndarray
    dst_aligned_ids: np.ndarray

    @property
    def num_window_tokens(self) -> int:
        """Tokens that move: ``num_tokens - first_token``."""
        return self.num_tokens - self.first_token

    def _slots(self, ids: np.ndarray, first_block: int, block_size: int) -> torch.Tensor:
        t = np.arange(self.first_token, self.num_tokens, dtype=np.int64)
        blocks = ids[t // block_size - first_block]
        return torch.from_numpy(blocks * block_size + t % block_size)

    def src_slots(self) -> torch.Tensor:
        """Source token slots (``block * src_block_size + offset``) of tokens ``[first_token,
        num_tokens)``, int64 ``[num_window_tokens]``."""
        return self._slots(self.src_block_ids, self.src_first_block, self.src_block_size)

    def dst_slots(self) -> torch.Tensor:
        """Destination token slots of the same tokens, int64 ``[num_window_tokens]``."""
        return self._slots(self.dst_block_ids, self.dst_first_block, self.dst_block_size)

    def src_aligned(self) -> tuple[np.ndarray, int]:
        """(source block ids from ``aligned_start``, tokens from there to ``num_tokens``): the
        plain ops' ``block_ids`` and ``num_tokens``. ``ValueError`` when there is no aligned
        start."""
        return self._aligned(self.src_aligned_ids)

    def dst_aligned(self) -> tuple[np.ndarray, int]:
        """(destination block ids from ``aligned_start``, tokens from there), as
        :meth:`src_aligned`."""
        return self._aligned(self.dst_aligned_ids)

    def _aligned(self, ids: np.ndarray) -> tuple[np.ndarray, int]:
        if self.aligned_start is None:
            raise ValueError(
                f"window: no token at or before {self.first_token} starts a block on both sides "
                f"(block sizes {self.src_block_size} and {self.dst_block_size}) with real blocks "
                "from there; move the window by token slots"
            )
        return ids, self.num_tokens - self.aligned_start


def _live(ids: np.ndarray, first: int, num_tokens: int, block_size: int, null_block, what: str) -> np.ndarray:
    """The side's block ids at positions ``[first // block_size, ceil(num_tokens/block_size))``,
    checked: enough of them, none null, no repeats."""
    start, end = first // block_size, -(-num_tokens // block_size)
    if ids.size < end:
        raise ValueError(
            f"{what}: {num_tokens} tokens need {end} blocks of {block_size}, the list has {ids.size}"
        )
    live = ids[start:end]
    if null_block is not None:
        bad = np.nonzero(live == null_block)[0]
        if bad.size:
            raise ValueError(
                f"{what}: position {start + int(bad[0])} holds the null block ({null_block}) but holds "
                f"in-window tokens (the window is tokens [{first}, {num_tokens}))"
            )
    srt = np.sort(live)
    dup = srt[1:] == srt[:-1]
    if dup.any():
        raise ValueError(f"{what}: repeated block id {int(srt[1:][dup][0])} among the in-window blocks")
    return np.ascontiguousarray(live)


def select_window_blocks(
    src_block_ids,
    dst_block_ids,
    num_tokens: int,
    window: int,
    src_block_size: int,
    dst_block_size: int,
    extra_retained_tokens: int = 0,
    null_block: int | None = NULL_BLOCK,
) -> WindowBlocks:
    """The in-window blocks of one request's sliding-window group on both sides.

    Args:
        src_block_ids, dst_block_ids: each side's positional block list of the group (vLLM's,
            null blocks included; the destination's may be longer than the tokens need).
        num_tokens: tokens the source computed (what moves ends there).
        window: the group's sliding window (tokens, the current one included).
        src_block_size, dst_block_size: tokens per block on each side.
        extra_retained_tokens: tokens vLLM keeps beyond the window (its ``SlidingWindowSpec``).
        null_block: the id standing for a dead block (vLLM: 0); an in-window position holding
            it is refused. None: no such id.

    Raises ``ValueError`` naming the side and position of a null, repeated or missing
    in-window block.
    """
    bs_src = _check_int("src_block_size", src_block_size, 1)
    bs_dst = _check_int("dst_block_size", dst_block_size, 1)
    tokens = window_tokens(num_tokens, window, extra_retained_tokens)
    first, n = tokens.start, tokens.stop
    if null_block is not None:
        null_block = _check_int("null_block", null_block, 0)
    src = _ids(src_block_ids, "src_block_ids")
    dst = _ids(dst_block_ids, "dst_block_ids")
    src_live = _live(src, first, n, bs_src, null_block, "src_block_ids")
    dst_live = _live(dst, first, n, bs_dst, null_block, "dst_block_ids")
    # Aligned start: the latest multiple of both block sizes at or before the window's first
    # token (an earlier one only adds positions), usable when both lists hold real, distinct
    # blocks from there on (their tokens before the window are the request's own, moved spare).
    aligned = (first // math.lcm(bs_src, bs_dst)) * math.lcm(bs_src, bs_dst)
    src_al = _extend(src, src_live, aligned, first, bs_src, null_block)
    dst_al = _extend(dst, dst_live, aligned, first, bs_dst, null_block)
    ok = src_al is not None and dst_al is not None
    empty = np.zeros(0, dtype=np.int64)
    return WindowBlocks(
        first_token=first,
        num_tokens=n,
        src_block_size=bs_src,
        dst_block_size=bs_dst,
        src_first_block=first // bs_src,
        dst_first_block=first // bs_dst,
        src_block_ids=src_live,
        dst_block_ids=dst_live,
        aligned_start=aligned if ok else None,
        src_aligned_ids=src_al if ok else empty,
        dst_aligned_ids=dst_al if ok else empty,
    )


def _extend(ids: np.ndarray, live: np.ndarray, start: int, first: int, block_size: int, null_block):
    """The side's ids from token ``start`` on (its in-window ids after the blocks between), or
    None when one of those blocks is null or repeats an id."""
    extra = ids[start // block_size : first // block_size]
    if null_block is not None and (extra == null_block).any():
        return None
    out = np.concatenate([extra, live])
    if np.unique(out).size != out.size:
        return None
    return np.ascontiguousarray(out)


def state_block(
    block_ids,
    num_speculative_blocks: int = 0,
    null_block: int | None = NULL_BLOCK,
    position: int | None = None,
) -> int:
    """The running state block of a request's state-group block list: the last entry before the
    ``num_speculative_blocks`` scratch blocks (vLLM's ``clip_ssm_state_blocks``; in "none" mode
    the list's first entry), or with ``position`` the entry there (vLLM's "align" mode: the
    list is positional and the state lies in the block of the last computed token,
    ``(num_computed_tokens - 1) // block_size``, which on a decode server that allocated for
    more tokens is not the last entry). ``ValueError`` when the list is too short or that entry
    is the null block."""
    ids = _ids(block_ids, "block_ids")
    spec = _check_int("num_speculative_blocks", num_speculative_blocks, 0)
    if ids.size < spec + 1:
        raise ValueError(
            f"block_ids: {ids.size} entries, a state group's list holds its state block and "
            f"{spec} speculative blocks"
        )
    at = ids.size - 1 - spec if position is None else _check_int("position", position, 0)
    if at > ids.size - 1 - spec:
        raise ValueError(
            f"block_ids: {ids.size} entries ({spec} speculative), the state of the last computed token "
            f"lies at position {at}"
        )
    block = int(ids[at])
    if null_block is not None and block == null_block:
        raise ValueError(f"block_ids: the state block (position {at}) is the null block ({null_block})")
    return block
