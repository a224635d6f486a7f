"""One export's record as the export tracker keeps it (:mod:`kvxfer.exports`), what it opens to a
loader (:func:`spans`), how a request's token and digest are checked against it
(:func:`verified`), and how a notification or done mark counts toward its release
(:func:`counted`)."""

from __future__ import annotations

import hmac
import itertools
from collections.abc import Callable

import numpy as np

from .auth import UNAUTHORIZED

__all__ = ["ALTERED", "MAX_FORGED", "OTHER_EXPORT", "ExportRecord", "Verify", "counted", "spans", "verified"]

ALTERED = "refused: the block ids, num_tokens or groups of the params differ from the export's (altered or sliced params)"
OTHER_EXPORT = "refused: the params are of another export of this request id (an earlier, released one)"
# Tokens of one message whose MAC is computed and fails (forged, or of another engine) before the
# rest of its ids that are not live here are refused without one: a message of made-up ids costs
# this many MACs, not one per id (an authentic message fails none).
MAX_FORGED = 16

Verify = Callable[[str, object, object], bool]  # kvxfer.auth.EngineSecret.verify


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


def verified(
    live: dict,
    request_ids: list[str],
    tokens: list | None,
    verify: Verify | None,
    bad: dict,
    digests: list | None = None,
) -> list[tuple[str, ExportRecord | None]]:
    """``(request id, its record in live or None)`` for each of ``request_ids`` whose token
    verifies (all of them when ``tokens`` is None); the others go into ``bad`` with why.

    A live export verifies with exactly its own token (:func:`~kvxfer.auth.tokens_match`'s
    test, inline: one loop per message, no call per request) and, where ``digests`` are
    given, its own content digest (else :data:`ALTERED`). A request not live here is
    checked with ``verify(request_id, token, digest)`` (:meth:`kvxfer.auth.EngineSecret.verify`)
    when a digest came with it, so an unknown request is told apart from a forged one; with
    no digest (notifications, heartbeats: they act on live exports only) it passes as not
    live. An authentic token of another export of a live request id is
    :data:`OTHER_EXPORT`. Once :data:`MAX_FORGED` tokens of the call failed ``verify``, the
    rest that would need it are refused unverified. A token that is not ASCII (no token
    is) is refused. Call under the tracker's lock."""
    if tokens is None:
        return [(rid, live.get(rid)) for rid in request_ids]
    out = []
    eq = hmac.compare_digest  # raises for a str that is not ASCII: those are refused first
    forged = 0
    for rid, tok, dg in zip(request_ids, tokens, digests if digests is not None else _NONES(request_ids)):
        e = live.get(rid)
        if e is not None and type(tok) is str and tok.isascii() and eq(e.token, tok):
            if dg is None or dg == e.digest:
                out.append((rid, e))
            else:
                bad[rid] = ALTERED
        elif dg is None:
            if e is None:
                out.append((rid, None))
            else:
                bad[rid] = UNAUTHORIZED
        elif verify is not None and forged < MAX_FORGED:
            if verify(rid, tok, dg):
                if e is None:
                    out.append((rid, None))
                else:
                    bad[rid] = OTHER_EXPORT
            else:
                forged += 1
                bad[rid] = UNAUTHORIZED
        else:
            bad[rid] = UNAUTHORIZED
    return out


def _NONES(request_ids: list) -> itertools.repeat:
    return itertools.repeat(None, len(request_ids))
