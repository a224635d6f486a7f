"""Staging buffers and the chunked, double-buffered pipeline the ``pg`` transport moves wires through.

A request moves as wire tensors ``[H, L, 2, T, D]`` (MLA ``[L, T, D]``) cut into chunks that
each fit one staging buffer:

* :class:`StagingPool`: ``num_buffers`` buffers of ``buffer_bytes`` carved out of ONE
  allocation made at construction (device memory, or pinned host memory), leased per stream
  and returned, never reallocated; a buffer that GPU work may still touch after a failure is
  held back until that work completed (:meth:`StagingPool.hold_until`).
* :class:`StagingLanes`: such pools for streams that run at once, one stream per pool (a
  lane), made on first need up to a cap: a stalled stream holds its own lane only.
* :class:`Chunk` / :func:`cut`: both ends cut each ops call ``(unit ids, num_tokens)`` into
  chunks of the same ``chunk_tokens`` (agreed with :func:`chunk_tokens_for`: a multiple of
  both sides' units, so every chunk starts on a unit boundary on both sides); chunk ``i`` of
  a stream travels with tag ``i``.
* :func:`pipelined_send` / :func:`pipelined_recv`: with two (or more) buffers, the gather of
  chunk ``i+1`` runs while chunk ``i`` is on the wire; the receiver posts the receive of chunk
  ``i+1`` before it scatters chunk ``i``. ``send``/``recv`` return a work object with
  ``wait()`` (``ProcessGroup.send/recv`` work, bounded by the caller) or ``None``. Buffer
  reuse is always "wait the work that last used this buffer", so the code is the same for Gloo
  (host waits) and NCCL (stream waits). When host buffers stage CUDA caches (Gloo through
  pinned memory), :class:`HostFence` per buffer makes the host hand a buffer to the transport
  only after the CUDA gather that filled it completed, and refill it only after the CUDA
  scatter that drained it completed (``event.query()`` polled, bounded).

:class:`kvxfer.transports.pg.pipeline.StagedPipeline` wires these into the engine.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..ordering import event_done, record_done, wait_event
from ..spec import KVCacheSpec
from ..tracing import trace

_LOG = logging.getLogger(__name__)

__all__ = [
    "Chunk",
    "HostFence",
    "StagingLanes",
    "StagingPool",
    "Stream",
    "chunk_tokens_for",
    "cut",
    "pipelined_recv",
    "pipelined_send",
    "record_done",
    "wire_viewer",
]

# Every buffer starts on a 256-byte boundary: any dtype view is aligned, and CUDA copy kernels
# get full-width vector accesses.
_ALIGN = 256


def wire_viewer(
    spec: KVCacheSpec, num_heads: int, num_layers: int | None = None
) -> Callable[[Chunk, torch.Tensor], torch.Tensor]:
    """``view(chunk, slot)``: the wire of ``chunk`` (``spec.wire_shape`` of its tokens,
    ``num_heads`` heads, ``num_layers`` layers: default all) at the start of the ``uint8``
    staging ``slot``; ``ValueError`` naming the chunk when the slot is too small."""

    def view(c: Chunk, slot: torch.Tensor) -> torch.Tensor:
        shape = spec.wire_shape(c.num_tokens, num_heads, num_layers)
        nbytes = math.prod(shape) * spec.element_size
        if nbytes > slot.numel():
            raise ValueError(f"staging: chunk {c.index} needs {nbytes} bytes, buffer has {slot.numel()}")
        return slot[:nbytes].view(spec.dtype).view(shape)

    return view


def _positive_int(field: str, value: object, allow_zero: bool = False) -> int:
    ok = isinstance(value, int) and not isinstance(value, bool) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        raise ValueError(
            f"{field}: must be a {'non-negative' if allow_zero else 'positive'} int, got {value!r}"
        )
    return value  # type: ignore[return-value]


# --------------------------------------------------------------------------- pool
class StagingPool:
    """Fixed staging buffers from one allocation, leased per request and reused.

    Args:
        num_buffers: buffers in the pool (a double-buffered transfer leases 2).
        buffer_bytes: usable bytes per buffer.
        device: where the buffers live (``"cpu"`` or a CUDA device).
        pin_memory: page-locked host memory (``device`` must be CPU; needs CUDA).

    ``buffers[i]`` is a 1-D ``uint8`` tensor of ``buffer_bytes``; :func:`wire_viewer` views a
    prefix of it as a chunk's wire tensor.
    """

    def __init__(
        self,
        num_buffers: int,
        buffer_bytes: int,
        device: torch.device | str = "cpu",
        pin_memory: bool = False,
    ) -> None:
        _positive_int("num_buffers", num_buffers)
        _positive_int("buffer_bytes", buffer_bytes)
        device = torch.device(device)
        if pin_memory and device.type != "cpu":
            raise ValueError(f"pin_memory: pinned staging lives in host memory, but device is {device}")
        if pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory: pinned host memory needs CUDA, and none is available")
        stride = -(-buffer_bytes // _ALIGN) * _ALIGN
        # One allocation for the pool's lifetime; + _ALIGN to align the first buffer.
        self._storage = torch.empty(
            num_buffers * stride + _ALIGN, dtype=torch.uint8, device=device, pin_memory=pin_memory
        )
        lead = (-self._storage.data_ptr()) % _ALIGN
        self.buffers: tuple[torch.Tensor, ...] = tuple(
            self._storage[lead + i * stride : lead + i * stride + buffer_bytes] for i in range(num_buffers)
        )
        self.buffer_bytes = buffer_bytes
        self.device = device
        self.pinned = pin_memory
        self._free = list(range(num_buffers))
        self._cond = threading.Condition()
        self._held: dict[int, Any] = {}  # buffer index -> event its last (GPU) user must reach
        self._quarantine: list[tuple[int, Any]] = []  # released, but their GPU work may still run
        self.num_leases = 0

    @property
    def storage(self) -> torch.Tensor:
        """The pool's one allocation (every buffer lies in it): what a transport registers."""
        return self._storage

    @property
    def num_buffers(self) -> int:
        return len(self.buffers)

    @property
    def num_free(self) -> int:
        with self._cond:
            return len(self._free)

    def free_now(self) -> int:
        """:attr:`num_free` once the buffers whose GPU work completed came back."""
        with self._cond:
            self._unquarantine()
            return len(self._free)

    def acquire(self, n: int = 2, timeout_s: float = 30.0) -> list[int]:
        """Lease ``n`` buffers at once (all or none, so two transfers never deadlock holding one
        each); returns their indices. Raises ``TimeoutError`` after ``timeout_s``."""
        _positive_int("n", n)
        if n > self.num_buffers:
            raise ValueError(f"n: {n} buffers requested from a pool of {self.num_buffers}")
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._unquarantine()
            while len(self._free) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"staging pool: {n} buffers not free within {timeout_s}s "
                        f"({len(self._free)}/{self.num_buffers} free, {len(self._quarantine)} held by "
                        "GPU work that has not completed)"
                    )
                self._cond.wait(min(left, 0.005) if self._quarantine else left)
                self._unquarantine()
            taken, self._free = self._free[:n], self._free[n:]
            self.num_leases += 1
            return taken

    def release(self, indices: Sequence[int]) -> None:
        """Return leased buffers (by index) to the pool; one marked by :meth:`hold_until` comes
        back only once its event completed."""
        with self._cond:
            for i in indices:
                if not 0 <= i < self.num_buffers or i in self._free:
                    raise ValueError(f"release: buffer {i} is not leased")
            for i in indices:
                ev = self._held.pop(i, None)
                if ev is not None and not event_done(ev):
                    self._quarantine.append((i, ev))
                else:
                    self._free.append(i)
            self._cond.notify_all()

    def hold_until(self, slots: Sequence[torch.Tensor], event: Any) -> None:
        """Keep the leased buffers ``slots`` out of the pool after their release until
        ``event`` (``query()``) completed: GPU work that timed out may still read or write them."""
        with self._cond:
            for t in slots:
                for i, b in enumerate(self.buffers):
                    if b.data_ptr() == t.data_ptr():
                        self._held[i] = event

    def _unquarantine(self) -> None:
        if self._quarantine:
            done = [(i, ev) for i, ev in self._quarantine if event_done(ev)]
            for item in done:
                self._quarantine.remove(item)
                self._free.append(item[0])

    @contextlib.contextmanager
    def lease(self, n: int = 2, timeout_s: float = 30.0) -> Iterator[list[torch.Tensor]]:
        """``with pool.lease(2) as slots:`` the buffers as tensors, returned on exit."""
        idx = self.acquire(n, timeout_s)
        try:
            yield [self.buffers[i] for i in idx]
        finally:
            self.release(idx)


