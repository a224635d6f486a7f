"""The exporting role of an engine rank: its side channel (handshakes, lease grants, send
requests, notifications, heartbeats), lease expiry, and the checks in front of every stream.

Every message that touches a request carries the request's token (:mod:`kvxfer.auth`); one
that does not verify is refused without telling anything about the cache or the request. A
message is handled by a lookup of its type (:meth:`Exporter.handle`); the messages a transport
answers itself (pair requests) are that transport's (:meth:`~kvxfer.transports.Transport.serves`),
and a send request goes to the transport it names once its tokens verified and its calls read
only what they open (:mod:`kvxfer.entitlement`).
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from . import control
from .auth import UNAUTHORIZED
from .engine_types import TICK_MS
from .entitlement import allowed_prefixes, call_refusal
from .export_records import spans
from .exports import UNKNOWN
from .ordering import NOT_READY
from .plan import plan_reads
from .rank import Rank, Runtime
from .transports import Transport, offered
from .transports.streams import StreamJob

_LOG = logging.getLogger(__name__)

REPEATED = "request_ids: a lease request names a request more than once"
LONG_POLL_MAX_S = 1.0  # a grant held for new layers is answered within this, whatever the loader asked

__all__ = ["LONG_POLL_MAX_S", "Exporter"]


class Exporter:
    """Serves remote loaders from one engine rank (see the module doc).

    Args:
        rank: the rank's configuration.
        rt: what the rank's parts share while it runs (its export tracker, secret, counters).
        transports: the rank's transports by name.
    """

    def __init__(self, rank: Rank, rt: Runtime, transports: dict[str, Transport]) -> None:
        self.rank = rank
        self.rt = rt
        self.transports = transports
        # what tick() calls: a transport with nothing to keep up to date says so (``ticks``)
        self._tickers = [t for t in transports.values() if getattr(t, "ticks", True)]
        self.server: control.ControlServer | None = None
        # loader tp size -> (notifications per request, loader ranks that notify this rank), or
        # why a loader of that size cannot notify here (at most MAX_TP_SIZE keys)
        self.expected: dict[int, tuple[int, frozenset[int]] | str] = {}
        # one bound method for every tick: the control module's book keeps the answers of the
        # callable it is given (a pure function of its arguments) until it is given another
        self._expected = self.expected_from
        self._thread: threading.Thread | None = None
        self._handlers: dict[type, object] = {}

    # -------------------------------------------------------------------------- lifecycle
    def bind(self, ctx) -> int:
        """Bind the side channel in zmq context ``ctx`` (rank 0's port + this rank, or a free
        port); returns the engine's base port (what rank 0 binds)."""
        rank = self.rank
        port = rank.port + rank.tp_rank if rank.port else 0
        self.server = control.ControlServer(ctx, rank.host, port)
        return self.server.port - rank.tp_rank

    def start(self) -> None:
        """Start serving (after the transports started: their handlers are looked up now)."""
        self._handlers = {
            control.ReadReq: self._handle_read,
            control.Notify: self._handle_notify,
            control.Hello: self._handle_hello,
            control.Heartbeat: self._handle_heartbeat,
            control.SendReq: self._handle_send,
        }
        for t in self.transports.values():
            for kind, handler in t.serves().items():
                self._handlers[kind] = self._paired(handler)
        rank = self.rank
        self._thread = threading.Thread(
            target=self._serve, name=f"kvxfer-server-{rank.engine_id}-{rank.tp_rank}", daemon=True
        )
        self._thread.start()

    def threads(self) -> list[threading.Thread]:
        return [self._thread] if self._thread is not None else []

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

    # -------------------------------------------------------------------------- server
    def _serve(self) -> None:
        rank, rt = self.rank, self.rt
        while not rt.stop.is_set():
            try:
                self.server.serve_once(self.handle, TICK_MS)
                self.tick()
                n = rt.exports.expire()
                if n:
                    rt.metrics.add("expirations", n)
            except Exception as e:  # keep serving; the peer sees a timeout
                if rt.stop.is_set():
                    return
                _LOG.warning(
                    "kvxfer exporter %s rank %d: side channel error (%s: %s); still serving",
                    rank.engine_id,
                    rank.tp_rank,
                    type(e).__name__,
                    e,
                )

    def tick(self, beat: bool = True) -> None:
        """What the transports do often (:meth:`~kvxfer.transports.Transport.tick`: the ``ipc``
        lease-slot table's heartbeat, ready flags and the done marks of one-sided reads, counted
        as notifications). Called by the server thread every tick and by ``poll()``
        (``beat=False``: the server thread's beat suffices; with no live export there is no
        ready flag to set nor mark to count, as on a decode engine: nothing to do)."""
        if not beat and self.rt.exports.idle():
            return
        for t in self._tickers:
            t.tick(beat, self._expected)

    def handle(self, msg):
        """The reply to one side-channel message (or a :class:`~kvxfer.control.Deferred`)."""
        handler = self._handlers.get(type(msg))
        if handler is None:
            return control.ErrorReply(f"unexpected message {type(msg).__name__}")
        return handler(msg)

    def authorized(
        self, request_ids: list[str], tokens: list[str], digests: list[bytes] | None = None
    ) -> dict[str, str]:
        """Request ids whose token (and content digest, when given) does not verify -> why
        (empty when all do)."""
        miscounted = self._miscounted(request_ids, tokens, digests)
        if miscounted is not None:
            return miscounted
        return self.rt.exports.unauthorized(request_ids, tokens, self.rt.secret.verify, digests)

    @staticmethod
    def _miscounted(request_ids: list[str], tokens, digests=None) -> dict[str, str] | None:
        """Every id refused (why) when ``tokens`` (``digests``, when given) is not one per
        request id; else None (the tracker verifies each: ExportTracker.grant / notify_many)."""
        if len(tokens) == len(request_ids) and (digests is None or len(digests) == len(request_ids)):
            return None
        why = "unauthorized: one token (and one content digest) per request id is needed"
        return dict.fromkeys(request_ids, why) or {"*": why}

    def _paired(self, handler):
        """A transport's handler of a pair request, behind the check of the request's token and
        digest the pair request carries."""

        def handle(msg) -> control.SendReply:
            if self.authorized([msg.request_id], [msg.token], [msg.digest]):
                return control.SendReply(ok=False, failed={"*": UNAUTHORIZED})
            return handler(msg)

        return handle

    def _handle_hello(self, msg: control.Hello):
        if msg.version != control.PROTOCOL_VERSION:
            return control.ErrorReply(f"protocol version {msg.version} != {control.PROTOCOL_VERSION}")
        bad = self.authorized([msg.request_id], [msg.token], [msg.digest])
        if bad:
            return control.ErrorReply(f"{control.HELLO_REFUSED}: {next(iter(bad.values()))}")
        rank, rt = self.rank, self.rt
        entries = {name: t.hello_entry(msg) for name, t in self.transports.items()}
        return control.HelloReply(
            **rank.identity_fields(offered(self.transports)),
            num_blocks=rank.num_blocks,
            ipc=entries["ipc"],
            pg=entries["pg"],
            incarnation=rt.incarnation,
            nixl=entries["nixl"],
        )

    def _handle_heartbeat(self, msg: control.Heartbeat) -> control.Ack:
        bad = self._miscounted(msg.request_ids, msg.tokens)
        if bad is None:  # each token checked as its lease is renewed (one hold of the lock)
            bad = self.rt.exports.heartbeat(msg.request_ids, msg.tokens, self.rt.secret.verify)
        return control.Ack(failed=bad)

    # -------------------------------------------------------------------------- grants
    def _handle_read(self, msg: control.ReadReq):
        """A lease request: granted now, or (a long poll) when a wanted layer is ready or at
        ``wait_s``. A request named twice is refused (no loader does it, and a held long poll is
        checked again on every pass: its cost must stay that of the exports it names)."""
        ids = msg.request_ids
        if len(ids) > 1 and len(set(ids)) != len(ids):
            return control.ErrorReply(REPEATED)
        reply = self._grant_reply(msg, final=msg.wait_s <= 0)
        if reply is None:
            wait = min(float(msg.wait_s), LONG_POLL_MAX_S)
            return control.Deferred(lambda final: self._grant_reply(msg, final), time.monotonic() + wait)
        return reply

    def _grant_reply(self, msg: control.ReadReq, final: bool) -> control.ReadReply | None:
        """Grant (and renew) the leases of ``msg``'s requests whose tokens verify, with the
        layers ready of layer-wise exports (``layers``: one entry per granted request, ``b""``
        for a whole one; empty when none is layer-wise). None (not ``final``) when nothing the
        loader wants is ready yet."""
        rt = self.rt
        miscounted = self._miscounted(msg.request_ids, msg.tokens, msg.digests)
        epochs = (
            None
            if miscounted is not None
            else rt.exports.grant_verified(msg.request_ids, msg.tokens, msg.digests)
        )
        late = None
        if epochs is not None:  # every request a verified whole export (one native call)
            rids = msg.request_ids
            late = rt.order.not_ready(rids)
            if not late:  # and every one's compute done: granted as asked
                return control.ReadReply(
                    ok=rids, epochs=epochs, failed={}, incarnation=rt.incarnation, layers=[]
                )
            ok, failed, masks = dict(zip(rids, epochs)), {}, {}
        elif miscounted is not None:
            ok, failed, masks = {}, miscounted, {}
        else:
            with rt.exports.lock:
                ok, failed, masks = rt.exports.grant(
                    msg.request_ids, msg.tokens, rt.secret.verify, msg.digests
                )
        if late is None:
            late = rt.order.not_ready(list(ok))
        for rid in late:  # compute still writing: ask again
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
        return control.ReadReply(
            ok=list(ok), epochs=list(ok.values()), failed=failed, incarnation=rt.incarnation, layers=layers
        )

    # -------------------------------------------------------------------------- notifications
    def _handle_notify(self, msg: control.Notify) -> control.Ack:
        """Count a loader rank's notifications (idempotent: a retried one counts once). The
        plan that says how many to expect is made only once a token verified, for a loader rank
        the plan has notify this rank (another one counts nothing)."""
        rt = self.rt
        ids = [*msg.request_ids, *msg.failed] if msg.failed else msg.request_ids
        bad = self._miscounted(ids, msg.tokens)
        if bad is not None:
            return control.Ack(failed=bad)
        if rt.exports.notify_verified(ids, msg.tokens, msg.tp_rank, msg.tp_size, self._expected) is not None:
            return control.Ack(failed={})  # every id verified and counted (one native call)
        bad = {}
        rt.exports.notify_many(
            ids,
            msg.tp_rank,  # one key per loader rank, shared with its done marks (ipc.slots)
            lambda: self.expected_from(msg.tp_size, msg.tp_rank),
            msg.tokens,
            rt.secret.verify,
            bad,
        )
        return control.Ack(failed=bad)

    def expected_from(self, loader_tp: int, loader_rank: int) -> int | str:
        """Notifications this rank expects per request from a ``loader_tp``-rank loader
        engine, or why ``loader_rank`` of it may not notify here (the plan of the pair has it
        notify other ranks, or no plan exists). Cached per TP size (at most MAX_TP_SIZE)."""
        rank = self.rank
        got = self.expected.get(loader_tp)
        if got is None:
            try:
                plan = plan_reads(rank.spec, rank.tp_size, rank.spec, loader_tp)
            except ValueError as e:
                got = f"refused: no transfer plan to a {loader_tp}-rank loader ({e})"
            else:
                notifiers = frozenset(d for d in range(loader_tp) if rank.tp_rank in plan.notify_targets(d))
                got = (plan.expected_notifications(rank.tp_rank), notifiers)
            self.expected[loader_tp] = got
        if type(got) is str:
            return got
        if loader_rank not in got[1]:
            return (
                f"refused: loader rank {loader_rank}/{loader_tp} does not notify exporter rank {rank.tp_rank}"
            )
        return got[0]

    # -------------------------------------------------------------------------- streams
    def _handle_send(self, msg: control.SendReq) -> control.SendReply:
        """Check a send request (tokens, then that it reads only what they open) and hand its
        stream to the transport it names. The tokens are verified and their exports looked up in
        one hold of the tracker's lock: an export released and exported again in between would
        otherwise be opened by the earlier export's token."""
        with self.rt.exports.lock:
            if self.authorized(msg.request_ids, msg.tokens):
                return control.SendReply(ok=False, failed={"*": UNAUTHORIZED})
            transport = self.transports.get(msg.transport)
            if transport is None:
                return control.SendReply(ok=False, failed={"*": f"unknown transport {msg.transport!r}"})
            job = self.stream_job(msg)
        if isinstance(job, control.SendReply):
            return job
        return transport.serve_stream(job)

    def stream_job(self, msg: control.SendReq) -> StreamJob | control.SendReply:
        """The stream of a send request (its tokens verified), its requests' leases renewed; or
        why it cannot be streamed, as the reply."""
        rank, rt = self.rank, self.rt
        units = sorted({msg.unit, *(c[3] for c in msg.calls if c[3])})  # the calls' own units, if any
        for u in units:
            if u not in rank.units:
                return control.SendReply(ok=False, failed={"*": f"unit {u}: not one of {sorted(rank.units)}"})
        if msg.layers and (
            len(set(msg.layers)) != len(msg.layers)
            or not all(0 <= x < rank.spec.num_layers for x in msg.layers)
        ):
            why = f"layers: {msg.layers} is not a set of layers of this cache"
            return control.SendReply(ok=False, failed={"*": why})
        heads = rank.spec.heads_per_rank(rank.tp_size)
        if msg.head_start + msg.num_heads > heads:
            why = f"heads [{msg.head_start}, +{msg.num_heads}) are not within this rank's {heads}"
            return control.SendReply(ok=False, failed={"*": why})
        nl = len(msg.layers) or None
        for u in units:
            why = rank.pipeline.check_chunk(rank.spec, msg.num_heads, msg.chunk_tokens, u, nl)
            if why:
                return control.SendReply(ok=False, failed={"*": f"staging: {why}"})
        exports = rt.exports
        with exports.lock:
            live = [(rid, exports.lookup(rid)) for rid in msg.request_ids]
            gone = {
                rid: "not exported here, already released or lease expired" for rid, e in live if e is None
            }
            if gone:
                return control.SendReply(ok=False, failed=gone)
            checked = [e for _, e in live]
            why = self._entitlement_refusal(msg, checked)
            if why:
                return control.SendReply(ok=False, failed={"*": f"refused: {why}"})
            exports.heartbeat(msg.request_ids)
        return StreamJob(msg, checked)

    def _entitlement_refusal(self, msg: control.SendReq, exports: list) -> str:
        """Why ``msg``'s calls read a token no export of its requests holds ("" when they do
        not: :mod:`kvxfer.entitlement`)."""
        bs = self.rank.spec.block_size
        whole = () if self.rank.groups is None else self.rank.groups.whole
        blocks, lens = allowed_prefixes([sp for e in exports for sp in spans(e, bs, whole)], bs)
        for k, (raw, num_tokens, offset, unit) in enumerate(msg.calls):
            if len(raw) % 8:
                return f"call {k}: its ids are {len(raw)} bytes, not int64s"
            ids = np.frombuffer(raw, dtype=np.int64)
            why = call_refusal(blocks, lens, ids, num_tokens, offset, unit or msg.unit, bs)
            if why:
                return f"call {k}: {why}"
        return ""
