"""The exporting role of :class:`~kvxfer.engine.TransferEngine`: the rank's side channel
(handshakes, lease grants, pg send requests, notifications, heartbeats, lease expiry) and the
sender thread that gathers and sends wires for ``pg`` exports."""

from __future__ import annotations

import logging
import queue

import numpy as np
import torch

from . import control as C
from . import ops
from .engine_types import TICK_MS, batch_tag
from .ordering import NOT_READY, FenceTimeout, event_done, wait_event
from .plan import plan_reads
from .tracing import trace

_LOG = logging.getLogger(__name__)


class ExporterRole:
    """Methods of :class:`~kvxfer.engine.TransferEngine` that serve remote loaders."""

    # -------------------------------------------------------------------------- server
    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                self._server.serve_once(self._handle, TICK_MS)
                n = self._exports.expire()
                if n:
                    self._metrics.add("expirations", n)
            except Exception as e:  # keep serving; the peer sees a timeout
                if self._stop.is_set():
                    return
                _LOG.warning(
                    "kvxfer exporter %s rank %d: side channel error (%s: %s); still serving",
                    self.engine_id,
                    self.tp_rank,
                    type(e).__name__,
                    e,
                )

    def _hello_reply(self, error: str | None = None) -> C.HelloReply:
        pg = (
            {
                "host": self.host,
                "port": self._store.port,
                "backend": self._pg_backend,
                "backends": self._pg_backends,
                "units": [v.unit for v in self._views],  # what a SendReq's unit may be
                **getattr(self.pipeline, "handshake_info", dict)(),
            }
            if self._store
            else None
        )
        return C.HelloReply(
            **self._identity_fields(),
            num_blocks=self.num_blocks,
            ipc=self._ipc_desc,
            pg=pg,
            error=error,
        )

    def _handle(self, msg):
        if isinstance(msg, C.Hello):
            if msg.version != C.PROTOCOL_VERSION:
                return self._hello_reply(f"protocol version {msg.version} != {C.PROTOCOL_VERSION}")
            self._loader_tp[msg.engine_id] = msg.tp_size
            return self._hello_reply()
        if isinstance(msg, C.ReadReq):
            self._loader_tp[msg.engine_id] = msg.tp_size
            ok, bad = self._exports.grant(msg.request_ids)
            for rid in self._order.not_ready(list(ok)):  # compute still writing: ask again
                del ok[rid]
                bad[rid] = NOT_READY
            return C.ReadReply(ok=list(ok), epochs=[e.tobytes() for e in ok.values()], failed=bad)
        if isinstance(msg, C.Heartbeat):
            self._exports.heartbeat(msg.request_ids)
            return None
        if isinstance(msg, C.Notify):
            expected = self._expected.get(msg.tp_size)
            if expected is None:
                plan = plan_reads(self.spec, self.tp_size, self.spec, msg.tp_size)
                expected = self._expected[msg.tp_size] = plan.expected_notifications(self.tp_rank)
            released = 0
            for rid in [*msg.request_ids, *msg.failed]:
                released += self._exports.notify(rid, (msg.engine_id, msg.tp_rank), expected)
            if released:
                self._metrics.add("finished_exports", released)
            return None
        if isinstance(msg, C.PairReq):
            if self._store is None:
                return C.SendReply(ok=False, failed={"*": "pg transport not offered by this engine"})
            backend = msg.backend or self._pg_backend
            if backend not in self._pg_backends:
                return C.SendReply(
                    ok=False,
                    failed={"*": f"pg backend {backend!r} not served here (offers {self._pg_backends})"},
                )
            self._pair_backend[msg.key] = backend
            self._send_q.put(("pair", msg.key))
            return C.SendReply(ok=True, failed={})
        if isinstance(msg, C.SendReq):
            return self._handle_send(msg)
        return C.ErrorReply(f"unexpected message {type(msg).__name__}")

    def _handle_send(self, msg: C.SendReq):
        """Gather the chunks under the tracker lock (a consistent snapshot of leased blocks)."""
        if msg.key not in self._sender_pairs and not self._pair_pending(msg.key):
            return C.SendReply(ok=False, failed={"*": f"unknown pair group {msg.key}"})
        view = self._by_unit.get(msg.unit)
        if view is None:
            return C.SendReply(ok=False, failed={"*": f"unit {msg.unit}: not one of {sorted(self._by_unit)}"})
        wires = []
        with self._exports.lock:
            bad = {}
            for rid in msg.request_ids:
                if self._exports.lookup(rid) is None:
                    bad[rid] = "not exported here, already released or lease expired"
            if bad:
                return C.SendReply(ok=False, failed=bad)
            self._exports.heartbeat(msg.request_ids)
            if msg.chunk_tokens and getattr(self.pipeline, "streams", False):  # staged: sender gathers
                why = self.pipeline.check_chunk(self.spec, msg.num_heads, msg.chunk_tokens, msg.unit)
                if why:
                    return C.SendReply(ok=False, failed={"*": f"staging: {why}"})
                self._send_q.put(("stream", msg.key, msg))
                return C.SendReply(ok=True, failed={})
            # Gloo pairs of CUDA caches carry host wires: gather into pinned memory, and the
            # sender hands a wire to Gloo only after the gather's event completed.
            host_wire = self.device.type == "cuda" and self._pair_backend.get(msg.key) == "gloo"
            # CUDA gathers run on the engine's send stream (the sender sends on it too); the
            # tracker reports these requests released only after the gathers ran, so the caller
            # cannot reuse their blocks before they were read (kvxfer.tracker.track_gather).
            with self._order.on_stream("send"):
                for units_b, num_tokens in msg.chunks:
                    units = np.frombuffer(units_b, dtype=np.int64)  # ops copies and checks them
                    out = None
                    if host_wire:
                        shape = self.spec.wire_shape(num_tokens, msg.num_heads)
                        out = torch.empty(shape, dtype=self.spec.dtype, pin_memory=True)
                    with trace("gather", batch_tag(msg.request_ids)):
                        wires.append(
                            ops.gather_blocks(
                                view.caches,
                                view.spec,
                                units,
                                num_tokens,
                                msg.head_start,
                                msg.num_heads,
                                out=out,
                            )
                        )
                ready = None
                if self.device.type == "cuda":
                    ready = torch.cuda.Event()
                    ready.record()
                    self._exports.track_gather(msg.request_ids, ready)
        self._send_q.put(("send", msg.key, wires, ready if host_wire else None))
        return C.SendReply(ok=True, failed={})

    def _stream_send(self, pair, msg: C.SendReq) -> None:
        """Staged pg export: gather each chunk (under the tracker lock, so a request released
        mid-stream is never read: the stream stops and the loader times out and fails it)."""
        view = self._by_unit[msg.unit]  # checked by _handle_send

        def gather(units, num_tokens: int, out: torch.Tensor) -> None:
            with self._exports.lock:
                gone = [r for r in msg.request_ids if self._exports.lookup(r) is None]
                if gone:
                    raise RuntimeError(f"released during the stream: {gone}")
                ops.gather_blocks(
                    view.caches, view.spec, units, num_tokens, msg.head_start, msg.num_heads, out=out
                )
                if self.device.type == "cuda":  # released only after this gather ran
                    ev = torch.cuda.Event()
                    ev.record()
                    self._exports.track_gather(msg.request_ids, ev)

        calls = [(torch.from_numpy(np.frombuffer(b, dtype=np.int64).copy()), t) for b, t in msg.chunks]
        with self._order.on_stream("send"):
            sent = self.pipeline.send_stream(
                pair,
                1,
                self.timeout_s,
                self._pair_backend.get(msg.key, self._pg_backend),
                self.spec,
                self.device,
                msg.num_heads,
                msg.unit,
                msg.chunk_tokens,
                calls,
                gather,
                batch_tag(msg.request_ids),
            )
        self._metrics.add("bytes_sent", sent)

    def _pair_pending(self, key: str) -> bool:
        return True  # pairs are created in FIFO order on the sender thread before any send

    # -------------------------------------------------------------------------- sender
    def _send_loop(self) -> None:
        from .transports import pg

        while not self._stop.is_set():
            if self._stuck:  # buffers of timed-out CUDA work, dropped once it completed
                self._stuck[:] = [e for e in self._stuck if not event_done(e.event)]
            try:
                job = self._send_q.get(timeout=0.1)
            except queue.Empty:
                continue
            if job is None:
                return
            key = job[1]
            try:
                if job[0] == "pair":
                    store = pg.connect_store(self.host, self._store.port, self.timeout_s)
                    backend = self._pair_backend.get(key, self._pg_backend)
                    self._sender_pairs[key] = pg.new_pair(store, key, 0, self.host, self.timeout_s, backend)
                else:
                    hook = self._hooks.get("before_send")
                    if hook:
                        hook()
                    pair = self._sender_pairs.get(key)
                    if pair is None:
                        continue
                    if job[0] == "stream":
                        self._stream_send(pair, job[2])
                        continue
                    if job[3] is not None:  # host wires of CUDA caches: the gather must be done
                        try:
                            wait_event(job[3], self.timeout_s, f"gather for pair {key}", keep=job[2])
                        except FenceTimeout as e:  # the pinned wires live until the gather ran
                            self._stuck.append(e)
                            raise
                    with self._order.on_stream("send"):  # NCCL orders its send after the gathers
                        for wire in job[2]:
                            with trace("send", key):
                                self.pipeline.send(pair, wire, 1, self.timeout_s)
                            self._metrics.add("bytes_sent", wire.numel() * wire.element_size())
            except Exception as e:
                _LOG.warning(
                    "kvxfer exporter %s rank %d: pg %s for pair %s failed (%s: %s); the pair is dropped "
                    "and the loader re-pairs",
                    self.engine_id,
                    self.tp_rank,
                    job[0],
                    key,
                    type(e).__name__,
                    e,
                )
                # the loader times out and re-pairs; this pair is torn down now
                pg.discard_pair(self._sender_pairs.pop(key, None), f"{type(e).__name__}: {e}")