class StagingLanes:
    """Staging pools ("lanes") of one kind for streams that run at the same time: a stream takes
    a whole lane (:meth:`lane`), made on first need up to ``max_lanes``. So a stream that stalls
    (its peer stopped reading: each of its sends waits out its own bound) holds its own lane
    only, and other peers' streams go on in theirs; with every lane streaming, the next stream
    waits for one, at most its timeout. Memory: ``max_lanes`` pools at most, made only when
    streams overlap (or a lane's buffers wait for GPU work of a failed stream).

    Args:
        make: makes one lane's pool (outside the lock: a slow allocation holds no one else).
        max_lanes: lanes at most (>= 1).
    """

    def __init__(self, make: Callable[[], StagingPool], max_lanes: int) -> None:
        _positive_int("max_lanes", max_lanes)
        self._make = make
        self.max_lanes = max_lanes
        self.pools: list[StagingPool] = []  # every lane made, in order
        self._idle: list[StagingPool] = []
        self._making = 0  # lanes being made (counted against max_lanes)
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def lane(self, want: int, timeout_s: float) -> Iterator[StagingPool]:
        """``with lanes.lane(2, t) as pool:`` a lane no other stream uses until the block ends:
        an idle one with ``want`` buffers free (none held by GPU work of a failed stream), else
        a new one while fewer than ``max_lanes`` exist, else any idle one (its lease waits for
        its buffers); ``TimeoutError`` naming the lanes when none is idle within ``timeout_s``.
        A lane that cannot be made (out of memory) fails the stream only when no lane exists or
        is being made; else it waits for one, and no more lanes are made."""
        pool = self._take(want, time.monotonic() + timeout_s, timeout_s, True)
        try:
            yield pool
        finally:
            with self._cond:
                self._idle.append(pool)
                self._cond.notify_all()  # a waiter that may only take an idle lane must not eat it

    def _take(self, want: int, end: float, timeout_s: float, grow: bool) -> StagingPool:
        with self._cond:
            while True:
                idle = self._idle
                for i in range(len(idle) - 1, -1, -1):  # the lane used last first: its memory is warm
                    if idle[i].free_now() >= want:
                        return idle.pop(i)
                if grow and len(self.pools) + self._making < self.max_lanes:
                    self._making += 1
                    break
                if idle:  # each one's buffers wait for GPU work of a failed stream: its lease waits
                    return idle.pop()
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"staging: all {self.max_lanes} lanes streaming for {timeout_s}s "
                        "(other peers' streams; raise max_streams for more at once)"
                    )
                self._cond.wait(left)
        try:
            pool = self._make()
        except BaseException as e:
            with self._cond:
                self._making -= 1
                self._cond.notify_all()
                if not isinstance(e, Exception) or not (self.pools or self._making):
                    raise
                # memory allows no more: the lanes stay as many as there are (or are being made)
                self.max_lanes = len(self.pools) + self._making
            _LOG.warning(
                "staging: a lane beyond the %d made could not be made (%s: %s); at most %d from now "
                "on, this stream waits for one",
                len(self.pools), type(e).__name__, e, self.max_lanes,
            )  # fmt: skip
            return self._take(want, end, timeout_s, False)
        with self._cond:
            self._making -= 1
            self.pools.append(pool)
        return pool


