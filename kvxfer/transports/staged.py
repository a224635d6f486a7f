"""Chunked, double-buffered ``pg`` transfers through staging buffers allocated once.

:class:`StagedPipeline` is a :class:`~kvxfer.transports.WirePipeline` the engine recognises
(``streams = True``): instead of gathering a whole wire per (batch, source rank) into a fresh
tensor and sending it, the exporter gathers ``chunk_tokens`` tokens at a time into one of two
staging buffers while the previous chunk is on the wire, and the loader receives into its own
two buffers, scattering chunk ``i`` while chunk ``i+1`` arrives
(:func:`kvxfer.staging.pipelined_send` / :func:`~kvxfer.staging.pipelined_recv` over the raw,
non-blocking ``ProcessGroup.send/recv`` work objects). The same code runs over Gloo (CPU) and
NCCL (GPU); nothing is allocated per request: each role (sending, receiving) has one
:class:`~kvxfer.staging.StagingPool` per buffer kind, made on first use and reused.

Agreement between the two ends (both must cut identical chunks):

1. the exporter advertises its buffer size in the handshake's ``pg`` entry
   (:meth:`handshake_info`: ``{"staging_bytes": n}``);
2. the loader picks ``chunk_tokens`` (:meth:`chunk_tokens_for`): the most tokens whose wire
   fits ``min(own, exporter's)`` buffer, rounded down to a multiple of ``lcm(source unit,
   destination unit)`` so every chunk starts on a unit boundary on both sides, and sends it in
   the ``SendReq``; ``0`` (an exporter that does not stage) means whole wires, received into
   a staging buffer when one fits, else into a tensor allocated for it (counted in stats);
3. both split each ops call of ``T`` tokens into pieces of ``chunk_tokens`` (``T`` when
   ``T <= chunk_tokens``) with :func:`pieces`; piece ``i`` of a stream travels with tag ``i``.

Buffer kinds: NCCL pairs use device buffers on the cache device; Gloo pairs use host buffers,
page-locked when the caches are CUDA (``pin_memory``): there the host hands a buffer to Gloo
only after the CUDA gather into it completed, and refills a receive buffer only after the
CUDA scatter that read it completed (events polled with ``query()``, never ``synchronize()``).
``pin_memory=True`` also makes the exporter offer a Gloo pair for CUDA caches (staging through
pinned host memory instead of NCCL).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch

from ..spec import KVCacheSpec
from ..staging import ChunkPlan, StagingPool, pipelined_recv, pipelined_send
from ..tracing import trace
from . import WirePipeline

__all__ = ["Piece", "StagedPipeline", "pieces"]

DEFAULT_BUFFER_BYTES = 32 << 20  # 2 x 32 MiB per role: 256 Llama-8B tokens (8 heads) per chunk


@dataclass(frozen=True)
class Piece:
    """Tokens ``num_tokens`` of one ops call, at unit ids ``units`` of this side, sent as the
    ``index``-th chunk of a stream."""

    index: int
    units: torch.Tensor
    num_tokens: int


def pieces(calls: Sequence[tuple[torch.Tensor, int]], chunk_tokens: int, unit: int) -> list[Piece]:
    """Cut ops calls ``(unit ids, num_tokens)`` into pieces of ``chunk_tokens`` tokens.

    ``chunk_tokens`` must be a multiple of ``unit`` (tokens per unit of this side) unless it is
    0 (one piece per call). A call of ``T <= chunk_tokens`` tokens is one piece; a longer one
    gives ``ceil(T / chunk_tokens)`` pieces, the last shorter. Both ends call this with their
    own units and the same ``chunk_tokens``, so they cut at the same tokens.
    """
    if chunk_tokens and chunk_tokens % unit:
        raise ValueError(f"chunk_tokens: {chunk_tokens} is not a multiple of the unit {unit}")
    out: list[Piece] = []
    for units, t in calls:
        c = chunk_tokens if 0 < chunk_tokens < t else max(t, 1)
        for ch in ChunkPlan(t, c, unit, unit, 1):
            out.append(Piece(len(out), ch.src_blocks(units), ch.num_tokens))
    return out


@contextlib.contextmanager
def _held_on_error(pool: StagingPool, slots: list[torch.Tensor], cache_device: torch.device):
    """If the stream fails, GPU work it enqueued may still touch ``slots``: keep them out of
    the pool until an event recorded now (after all of it, on this stream) completed."""
    try:
        yield
    except BaseException:
        if cache_device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()
            pool.hold_until(slots, ev)
        raise


class _Timed:
    """A ProcessGroup work object whose ``wait()`` is bounded by the pair's timeout."""

    __slots__ = ("_td", "_work")

    def __init__(self, work, timeout_s: float) -> None:
        self._work, self._td = work, timedelta(seconds=timeout_s)

    def wait(self):
        return self._work.wait(self._td)


