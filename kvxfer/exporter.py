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
from typing import NamedTuple

import numpy as np
import torch

from . import control as C
from . import ops
from .auth import UNAUTHORIZED
from .completion import UNKNOWN
from .engine_types import TICK_MS
from .entitlement import allowed_prefixes, call_refusal
from .ordering import NOT_READY
from .plan import plan_reads
from .tracing import batch_tag
from .transports.batching import view_at

_LOG = logging.getLogger(__name__)

LONG_POLL_MAX_S = 1.0  # a grant held for new layers is answered within this, whatever the loader asked


class StreamJob(NamedTuple):
    """A send request that passed its checks, with the exports its tokens opened (the ones its
    calls were checked against: a stream sends a request's bytes only while that same export
    is live, not a later export of its id)."""

    msg: C.SendReq
    exports: list


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

    def _authorized(
        self, request_ids: list[str], tokens: list[str], digests: list[bytes] | None = None
    ) -> dict[str, str]:
        """Request ids whose token (and content digest, when given) does not verify -> why
        (empty when all do)."""
        miscounted = self._miscounted(request_ids, tokens, digests)
        if miscounted is not None:
            return miscounted
        return self._exports.unauthorized(request_ids, tokens, self._secret.verify, digests)

    @staticmethod
    def _miscounted(request_ids: list[str], tokens, digests=None) -> dict[str, str] | None:
        """Every id refused (why) when ``tokens`` (``digests``, when given) is not one per
        request id; else None (the tracker verifies each: ExportTracker.grant / notify_many)."""
        if len(tokens) == len(request_ids) and (digests is None or len(digests) == len(request_ids)):
            return None
        why = "unauthorized: one token (and one content digest) per request id is needed"
        return dict.fromkeys(request_ids, why) or {"*": why}

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
            bad = self._authorized([msg.request_id], [msg.token], [msg.digest])
            if bad:
                why = next(iter(bad.values()))
                return C.ErrorReply(f"{C.HELLO_REFUSED}: {why}")
            reply = self._hello_reply()
            reply.nixl = self._nixl_entry(msg)  # kvxfer.transports.nixl.role
            return reply
        if isinstance(msg, C.Heartbeat):
            bad = self._authorized(msg.request_ids, msg.tokens)
            self._exports.heartbeat([r for r in msg.request_ids if r not in bad])
            return C.Ack(failed=bad)
        if isinstance(msg, C.PairReq):
            if self._authorized([msg.request_id], [msg.token], [msg.digest]):
                return C.SendReply(ok=False, failed={"*": UNAUTHORIZED})
            if self._store is None:
                return C.SendReply(ok=False, failed={"*": "pg transport not offered by this engine"})
            backend = msg.backend or self._pg_backend
            if backend not in self._pg_backends:
                return C.SendReply(
                    ok=False,
                    failed={"*": f"pg backend {backend!r} not served here (offers {self._pg_backends})"},
                )
            why = self._sender_pairs.open(msg.key, backend)  # joined on a thread of its own
            return C.SendReply(ok=not why, failed={"*": why} if why else {})
        if isinstance(msg, C.SendReq):
            return self._handle_send(msg)
        if isinstance(msg, C.NixlPairReq):
            return self._handle_nixl_pair(msg)  # kvxfer.transports.nixl.role
        return C.ErrorReply(f"unexpected message {type(msg).__name__}")

    def _handle_read(self, msg: C.ReadReq):
        """A lease request: granted now, or (a long poll) when a wanted layer is ready or at
        ``wait_s``."""
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
        miscounted = self._miscounted(msg.request_ids, msg.tokens, msg.digests)
        if miscounted is not None:
            ok, failed, masks = {}, miscounted, {}
        else:
            with self._exports.lock:
                ok, failed, masks = self._exports.grant(
                    msg.request_ids, msg.tokens, self._secret.verify, msg.digests
                )
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
        if (
            not final
            and not ok
            and failed  # an empty request, or one whose every id was refused, is answered now
            and all(why in (NOT_READY, UNKNOWN) for why in failed.values())
        ):
            return None
        return C.ReadReply(
            ok=list(ok),
            epochs=list(ok.values()),
            failed=failed,
            incarnation=self._incarnation,
            layers=layers,
        )

    def _handle_notify(self, msg: C.Notify) -> C.Ack:
        """Count a loader rank's notifications (idempotent: a retried one counts once). The
        plan that says how many to expect is made only once a token verified, for a loader rank
        the plan has notify this rank (another one counts nothing)."""
        ids = [*msg.request_ids, *msg.failed] if msg.failed else msg.request_ids
        bad = self._miscounted(ids, msg.tokens)
        if bad is not None:
            return C.Ack(failed=bad)
        bad = {}
        released = self._exports.notify_many(
            ids,
            (msg.engine_id, msg.tp_rank),
            lambda: self._expected_from(msg.tp_size, msg.tp_rank),
            msg.tokens,
            self._secret.verify,
            bad,
        )
        if released:
            self._metrics.add("finished_exports", released)
        return C.Ack(failed=bad)

    def _expected_from(self, loader_tp: int, loader_rank: int) -> int | str:
        """Notifications this rank expects per request from a ``loader_tp``-rank loader
        engine, or why ``loader_rank`` of it may not notify here (the plan of the pair has it
        notify other ranks, or no plan exists). Cached per TP size (at most MAX_TP_SIZE)."""
        got = self._expected.get(loader_tp)
        if got is None:
            try:
                plan = plan_reads(self.spec, self.tp_size, self.spec, loader_tp)
            except ValueError as e:
                got = f"refused: no transfer plan to a {loader_tp}-rank loader ({e})"
            else:
                notifiers = frozenset(d for d in range(loader_tp) if self.tp_rank in plan.notify_targets(d))
                got = (plan.expected_notifications(self.tp_rank), notifiers)
            self._expected[loader_tp] = got
        if type(got) is str:
            return got
        if loader_rank not in got[1]:
            return (
                f"refused: loader rank {loader_rank}/{loader_tp} does not notify exporter rank {self.tp_rank}"
            )
        return got[0]

    def _handle_send(self, msg: C.SendReq):
        """Check a pg send request (tokens, then that it reads only what they open) and queue
        its stream for the sender thread."""
        bad = self._authorized(msg.request_ids, msg.tokens)
        if bad:
            return C.SendReply(ok=False, failed={"*": UNAUTHORIZED})
        if self._nixl_owns(msg.key):
            return self._handle_nixl_send(msg)  # a staged nixl stream (kvxfer.transports.nixl.role)
        if self._sender_pairs.backend(msg.key) is None:
            why = f"unknown pair group {msg.key} (never paired here, evicted, or this rank restarted)"
            return C.SendReply(ok=False, failed={"*": why})
        job = self._stream_job(msg)
        if isinstance(job, C.SendReply):
            return job
        why = self._sender_pairs.submit(msg.key, job)  # run by the pair's own thread
        return C.SendReply(ok=not why, failed={"*": why} if why else {})

    def _stream_job(self, msg: C.SendReq) -> StreamJob | C.SendReply:
        """The stream of a send request (pg or staged nixl; tokens verified), its requests'
        leases renewed; or why it cannot be streamed, as the reply."""
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
        heads = self.spec.heads_per_rank(self.tp_size)
        if msg.head_start + msg.num_heads > heads:
            return C.SendReply(
                ok=False,
                failed={
                    "*": f"heads [{msg.head_start}, +{msg.num_heads}) are not within this rank's {heads}"
                },
            )
        nl = len(msg.layers) or None
        for u in units:
            why = self.pipeline.check_chunk(self.spec, msg.num_heads, msg.chunk_tokens, u, nl)
            if why:
                return C.SendReply(ok=False, failed={"*": f"staging: {why}"})
        with self._exports.lock:
            live = [(rid, self._exports.lookup(rid)) for rid in msg.request_ids]
            gone = {
                rid: "not exported here, already released or lease expired" for rid, e in live if e is None
            }
            if gone:
                return C.SendReply(ok=False, failed=gone)
            exports = [e for _, e in live]
            why = self._entitlement_refusal(msg, exports)
            if why:
                return C.SendReply(ok=False, failed={"*": f"refused: {why}"})
            self._exports.heartbeat(msg.request_ids)
        return StreamJob(msg, exports)

    def _entitlement_refusal(self, msg: C.SendReq, exports: list) -> str:
        """Why ``msg``'s calls read a token no export of its requests holds ("" when they do
        not: :mod:`kvxfer.entitlement`)."""
        bs = self.spec.block_size
        blocks, lens = allowed_prefixes([(e.block_ids, e.num_tokens) for e in exports], bs)
        for k, (raw, num_tokens, offset, unit) in enumerate(msg.calls):
            if len(raw) % 8:
                return f"call {k}: its ids are {len(raw)} bytes, not int64s"
            ids = np.frombuffer(raw, dtype=np.int64)
            why = call_refusal(blocks, lens, ids, num_tokens, offset, unit or msg.unit, bs)
            if why:
                return f"call {k}: {why}"
        return ""

    # -------------------------------------------------------------------------- sender
    def _stream_send(self, pair, job: StreamJob) -> None:
        """Gather (:meth:`_stream_gathers`) and send a pg stream's chunks on the engine's send
        stream, then its status (one byte per request: landed or released meanwhile). Runs on
        the pair's own thread (:class:`~kvxfer.transports.pg.send.PairSenders`); a failure
        discards the pair."""
        hook = self._hooks.get("before_send")
        if hook:
            hook()
        msg = job.msg
        calls, gather, status = self._stream_gathers(job)
        with self._order.on_stream("send"):
            sent = self.pipeline.send_stream(
                pair,
                1,
                self.timeout_s,
                self._sender_pairs.backend(msg.key),
                self.spec,
                self.device,
                msg.num_heads,
                msg.unit,
                msg.chunk_tokens,
                calls,
                gather,
                batch_tag(msg.request_ids),
                len(msg.layers) or None,
                status,
            )
        self._metrics.add("bytes_sent", sent)

    def _stream_gathers(self, job: StreamJob):
        """A send request's chunk calls (unit ids as tensors, tokens, offset), the gather the
        staged pipeline runs per chunk, and the stream's status: ``status()`` gives one byte
        per request, 1 when the export checked for it (``job.exports``) was still live at every
        chunk's gather (so the bytes sent are its), 0 when it was released meanwhile (also when
        its id was exported again since). The gather runs under
        the tracker lock, so no request is released during one; a released request's blocks
        are still gathered (the stream goes on for the others) but never reported landed. On
        CUDA the requests are reported released only after the gathers ran."""
        msg, checked = job
        cuda = self.device.type == "cuda"
        layers = list(msg.layers) or None
        rids = msg.request_ids
        live = bytearray(b"\x01" * len(rids))
        exports = self._exports

        def gather(c, out: torch.Tensor) -> None:
            view = view_at(self._by_unit, c.unit, c.offset, self._offset_views)
            with exports.lock:
                for k, rid in enumerate(rids):
                    if live[k] and exports.lookup(rid) is not checked[k]:
                        live[k] = 0
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
                    exports.track_gather(rids, ev)

        calls = [
            (torch.from_numpy(np.frombuffer(b, dtype=np.int64).copy()), t, o, u) for b, t, o, u in msg.calls
        ]
        return calls, gather, lambda: bytes(live)

    def _send_loop(self) -> None:
        """The sender thread: staged ``nixl`` streams, one after another (``pg`` pairs run
        their streams on threads of their own: :mod:`kvxfer.transports.pg.send`)."""
        while not self._stop.is_set():
            try:
                job = self._send_q.get(timeout=0.1)
            except queue.Empty:
                continue
            if job is None:
                return
            self._nixl_stream_send(job[2])  # kvxfer.transports.nixl.role; logs its own failures

    def _join_pair(self, key: str, backend: str):
        """Join pair group ``key`` as its rank 0 (a pair's own thread: blocks until the loader
        joins, at most ``timeout_s``)."""
        from .transports.pg import groups as pg

        store = pg.connect_store(self.host, self._store.port, self.timeout_s)
        return pg.new_pair(store, key, 0, self.host, self.timeout_s, backend)