# --------------------------------------------------------------------------- chunks
@dataclass(frozen=True)
class Chunk:
    """``num_tokens`` tokens of one ops call, at this side's unit ids ``units`` (a slice of the
    call's unit list: a view for tensors; ``unit`` tokens per id), sent as the ``index``-th
    chunk of a stream. ``offset``: the call starts that many tokens into its first unit (a
    partial load's head; :func:`kvxfer.views.offset_view`)."""

    index: int
    units: Any
    num_tokens: int
    offset: int = 0
    unit: int = 1


@dataclass(frozen=True)
class Stream:
    """What both ends of one stream agree on (the same on both, each with its own unit ids):
    the ops ``calls`` (unit ids, tokens[, offset[, unit]]) of a wire of ``num_heads`` heads of
    ``spec`` (``num_layers`` of its layers: a layer group; default all), in ``unit``-token
    units where a call names none, cut into chunks of ``chunk_tokens`` tokens; ``tag``: its
    NVTX name."""

    spec: KVCacheSpec
    num_heads: int
    unit: int
    chunk_tokens: int
    calls: Sequence[tuple]
    num_layers: int | None = None
    tag: str = ""

    def chunks(self) -> list[Chunk]:
        """The chunks both ends cut :attr:`calls` into (:func:`cut`), in order."""
        return cut(self.calls, self.chunk_tokens, self.unit)

    def viewer(self) -> Callable[[Chunk, torch.Tensor], torch.Tensor]:
        """``view(chunk, slot)``: the chunk's wire in a staging slot (:func:`wire_viewer`)."""
        return wire_viewer(self.spec, self.num_heads, self.num_layers)