class _QueryFence:
    """Host fence for a host staging buffer of CUDA caches: ``record()`` an event on the
    current stream, ``wait()`` polls ``query()`` (bounded) until the work before it is done."""

    def __init__(self, timeout_s: float) -> None:
        self._ev = torch.cuda.Event()
        self._recorded = False
        self._timeout_s = timeout_s

    def record(self) -> None:
        self._ev.record()
        self._recorded = True

    def wait(self) -> None:
        if self._recorded:
            from ..ordering import wait_event

            wait_event(self._ev, self._timeout_s, "staging buffer")


class StagedPipeline(WirePipeline):
    """Double-buffered chunk streaming through staging pools (see module doc).

    Args:
        buffer_bytes: bytes of each staging buffer (the exporter advertises it; a chunk's wire
            fits one buffer).
        depth: buffers leased per stream (2 = double buffering; more keeps more chunks in
            flight).
        pin_memory: stage CUDA caches through pinned host memory over Gloo instead of NCCL.
        max_chunk_tokens: optional cap on tokens per chunk (more, smaller chunks in flight).
    """

    streams = True

    def __init__(
        self,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        depth: int = 2,
        pin_memory: bool = False,
        max_chunk_tokens: int | None = None,
    ) -> None:
        for name, v in (("buffer_bytes", buffer_bytes), ("depth", depth)):
            if isinstance(v, bool) or not isinstance(v, int) or v < (2 if name == "depth" else 1):
                raise ValueError(f"{name}: must be an int >= {2 if name == 'depth' else 1}, got {v!r}")
        if max_chunk_tokens is not None and (not isinstance(max_chunk_tokens, int) or max_chunk_tokens < 1):
            raise ValueError(f"max_chunk_tokens: must be a positive int or None, got {max_chunk_tokens!r}")
        self.buffer_bytes = buffer_bytes
        self.depth = depth
        self.pin_memory = bool(pin_memory)
        self.max_chunk_tokens = max_chunk_tokens
        self._pools: dict[tuple[str, str, bool], StagingPool] = {}
        self._lock = threading.Lock()
        self.num_pool_allocs = 0
        self.num_streams = 0
        self.num_chunks_sent = 0
        self.num_chunks_recv = 0
        self.num_fallback_allocs = 0

    # ------------------------------------------------------------------ configuration
    def pg_backend(self, device: torch.device) -> str:
        """Pair-group backend this side offers for caches on ``device``."""
        return "nccl" if device.type == "cuda" and not self.pin_memory else "gloo"

    def handshake_info(self) -> dict:
        return {"staging_bytes": self.buffer_bytes}

    def chunk_tokens_for(
        self, peer_pg: dict | None, bytes_per_token: int, src_unit: int, dst_unit: int
    ) -> int:
        """Tokens per chunk for a read from an exporter whose handshake ``pg`` entry is
        ``peer_pg`` (0: it does not stage; whole wires). Raises ``ValueError`` when a buffer
        cannot hold one chunk unit."""
        peer = (peer_pg or {}).get("staging_bytes")
        if not isinstance(peer, int) or peer <= 0:
            return 0
        unit = math.lcm(src_unit, dst_unit)
        fit = min(self.buffer_bytes, peer) // bytes_per_token
        if self.max_chunk_tokens is not None:
            fit = min(fit, self.max_chunk_tokens)
        chunk = fit // unit * unit
        if chunk == 0:
            raise ValueError(
                f"staging: a buffer of {min(self.buffer_bytes, peer)} bytes holds {fit} tokens of "
                f"{bytes_per_token} bytes, fewer than one chunk unit of {unit} tokens"
            )
        return chunk

    def check_chunk(self, spec: KVCacheSpec, num_heads: int, chunk_tokens: int, unit: int) -> str:
        """Exporter: why a loader's ``chunk_tokens`` cannot be served ("" when it can)."""
        if chunk_tokens < 0 or (chunk_tokens and chunk_tokens % unit):
            return f"chunk_tokens {chunk_tokens} is not a non-negative multiple of the unit {unit}"
        need = chunk_tokens * spec.bytes_per_token(num_heads=num_heads)
        if need > self.buffer_bytes:
            return f"chunk_tokens {chunk_tokens} need {need} bytes, staging buffers hold {self.buffer_bytes}"
        return ""

    def _pool(self, role: str, backend: str, cache_device: torch.device) -> StagingPool:
        host = backend == "gloo"
        pinned = host and cache_device.type == "cuda"
        key = (role, backend, pinned)
        with self._lock:
            pool = self._pools.get(key)
            if pool is None:
                pool = StagingPool(
                    self.depth, self.buffer_bytes, "cpu" if host else cache_device, pin_memory=pinned
                )
                self._pools[key] = pool
                self.num_pool_allocs += 1
            return pool

    def stats(self) -> dict:
        return {
            "staging_pools": self.num_pool_allocs,
            "staging_streams": self.num_streams,
            "staging_chunks_sent": self.num_chunks_sent,
            "staging_chunks_recv": self.num_chunks_recv,
            "staging_fallback_allocs": self.num_fallback_allocs,
        }

    # ------------------------------------------------------------------ streaming
    @staticmethod
    def _viewer(spec: KVCacheSpec, num_heads: int):
        def view(p: Piece, slot: torch.Tensor) -> torch.Tensor:
            shape = spec.wire_shape(p.num_tokens, num_heads)
            nbytes = math.prod(shape) * spec.element_size
            if nbytes > slot.numel():
                raise ValueError(f"staging: chunk {p.index} needs {nbytes} bytes, buffer has {slot.numel()}")
            return slot[:nbytes].view(spec.dtype).view(shape)

        return view

    def send_stream(
        self,
        pg,
        peer: int,
        timeout_s: float,
        backend: str,
        spec: KVCacheSpec,
        cache_device: torch.device,
        num_heads: int,
        unit: int,
        chunk_tokens: int,
        calls: Sequence[tuple[torch.Tensor, int]],
        gather: Callable[[torch.Tensor, int, torch.Tensor], None],
        tag: str = "",
    ) -> int:
        """Exporter: gather every piece of ``calls`` (source unit ids, tokens) into staging
        buffers and send it; gather of piece ``i+1`` overlaps the send of piece ``i``. Returns
        the bytes sent. ``gather(units, num_tokens, out)`` fills the wire view ``out``."""
        ps = pieces(calls, chunk_tokens, unit)
        view = self._viewer(spec, num_heads)
        pool = self._pool("send", backend, cache_device)
        fences = self._fences(pool, cache_device, timeout_s)
        sent = 0

        def do_gather(p: Piece, buf: torch.Tensor) -> None:
            with trace("gather", tag):
                gather(p.units, p.num_tokens, buf)

        def do_send(p: Piece, buf: torch.Tensor):
            nonlocal sent
            sent += buf.numel() * buf.element_size()
            with trace("send", tag):
                return _Timed(pg.send([buf.reshape(-1).view(torch.uint8)], peer, p.index), timeout_s)

        with pool.lease(self.depth, timeout_s) as slots, _held_on_error(pool, slots, cache_device):
            n = pipelined_send(ps, slots, view, do_gather, do_send, fences)
        self.num_streams += 1
        self.num_chunks_sent += n
        return sent

    def recv_stream(
        self,
        pg,
        peer: int,
        timeout_s: float,
        backend: str,
        spec: KVCacheSpec,
        cache_device: torch.device,
        num_heads: int,
        unit: int,
        chunk_tokens: int,
        calls: Sequence[tuple[torch.Tensor, int]],
        scatter: Callable[[torch.Tensor, int, torch.Tensor], None],
        tag: str = "",
    ) -> int:
        """Loader: receive every piece of ``calls`` (destination unit ids, tokens) into
        staging buffers and scatter it; receiving piece ``i+1`` overlaps scattering piece
        ``i``. Returns the number of pieces. ``scatter(units, num_tokens, wire)``."""
        ps = pieces(calls, chunk_tokens, unit)
        view = self._viewer(spec, num_heads)
        pool = self._pool("recv", backend, cache_device)
        fences = self._fences(pool, cache_device, timeout_s)

        def do_recv(p: Piece, buf: torch.Tensor):
            with trace("recv", tag):
                return _Timed(pg.recv([buf.reshape(-1).view(torch.uint8)], peer, p.index), timeout_s)

        def do_scatter(p: Piece, buf: torch.Tensor) -> None:
            with trace("scatter", tag):
                scatter(p.units, p.num_tokens, buf)

        too_big = chunk_tokens == 0 and any(
            math.prod(spec.wire_shape(t, num_heads)) * spec.element_size > self.buffer_bytes for _, t in calls
        )
        if too_big:  # an exporter that does not stage sends whole wires larger than a buffer
            for p in ps:
                wire = torch.empty(
                    spec.wire_shape(p.num_tokens, num_heads),
                    dtype=spec.dtype,
                    device=pool.buffers[0].device,
                    pin_memory=pool.pinned,
                )
                self.num_fallback_allocs += 1
                do_recv(p, wire).wait()
                do_scatter(p, wire)
                if fences is not None:  # the host wire must outlive the CUDA scatter reading it
                    fences[0].record()
                    fences[0].wait()
            n = len(ps)
        else:
            with pool.lease(self.depth, timeout_s) as slots, _held_on_error(pool, slots, cache_device):
                n = pipelined_recv(ps, slots, view, do_recv, do_scatter, fences)
        self.num_streams += 1
        self.num_chunks_recv += n
        return n

    def _fences(self, pool: StagingPool, cache_device: torch.device, timeout_s: float):
        if pool.device.type == "cpu" and cache_device.type == "cuda":
            return [_QueryFence(timeout_s) for _ in range(self.depth)]
        return None
