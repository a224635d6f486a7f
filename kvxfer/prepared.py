"""The prepared copy: what a copy between two registered caches checks once (specs compatible,
one device, both sides' templates for a head slice and layer set), then per call only ids and
token counts, for one request or for a batch of them in CSR form.

Every copy the engine makes runs through a :class:`PreparedCopy`: the one-sided ipc load keeps
its own; :func:`kvxfer.ops.copy_blocks` with producer-checked ids on registered caches finds the
one its source keeps per destination (:func:`prepared_copy`). Each call dispatches through
:func:`kvxfer.dispatch.launch`.
"""

from __future__ import annotations

import math

import numpy as np

from .backends.base import PagedSide
from .dispatch import Launch, check_args, launch, registered_budget
from .paged import PagedCache, as_block_ids, int_array, make_side

__all__ = ["PreparedCopy", "copy_sides", "prepared_copy"]

_PAIRS_MAX = 256  # prepared copies a source keeps (destinations come and go: offset views)


class PreparedCopy:
    """:func:`kvxfer.ops.copy_blocks` between two registered caches (:func:`register_caches`)
    for one head slice and layer set, with what that call checks per call (the specs compatible,
    both caches on one device, the two sides' templates) checked once here.

    ``copy(src_ids, dst_ids, num_tokens)`` moves one request, ids as :func:`copy_blocks` takes
    them (:class:`~kvxfer.paged.CheckedIds` skip their checks as there; other ids are checked);
    :meth:`batch` moves several, given in CSR form, checked once for the batch. A call skips
    what :func:`copy_blocks` adds per call before it reaches the same prepared copy (type
    checks, the lookup of this object by its memo key).

    Args:
        src_caches, dst_caches: registered caches (:class:`~kvxfer.paged.PagedCache`).
        src_head_start, dst_head_start, num_heads, layers: as for :func:`copy_blocks`.
        backend: as for :func:`copy_blocks` (None: the device's default, or the copy engines
            when the rule says so).

    Raises ``ValueError`` as :func:`copy_blocks` would for these arguments.
    """

    __slots__ = ("_budget", "_dst", "_how", "_spare", "_src", "_within", "dst_caches")

    def __init__(
        self,
        src_caches: PagedCache,
        dst_caches: PagedCache,
        src_head_start: int = 0,
        dst_head_start: int = 0,
        num_heads: int | None = None,
        layers=None,
        backend: str | None = None,
    ) -> None:
        if not isinstance(src_caches, PagedCache) or not isinstance(dst_caches, PagedCache):
            raise ValueError(
                "PreparedCopy: src_caches and dst_caches must be registered caches (register_caches)"
            )
        ss, ds = src_caches.spec, dst_caches.spec
        mismatch = None if ss is ds else ss.model_mismatch(ds)
        if mismatch:
            raise ValueError(f"incompatible caches: {mismatch}")
        st = _template(src_caches, src_head_start, num_heads, layers, "src_caches")
        dt = _template(dst_caches, dst_head_start, st.num_heads, layers, "dst_caches")
        device, dst_device = st.device, dt.device  # a tensor's .device is a torch call: made once here
        if dst_device != device:
            raise ValueError(f"dst_caches: on {dst_device}, src_caches on {device}; copy needs one device")
        self._src, self._dst, self.dst_caches = st, dt, dst_caches
        # a copy within one cache whose head slices meet: a batch reading a block it writes would
        # read it before or after the write by how its requests are packed (refused by batch())
        self._within = src_caches is dst_caches and (
            src_head_start < dst_head_start + dt.num_heads and dst_head_start < src_head_start + st.num_heads
        )
        self._how = Launch("copy", backend, device, src_caches.info.engines, src_caches, dst_caches)
        self._budget = registered_budget(src_caches, dst_caches)
        # run_bounded's pairs of sides, reused: a call takes one (list.pop and list.append are
        # atomic under the GIL: a pair is one call's at a time) and sets only its ids and token
        # count; two new sides per call cost more than the rest of the call's Python
        self._spare: list[tuple[PagedSide, PagedSide]] = []

    @property
    def backend(self) -> str | None:
        """The backend asked for (None: the device's default)."""
        return self._how.backend

    def __call__(self, src_block_ids, dst_block_ids, num_tokens: int) -> None:
        """Copy one request's first ``num_tokens`` tokens (ids in token order, at least
        ``ceil(num_tokens / block_size)`` on each side)."""
        if type(num_tokens) is not int or num_tokens < 0:
            raise ValueError(f"num_tokens: must be an int >= 0, got {num_tokens!r}")
        if num_tokens:
            self.run(src_block_ids, dst_block_ids, num_tokens)

    def run(
        self, src_block_ids, dst_block_ids, num_tokens: int, max_sms=None, dma=None, backend=None
    ) -> None:
        """:meth:`__call__` for ``num_tokens`` > 0 already checked, with the per-call options of
        :func:`copy_blocks` (``max_sms`` checked by the caller)."""
        src, dst = copy_sides(self._src, self._dst, src_block_ids, dst_block_ids, num_tokens)
        budget = max_sms if max_sms is not None else self._budget
        if budget is not None:
            src.max_sms = dst.max_sms = budget
        how = self._how if backend is None else self._how._replace(backend=backend)
        launch(how, src, dst, budget, dma)

    def run_bounded(self, src_ids: np.ndarray, dst_ids: np.ndarray, num_tokens: int) -> None:
        """:meth:`run` with ids their producer bounded for this copy (:meth:`takes`): C-contiguous
        int64 arrays of exactly ``ceil(num_tokens / block_size)`` ids of each side's caches,
        in range, the destination's without repeats, ``num_tokens`` > 0. Nothing is checked
        here: the one-sided load's ids were checked at ``load()``, against the bounds
        :meth:`takes` agreed to once."""
        spare = self._spare
        try:
            src, dst = spare.pop()
        except IndexError:  # a first call, or one beside another thread's
            src, dst = _with_ids(self._src, src_ids, num_tokens), _with_ids(self._dst, dst_ids, num_tokens)
            if self._budget is not None:  # the same on every call of this copy
                src.max_sms = dst.max_sms = self._budget
        else:
            src.block_ids, src.num_tokens = src_ids, num_tokens
            dst.block_ids, dst.num_tokens = dst_ids, num_tokens
        try:
            launch(self._how, src, dst, self._budget, None)
        finally:
            spare.append((src, dst))

    def takes(self, src_block_size: int, src_bound: int, dst_block_size: int, dst_bound: int) -> bool:
        """Whether ids of blocks of ``src_block_size`` tokens below ``src_bound`` (and of the
        destination's likewise) are ids of this copy's two sides (:meth:`run_bounded`)."""
        st, dt = self._src, self._dst
        return (
            st.block_size == src_block_size
            and st.slot_block == 1
            and src_bound <= st.num_blocks
            and dt.block_size == dst_block_size
            and dt.slot_block == 1
            and dst_bound <= dt.num_blocks
        )

    def sides(self, src_block_ids, dst_block_ids, num_tokens: int) -> tuple[PagedSide, PagedSide]:
        """The two sides a call with these ids and token count runs on (checked as it checks
        them), without running it."""
        return copy_sides(self._src, self._dst, src_block_ids, dst_block_ids, num_tokens)

    def batch(
        self, src_ids, src_indptr, dst_ids, dst_indptr, num_tokens, max_sms: int | None = None, dma=None
    ) -> int:
        """Copy a batch of requests given in CSR form; returns the kernel calls it took.

        Request ``i`` moves its first ``num_tokens[i]`` tokens from the source ids
        ``src_ids[src_indptr[i]:src_indptr[i + 1]]`` to the destination ids
        ``dst_ids[dst_indptr[i]:dst_indptr[i + 1]]``, each segment in token order and at least
        ``ceil(num_tokens[i] / block_size)`` ids of its side long (extra ids are ignored).

        Shapes (int arrays, lists or CPU/GPU int tensors): ``src_ids`` ``[nnz_src]``,
        ``src_indptr`` ``[B + 1]`` (0 first, ``nnz_src`` last, non-decreasing), ``dst_ids``
        ``[nnz_dst]``, ``dst_indptr`` ``[B + 1]``, ``num_tokens`` ``[B]`` (>= 0).

        The whole batch is checked before anything is written, in one pass of numpy per check:
        segments, ids in range, and no destination id named twice among the ids moved (the
        requests would race for it). Requests run in order, packed into as few kernel calls as
        exactness allows: a request joins the call before it when that call's tokens so far
        fill whole blocks of both sides (a multiple of ``lcm`` of the block sizes), so a batch
        whose requests all fill whole blocks, but for the last, is one call. A batch within one
        cache (the same registered caches on both sides, head slices meeting) may not read a block
        it writes (``ValueError``). ``max_sms`` and ``dma`` as for :func:`copy_blocks`.
        """
        check_args(max_sms, dma)
        st, dt = self._src, self._dst
        n = _int_array(num_tokens, "num_tokens")
        count = n.size
        if count and int(n.min()) < 0:
            raise ValueError(f"num_tokens: request {int(np.argmax(n < 0))} has {int(n.min())} tokens (< 0)")
        s_need = -(-n // st.block_size)
        d_need = -(-n // dt.block_size)
        s = _segments(src_ids, src_indptr, s_need, count, "src")
        d = _segments(dst_ids, dst_indptr, d_need, count, "dst")
        _in_range(s, st.num_blocks, "src_block_ids")
        _in_range(d, dt.num_blocks, "dst_block_ids")
        if d.size > 1:
            srt = np.sort(d)
            dup = srt[1:] == srt[:-1]
            if dup.any():
                raise ValueError(f"dst_block_ids: repeated block id {int(srt[1:][dup][0])} in a destination")
        if self._within:
            _read_and_written(s, d)
        budget = max_sms if max_sms is not None else self._budget
        how = self._how
        align = math.lcm(st.block_size, dt.block_size)
        tok = np.zeros(count + 1, dtype=np.int64)
        np.cumsum(n, out=tok[1:])
        s_off = np.zeros(count + 1, dtype=np.int64)
        np.cumsum(s_need, out=s_off[1:])
        d_off = np.zeros(count + 1, dtype=np.int64)
        np.cumsum(d_need, out=d_off[1:])
        ends = (np.flatnonzero(n % align) + 1).tolist()  # a call closes after a ragged request
        if not ends or ends[-1] != count:
            ends.append(count)
        calls, start = 0, 0
        for end in ends:
            tokens = int(tok[end] - tok[start])
            if tokens:
                src = _with_ids(st, s[s_off[start] : s_off[end]], tokens)
                dst = _with_ids(dt, d[d_off[start] : d_off[end]], tokens)
                if budget is not None:
                    src.max_sms = dst.max_sms = budget
                launch(how, src, dst, budget, dma)
                calls += 1
            start = end
        return calls


def _read_and_written(src_ids: np.ndarray, dst_ids: np.ndarray) -> None:
    """Refuse a batch within one cache that reads a block it writes."""
    both = np.intersect1d(src_ids, dst_ids)
    if both.size:
        raise ValueError(
            f"block {int(both[0])}: read and written by one batch within one cache (whether it is "
            "read before or after the write would depend on how the batch is packed into calls)"
        )


def prepared_copy(
    src_caches: PagedCache,
    dst_caches: PagedCache,
    src_head_start: int,
    dst_head_start: int,
    num_heads: int | None,
    layers,
) -> PreparedCopy:
    """The :class:`PreparedCopy` registered ``src_caches`` keep for (``dst_caches``, heads,
    layers), made on first use (at most 256 kept: destinations come and go, as the offset
    views of partial loads do)."""
    pairs = src_caches.__dict__.get("_pairs")
    if pairs is None:
        pairs = src_caches.__dict__["_pairs"] = {}
    key = (
        id(dst_caches),
        src_head_start,
        dst_head_start,
        num_heads,
        None if layers is None else tuple(layers),
    )
    got = pairs.get(key)
    if got is None or got.dst_caches is not dst_caches:
        if len(pairs) >= _PAIRS_MAX:
            pairs.clear()
        got = pairs[key] = PreparedCopy(
            src_caches, dst_caches, src_head_start, dst_head_start, num_heads, layers
        )
    return got


def copy_sides(
    st: PagedSide, dt: PagedSide, src_ids, dst_ids, num_tokens: int
) -> tuple[PagedSide, PagedSide]:
    """A copy's two sides from their templates (:func:`_template`) and ids, the ids checked as
    :func:`~kvxfer.paged.as_block_ids` checks them (the destination's for repeats too). No torch
    call: the ids stay numpy and the device is kept (with a cold cache, torch calls were most
    of an ops call's host cost: profiling/results/2026-11-23-cpu-hostcost/README.md)."""
    src = _with_ids(
        st,
        as_block_ids(src_ids, st.num_blocks, -(-num_tokens // st.block_size), "src_block_ids", False),
        num_tokens,
    )
    dst = _with_ids(
        dt,
        as_block_ids(dst_ids, dt.num_blocks, -(-num_tokens // dt.block_size), "dst_block_ids", True),
        num_tokens,
    )
    return src, dst


def _template(caches: PagedCache, head_start: int, num_heads: int | None, layers, name: str) -> PagedSide:
    """The side of registered ``caches`` for a head slice and layer set, validated once by
    :func:`make_side` and kept on the caches object (without ids: :func:`_with_ids` adds them)."""
    memo = caches.__dict__.get("_sides")
    if memo is None:
        memo = caches.__dict__["_sides"] = {}
    key = (head_start, num_heads, None if layers is None else tuple(layers))
    t = memo.get(key)
    if t is None:
        t = memo[key] = make_side(caches, caches.spec, [], 0, head_start, num_heads, layers, name=name)
    return t


def _with_ids(t: PagedSide, ids: np.ndarray, num_tokens: int) -> PagedSide:
    return PagedSide(
        t.caches,
        ids,
        num_tokens,
        t.block_size,
        t.num_blocks,
        t.head_start,
        t.num_heads,
        t.head_dim,
        t.num_kv,
        t.stride_kv,
        t.stride_block,
        t.stride_token,
        t.stride_head,
        t.layout,
        t.memo,
        t.max_sms,
        t.slot_block,
    )


# --------------------------------------------------------------------------- CSR checks


def _int_array(x, what: str) -> np.ndarray:
    """``x`` as a 1-D C-contiguous int64 numpy array (a copy: the caller's array may change)."""
    return np.ascontiguousarray(int_array(x, what, copy=True))


def _segments(ids, indptr, need: np.ndarray, count: int, side: str) -> np.ndarray:
    """The ids a batch moves on one side: of each request's segment ``ids[indptr[i]:indptr[i +
    1]]`` its first ``need[i]``, concatenated (the ids themselves when no segment is longer)."""
    what = f"{side}_block_ids"
    arr = _int_array(ids, what)
    ptr = _int_array(indptr, f"{side}_indptr")
    if ptr.size != count + 1:
        raise ValueError(f"{side}_indptr: {count} requests need {count + 1} offsets, got {ptr.size}")
    if ptr[0] != 0 or ptr[-1] != arr.size:
        raise ValueError(f"{side}_indptr: must start at 0 and end at {arr.size} ({what}' length)")
    have = np.diff(ptr)
    if (have < 0).any():
        raise ValueError(f"{side}_indptr: offsets must not decrease (request {int(np.argmax(have < 0))})")
    short = have < need
    if short.any():
        i = int(np.argmax(short))
        raise ValueError(
            f"num_tokens[{i}]: needs {int(need[i])} blocks, but {what} of request {i} has {int(have[i])}"
        )
    if np.array_equal(have, need):
        return arr
    total = int(need.sum())
    first = np.zeros(count, dtype=np.int64)
    np.cumsum(need[:-1], out=first[1:])
    return arr[np.arange(total, dtype=np.int64) - np.repeat(first - ptr[:-1], need)]


def _in_range(ids: np.ndarray, bound: int, what: str) -> None:
    if ids.size:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= bound:
            raise ValueError(f"{what}: block id {lo if lo < 0 else hi} out of range [0, {bound})")
