"""A rank's caches as the ops address them: registered once, in each unit an id may name.

An ops call names tokens by ids of one *unit*: block ids (``unit = block_size``) or token slots
(``unit = 1``: one id per token, ``block * block_size + offset``), which lets requests that end
inside a block share one call. :class:`CacheViews` registers a rank's caches
(:func:`kvxfer.paged.register_caches`, checked once) in every unit they can be addressed in,
coarsest first, and keeps the *offset views* a partial load that starts inside a block is
addressed through (each block seen from token ``o`` on: ``narrow`` views, no copy), made on
first use. Both ends of a transfer use it: the loader for its own caches and for an exporter's
caches it mapped (``ipc``), the exporter for the gathers of a stream.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .backends.dma import PathStats, check_max_sms
from .paged import PagedCache, register_caches
from .spec import KVCacheSpec, Layout

_LOG = logging.getLogger(__name__)

__all__ = ["CacheView", "CacheViews", "cache_views", "offset_view", "unit_view", "view_at"]

_OFFSET_VIEWS_MAX = 256  # offset views kept per registration (at most lcm / gcd of two block sizes each)


@dataclass(frozen=True)
class CacheView:
    """One way to address a rank's caches in an ops call: ``unit`` tokens per id.

    ``caches`` is a :class:`kvxfer.paged.PagedCache` (validated once: ops calls skip the
    per-layer checks), ``spec`` its spec.
    """

    caches: Sequence[torch.Tensor]
    spec: KVCacheSpec
    unit: int


def cache_views(
    caches: Sequence[torch.Tensor], spec: KVCacheSpec, max_sms: int | None = None
) -> tuple[CacheView, ...]:
    """The views an ops call may address ``caches`` through, coarsest first.

    Always the caches themselves (unit = ``block_size``: ids are block ids) and, when blocks
    hold more than one token, a token-slot view (unit = 1: ids are token slots): for NHD and
    MLA caches whose blocks are not padded apart the block-size-1 tensor view of
    :func:`unit_view` (plain strides, so the copy engines can still take its whole-token runs);
    for HND caches and padded blocks, which no tensor view re-blocks, the caches registered
    with ``token_slots`` (the kernels split each slot into block and offset). Every view
    carries the SM budget ``max_sms`` and one shared record of the paths its ops chose
    (:func:`kvxfer.ops.path_stats`). Caches with more token slots than the kernels can address
    keep block units only, with a warning.
    """
    stats = PathStats(check_max_sms(max_sms))
    reg = register_caches(caches, spec, max_sms, path_stats=stats)
    out = [CacheView(reg, spec, spec.block_size)]
    if spec.block_size == 1:
        return tuple(out)
    views, vspec, unit = unit_view(caches, spec)
    if unit == 1:
        slots = register_caches(views, vspec, max_sms, path_stats=stats)
    else:
        try:  # the caches passed as blocks just now: only the slot count can be refused
            slots = register_caches(caches, spec, max_sms, path_stats=stats, token_slots=True)
        except ValueError as e:
            _LOG.warning(
                "kvxfer: %s caches without token slots (%s); requests that end inside a block "
                "take a call each",
                spec.layout.value,
                e,
            )
            return tuple(out)
    out.append(CacheView(slots, slots.spec, 1))
    return tuple(out)


class CacheViews:
    """One rank's caches registered in each unit (:func:`cache_views`), with the offset views
    made so far.

    ``views``: coarsest first; ``by_unit``: unit -> view; ``units``: the units, coarsest first;
    ``num_blocks``: blocks of the caches; ``spec``: their spec (block units). :meth:`at` is the
    view an ops call addresses; :meth:`bound` the ids' bound in a unit."""

    __slots__ = ("_offsets", "by_unit", "num_blocks", "spec", "units", "views")

    def __init__(self, caches: Sequence[torch.Tensor], spec: KVCacheSpec, max_sms: int | None = None) -> None:
        self.views = cache_views(caches, spec, max_sms)
        self.by_unit = {v.unit: v for v in self.views}
        self.units = [v.unit for v in self.views]
        self.spec = spec
        self.num_blocks = self.views[0].caches.info.num_blocks
        self._offsets: dict[tuple[int, int], CacheView] = {}

    def at(self, unit: int, offset: int = 0) -> CacheView:
        """The view of ``unit`` (``KeyError`` for a unit these caches lack), seen from token
        ``offset`` of each block on when ``offset`` is not 0 (made once)."""
        if not offset:
            return self.by_unit[unit]
        got = self._offsets.get((unit, offset))
        if got is None:
            if len(self._offsets) >= _OFFSET_VIEWS_MAX:
                self._offsets.clear()
            got = self._offsets[(unit, offset)] = _offset_registered(self.by_unit[unit], offset)
        return got

    def bound(self, unit: int) -> int:
        """How many ids of ``unit`` address these caches (blocks, or token slots)."""
        return self.num_blocks * (self.spec.block_size // unit)

    @property
    def whole(self) -> CacheView:
        """The block view (ids are block ids)."""
        return self.views[0]


def _offset_registered(base: CacheView, offset: int) -> CacheView:
    """``base`` seen from token ``offset`` of each block on, registered with the base's budget
    and path record (an offset view is the same engine's caches)."""
    views, vspec = offset_view(base.caches, base.spec, offset)
    caches = base.caches
    budget = caches.max_sms if isinstance(caches, PagedCache) else None
    stats = caches.path_stats if isinstance(caches, PagedCache) else None
    return CacheView(register_caches(views, vspec, budget, path_stats=stats), vspec, base.unit)


def view_at(by_unit: dict[int, CacheView], unit: int, offset: int, memo: dict) -> CacheView:
    """The view an ops call with ``unit`` and ``offset`` addresses among ``by_unit``: the unit's
    own view, or the block view offset by ``offset`` tokens (made once, kept in ``memo``). For
    views not held in a :class:`CacheViews` (tests, benchmarks)."""
    if offset == 0:
        return by_unit[unit]
    got = memo.get((unit, offset))
    if got is None:
        got = memo[(unit, offset)] = _offset_registered(by_unit[unit], offset)
    return got


def unit_view(
    caches: Sequence[torch.Tensor], spec: KVCacheSpec
) -> tuple[list[torch.Tensor], KVCacheSpec, int]:
    """View a cache so several requests can share one ops call.

    NHD ``[2, nb, bs, h, d]`` and MLA ``[nb, bs, d]`` caches are viewed with block size 1
    (``[2, nb*bs, 1, h, d]``, ``[nb*bs, 1, d]``): a "block" is then one token slot, so
    any concatenation of requests is exact. HND ``[2, nb, h, bs, d]`` cannot be re-blocked (its
    token stride is inside a block), nor can caches whose blocks are padded apart; they keep
    their blocks here (:func:`cache_views` addresses their tokens through ``token_slots``
    instead). Returns (views, spec of the views, unit = tokens per unit).
    """
    c0 = caches[0]
    if spec.use_mla:
        mergeable = c0.stride(0) == c0.shape[1] * c0.stride(1)
        if mergeable:
            views = [c.view(-1, 1, c.shape[-1]) for c in caches]
    elif spec.layout is Layout.NHD:
        mergeable = c0.stride(1) == c0.shape[2] * c0.stride(2)
        if mergeable:
            views = [c.view(2, -1, 1, c.shape[3], c.shape[4]) for c in caches]
    else:
        mergeable = False
    if not mergeable:  # HND, or blocks padded apart: keep whole blocks as units
        return list(caches), spec, spec.block_size
    return views, dataclasses.replace(spec, block_size=1), 1


def offset_view(caches: Sequence[torch.Tensor], spec: KVCacheSpec, offset: int):
    """``caches`` seen with every block starting ``offset`` tokens in (block size
    ``block_size - offset``): block ``b`` of the view is tokens ``[offset, block_size)`` of block
    ``b``, so an ops call can start a request in the middle of a block. Views, no copies."""
    bs = spec.block_size
    if not 0 <= offset < bs:
        raise ValueError(f"offset: must be in [0, {bs}), got {offset}")
    if offset == 0:
        return list(caches), spec
    dim = 1 if spec.use_mla else (2 if spec.layout is Layout.NHD else 3)
    return [c.narrow(dim, offset, bs - offset) for c in caches], dataclasses.replace(
        spec, block_size=bs - offset
    )
