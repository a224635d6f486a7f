"""Staging buffers, chunk plans and the double-buffered gather/send - recv/scatter pipeline.

The ``pg`` transport moves a request as wire tensors ``[H, L, 2, T, D]`` (MLA ``[L, T, D]``)
through staging buffers. This module holds the three GPU-independent pieces:

* :class:`StagingPool`: ``num_buffers`` buffers of ``buffer_bytes`` carved out of ONE
  allocation made at construction (device memory, or pinned host memory with
  ``pin_memory=True``), leased and returned per request, never reallocated.
* :func:`plan_chunks`: splits a request of ``num_tokens`` tokens into chunks whose wire fits one
  buffer. Every chunk but the last holds a multiple of ``lcm(src_block_size, dst_block_size)``
  tokens, so each chunk starts on a block boundary on BOTH sides and is a whole block list
  slice for :mod:`kvxfer.ops` (``block_ids[t0 // bs : ceil(t1 / bs)]``).
* :func:`pipelined_send` / :func:`pipelined_recv`: with two (or more) buffers, gather of chunk
  ``i+1`` runs while chunk ``i`` is on the wire; the receiver posts the receive of chunk
  ``i+1`` before it scatters chunk ``i``. ``send``/``recv`` return a work object with
  ``wait()`` (``torch.distributed`` ``Work`` from ``ProcessGroup.send/recv``), or ``None`` when
  they completed synchronously. The code is the same for Gloo (CPU; ``wait()`` blocks the host)
  and NCCL (GPU; ``wait()`` orders the current stream after the communication, the host does
  not block), because buffer reuse is always expressed as "wait the work that last used this
  buffer". When buffers are host memory and the caches are CUDA (pinned staging for a CPU
  transport), pass :func:`host_fences`: a buffer is handed to the transport only after the
  CUDA copy that filled it finished, and re-filled only after the copy that drained it.

How the engine plugs it in (``pg`` transport, one pair group per (exporter rank, loader
rank)):

1. at start-up: ``pool = StagingPool(num_buffers=2 * concurrent_transfers, buffer_bytes=...,
   device=cache_device, pin_memory=stage_on_host)``;
2. after the handshake both sides agree on ``buffer_bytes = min(local, peer)`` (the chunk plan
   must be identical on both ends) and on each :class:`~kvxfer.plan.Read`;
3. per read: ``chunks = plan_chunks(num_tokens, src_bs, dst_bs, spec.bytes_per_token(n_heads),
   buffer_bytes)``;
   exporter: ``with pool.lease(2, timeout_s) as slots: pipelined_send(chunks, slots,
   wire_viewer(spec, n_heads), ops_gatherer(caches, spec, block_ids, src_head_start,
   n_heads), lambda c, b: pg.send([b], peer, tag + c.index), fences)``;
   loader: the mirror image with ``pipelined_recv``, ``ops_scatterer`` and ``pg.recv``.
   Every wait is bounded by the pair group's timeout.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .ordering import event_done
from .spec import KVCacheSpec

__all__ = [
    "Chunk",
    "ChunkPlan",
    "CudaHostFence",
    "StagingPool",
    "host_fences",
    "ops_gatherer",
    "ops_scatterer",
    "pipelined_recv",
    "pipelined_send",
    "plan_chunks",
    "record_done",
    "wait_for",
    "wire_viewer",
]

# Every buffer starts on a 256-byte boundary: any dtype view is aligned, and CUDA copy kernels
# get full-width vector accesses.
_ALIGN = 256


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
    def num_buffers(self) -> int:
        return len(self.buffers)

    @property
    def num_free(self) -> int:
        with self._cond:
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


def wire_viewer(
    spec: KVCacheSpec, num_heads: int | None = None, num_layers: int | None = None
) -> Callable[[Chunk, torch.Tensor], torch.Tensor]:
    """``view(chunk, slot)``: the first bytes of a uint8 buffer as the chunk's contiguous wire
    ``[num_heads, L, 2, chunk.num_tokens, D]`` (MLA ``[L, chunk.num_tokens, D]``)."""

    def view(chunk: Chunk, slot: torch.Tensor) -> torch.Tensor:
        shape = spec.wire_shape(chunk.num_tokens, num_heads, num_layers)
        nbytes = math.prod(shape) * spec.element_size
        if nbytes > slot.numel():
            raise ValueError(
                f"staging buffer: chunk {chunk.index} needs {nbytes} bytes, buffer has {slot.numel()}"
            )
        return slot[:nbytes].view(spec.dtype).view(shape)

    return view


# --------------------------------------------------------------------------- chunks
@dataclass(frozen=True)
class Chunk:
    """Tokens ``[token_start, token_start + num_tokens)`` of a request; both starts are block
    aligned, so the chunk is ``src_num_blocks`` source blocks from ``src_block_start`` of the
    request's source block list, and likewise on the destination."""

    index: int
    token_start: int
    num_tokens: int
    src_block_start: int
    src_num_blocks: int
    dst_block_start: int
    dst_num_blocks: int

    def src_blocks(self, block_ids: Any) -> Any:
        """This chunk's slice of the request's source block list (a view for tensors)."""
        return block_ids[self.src_block_start : self.src_block_start + self.src_num_blocks]

    def dst_blocks(self, block_ids: Any) -> Any:
        """This chunk's slice of the request's destination block list."""
        return block_ids[self.dst_block_start : self.dst_block_start + self.dst_num_blocks]


