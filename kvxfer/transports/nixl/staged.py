"""The staged path of the ``nixl`` transport: gather into registered staging, READ, scatter.

Used for every read the direct path cannot serve (layouts, block sizes or head slices that do
not line up, MLA with padded rows...). It is the chunked, double-buffered pipeline of the
``pg`` transport (:mod:`kvxfer.transports.staging`: both ends :func:`~kvxfer.transports.staging.cut` the ops calls
into the same chunks of ``chunk_tokens`` tokens) with NIXL in place of send/recv:

1. the loader opens a mailbox for a fresh stream key and asks the exporter (``SendReq`` on the
   side channel, carrying the requests' tokens) to stream ``calls``;
2. the exporter gathers chunk ``i`` into one of its registered staging buffers (slot ``s``)
   and notifies the loader ``R(key, i, s, nbytes)``;
3. the loader READs ``nbytes`` of the exporter's slot ``s`` into one of its own registered
   staging buffers, with the notification ``D(key, i)`` that NIXL delivers to the exporter
   once the READ completed — so the exporter refills slot ``s`` only after it was read;
4. the loader scatters the chunk while the next one is gathered and read;
5. once the loader READ every chunk, the exporter notifies ``E(key, status)``: one byte per
   request of the send request, 1 when it was live at every chunk's gather, 0 when it was
   released meanwhile. The loader reports a request landed only from a 1 there (and the
   others failed, while the rest of the stream lands).

Either side that fails sends ``A(key)`` (abort), so the other stops at once instead of waiting
out its bound; the loader's abort (sent also in answer to the exporter's) says whether any of
its READs is still running. Buffers another transfer may still touch after a failure stay out
of the pool: the loader's until its READ ended (:class:`~kvxfer.transports.nixl.XferFence`),
the exporter's — only when the loader did not say "nothing running" within ``ECHO_S`` and is
not reported gone — until the loader's deadline has certainly passed (the loader never uses a
chunk after its deadline, and the exporter knows the loader's ``timeout_s`` from its pair
request). A side waiting ``PING_S`` without news pings its peer: NIXL reports a dead peer on
the ping at once.
CUDA caches: the host hands a buffer to NIXL only after the gather into it completed, and
refills a receive buffer only after the scatter that read it completed
(:class:`~kvxfer.transports.staging.HostFence`), since the NIC reads and writes outside any CUDA stream.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ...tracing import trace
from ..staging import Chunk, HostFence, StagingPool, Stream, pipelined_recv, pipelined_send
from .agent import NixlAgent, NixlError, XferFence, XferTimeout, encode_notif, mem_of

__all__ = ["PING_S", "NixlStaging", "recv_stream", "send_stream"]

PING_S = 0.2  # a side waiting this long without news pings its peer: a dead one is reported
ECHO_S = 1.0  # how long an exporter whose stream failed waits for the loader's "nothing running"


class NixlStaging:
    """A :class:`~kvxfer.transports.staging.StagingPool` registered with a NIXL agent, and what a peer
    needs to address its buffers (:meth:`describe`)."""

    def __init__(
        self,
        agent: NixlAgent,
        depth: int,
        buffer_bytes: int,
        cache_device: torch.device,
        pin_memory: bool,
        what: str,
    ) -> None:
        host = cache_device.type != "cuda" or pin_memory
        self.pool = StagingPool(
            depth,
            buffer_bytes,
            "cpu" if host else cache_device,
            pin_memory=host and cache_device.type == "cuda",
        )
        agent.register([self.pool.storage], what)
        self.mem, self.dev = mem_of(self.pool.buffers[0])
        self.addrs = [int(b.data_ptr()) for b in self.pool.buffers]
        self._slot = {a: i for i, a in enumerate(self.addrs)}
        self.cache_device = cache_device

    def slot_of(self, buf: torch.Tensor) -> int:
        return self._slot[int(buf.data_ptr())]

    def describe(self) -> dict:
        return {"addrs": self.addrs, "bytes": self.pool.buffer_bytes, "mem": self.mem, "dev": self.dev}

    def fences(self, timeout_s: float) -> list[HostFence] | None:
        """Host fences per buffer when CUDA kernels fill or drain the buffers (None on CPU)."""
        if self.cache_device.type != "cuda":
            return None
        return [HostFence(timeout_s) for _ in range(self.pool.num_buffers)]


class _Until:
    """An "event" (``query()``) that completes at a monotonic time: keeps a staging buffer out
    of the pool until a peer can no longer be reading it."""

    def __init__(self, t: float) -> None:
        self.t = t

    def query(self) -> bool:
        return time.monotonic() >= self.t


def _abort(agent: NixlAgent, peer: str, key: str, clean: bool = False) -> bool:
    """Tell ``peer`` the stream ``key`` is over (``clean``: none of this side's READs is still
    running); True when NIXL says the peer is gone."""
    try:
        agent.send_notif(peer, encode_notif("A", key, int(clean)))
    except NixlError as e:
        return e.peer_gone
    return False


# --------------------------------------------------------------------------- exporter
def send_stream(
    agent: NixlAgent,
    peer: str,
    key: str,
    staging: NixlStaging,
    stream: Stream,
    gather: Callable[[Chunk, torch.Tensor], None],
    timeout_s: float,
    peer_timeout_s: float,
    status: Callable[[], bytes] | None = None,
) -> int:
    """Exporter: gather every chunk of ``stream`` (source unit ids) into the registered staging
    buffers and let ``peer`` READ it (module doc); returns the bytes read. Every wait ends
    ``timeout_s`` after the last progress (the stream's start, or the loader's last completed
    READ). ``gather(chunk, out)`` fills the wire view ``out`` and raises to stop;
    ``status()`` gives the stream's status bytes once every chunk was read (module doc, step
    5). An exception raised here carries ``peer_gone = True`` when NIXL reported the loader
    gone."""
    chunks = stream.chunks()
    view = stream.viewer()
    tag = stream.tag
    bound = [time.monotonic() + timeout_s]  # moves on with every READ completed (as pg's per-op bound)
    acked: set[int] = set()
    sent_at: dict[int, tuple[float, torch.Tensor]] = {}  # chunk -> (R sent, slot) until acked
    failed: list[BaseException] = []  # the first failure: every later wait raises it at once
    clean = [False]  # the loader said none of its READs of this stream is still running
    total = 0

    def absorb(msgs) -> None:
        for frm, m in msgs:
            if frm != peer:
                continue
            if m.kind == "D":
                acked.add(m.a)
                sent_at.pop(m.a, None)
                bound[0] = time.monotonic() + timeout_s
            elif m.kind == "A":
                clean[0] = clean[0] or m.a == 1
                if not failed:
                    failed.append(RuntimeError(f"the loader {peer} aborted the stream"))

    class Acked:
        """Work of one chunk: ``wait()`` returns once the loader's READ of it completed."""

        def __init__(self, i: int) -> None:
            self.i = i

        def wait(self) -> None:
            while self.i not in acked:
                if failed:
                    raise failed[0]
                got = agent.wait_box(key, min(bound[0], time.monotonic() + PING_S))
                absorb(got)
                if self.i in acked:
                    return
                if not got and not failed and time.monotonic() < bound[0]:
                    try:
                        agent.ping(peer, key)  # a dead loader is reported now, not at our bound
                    except NixlError as e:
                        failed.append(e)
                if not failed and agent.stopping():
                    failed.append(NixlError("the engine is closing"))
                if not failed and time.monotonic() >= bound[0]:
                    failed.append(
                        TimeoutError(f"the loader did not read chunk {self.i} within {timeout_s:.1f}s")
                    )

    def do_gather(c: Chunk, buf: torch.Tensor) -> None:
        with trace("gather", tag):
            gather(c, buf)

    def do_send(c: Chunk, buf: torch.Tensor) -> Acked:
        nonlocal total
        nbytes = buf.numel() * buf.element_size()
        sent_at[c.index] = (time.monotonic(), buf)
        with trace("send", tag):
            agent.send_notif(peer, encode_notif("R", key, c.index, staging.slot_of(buf), nbytes))
        total += nbytes
        return Acked(c.index)

    agent.open_box(key)
    try:
        with staging.pool.lease(staging.pool.num_buffers, timeout_s) as slots:
            try:
                pipelined_send(chunks, slots, view, do_gather, do_send, staging.fences(timeout_s))
                if status is not None:
                    agent.send_notif(peer, encode_notif("E", key, data=status()))
            except BaseException as e:
                gone = _abort(agent, peer, key)
                if gone:
                    e.peer_gone = True  # type: ignore[attr-defined]  # the caller forgets the peer
                    raise
                # A loader answers an abort with its own, saying whether a READ of ours is still
                # running; wait a moment for it (or for the last acknowledgements).
                end = time.monotonic() + ECHO_S
                while sent_at and not clean[0] and time.monotonic() < end:
                    absorb(agent.wait_box(key, end))
                if sent_at and not clean[0]:
                    # Buffers announced but not acknowledged may still be read by the loader
                    # until its own deadline (at most its timeout_s after our notice).
                    for t, buf in list(sent_at.values()):
                        staging.pool.hold_until([buf], _Until(t + peer_timeout_s + 1.0))
                raise
    finally:
        agent.close_box(key)
    return total


