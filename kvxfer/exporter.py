"""The exporting role of :class:`~kvxfer.engine.TransferEngine`: the rank's side channel
(handshakes, lease grants, pg send requests, notifications, heartbeats, lease expiry) and the
sender thread that joins pair groups and streams gathered chunks for ``pg`` exports.

Every message that touches a request carries the request's token (:mod:`kvxfer.auth`); one
that does not verify is refused without telling anything about the cache or the request.
"""

from __future__ import annotations

import logging
import queue
import time

import numpy as np
import torch

from . import control as C
from . import ops
from .auth import UNAUTHORIZED
from .engine_types import TICK_MS, describe_error
from .ordering import NOT_READY
from .plan import plan_reads
from .tracing import batch_tag
from .tracker import UNKNOWN
from .transports.batching import view_at

_LOG = logging.getLogger(__name__)

LONG_POLL_MAX_S = 1.0  # a grant held for new layers is answered within this, whatever the loader asked


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

    def _authorized(self, request_ids: list[str], tokens: list[str]) -> dict[str, str]:
        """Request ids whose token does not verify -> why (empty when all do)."""
        miscounted = self._miscounted(request_ids, tokens)
        if miscounted is not None:
            return miscounted
        return self._exports.unauthorized(request_ids, tokens, self._secret.token)

    @staticmethod
    def _miscounted(request_ids: list[str], tokens) -> dict[str, str] | None:
        """Every id refused (why) when ``tokens`` is not one token per request id; else None
        (the tracker verifies each token: ExportTracker.grant / notify_many)."""
        if type(tokens) is list and len(tokens) == len(request_ids):
            return None
        return {rid: "unauthorized: one token per request id is needed" for rid in request_ids} or {
            "*": "unauthorized: one token per request id is needed"
        }

    def _hello_reply(self) -> C.HelloReply:
        pg = (
            {
                "host": self.host,
                "port": self._store.port,
                "backend": self._pg_backend,
                "backends": self._pg_backends,
                "units": [v.unit for v in self._views],  # what a SendReq's unit may be
                **self.pipeline.handshake_info(),
            }
            if self._store
            else None
        )
        return C.HelloReply(
            **self._identity_fields(),
            num_blocks=self.num_blocks,
            ipc=self._ipc_desc,
            pg=pg,
            incarnation=self._incarnation,
        )

    def _handle(self, msg):
        if type(msg) is C.ReadReq:  # the messages of every request first
            return self._handle_read(msg)
        if type(msg) is C.Notify:
            return self._handle_notify(msg)
        if isinstance(msg, C.Hello):
            if msg.version != C.PROTOCOL_VERSION:
                return C.ErrorReply(f"protocol version {msg.version} != {C.PROTOCOL_VERSION}")
            if self._authorized([msg.request_id], [msg.token]):
                return C.ErrorReply("unauthorized: a handshake must present the token of a request's params")
            self._loader_tp[msg.engine_id] = msg.tp_size
            reply = self._hello_reply()
            reply.nixl = self._nixl_entry(msg)  # kvxfer.nixl_role
            return reply
        if isinstance(msg, C.Heartbeat):
            bad = self._authorized(msg.request_ids, msg.tokens)
            self._exports.heartbeat([r for r in msg.request_ids if r not in bad])
            return C.Ack(failed=bad)
        if isinstance(msg, C.PairReq):
            if self._authorized([msg.request_id], [msg.token]):
                return C.SendReply(ok=False, failed={"*": UNAUTHORIZED})
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
        if isinstance(msg, C.NixlPairReq):
            return self._handle_nixl_pair(msg)  # kvxfer.nixl_role
        return C.ErrorReply(f"unexpected message {type(msg).__name__}")

    def _handle_read(self, msg: C.ReadReq):
        """A lease request: granted now, or (a long poll) when a wanted layer is ready or at
        ``wait_s``."""
        self._loader_tp[msg.engine_id] = msg.tp_size
        reply = self._grant_reply(msg, final=msg.wait_s <= 0)
        if reply is None:
            wait = min(float(msg.wait_s), LONG_POLL_MAX_S)
            return C.Deferred(lambda final: self._grant_reply(msg, final), time.monotonic() + wait)
        return reply

    def _grant_reply(self, msg: C.ReadReq, final: bool) -> C.ReadReply | None:
        """Grant (and renew) the leases of ``msg``'s requests whose tokens verify, with the
        layers ready of layer-wise exports (``layers``: one entry per granted request, ``b""``
        for a whole one; empty when none is layer-wise). None (not ``final``) when nothing the
        loader wants is ready yet."""
        miscounted = self._miscounted(msg.request_ids, msg.tokens)
        if miscounted is not None:
            ok, failed, masks = {}, miscounted, {}
        else:
            with self._exports.lock:
                ok, failed, masks = self._exports.grant(msg.request_ids, msg.tokens, self._secret.token)
        for rid in self._order.not_ready(list(ok)):  # compute still writing: ask again
            del ok[rid]
            failed[rid] = NOT_READY
        layers: list[bytes] = []
        if masks:
            want = dict(zip(msg.request_ids, msg.want)) if msg.want else {}
            for rid in list(ok):
                m = masks.get(rid)
                if m is None:
                    layers.append(b"")
                    continue
                w = want.get(rid)
                wanted = (
                    m if not w else m & np.unpackbits(np.frombuffer(w, np.uint8), count=m.size).astype(bool)
                )
                if not wanted.any():
                    del ok[rid]
                    failed[rid] = NOT_READY
                    continue
                layers.append(np.packbits(m).tobytes())
        if not final and not ok and not any(why not in (NOT_READY, UNKNOWN) for why in failed.values()):
            return None
        return C.ReadReply(
            ok=list(ok),
            epochs=list(ok.values()),
            failed=failed,
            incarnation=self._incarnation,
            layers=layers,
        )

    def _handle_notify(self, msg: C.Notify) -> C.Ack:
        """Count a loader rank's notifications (idempotent: a retried one counts once)."""
        ids = [*msg.request_ids, *msg.failed] if msg.failed else msg.request_ids
        bad = self._miscounted(ids, msg.tokens)
        if bad is not None:
            return C.Ack(failed=bad)
        bad = {}
        expected = self._expected.get(msg.tp_size)
        if expected is None:
            plan = plan_reads(self.spec, self.tp_size, self.spec, msg.tp_size)
            expected = self._expected[msg.tp_size] = plan.expected_notifications(self.tp_rank)
        released = self._exports.notify_many(
            ids, (msg.engine_id, msg.tp_rank), expected, msg.tokens, self._secret.token, bad
        )
        if released:
            self._metrics.add("finished_exports", released)
        return C.Ack(failed=bad)

    def _handle_send(self, msg: C.SendReq):
        """Check a pg send request and queue its stream for the sender thread."""
        bad = self._authorized(msg.request_ids, msg.tokens)
        if bad:
            return C.SendReply(ok=False, failed={"*": UNAUTHORIZED})
        if self._nixl_owns(msg.key):
            return self._handle_nixl_send(msg)  # a staged nixl stream (kvxfer.nixl_role)
        if msg.key not in self._pair_backend:
            return C.SendReply(ok=False, failed={"*": f"unknown pair group {msg.key}"})
        refused = self._send_refusal(msg)
        if refused is not None:
            return refused
        self._send_q.put(("stream", msg.key, msg))
        return C.SendReply(ok=True, failed={})

    def _send_refusal(self, msg: C.SendReq) -> C.SendReply | None:
        """Why a send request (pg or staged nixl; tokens verified) cannot be streamed, as the
        reply; None when it can, its requests' leases then renewed."""
        units = sorted({msg.unit, *(c[3] for c in msg.calls if c[3])})  # the calls' own units, if any
        for u in units:
            if u not in self._by_unit:
                return C.SendReply(ok=False, failed={"*": f"unit {u}: not one of {sorted(self._by_unit)}"})
        if msg.layers and (
            len(set(msg.layers)) != len(msg.layers)
            or not all(0 <= x < self.spec.num_layers for x in msg.layers)
        ):
            return C.SendReply(
                ok=False, failed={"*": f"layers: {msg.layers} is not a set of layers of this cache"}
            )
        nl = len(msg.layers) or None
        for u in units:
            why = self.pipeline.check_chunk(self.spec, msg.num_heads, msg.chunk_tokens, u, nl)
            if why:
                return C.SendReply(ok=False, failed={"*": f"staging: {why}"})
        with self._exports.lock:
            gone = {
                rid: "not exported here, already released or lease expired"
                for rid in msg.request_ids
                if self._exports.lookup(rid) is None
            }
            if gone:
                return C.SendReply(ok=False, failed=gone)
            self._exports.heartbeat(msg.request_ids)
        return None

    # -------------------------------------------------------------------------- sender
    def _stream_send(self, pair, msg: C.SendReq) -> None:
        """Gather (:meth:`_stream_gathers`) and send a pg stream's chunks on the engine's send
        stream."""
        calls, gather = self._stream_gathers(msg)
        with self._order.on_stream("send"):
            sent = self.pipeline.send_stream(
                pair,
                1,
                self.timeout_s,
                self._pair_backend[msg.key],
                self.spec,
                self.device,
                msg.num_heads,
                msg.unit,
                msg.chunk_tokens,
                calls,
                gather,
                batch_tag(msg.request_ids),
                len(msg.layers) or None,
            )
        self._metrics.add("bytes_sent", sent)

    def _stream_gathers(self, msg: C.SendReq):
        """A send request's chunk calls (unit ids as tensors, tokens, offset) and the gather the
        staged pipeline runs per chunk: under the tracker lock, so a request released
        mid-stream is never read (the stream stops and the loader fails it); on CUDA the
        requests are reported released only after the gathers ran."""
        cuda = self.device.type == "cuda"
        layers = list(msg.layers) or None

        def gather(c, out: torch.Tensor) -> None:
            view = view_at(self._by_unit, c.unit, c.offset, self._offset_views)
            with self._exports.lock:
                gone = [r for r in msg.request_ids if self._exports.lookup(r) is None]
                if gone:
                    raise RuntimeError(f"released during the stream: {gone}")
                ops.gather_blocks(
                    view.caches,
                    view.spec,
                    c.units,
                    c.num_tokens,
                    msg.head_start,
                    msg.num_heads,
                    layers,
                    out=out,
                )
                if cuda:
                    ev = torch.cuda.Event()
                    ev.record()
                    self._exports.track_gather(msg.request_ids, ev)

        calls = [
            (torch.from_numpy(np.frombuffer(b, dtype=np.int64).copy()), t, o, u) for b, t, o, u in msg.calls
        ]
        return calls, gather

    def _send_loop(self) -> None:
        from .transports import pg

        while not self._stop.is_set():
            try:
                job = self._send_q.get(timeout=0.1)
            except queue.Empty:
                continue
            if job is None:
                return
            kind, key = job[0], job[1]
            if kind == "nixl":
                self._nixl_stream_send(job[2])  # kvxfer.nixl_role; logs its own failures
                continue
            try:
                if kind == "pair":
                    store = pg.connect_store(self.host, self._store.port, self.timeout_s)
                    self._sender_pairs[key] = pg.new_pair(
                        store, key, 0, self.host, self.timeout_s, self._pair_backend[key]
                    )
                    continue
                hook = self._hooks.get("before_send")
                if hook:
                    hook()
                pair = self._sender_pairs.get(key)
                if pair is None:
                    _LOG.warning(
                        "kvxfer exporter %s rank %d: no pair group %s (dropped)",
                        self.engine_id,
                        self.tp_rank,
                        key,
                    )
                    continue
                self._stream_send(pair, job[2])
            except Exception as e:
                _LOG.warning(
                    "kvxfer exporter %s rank %d: pg %s for pair %s failed (%s); the pair is torn down "
                    "and the loader re-pairs",
                    self.engine_id,
                    self.tp_rank,
                    kind,
                    key,
                    describe_error(e),
                )
                pg.discard_pair(self._sender_pairs.pop(key, None), describe_error(e))