def cut(calls: Sequence[tuple], chunk_tokens: int, unit: int) -> list[Chunk]:
    """Cut ops calls ``(unit ids, num_tokens[, offset[, call unit]])`` into chunks of
    ``chunk_tokens`` tokens.

    ``unit``: tokens per unit id of this side, for calls that do not name their own (a call
    unit of 0 or none; a batch whose requests end inside a block sends their tails as token
    slots, unit 1, after a call in blocks). ``chunk_tokens`` must be a multiple of every unit.
    A call of ``T <= chunk_tokens`` tokens is one chunk; a longer one gives
    ``ceil(T / chunk_tokens)`` chunks, the last shorter. Both ends call this with their own
    units and the same ``chunk_tokens``, so they cut at the same tokens and number the chunks
    alike. A call with an offset is a partial load's short head (within one unit) and is never
    cut.
    """
    _positive_int("chunk_tokens", chunk_tokens)
    _positive_int("unit", unit)
    out: list[Chunk] = []
    for call in calls:
        units, t = call[0], call[1]
        offset = call[2] if len(call) > 2 else 0
        u = (call[3] if len(call) > 3 else 0) or unit
        if chunk_tokens % u:
            raise ValueError(f"chunk_tokens: {chunk_tokens} is not a multiple of the unit {u}")
        if offset:
            if t > chunk_tokens:
                raise ValueError(f"cut: an offset call of {t} tokens exceeds a chunk of {chunk_tokens}")
            out.append(Chunk(len(out), units, t, offset, u))
            continue
        for t0 in range(0, t, chunk_tokens):
            n = min(chunk_tokens, t - t0)
            u0 = t0 // u
            out.append(Chunk(len(out), units[u0 : u0 + -(-n // u)], n, 0, u))
    return out


def chunk_tokens_for(
    buffer_bytes: int,
    bytes_per_token: int,
    src_unit: int,
    dst_unit: int,
    max_chunk_tokens: int | None = None,
) -> int:
    """Tokens per chunk both ends cut with: the most whose wire fits ``buffer_bytes`` (the
    smaller of the two ends' buffers), rounded down to a multiple of ``lcm(src_unit,
    dst_unit)``. Raises ``ValueError`` naming the sizes when a buffer cannot hold one unit."""
    for name, v in (("buffer_bytes", buffer_bytes), ("bytes_per_token", bytes_per_token)):
        _positive_int(name, v)
    unit = math.lcm(src_unit, dst_unit)
    fit = buffer_bytes // bytes_per_token
    if max_chunk_tokens is not None:
        fit = min(fit, _positive_int("max_chunk_tokens", max_chunk_tokens))
    chunk = fit // unit * unit
    if chunk == 0:
        raise ValueError(
            f"staging: a buffer of {buffer_bytes} bytes holds {fit} tokens of {bytes_per_token} bytes, "
            f"fewer than one chunk unit lcm({src_unit}, {dst_unit}) = {unit} tokens"
        )
    return chunk


# --------------------------------------------------------------------------- pipeline
class Work(Protocol):
    def wait(self) -> Any: ...


class HostFence:
    """Host-side fence of one staging buffer in host memory that CUDA kernels fill or drain:
    ``record()`` marks the current CUDA stream's position, ``wait()`` polls until the work
    before it completed (at once if nothing was recorded), bounded by ``timeout_s``
    (:class:`~kvxfer.ordering.FenceTimeout`, which carries the event)."""

    def __init__(self, timeout_s: float) -> None:
        self._event = torch.cuda.Event()
        self._recorded = False
        self._timeout_s = timeout_s

    def record(self) -> None:
        self._event.record()
        self._recorded = True

    def wait(self) -> None:
        if self._recorded:
            wait_event(self._event, self._timeout_s, "staging buffer")


def _check_slots(slots: Sequence[torch.Tensor], fences) -> int:
    depth = len(slots)
    if depth < 2:
        raise ValueError(f"slots: double buffering needs at least 2 buffers, got {depth}")
    if fences is not None and len(fences) != depth:
        raise ValueError(f"fences: one per slot needed ({depth}), got {len(fences)}")
    return depth


def _drain(pending: Sequence[Work | None], failed: BaseException | None = None) -> None:
    """Wait every posted send or receive, all of them even when some fail. After ``failed``
    (the error that stopped the pipeline) a failing wait is added to it as a note instead of
    replacing it: the caller reports the first cause (a CUDA fault in a scatter), not the
    peer's timeout that followed. Without ``failed`` the first failing wait is raised."""
    errors: list[Exception] = []
    for w in pending:
        if w is not None:
            try:
                w.wait()
            except Exception as e:
                errors.append(e)
    for e in errors if failed is not None else errors[1:]:
        (failed or errors[0]).add_note(f"then, draining the pipeline: {type(e).__name__}: {e}")
    if failed is None and errors:
        raise errors[0]


def pipelined_send(
    chunks: Sequence[Chunk],
    slots: Sequence[torch.Tensor],
    view: Callable[[Chunk, torch.Tensor], torch.Tensor],
    gather: Callable[[Chunk, torch.Tensor], None],
    send: Callable[[Chunk, torch.Tensor], Work | None],
    fences: Sequence[HostFence] | None = None,
) -> int:
    """Gather and send every chunk, double-buffered; returns the number of chunks sent.

    For chunk ``i`` in slot ``s = i % len(slots)``: wait the send that last used slot ``s``
    (chunk ``i - len(slots)``), ``gather(chunk, buf)`` into ``buf = view(chunk, slots[s])``,
    then ``send(chunk, buf)`` (non-blocking; returns a work object or None). So the gather of
    chunk ``i+1`` overlaps the send of chunk ``i``. With ``fences``, the host waits for the
    gather's CUDA copy before handing ``buf`` to the transport. All sends are waited before
    returning, also when a callable raises (its error is the one raised; see :func:`_drain`).
    """
    depth = _check_slots(slots, fences)
    pending: list[Work | None] = [None] * depth
    count = 0
    try:
        for i, chunk in enumerate(chunks):
            s = i % depth
            if pending[s] is not None:
                work, pending[s] = pending[s], None
                work.wait()
            buf = view(chunk, slots[s])
            gather(chunk, buf)
            if fences is not None:
                fences[s].record()
                fences[s].wait()
            pending[s] = send(chunk, buf)
            count += 1
    except BaseException as e:
        _drain(pending, e)
        raise
    _drain(pending)
    return count


def pipelined_recv(
    chunks: Sequence[Chunk],
    slots: Sequence[torch.Tensor],
    view: Callable[[Chunk, torch.Tensor], torch.Tensor],
    recv: Callable[[Chunk, torch.Tensor], Work | None],
    scatter: Callable[[Chunk, torch.Tensor], None],
    fences: Sequence[HostFence] | None = None,
) -> int:
    """Receive and scatter every chunk, double-buffered; returns the number of chunks scattered.

    The receives of the first ``len(slots)`` chunks are posted up front; after chunk ``i``'s
    receive completes it is scattered and the receive of chunk ``i + len(slots)`` is posted into
    the same slot, so receiving chunk ``i+1`` overlaps scattering chunk ``i``. With ``fences``,
    a slot is re-posted only after the host saw the CUDA scatter that read it finish. Posted
    receives are waited before returning, also when a callable raises (its error is the one
    raised; see :func:`_drain`).
    """
    depth = _check_slots(slots, fences)
    n = len(chunks)
    bufs: list[torch.Tensor | None] = [None] * depth
    pending: list[Work | None] = [None] * depth

    def post(i: int) -> None:
        s = i % depth
        if fences is not None:
            fences[s].wait()
        bufs[s] = view(chunks[i], slots[s])
        pending[s] = recv(chunks[i], bufs[s])

    count = 0
    try:
        for i in range(min(depth, n)):
            post(i)
        for i in range(n):
            s = i % depth
            work, pending[s] = pending[s], None
            if work is not None:
                with trace("wait"):
                    work.wait()
            scatter(chunks[i], bufs[s])
            if fences is not None:
                fences[s].record()
            count += 1
            if i + depth < n:
                post(i + depth)
    except BaseException as e:
        _drain(pending, e)
        raise
    _drain(pending)
    return count