# --------------------------------------------------------------------------- loader
class _Reads:
    """The loader's READs of one stream: each chunk's READ starts as soon as both its buffer
    is posted and the exporter announced it, whichever comes last."""

    def __init__(
        self,
        agent: NixlAgent,
        peer: str,
        key: str,
        remote: dict,
        staging: NixlStaging,
        deadline: float,
        tag: str,
    ) -> None:
        self.agent, self.peer, self.key, self.remote = agent, peer, key, remote
        self.staging, self.deadline, self.tag = staging, deadline, tag
        self.want: dict[int, torch.Tensor] = {}  # chunk -> posted buffer
        self.ready: dict[int, tuple[int, int]] = {}  # chunk -> (exporter slot, bytes)
        self.active: dict[int, tuple] = {}  # chunk -> (handle, buffer)
        self.done: set[int] = set()
        self.failed: BaseException | None = None  # the first failure: later waits raise it at once
        self.status: bytes | None = None  # the exporter's E notification (module doc, step 5)

    def _absorb(self) -> None:
        for frm, m in self.agent.take(self.key):
            if frm != self.peer:
                continue
            if m.kind == "R":
                self.ready[m.a] = (m.b, m.c)
            elif m.kind == "E":
                self.status = m.data
            elif m.kind == "A":
                raise RuntimeError(
                    f"the exporter {self.peer} aborted the stream (a request was released, or its gather failed)"
                )

    def _start(self) -> None:
        for i in [i for i in self.want if i in self.ready and i not in self.active and i not in self.done]:
            buf = self.want[i]
            slot, nbytes = self.ready.pop(i)
            want = buf.numel() * buf.element_size()
            addrs = self.remote["addrs"]
            if not 0 <= slot < len(addrs) or nbytes != want or nbytes > self.remote["bytes"]:
                raise RuntimeError(
                    f"the exporter announced chunk {i} as {nbytes} bytes in slot {slot}; "
                    f"expected {want} bytes in one of {len(addrs)} slots"
                )
            local = _one(buf.data_ptr(), nbytes, self.staging.dev)
            remote = _one(addrs[slot], nbytes, self.remote["dev"])
            with trace("recv", self.tag):
                h = self.agent.start_read(
                    local,
                    self.staging.mem,
                    self.peer,
                    remote,
                    self.remote["mem"],
                    encode_notif("D", self.key, i),
                )
            self.active[i] = (h, buf)

    def post(self, c: Chunk, buf: torch.Tensor) -> _ReadWork:
        self.want[c.index] = buf
        if self.failed is None:
            try:
                self._absorb()
                self._start()
            except BaseException as e:
                self.failed = e
        return _ReadWork(self, c.index)

    def wait(self, i: int) -> None:
        if self.failed is not None:
            raise self.failed
        try:
            self._wait(i)
        except BaseException as e:
            self.failed = e
            raise

    def _wait(self, i: int) -> None:
        pause = 0.0
        quiet_since = time.monotonic()
        while True:
            n = len(self.done) + len(self.ready) + len(self.active)
            self._absorb()
            self._start()
            for j, (h, _) in list(self.active.items()):
                st = self.agent.poll_read(h)
                if st == "DONE":
                    self.agent.release_read(h)
                    del self.active[j]
                    self.done.add(j)
                elif st == "ERR":
                    raise NixlError(f"NIXL READ of chunk {j} from {self.peer} failed (peer gone?)")
            if i in self.done:
                return
            if self.agent.stopping():
                raise NixlError("the engine is closing")
            now = time.monotonic()
            if now >= self.deadline:
                raise TimeoutError(f"chunk {i} not read by the load's deadline")
            if len(self.done) + len(self.ready) + len(self.active) != n:
                quiet_since = now
            elif now - quiet_since > PING_S:
                self.agent.ping(self.peer, self.key)  # a dead exporter is reported now
                quiet_since = now
            self.agent.poll()
            if pause:
                time.sleep(pause)
            pause = min(5e-4, pause * 2 + 2e-5)

    def wait_status(self, num_requests: int) -> bytes:
        """The exporter's status of the stream (one byte per request), waited for by the
        deadline; ``RuntimeError`` when it names another number of requests."""
        while self.status is None:
            self._absorb()
            if self.status is not None:
                break
            if self.agent.stopping():
                raise NixlError("the engine is closing")
            if time.monotonic() >= self.deadline:
                raise TimeoutError("the exporter's status of the stream did not come by the load's deadline")
            self.agent.poll()
            time.sleep(2e-4)
        if len(self.status) != num_requests:
            raise RuntimeError(
                f"the exporter's status names {len(self.status)} requests, the stream carries {num_requests}"
            )
        return self.status

    def cancel(self) -> list[tuple[torch.Tensor, XferFence]]:
        """Cancel every READ still running; those NIXL cannot cancel come back as (buffer,
        fence)."""
        held = []
        for h, buf in self.active.values():
            if not self.agent.release_read(h, quiet=True):
                held.append((buf, XferFence(self.agent, [h])))
        self.active.clear()
        return held


