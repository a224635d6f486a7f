"""What a send request may read: the tokens of the exports its tokens open, nothing else.

An exporter serves a loader's ``SendReq`` (``pg``, staged ``nixl``) by gathering the ops calls
the loader names. Before it queues the stream it checks every call against the exports that
the request's tokens opened (:mod:`kvxfer.auth`): each source token a call reads must be one
of tokens ``[0, num_tokens)`` of one of those exports, in its own block. So a loader that holds
one request's params cannot make the exporter send another request's blocks, blocks nobody
exported (another tenant's old KV) or the unused tail of a partial last block.

Every export readable from a block starts at the block's first token, so what may be read of
a block is a prefix ``[0, n)``: the longest of the opened exports holding it. A call reads
through one of the exporter's views (:mod:`kvxfer.batching`): whole blocks (unit =
block size, optionally every block seen from ``offset`` on), or token slots (unit 1,
``block * block_size + token``). One vectorised pass per call, no per-block Python.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["allowed_prefixes", "call_refusal"]


def allowed_prefixes(
    exports: Sequence[tuple[np.ndarray, int]], block_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """The blocks of ``exports`` (``(block_ids int64, num_tokens)`` each) and how many leading
    tokens of each may be read: (sorted unique block ids, readable tokens per block), both int64."""
    if not exports:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    blocks = np.concatenate([ids for ids, _ in exports])
    lens = np.full(blocks.size, block_size, dtype=np.int64)
    end = 0
    for ids, n in exports:  # the last block of each export holds its partial tail
        end += ids.size
        lens[end - 1] = n - (ids.size - 1) * block_size
    order = np.lexsort((lens, blocks))  # by block, then by length: the longest prefix last
    blocks, lens = blocks[order], lens[order]
    last = np.ones(blocks.size, dtype=bool)
    last[:-1] = blocks[1:] != blocks[:-1]
    return blocks[last], lens[last]


def call_refusal(
    blocks: np.ndarray,
    lens: np.ndarray,
    ids: np.ndarray,
    num_tokens: int,
    offset: int,
    unit: int,
    block_size: int,
) -> str:
    """Why one call (source unit ``ids``, ``num_tokens``, token ``offset`` into each block,
    ``unit`` tokens per id) reads something not readable by ``(blocks, lens)``
    (:func:`allowed_prefixes`); "" when every token it reads is."""
    if unit == 1 and block_size != 1:  # token slots
        if offset:
            return f"a call of token slots has offset {offset}"
        if ids.size != num_tokens:
            return f"a call of token slots names {ids.size} slots for {num_tokens} tokens"
        if ids.size and int(ids.min()) < 0:
            return "a call names a negative token slot"
        rows, end = ids // block_size, ids % block_size + 1
    elif unit == block_size:
        if not 0 <= offset < block_size:
            return f"offset {offset} is not inside a block of {block_size} tokens"
        per = block_size - offset  # tokens of one block the call reads (its view's block size)
        k = ids.size
        if num_tokens < 1 or k != -(-num_tokens // per):
            return f"a call names {k} blocks for {num_tokens} tokens (from token {offset} of each)"
        if int(ids.min()) < 0:
            return "a call names a negative block id"
        rows = ids
        end = np.full(k, offset + per, dtype=np.int64)
        end[-1] = offset + num_tokens - (k - 1) * per
    else:
        return f"unit {unit} is neither a block ({block_size} tokens) nor a token slot"
    if not rows.size:
        return ""
    at = np.minimum(np.searchsorted(blocks, rows), max(blocks.size - 1, 0))
    if not blocks.size:
        ok = np.zeros(rows.size, dtype=bool)
    else:
        ok = (blocks[at] == rows) & (end <= lens[at])
    if ok.all():
        return ""
    i = int(np.flatnonzero(~ok)[0])
    return (
        f"the call reads tokens up to {int(end[i])} of block {int(rows[i])}, which no export "
        "these tokens open holds (its requests hold other blocks, or fewer tokens of it)"
    )
