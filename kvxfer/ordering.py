"""Stream ordering of transfers against the caller's compute, without host synchronisation.

Two guarantees, one object per engine rank (:class:`StreamOrder`):

* **Exporter: a request's KV moves only after the compute that wrote it.** The caller hands
  what to wait for at export: ``engine.export(rid, ids, n, ready=ev)`` with ``ready`` a CUDA
  event (or a list of them) recorded after the kernels that wrote the blocks, or a CUDA stream
  (an event is recorded on it at export time, capturing everything issued on it so far); or
  once for all requests ``engine.set_compute_stream(stream)``. Until every such event has
  completed (``event.query()``, never ``synchronize()``), the rank answers a loader's lease
  grant with :data:`NOT_READY` and the loader asks again (bounded by its ``timeout_s``), so
  neither a ``pg`` gather nor an ``ipc`` copy can read blocks the compute is still writing.
  Granularity is the request (all its layers), not the layer.
* **Loader: the scatter/copy is ordered before the caller reads the cache.** On CUDA caches
  every transfer kernel of a (batch, source rank) runs on the rank's own transfer stream
  (:meth:`StreamOrder.stream`); afterwards the transfer thread records an event on it and
  polls ``event.query()`` (bounded by ``timeout_s``; sleeps between polls, no
  ``synchronize()``) before it checks lease epochs, notifies the exporter and marks the
  requests finished. So ``poll()`` reports a request in ``finished_recving`` only after its
  bytes are in the cache, and any kernel the caller launches after that poll sees them; the
  exporter frees its blocks only after the copy that read them completed.

On CPU caches with no ``ready`` given everything here is a no-op (the CPU ops are
synchronous). Objects with a ``query() -> bool`` method are accepted as events, so a CPU
offload path can pass the event of its device-to-host copy.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import torch

from .tracing import trace

__all__ = ["NOT_READY", "FenceTimeout", "StreamOrder", "event_done", "wait_event"]

NOT_READY = "not ready: the compute writing its KV has not finished (yet)"
_NULL = contextlib.nullcontext()


def _events(ready: Any) -> list:
    """Normalise ``ready`` (event, stream, or a list of them) to objects with ``query()``."""
    items = ready if isinstance(ready, (list, tuple)) else [ready]
    out = []
    for d in items:
        if isinstance(d, torch.cuda.Stream):
            ev = torch.cuda.Event()
            ev.record(d)
            out.append(ev)
        elif callable(getattr(d, "query", None)):
            out.append(d)
        else:
            raise ValueError(
                f"ready: expected CUDA events or streams (objects with query()), got {type(d).__name__}"
            )
    return out


class StreamOrder:
    """Ready-gates of exported requests and the transfer stream of one engine rank."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._streams: dict[str, Any] = {}  # role ("load", "send") -> transfer stream
        self._compute = None
        self._pending: dict[str, list] = {}  # request id -> events not yet seen complete
        self._lock = threading.Lock()
        self.num_not_ready = 0  # grant answers NOT_READY (stats)
        self.num_waits = 0  # completion events waited for

    # ------------------------------------------------------------------ exporter side
    def set_compute_stream(self, stream: Any) -> None:
        """Every later export waits for the work issued on ``stream`` before it (None: stop)."""
        if stream is not None and not isinstance(stream, torch.cuda.Stream):
            raise ValueError(f"stream: expected a torch.cuda.Stream or None, got {type(stream).__name__}")
        self._compute = stream

    def events(self, ready: Any) -> list:
        """``ready`` (CUDA events and/or streams, or objects with ``query()``) as events."""
        return _events(ready)

    def mark(self, request_id: str, ready: Any = None) -> tuple[bool, tuple | None]:
        """Remember what ``request_id``'s export waits for (``ready``, else the compute stream),
        added to what a gate of the id waits for already (a live export's own compute is never
        dropped by another call's). Returns (:meth:`gated` of it, what :meth:`restore` takes to
        undo this mark if the export is then refused: None when nothing was written)."""
        if ready is None:
            ready = self._compute
            if ready is None:
                return request_id in self._pending, None
        events = _events(ready)
        if not events:
            return request_id in self._pending, None
        with self._lock:
            if len(self._pending) >= 4096:  # gates of requests never granted (expired, aborted)
                for rid in [r for r, evs in self._pending.items() if all(e.query() for e in evs)]:
                    del self._pending[rid]
            was = self._pending.get(request_id)
            now = events if was is None else [*was, *events]
            self._pending[request_id] = now
        return True, (now, was)

    def restore(self, request_id: str, undo: tuple | None) -> None:
        """Undo a :meth:`mark` (``undo``: what it returned) of an export that was refused: the
        gate it replaced is put back, unless another call changed the gate since."""
        if undo is None:
            return
        now, was = undo
        with self._lock:
            if self._pending.get(request_id) is not now:
                return  # another export's mark, or a grant's look, since
            if was is None:
                del self._pending[request_id]
            else:
                self._pending[request_id] = was

    def gated(self, request_id: str) -> bool:
        """Whether ``request_id``'s export waits for events not yet seen complete."""
        return request_id in self._pending

    def not_ready(self, request_ids: list[str], count: bool = True) -> list[str]:
        """The ids whose ready events have not all completed (``query()`` only; never blocks).
        Completed ones are forgotten. ``count``: add them to ``num_not_ready`` (grants)."""
        if not self._pending:
            return []
        out = []
        with self._lock:
            for rid in request_ids:
                evs = self._pending.get(rid)
                if evs is None:
                    continue
                evs[:] = [e for e in evs if not e.query()]
                if evs:
                    out.append(rid)
                else:
                    del self._pending[rid]
        if count:
            self.num_not_ready += len(out)
        return out

    def forget(self, live: Any) -> None:
        """Drop gates of requests no longer exported (``live(rid) -> bool``)."""
        with self._lock:
            for rid in [r for r in self._pending if not live(r)]:
                del self._pending[rid]

    def num_pending(self) -> int:
        return len(self._pending)

    # ------------------------------------------------------------------ transfer side
    def stream(self, role: str = "load"):
        """The rank's transfer stream for ``role`` (``"load"``: copies and scatters into this
        rank's cache; ``"send"``: gathers for pg and nixl exports, but for a pg stream on its
        lane's own stream, :meth:`kvxfer.transports.pg.pipeline.StagedPipeline.send_stream`),
        created on first use; None on CPU. Two roles, two streams: an engine loading and
        exporting at once (D->P reuse) does not serialise one behind the other."""
        if not self.cuda:
            return None
        s = self._streams.get(role)
        if s is None:
            s = self._streams[role] = torch.cuda.Stream(self.device)
        return s

    def on_stream(self, role: str = "load") -> contextlib.AbstractContextManager:
        """Context running the enclosed kernels on the ``role`` transfer stream (no-op on CPU)."""
        return torch.cuda.stream(self.stream(role)) if self.cuda else _NULL

    def wait_done(self, timeout_s: float, role: str = "load") -> None:
        """Return once the work issued on the transfer stream so far has completed: an event
        recorded now, polled with ``query()`` (no ``synchronize()``); ``TimeoutError`` after
        ``timeout_s``. No-op on CPU."""
        if not self.cuda:
            return
        ev = record_done(self.stream(role))
        self.num_waits += 1
        wait_event(ev, timeout_s, "transfer stream")


