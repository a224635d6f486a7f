"""One export's record as the export tracker keeps it (:mod:`kvxfer.exports`), what it opens to a
loader (:func:`spans`), and how a notification or done mark counts toward its release
(:func:`counted`)."""

from __future__ import annotations

import numpy as np

__all__ = ["ExportRecord", "counted", "spans"]


class ExportRecord:
    """One live export of :class:`~kvxfer.exports.ExportTracker` without the control module (a
    plain slotted class: a dataclass's default factories are calls of their own, paid per
    ``export()``); with it, the module's ``ExportRecord`` its ``ExportBook`` makes
    (``csrc/ctl/export_book.h``), which has these attributes (and ``slot``)."""

    __slots__ = (
        "block_ids",
        "deadline",
        "digest",
        "gates",
        "gen",
        "groups",
        "marked",
        "notified_by",
        "num_tokens",
        "token",
    )

    def __init__(
        self,
        block_ids: np.ndarray,
        num_tokens: int,
        deadline: float,
        token: str = "",
        digest: bytes = b"",
        gen: int = 0,
        groups: tuple[int, ...] | None = None,
    ) -> None:
        self.block_ids = block_ids  # int64 [n]
        self.groups = groups  # ids per KV cache group (kvxfer.grouped), None: one group
        self.num_tokens = num_tokens
        self.deadline = deadline
        self.notified_by: dict[int, set] = {}  # expected count -> the senders counted toward it
        self.marked: np.ndarray | None = None  # layer-wise export: layers marked ready (None: all)
        self.gates: list = []  # (layers bool mask, events) of marked groups
        self.token = token  # the export's auth token (kvxfer.auth), kept to verify messages cheaply
        self.digest = digest  # kvxfer.auth.content_digest of (num_tokens, block_ids)
        self.gen = gen  # the export's generation of its request id (kvxfer.auth: the token's nonce)


def spans(e, block_size: int, whole: tuple[bool, ...] = ()) -> list[tuple[np.ndarray, int]]:
    """``(block ids, num_tokens)`` of export ``e`` (a record of :meth:`kvxfer.exports.ExportTracker.lookup`)
    whose blocks each start at a block's first token and whose last block holds the export's
    partial tail (what :func:`kvxfer.entitlement.allowed_prefixes` reads): the export itself, or
    for a request of several groups each group's live blocks (which end at the same token as the
    request); a group marked in ``whole`` (a state group:
    :attr:`kvxfer.groups.attention.GroupSet.whole`) opens its blocks whole."""
    if e.groups is None:
        return [(e.block_ids, e.num_tokens)]
    out = []
    at = 0
    need = -(-e.num_tokens // block_size)
    for g, n in enumerate(e.groups):
        if g < len(whole) and whole[g]:
            out.append((e.block_ids[at : at + n], n * block_size))
            at += n
            continue
        # a group's live blocks are its last n positions: seen from position need - n
        out.append((e.block_ids[at : at + n], e.num_tokens - (need - n) * block_size))
        at += n
    return out


def counted(e: ExportRecord, sender, expected: int) -> bool:
    """Count one notification (or done mark) of loader rank ``sender`` for export ``e``, whose
    plan expects ``expected`` of them; True when this one completed the count. A sender counts
    once: its repeats (a retried message, one message naming the request twice) return False,
    so an export is released, and reported, once whatever arrives.

    Senders are counted per expected count (per loader layout): the first message does not fix
    the count for the others. Else a token holder claiming another loader TP size (a rank of a
    4-rank loader: 4 expected) before the real loader's rank notified would leave that one's
    notification counted against 4, and the export leased for as long as anyone renewed it."""
    by = e.notified_by
    seen = by.get(expected)
    if seen is None:
        seen = by[expected] = set()
    if sender in seen:
        return False
    seen.add(sender)
    return len(seen) >= expected