@dataclass(frozen=True)
class ChunkPlan:
    """A request split into chunks of ``chunk_tokens`` (the last may be shorter). O(1) to
    build; chunks are computed on access."""

    num_tokens: int
    chunk_tokens: int
    src_block_size: int
    dst_block_size: int
    bytes_per_token: int

    def __len__(self) -> int:
        return -(-self.num_tokens // self.chunk_tokens) if self.num_tokens else 0

    def __getitem__(self, i: int) -> Chunk:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"chunk {i} out of range [0, {n})")
        t0 = i * self.chunk_tokens
        t = min(self.chunk_tokens, self.num_tokens - t0)
        sb, db = self.src_block_size, self.dst_block_size
        return Chunk(i, t0, t, t0 // sb, -(-t // sb), t0 // db, -(-t // db))

    def __iter__(self) -> Iterator[Chunk]:
        return (self[i] for i in range(len(self)))

    @property
    def max_chunk_bytes(self) -> int:
        """Wire bytes of the largest chunk."""
        return min(self.chunk_tokens, self.num_tokens) * self.bytes_per_token


def plan_chunks(
    num_tokens: int,
    src_block_size: int,
    dst_block_size: int,
    bytes_per_token: int,
    buffer_bytes: int,
    max_chunk_tokens: int | None = None,
) -> ChunkPlan:
    """Split ``num_tokens`` tokens into chunks whose wire fits ``buffer_bytes``.

    Args:
        num_tokens: tokens of the request (the last block on either side may be partial).
        src_block_size, dst_block_size: block sizes of the gathering and scattering caches.
        bytes_per_token: wire bytes per token of this read (``spec.bytes_per_token(heads)``).
        buffer_bytes: bytes of one staging buffer; both peers must use the same value
            (the smaller of the two pools') so that they cut identical chunks.
        max_chunk_tokens: optional cap (e.g. to get more chunks in flight for overlap).

    Every chunk but the last holds the largest multiple of ``lcm(src_block_size,
    dst_block_size)`` tokens that fits, so chunk boundaries are block boundaries on both sides.
    Raises ``ValueError`` when a buffer cannot hold even one such unit of a multi-chunk request.
    """
    _positive_int("num_tokens", num_tokens, allow_zero=True)
    _positive_int("src_block_size", src_block_size)
    _positive_int("dst_block_size", dst_block_size)
    _positive_int("bytes_per_token", bytes_per_token)
    _positive_int("buffer_bytes", buffer_bytes)
    if max_chunk_tokens is not None:
        _positive_int("max_chunk_tokens", max_chunk_tokens)
    unit = math.lcm(src_block_size, dst_block_size)
    fit = buffer_bytes // bytes_per_token
    if max_chunk_tokens is not None:
        fit = min(fit, max_chunk_tokens)
    chunk = fit // unit * unit
    if num_tokens <= fit:  # one chunk: it is the last, no alignment needed
        chunk = max(num_tokens, 1)
    elif chunk == 0:
        raise ValueError(
            f"buffer_bytes: {buffer_bytes} bytes hold {buffer_bytes // bytes_per_token} tokens of "
            f"{bytes_per_token} bytes, fewer than one chunk unit lcm({src_block_size}, {dst_block_size}) = "
            f"{unit} tokens (need >= {unit * bytes_per_token} bytes"
            + (f" and max_chunk_tokens >= {unit}" if max_chunk_tokens is not None else "")
            + ")"
        )
    return ChunkPlan(num_tokens, chunk, src_block_size, dst_block_size, bytes_per_token)


# --------------------------------------------------------------------------- pipeline
class Work(Protocol):
    def wait(self) -> Any: ...


class Fence(Protocol):
    def record(self) -> None: ...
    def wait(self) -> None: ...


class CudaHostFence:
    """Host-side fence for one staging buffer: ``record()`` marks the current CUDA stream's
    position, ``wait()`` blocks the host until the work before it finished (immediately when
    nothing was recorded). Only for host buffers used by a CPU transport with CUDA caches."""

    def __init__(self, device: torch.device | str) -> None:
        self._device = torch.device(device)
        self._event = torch.cuda.Event()

    def record(self) -> None:
        self._event.record(torch.cuda.current_stream(self._device))

    def wait(self) -> None:
        self._event.synchronize()


def host_fences(num_slots: int, buffer_device: torch.device | str, cache_device: torch.device | str):
    """Fences for :func:`pipelined_send` / :func:`pipelined_recv`: one
    :class:`CudaHostFence` per slot when host buffers stage CUDA caches, else ``None``
    (same-device buffers are ordered by the stream and the transport's work objects)."""
    buffer_device, cache_device = torch.device(buffer_device), torch.device(cache_device)
    if buffer_device.type == "cpu" and cache_device.type == "cuda":
        return [CudaHostFence(cache_device) for _ in range(num_slots)]
    return None


def _check_slots(chunks: ChunkPlan | Sequence[Chunk], slots: Sequence[torch.Tensor], fences) -> int:
    depth = len(slots)
    if depth < 2:
        raise ValueError(f"slots: double buffering needs at least 2 buffers, got {depth}")
    if fences is not None and len(fences) != depth:
        raise ValueError(f"fences: one per slot needed ({depth}), got {len(fences)}")
    if isinstance(chunks, ChunkPlan) and len(chunks):
        small = min(s.numel() * s.element_size() for s in slots)
        if chunks.max_chunk_bytes > small:
            raise ValueError(
                f"slots: chunks need {chunks.max_chunk_bytes} bytes, the smallest buffer has {small}"
            )
    return depth


def _drain(pending: Sequence[Work | None]) -> None:
    for w in pending:
        if w is not None:
            w.wait()


def pipelined_send(
    chunks: ChunkPlan | Sequence[Chunk],
    slots: Sequence[torch.Tensor],
    view: Callable[[Chunk, torch.Tensor], torch.Tensor],
    gather: Callable[[Chunk, torch.Tensor], None],
    send: Callable[[Chunk, torch.Tensor], Work | None],
    fences: Sequence[Fence] | None = None,
) -> int:
    """Gather and send every chunk, double-buffered; returns the number of chunks sent.

    For chunk ``i`` in slot ``s = i % len(slots)``: wait the send that last used slot ``s``
    (chunk ``i - len(slots)``), ``gather(chunk, buf)`` into ``buf = view(chunk, slots[s])``,
    then ``send(chunk, buf)`` (non-blocking; returns a work object or None). So the gather of
    chunk ``i+1`` overlaps the send of chunk ``i``. With ``fences``, the host waits for the
    gather's CUDA copy before handing ``buf`` to the transport. All sends are waited before
    returning, also when a callable raises.
    """
    depth = _check_slots(chunks, slots, fences)
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
    finally:
        _drain(pending)
    return count


def pipelined_recv(
    chunks: ChunkPlan | Sequence[Chunk],
    slots: Sequence[torch.Tensor],
    view: Callable[[Chunk, torch.Tensor], torch.Tensor],
    recv: Callable[[Chunk, torch.Tensor], Work | None],
    scatter: Callable[[Chunk, torch.Tensor], None],
    fences: Sequence[Fence] | None = None,
) -> int:
    """Receive and scatter every chunk, double-buffered; returns the number of chunks scattered.

    The receives of the first ``len(slots)`` chunks are posted up front; after chunk ``i``'s
    receive completes it is scattered and the receive of chunk ``i + len(slots)`` is posted into
    the same slot, so receiving chunk ``i+1`` overlaps scattering chunk ``i``. With ``fences``,
    a slot is re-posted only after the host saw the CUDA scatter that read it finish. Posted
    receives are waited before returning, also when a callable raises.
    """
    depth = _check_slots(chunks, slots, fences)
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
                work.wait()
            scatter(chunks[i], bufs[s])
            if fences is not None:
                fences[s].record()
            count += 1
            if i + depth < n:
                post(i + depth)
    finally:
        _drain(pending)
    return count


# --------------------------------------------------------------------------- ops adapters
def ops_gatherer(
    caches: Sequence[torch.Tensor],
    spec: KVCacheSpec,
    block_ids: Any,
    head_start: int = 0,
    num_heads: int | None = None,
    layers: Any = None,
    backend: str | None = None,
) -> Callable[[Chunk, torch.Tensor], None]:
    """``gather(chunk, buf)`` with :func:`kvxfer.ops.gather_blocks` over the chunk's source
    blocks (``block_ids`` is the whole request's source block list, token order)."""
    from . import ops

    ids = torch.as_tensor(block_ids, dtype=torch.int64)

    def gather(chunk: Chunk, buf: torch.Tensor) -> None:
        ops.gather_blocks(
            caches,
            spec,
            chunk.src_blocks(ids),
            chunk.num_tokens,
            head_start,
            num_heads,
            layers,
            out=buf,
            backend=backend,
        )

    return gather


def ops_scatterer(
    caches: Sequence[torch.Tensor],
    spec: KVCacheSpec,
    block_ids: Any,
    head_start: int = 0,
    layers: Any = None,
    backend: str | None = None,
) -> Callable[[Chunk, torch.Tensor], None]:
    """``scatter(chunk, buf)`` with :func:`kvxfer.ops.scatter_blocks` into the chunk's
    destination blocks (``block_ids`` is the whole request's destination block list)."""
    from . import ops

    ids = torch.as_tensor(block_ids, dtype=torch.int64)

    def scatter(chunk: Chunk, buf: torch.Tensor) -> None:
        ops.scatter_blocks(
            buf, caches, spec, chunk.dst_blocks(ids), chunk.num_tokens, head_start, layers, backend=backend
        )

    return scatter


# --------------------------------------------------------------------------- stream ordering
def wait_for(deps: Any, stream: Any = None) -> None:
    """Order ``stream`` (default: the current CUDA stream) after ``deps``: CUDA events and/or
    streams handed in by the caller (the compute that wrote the layers about to move). No host
    synchronisation. ``None`` or an empty list does nothing (CPU callers pass nothing)."""
    if deps is None:
        return
    if not isinstance(deps, (list, tuple)):
        deps = [deps]
    if not deps:
        return
    if stream is None:
        stream = torch.cuda.current_stream()
    for d in deps:
        if isinstance(d, torch.cuda.Event):
            stream.wait_event(d)
        elif isinstance(d, torch.cuda.Stream):
            stream.wait_stream(d)
        else:
            raise ValueError(f"deps: expected CUDA events or streams, got {type(d).__name__}")


def record_done(stream: Any = None) -> Any:
    """A CUDA event recorded on ``stream`` (default current) after the transfer's work; the
    caller's stream does ``wait_event`` on it before reading the scattered cache."""
    ev = torch.cuda.Event()
    ev.record(stream if stream is not None else torch.cuda.current_stream())
    return ev
