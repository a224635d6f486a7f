"""The ``pg`` transport's pipeline: chunked, double-buffered transfers through staging pools.

Every ``pg`` transfer streams: the exporter gathers ``chunk_tokens`` tokens at a time into one
of its staging buffers while the previous chunk is on the wire, and the loader receives into
its own buffers, scattering chunk ``i`` while chunk ``i+1`` arrives
(:func:`kvxfer.transports.staging.pipelined_send` / :func:`~kvxfer.transports.staging.pipelined_recv` over the raw,
non-blocking ``ProcessGroup.send/recv`` work objects). Nothing is allocated per request: each
role (sending, receiving) of an engine keeps per buffer kind the
:class:`~kvxfer.transports.staging.StagingPool` each of its streams running at once takes whole
(:class:`~kvxfer.transports.staging.StagingLanes`: made on first need, reused, at most
``max_streams``), so the memory a transfer uses is bounded by the configuration
(``depth x buffer_bytes`` per stream, 2 x 32 MiB by default), whatever the request's size. An
exporter streaming to several loaders at once gives each its own buffers (and with NCCL, unless
the engine has an SM budget, its own CUDA stream): a loader that stops reading holds its own
stream's only (each send waits out its bound), not every other loader's.

Agreement between the two ends (both must cut identical chunks):

1. the exporter advertises its buffer size in the handshake's ``pg`` entry
   (:meth:`StagedPipeline.handshake_info`: ``{"staging_bytes": n}``); a peer that does not
   is refused by name;
2. the loader picks ``chunk_tokens`` (:meth:`StagedPipeline.chunk_tokens_for`, from
   :func:`kvxfer.transports.staging.chunk_tokens_for` on ``min(own, exporter's)`` buffer) and sends it in
   the ``SendReq``; the exporter checks it fits its buffers;
3. both cut each ops call with :func:`kvxfer.transports.staging.cut` and send chunk ``i`` with tag ``i``;
4. after the last chunk the exporter sends the stream's *status* (tag ``n``, the number of
   chunks): one byte per request of the send request, 1 when the request was live at every
   chunk's gather (its bytes are its export's), 0 when it was released meanwhile (aborted,
   lease ended): the loader reports a request landed only from a 1 there, and the others
   failed, while the rest of the stream still lands. So one abort fails one request, and "done"
   always comes from the exporter's record, never from the absence of an error.

Buffer kinds: NCCL pairs use device buffers on the cache device; Gloo pairs use host buffers,
page-locked when the caches are CUDA: there the host hands a buffer to Gloo only after the
CUDA gather into it completed, and refills a receive buffer only after the CUDA scatter that
read it completed (:class:`~kvxfer.transports.staging.HostFence`). ``pin_memory=True`` makes the
exporter offer only Gloo for CUDA caches (staging through pinned host memory instead of NCCL).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch

from ...spec import KVCacheSpec
from ...tracing import trace
from ..staging import (
    Chunk,
    HostFence,
    StagingLanes,
    StagingPool,
    Stream,
    chunk_tokens_for,
    pipelined_recv,
    pipelined_send,
)

__all__ = ["DEFAULT_BUFFER_BYTES", "MAX_STREAMS", "StagedPipeline"]

DEFAULT_BUFFER_BYTES = 32 << 20  # 2 x 32 MiB per stream: 256 Llama-8B tokens (8 heads) per chunk
# streams a role runs at once, each in buffers of its own (made only when streams overlap): a
# loader that stops reading holds one stream's buffers, three more loaders are served meanwhile
MAX_STREAMS = 4


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
    """A ProcessGroup work object whose ``wait()`` ends by ``end`` (``time.monotonic()``). A
    loader's receives share the stream's one bound (a fresh timeout per chunk let an exporter
    sending each chunk just within it hold the stream, and the loader's worker, for many times
    the load's deadline); an exporter's sends are bounded one by one."""

    __slots__ = ("_end", "_work")

    def __init__(self, work, end: float) -> None:
        self._work, self._end = work, end

    def wait(self):
        return self._work.wait(timedelta(seconds=max(0.001, self._end - time.monotonic())))


class StagedPipeline:
    """How an engine's ``pg`` pairs move wires (see the module doc).

    Args:
        buffer_bytes: bytes of each staging buffer (the exporter advertises it; a chunk's wire
            fits one buffer).
        depth: buffers leased per stream (2 = double buffering; more keeps more chunks in
            flight).
        pin_memory: stage CUDA caches through pinned host memory over Gloo instead of NCCL.
        max_chunk_tokens: optional cap on tokens per chunk (more, smaller chunks in flight).
        max_streams: streams a role runs at once, each with its own ``depth`` buffers (made
            when streams overlap); one more waits for a free one, bounded by its timeout.
    """

    def __init__(
        self,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        depth: int = 2,
        pin_memory: bool = False,
        max_chunk_tokens: int | None = None,
        max_streams: int = MAX_STREAMS,
    ) -> None:
        for name, v in (("buffer_bytes", buffer_bytes), ("depth", depth), ("max_streams", max_streams)):
            if isinstance(v, bool) or not isinstance(v, int) or v < (2 if name == "depth" else 1):
                raise ValueError(f"{name}: must be an int >= {2 if name == 'depth' else 1}, got {v!r}")
        if max_chunk_tokens is not None and (not isinstance(max_chunk_tokens, int) or max_chunk_tokens < 1):
            raise ValueError(f"max_chunk_tokens: must be a positive int or None, got {max_chunk_tokens!r}")
        self.buffer_bytes = buffer_bytes
        self.depth = depth
        self.pin_memory = bool(pin_memory)
        self.max_chunk_tokens = max_chunk_tokens
        self.max_streams = max_streams
        self._lanes: dict[tuple[str, str, bool, str], StagingLanes] = {}
        self._streams: dict[int, object] = {}  # id of a send lane's pool -> its CUDA stream
        self._lock = threading.Lock()
        self.num_streams = 0
        self.num_chunks_sent = 0
        self.num_chunks_recv = 0

    # ------------------------------------------------------------------ configuration
    def pg_backend(self, device: torch.device) -> str:
        """Pair-group backend this side prefers for caches on ``device``."""
        return "nccl" if device.type == "cuda" and not self.pin_memory else "gloo"

    def handshake_info(self) -> dict:
        return {"staging_bytes": self.buffer_bytes}

    def chunk_tokens_for(
        self, peer_pg: dict | None, bytes_per_token: int, src_unit: int, dst_unit: int
    ) -> int:
        """Tokens per chunk for a read from an exporter whose handshake ``pg`` entry is
        ``peer_pg``. Raises ``ValueError`` naming the problem when the exporter does not
        advertise its staging buffers or a buffer cannot hold one chunk unit."""
        peer = (peer_pg or {}).get("staging_bytes")
        if isinstance(peer, bool) or not isinstance(peer, int) or peer <= 0:
            raise ValueError(
                f"staging: the exporter advertises no staging buffer size (pg entry {peer_pg!r}); "
                "it runs an incompatible kvxfer"
            )
        return chunk_tokens_for(
            min(self.buffer_bytes, peer), bytes_per_token, src_unit, dst_unit, self.max_chunk_tokens
        )

    def check_chunk(
        self, spec: KVCacheSpec, num_heads: int, chunk_tokens: int, unit: int, num_layers: int | None = None
    ) -> str:
        """Exporter: why a loader's ``chunk_tokens`` cannot be served ("" when it can)."""
        if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            return f"chunk_tokens {chunk_tokens!r} is not a positive int"
        if chunk_tokens % unit:
            return f"chunk_tokens {chunk_tokens} is not a multiple of the unit {unit}"
        need = chunk_tokens * spec.bytes_per_token(num_heads=num_heads, num_layers=num_layers)
        if need > self.buffer_bytes:
            return f"chunk_tokens {chunk_tokens} need {need} bytes, staging buffers hold {self.buffer_bytes}"
        return ""

    def _lanes_of(self, role: str, backend: str, cache_device: torch.device) -> StagingLanes:
        host = backend == "gloo"
        pinned = host and cache_device.type == "cuda"
        key = (role, backend, pinned, str(cache_device))
        with self._lock:
            lanes = self._lanes.get(key)
            if lanes is None:
                device = "cpu" if host else cache_device
                lanes = self._lanes[key] = StagingLanes(
                    lambda: StagingPool(self.depth, self.buffer_bytes, device, pin_memory=pinned),
                    self.max_streams,
                )
            return lanes

    @contextlib.contextmanager
    def _leased(
        self, role: str, backend: str, cache_device: torch.device, timeout_s: float, own_stream: bool = False
    ):
        """A stream's staging: a lane of ``role``'s pools for ``backend`` and its ``depth``
        buffers, both waited for within ``timeout_s``; the buffers held after a failure until
        the GPU work it enqueued completed. Yields (pool, buffers).

        ``own_stream``: an exporter's lane of device buffers (NCCL) runs on a CUDA stream of its
        own, current in the block: its gathers, and an NCCL send's wait (which makes the current
        stream wait for the send), then queue behind that lane only, not behind another loader's
        stalled send on the stream they would share. The caller asks for it only without an SM
        budget (lanes side by side would each take the budget). Pinned host buffers (Gloo) wait
        on the host, and the loader's lanes stay on its load stream
        (:meth:`kvxfer.ordering.StreamOrder.wait_done` waits for its scatters there)."""
        end = time.monotonic() + timeout_s
        lanes = self._lanes_of(role, backend, cache_device)
        with lanes.lane(self.depth, timeout_s) as pool:
            own = own_stream and role == "send" and pool.device.type == "cuda"
            with (
                torch.cuda.stream(self._lane_stream(pool, cache_device)) if own else contextlib.nullcontext(),
                pool.lease(self.depth, max(0.001, end - time.monotonic())) as slots,
                _held_on_error(pool, slots, cache_device),
            ):
                yield pool, slots

    def _lane_stream(self, pool: StagingPool, device: torch.device):
        """The CUDA stream of the lane ``pool`` (made on first use, kept with it)."""
        with self._lock:
            s = self._streams.get(id(pool))
            if s is None:
                s = self._streams[id(pool)] = torch.cuda.Stream(device)
            return s

    def _count(self, role: str, chunks: int) -> None:
        with self._lock:
            self.num_streams += 1
            if role == "send":
                self.num_chunks_sent += chunks
            else:
                self.num_chunks_recv += chunks

    def pools(self) -> list[StagingPool]:
        """Every staging pool made so far (each a lane of one role and buffer kind)."""
        with self._lock:
            return [p for lanes in self._lanes.values() for p in lanes.pools]

    def stats(self) -> dict:
        return {
            "staging_pools": len(self.pools()),
            "staging_streams": self.num_streams,
            "staging_chunks_sent": self.num_chunks_sent,
            "staging_chunks_recv": self.num_chunks_recv,
        }

    # ------------------------------------------------------------------ streaming
    def _fences(self, pool: StagingPool, cache_device: torch.device, timeout_s: float):
        if pool.device.type == "cpu" and cache_device.type == "cuda":
            return [HostFence(timeout_s) for _ in range(self.depth)]
        return None

    def send_stream(
        self,
        pg,
        peer: int,
        backend: str,
        cache_device: torch.device,
        stream: Stream,
        gather: Callable[[Chunk, torch.Tensor], None],
        timeout_s: float,
        status: Callable[[], bytes] | None = None,
        own_stream: bool = False,
    ) -> int:
        """Exporter: gather every chunk of ``stream`` (source unit ids) into staging buffers and
        send it to ``peer`` of pair ``pg`` (``backend``); the gather of chunk ``i+1`` overlaps
        the send of chunk ``i``. Returns the bytes sent. ``gather(chunk, out)`` fills the wire
        view ``out``. ``status()``, called once every chunk was gathered, gives the stream's
        status bytes (module doc, step 4), sent last. Every wait ends by ``timeout_s``.
        ``own_stream``: on device buffers, its lane's own CUDA stream (:meth:`_leased`)."""
        chunks = stream.chunks()
        view = stream.viewer()
        tag = stream.tag
        sent = 0

        def do_gather(c: Chunk, buf: torch.Tensor) -> None:
            with trace("gather", tag):
                gather(c, buf)

        def do_send(c: Chunk, buf: torch.Tensor):
            nonlocal sent
            sent += buf.numel() * buf.element_size()
            with trace("send", tag):
                # per send (the loader's receives bound the stream by its own deadline; a shared
                # bound here would fail an honest loader slower than this rank's timeout_s)
                return _Timed(
                    pg.send([buf.reshape(-1).view(torch.uint8)], peer, c.index), time.monotonic() + timeout_s
                )

        with self._leased("send", backend, cache_device, timeout_s, own_stream) as (pool, slots):
            n = pipelined_send(
                chunks, slots, view, do_gather, do_send, self._fences(pool, cache_device, timeout_s)
            )
            if status is not None:  # on the lane's stream too
                with trace("status", tag):
                    flags = torch.frombuffer(bytearray(status()), dtype=torch.uint8).to(pool.device)
                    _Timed(pg.send([flags], peer, n), time.monotonic() + timeout_s).wait()
        self._count("send", n)
        return sent

    def recv_stream(
        self,
        pg,
        peer: int,
        backend: str,
        cache_device: torch.device,
        stream: Stream,
        scatter: Callable[[Chunk, torch.Tensor], None],
        timeout_s: float,
        num_requests: int = 0,
    ) -> tuple[int, bytes]:
        """Loader: receive every chunk of ``stream`` (destination unit ids) from ``peer`` of
        pair ``pg`` (``backend``) into staging buffers and ``scatter(chunk, wire)`` it;
        receiving chunk ``i+1`` overlaps scattering chunk ``i``. Returns (the number of chunks,
        the stream's status: one byte per request, ``num_requests`` of them, module doc step 4;
        empty when 0). Every wait ends by ``timeout_s``."""
        chunks = stream.chunks()
        view = stream.viewer()
        tag = stream.tag
        end = time.monotonic() + timeout_s  # the stream's one bound (_Timed)

        def do_recv(c: Chunk, buf: torch.Tensor):
            with trace("recv", tag):
                return _Timed(pg.recv([buf.reshape(-1).view(torch.uint8)], peer, c.index), end)

        def do_scatter(c: Chunk, buf: torch.Tensor) -> None:
            with trace("scatter", tag):
                scatter(c, buf)

        with self._leased("recv", backend, cache_device, timeout_s) as (pool, slots):
            n = pipelined_recv(
                chunks, slots, view, do_recv, do_scatter, self._fences(pool, cache_device, timeout_s)
            )
        flags = b""
        if num_requests:
            got = torch.empty(num_requests, dtype=torch.uint8, device=pool.device)
            with trace("status", tag):
                _Timed(pg.recv([got], peer, n), end).wait()
            flags = got.cpu().numpy().tobytes()
        self._count("recv", n)
        return n, flags
