"""The loader's ``pg`` read: a pair group with each source rank, the send request that starts
the exporter's stream (:func:`kvxfer.transports.streams.ask_stream`), and the staged receive
that scatters each chunk as it lands, then the stream's status (which loads landed)."""

from __future__ import annotations

import secrets

from ... import control
from ...batching import BatchPlan, plan_loads, wire_bytes
from ...engine_types import LoadItem, Remote, describe_error, time_left
from ...plan import Read
from ..base import LoaderLink
from ..streams import StreamRefused, ask_stream, stream_scatters, take_status
from . import groups

__all__ = ["join_pair", "read"]


def join_pair(loader: LoaderLink, rem: Remote, s: int, token_of: LoadItem, deadline: float) -> tuple:
    """Ask source rank ``s`` to pair (with ``token_of``'s params) and join the pair group as its
    rank 1; (group, key). Keys never repeat."""
    rank = loader.rank
    key = f"{rank.engine_id}/{rank.tp_rank}/{secrets.token_hex(8)}"
    backend = rem.pg_backends[s]
    p = token_of.params
    req = control.PairReq(rank.engine_id, rank.tp_rank, key, backend, p.request_id, p.token, p.digest())
    rep = loader.client.call(rem.addrs[s], req, time_left(deadline))
    if not isinstance(rep, control.SendReply) or not rep.ok:
        raise RuntimeError(f"pair group refused: {getattr(rep, 'failed', rep)}")
    info = rem.replies[s].pg
    left = time_left(deadline)
    store = groups.connect_store(info["host"], info["port"], left)
    return groups.new_pair(store, key, 1, rank.host, left, backend), key


def read(
    loader: LoaderLink,
    pair: tuple,
    drop: callable,
    rem: Remote,
    s: int,
    reads: list[Read],
    loads,
    deadline: float,
    layers: list[int] | None = None,
) -> tuple[int, set[str], dict[str, str]]:
    """Stream each read's ops calls (of ``layers``, default all) from source rank ``s`` over
    ``pair`` (group, key) through the staged pipeline; ``drop(why)`` discards the pair (a
    failed stream may leave a receive posted). Returns (bytes moved, the local ids that landed:
    every read's stream carried them and the exporter's status says so; local id -> why for
    the others). A refused load leaves the batch, and the rest is asked again."""
    rank, rt = loader.rank, loader.rt
    group, key = pair
    bad: dict[str, str] = {}
    landed: set[str] = set()
    moved = saved = 0
    pg_info = rem.replies[s].pg
    for r in reads:
        while True:
            loads = [it for it in loads if it.request_id not in bad]
            if not loads:
                break
            bp = plan_loads(rank, loads, rem.spec.block_size, pg_info.get("units") or [rem.spec.block_size])
            bpt = rank.spec.bytes_per_token(num_heads=r.num_heads, num_layers=len(layers) if layers else None)
            chunk_tokens = rank.pipeline.chunk_tokens_for(pg_info, bpt, bp.src_unit, bp.dst_unit)
            try:
                refused = ask_stream(loader, "pg", rem, s, key, r, loads, bp, chunk_tokens, deadline, layers)
            except StreamRefused as e:
                drop(str(e))
                raise
            if refused:
                before = len(bad)
                bad.update(refused)
                if len(bad) == before:  # a refusal that names none of them: no progress
                    why = f"exporter rank {s} refused the send request: {refused}"
                    bad.update({it.request_id: why for it in loads})
                continue  # each refusal drops at least one load: bounded
            try:
                flags = _recv(
                    rank, rt, group, rem.pg_backends[s], r, loads, bp, chunk_tokens, deadline, layers
                )
            except Exception:
                drop("a stream failed")  # a failed stream may leave a receive posted
                raise
            take_status(loads, flags, s, landed, bad)
            m, sk = wire_bytes(rank.spec, bp, r.num_heads, layers)
            moved, saved = moved + m, saved + sk
            break
    rt.metrics.add("dedup_bytes", saved)
    return moved, landed - bad.keys(), bad


def _recv(
    rank, rt, group, backend: str, r: Read, loads, bp: BatchPlan, chunk_tokens: int, deadline: float, layers
):
    """Receive and scatter one stream; the exporter's status of it (one byte per load of
    ``loads``, 1: landed)."""
    hook = rt.hooks.get("before_recv")
    if hook:
        hook()
    stream, scatter = stream_scatters(rank, r, bp, chunk_tokens, loads, layers)
    n, flags = rank.pipeline.recv_stream(
        group, 0, backend, rank.device, stream, scatter, time_left(deadline), len(loads)
    )
    rt.metrics.record_ops(n, 0)
    return flags


def pair_error(s: int, e: BaseException, loads) -> dict[str, str]:
    """Every load failed because the pair with source rank ``s`` could not be made."""
    return {it.request_id: f"pg pair with rank {s}: {describe_error(e)}" for it in loads}