class _ReadWork:
    __slots__ = ("_i", "_r")

    def __init__(self, reads: _Reads, i: int) -> None:
        self._r, self._i = reads, i

    def wait(self) -> None:
        self._r.wait(self._i)


def _one(addr: int, nbytes: int, dev: int):
    import numpy as np

    return np.array([[addr, nbytes, dev]], dtype=np.uint64)


def recv_stream(
    agent: NixlAgent,
    peer: str,
    key: str,
    remote: dict,
    staging: NixlStaging,
    stream: Stream,
    scatter: Callable[[Chunk, torch.Tensor], None],
    deadline: float,
    num_requests: int = 0,
) -> tuple[int, bytes]:
    """Loader: READ every chunk of ``stream`` (destination unit ids) from ``peer``'s staging
    buffers (``remote``: its :meth:`NixlStaging.describe`) into this
    side's, and ``scatter(chunk, wire)`` it; returns (the number of chunks, the stream's
    status: ``num_requests`` bytes, module doc step 5; empty when 0). The mailbox ``key``
    must have been opened before the exporter was asked to stream (it is closed here). Every
    wait ends by ``deadline``."""
    chunks = stream.chunks()
    view = stream.viewer()
    tag = stream.tag
    reads = _Reads(agent, peer, key, remote, staging, deadline, tag)

    def do_scatter(c: Chunk, buf: torch.Tensor) -> None:
        with trace("scatter", tag):
            scatter(c, buf)

    try:
        left = max(0.0, deadline - time.monotonic())
        with staging.pool.lease(staging.pool.num_buffers, left) as slots:
            try:
                n = pipelined_recv(chunks, slots, view, reads.post, do_scatter, staging.fences(left))
                return n, reads.wait_status(num_requests) if num_requests else b""
            except BaseException:
                held = reads.cancel()
                for buf, fence in held:
                    staging.pool.hold_until([buf], fence)
                _abort(agent, peer, key, clean=not held)
                raise
    finally:
        agent.close_box(key)


def stream_error(e: BaseException) -> str:
    """A stream failure as a reason string."""
    if isinstance(e, XferTimeout):
        return str(e)
    return f"{type(e).__name__}: {e}"
