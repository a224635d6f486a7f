"""The engine's ends of a staged stream, shared by ``pg`` and staged ``nixl``.

A loader that cannot read an exporter's memory asks it to *stream* (:func:`ask_stream`: a
``SendReq`` on the side channel naming the transport, the requests with their tokens, the
head slice, the layers and the ops calls in source units); the exporter checks it (its
:class:`~kvxfer.exporter.Exporter` verifies the tokens and that the calls read only what they
open) and hands the transport a :class:`StreamJob`; the transport runs the chunked pipeline
(:mod:`kvxfer.transports.staging`) with the gathers of :func:`stream_gathers`, and sends the
stream's *status* last: one byte per request, 1 when the export checked for it was live at
every chunk's gather. The loader reports a load landed only from a 1 there
(:func:`take_status`). The loader's side of it lives in the transports' sessions (``pg``,
``nixl`` staged), under the load planner, which asks again without the loads an exporter
refused (:mod:`kvxfer.planner`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from .. import control, ops
from ..batching import BatchPlan
from ..engine_types import describe_error, time_left
from ..plan import Read
from ..tracing import batch_tag
from .base import LoaderLink, StreamJob
from .staging import Stream

if TYPE_CHECKING:  # pragma: no cover
    from ..peer import Peer
    from ..rank import Rank, Runtime

__all__ = ["RELEASED_MID_STREAM", "ask_stream", "stream_gathers", "stream_scatters", "take_status"]

RELEASED_MID_STREAM = "released during the stream (lease ended or aborted); not delivered"


def stream_gathers(rank: Rank, rt: Runtime, job: StreamJob) -> tuple[Stream, Callable, Callable[[], bytes]]:
    """The exporter's end of a checked send request: its :class:`Stream` (source unit ids as
    tensors), the gather the staged pipeline runs per chunk, and ``status()``: one byte per
    request of ``job``, 1 when the export checked for it (``job.exports``) was still live at
    every chunk's gather (so the bytes sent are its), 0 when it was released meanwhile (also
    when its id was exported again since). The gather runs under the tracker lock, so no
    request is released during one; a released request's blocks are still gathered (the stream
    goes on for the others) but never reported landed. On CUDA the requests are reported
    released only after the gathers ran."""
    msg, checked = job
    cuda = rank.device.type == "cuda"
    layers = list(msg.layers) or None
    rids = msg.request_ids
    live = bytearray(b"\x01" * len(rids))
    exports = rt.exports

    def gather(c, out: torch.Tensor) -> None:
        view = rank.views.at(c.unit, c.offset)
        with exports.lock:
            for k, rid in enumerate(rids):
                if live[k] and exports.lookup(rid) is not checked[k]:
                    live[k] = 0
            ops.gather_blocks(
                view.caches, view.spec, c.units, c.num_tokens, msg.head_start, msg.num_heads, layers, out=out
            )
            if cuda:
                ev = torch.cuda.Event()
                ev.record()
                exports.track_gather(rids, ev)

    calls = [(torch.from_numpy(np.frombuffer(b, dtype=np.int64).copy()), t, o, u) for b, t, o, u in msg.calls]
    stream = Stream(
        rank.spec,
        msg.num_heads,
        msg.unit,
        msg.chunk_tokens,
        calls,
        len(layers) if layers else None,
        batch_tag(rids),
    )
    return stream, gather, lambda: bytes(live)


def stream_scatters(
    rank: Rank, r: Read, bp: BatchPlan, chunk_tokens: int, loads: list, layers: list[int] | None = None
) -> tuple[Stream, Callable]:
    """The loader's end of a stream it asked for: the :class:`Stream` of ``bp``'s calls in this
    rank's units (head slice ``r``, ``layers``) and the scatter the staged pipeline runs per
    chunk. The ids were checked at ``load()`` (range, repeats); when the batch's loads write
    disjoint blocks (``bp.distinct``) no call repeats one either, and the ops skip those checks.
    ``rank`` may be a transfer's landing instead (``views``, ``spec``, ``num_blocks``)."""
    disjoint = bp.distinct

    def scatter(c, wire: torch.Tensor) -> None:
        dv = rank.views.at(c.unit, c.offset)
        bound = rank.num_blocks * (rank.spec.block_size // c.unit)
        ids = ops.CheckedIds(c.units, bound, True) if disjoint else c.units
        ops.scatter_blocks(wire, dv.caches, dv.spec, ids, c.num_tokens, r.dst_head_start, layers)

    stream = Stream(
        rank.spec,
        r.num_heads,
        bp.dst_unit,
        chunk_tokens,
        [(c.dst, c.num_tokens, c.dst_offset, c.dst_unit) for c in bp.calls],
        len(layers) if layers else None,
        batch_tag([it.request_id for it in loads]),
    )
    return stream, scatter


def ask_stream(
    link: LoaderLink,
    rank: Rank,
    transport: str,
    peer: Peer,
    s: int,
    key: str,
    r: Read,
    loads: list,
    bp: BatchPlan,
    chunk_tokens: int,
    deadline: float,
    layers: list[int] | None = None,
) -> dict[str, str]:
    """Ask source rank ``s`` to stream ``bp``'s calls (head slice ``r``, ``layers``) over
    ``transport``'s pair or mailbox ``key``; local id -> why for the loads it refused (empty:
    accepted). A refusal of the whole request (``"*"``) raises :class:`StreamRefused` naming
    it; a timeout forgets the peer and raises :class:`~kvxfer.control.ControlTimeout`."""
    req = control.SendReq(
        rank.engine_id,
        rank.tp_rank,
        key,
        [it.params.request_id for it in loads],
        [it.params.token for it in loads],
        r.src_head_start,
        r.num_heads,
        bp.src_unit,
        [(c.src.tobytes(), c.num_tokens, c.src_offset, c.src_unit) for c in bp.calls],
        chunk_tokens,
        layers or [],
        transport,
    )
    try:
        rep = link.client.call(peer.addrs[s], req, time_left(deadline))
    except control.ControlTimeout:
        link.forget(peer, "a send request timed out")
        raise
    if not isinstance(rep, control.SendReply):
        raise RuntimeError(f"send request refused: {getattr(rep, 'error', rep)}")
    if rep.ok:
        return {}
    if "*" in rep.failed:
        raise StreamRefused(rep.failed["*"])
    local_of = {it.params.request_id: it.request_id for it in loads}
    return {local_of.get(rid, rid): f"exporter rank {s}: {why}" for rid, why in rep.failed.items()}


class StreamRefused(RuntimeError):
    """The exporter refused a send request as a whole (the message says why)."""


class PairFailed(RuntimeError):
    """Pairing with a source rank failed (the message says why, as ``describe_error`` gives it)."""


def ask_paired(
    pair: Callable[[], str],
    ask: Callable[[str], dict[str, str]],
    unpair: Callable[[str], None],
    unknown: str,
    deadline: float,
) -> dict[str, str]:
    """A staged stream's send request over a pairing with its source rank (``pg``, ``nixl``):
    ``pair()`` pairs unless paired and returns the stream's key; ``ask(key)`` sends the request
    (:func:`ask_stream`: what it refused). A refusal of the whole request undoes the pairing
    (``unpair(why)``) and is raised, unless it says the exporter no longer knows the pairing
    (``unknown`` in it: evicted at its cap, or the exporter restarted): then the pairing is made
    anew once, within ``deadline``, and the request sent again. A failure to pair raises
    :class:`PairFailed`."""
    for again in (True, False):
        try:
            key = pair()
        except Exception as e:
            raise PairFailed(describe_error(e)) from e
        try:
            return ask(key)
        except StreamRefused as e:
            unpair(str(e))
            if not (again and unknown in str(e) and deadline > time.monotonic()):
                raise
    raise AssertionError("not reached: the second refusal is raised")


def take_status(loads: list, flags: bytes, s: int) -> tuple[set[str], dict[str, str]]:
    """The stream's record: the local ids of ``loads`` whose byte of the status ``flags`` is 1
    (landed), and why each other one failed (0: released during the stream, never delivered)."""
    why = f"exporter rank {s}: {RELEASED_MID_STREAM}"
    landed: set[str] = set()
    failed: dict[str, str] = {}
    for it, flag in zip(loads, flags):
        if flag == 1:
            landed.add(it.request_id)
        else:
            failed[it.request_id] = why
    return landed, failed