def record_done(stream: Any = None) -> Any:
    """A CUDA event recorded on ``stream`` (default current) after the transfer's work; the
    caller's stream does ``wait_event`` on it before reading the scattered cache."""
    ev = torch.cuda.Event()
    ev.record(stream if stream is not None else torch.cuda.current_stream())
    return ev


class FenceTimeout(TimeoutError):
    """A bounded wait for CUDA work ran out while the work may still be running.

    ``event`` completes when that work does; ``keep`` holds buffers the work still reads or
    writes. Whoever catches it must not free, reuse or report the memory the work touches
    until ``event.query()`` is true (the engine defers the request's outcome until then).
    """

    def __init__(self, message: str, event: Any, keep: Any = None) -> None:
        super().__init__(message)
        self.event = event
        self.keep = keep


def event_done(ev: Any) -> bool:
    """``ev.query()``, where an error (a broken CUDA context) counts as done: nothing will run."""
    try:
        return bool(ev.query())
    except Exception:
        return True


def wait_event(ev: Any, timeout_s: float, what: str, keep: Any = None) -> None:
    """Poll ``ev.query()`` until true, sleeping between queries for an eighth of the time
    waited so far (20 us to 1 ms): completion is seen at most ~12 % (plus one sleep's wake-up)
    after it happened, with ~25 queries in the first 8 ms and one a millisecond after (steps
    that double can see a copy almost its own duration late). Raises
    :class:`FenceTimeout` (carrying ``ev`` and ``keep``) after ``timeout_s``."""
    if ev.query():
        return
    start = time.monotonic()
    deadline = start + timeout_s
    with trace("wait", what):
        while not ev.query():
            t = time.monotonic()
            if t > deadline:
                raise FenceTimeout(f"{what}: CUDA work not complete within {timeout_s}s", ev, keep)
            time.sleep(poll_pause(t - start))


def poll_pause(waited_s: float, cap_s: float = 1e-3) -> float:
    """How long a completion poll sleeps after ``waited_s`` of waiting: an eighth of it, from
    20 us up to ``cap_s``, so what completes is seen at most ~12 % late (plus a wake-up)."""
    return min(cap_s, 2e-5 + waited_s / 8)
