"""The loader's ``pg`` read: a pair group with each source rank (NCCL, or Gloo on CPU and
through pinned host memory when both ranks share a GPU), the send request that starts the
exporter's stream, and the staged receive that scatters each chunk as it lands.

A mixin of :class:`~kvxfer.loader.LoaderRole` (and so of the engine): it uses the engine's
side channel, pipeline, caches, ordering and metrics.
"""

from __future__ import annotations

import secrets

import torch

from ... import control as C
from ... import ops
from ...engine_types import LoadItem, Remote, describe_error, time_left
from ...plan import Read
from ...tracing import batch_tag
from ..batching import BatchPlan, view_at


class PgReads:
    """Methods of :class:`~kvxfer.engine.TransferEngine` that read over ``pg``."""

    def _pair(self, rem: Remote, s: int, token_of: LoadItem, deadline: float):
        """The pair group with source rank ``s`` (joined on first use; keys never repeat)."""
        from . import groups as pg

        got = rem.pairs.get(s)
        if got is not None:
            return got
        key = f"{self.engine_id}/{self.tp_rank}/{secrets.token_hex(8)}"
        backend = rem.pg_backends[s]
        p = token_of.params
        req = C.PairReq(self.engine_id, self.tp_rank, key, backend, p.request_id, p.token, p.digest())
        rep = self._client.call(rem.addrs[s], req, time_left(deadline))
        if not isinstance(rep, C.SendReply) or not rep.ok:
            raise RuntimeError(f"pair group refused: {getattr(rep, 'failed', rep)}")
        info = rem.replies[s].pg
        left = time_left(deadline)
        store = pg.connect_store(info["host"], info["port"], left)
        group = pg.new_pair(store, key, 1, self.host, left, backend)
        got = rem.pairs[s] = (group, key)
        return got

    def _pg_read(self, rem: Remote, s: int, reads: list[Read], loads, deadline: float, layers=None):
        """Stream each read's ops calls (of ``layers``, default all) from source rank ``s``
        through the staged pipeline. Returns (bytes moved, the local ids that landed: every
        read's stream carried them and the exporter's status says so, local id -> why for the
        others). A refused load leaves the batch, and the rest is asked again."""
        bad: dict[str, str] = {}
        try:
            group, key = self._pair(rem, s, loads[0], deadline)
        except Exception as e:
            return 0, set(), {it.request_id: f"pg pair with rank {s}: {describe_error(e)}" for it in loads}
        moved = saved = 0
        pg_info = rem.replies[s].pg
        streams: dict[str, int] = {}  # local id -> reads whose stream says it landed
        for r in reads:
            while True:
                loads = [it for it in loads if it.request_id not in bad]
                if not loads:
                    break
                bp = self._plan(loads, rem.spec.block_size, pg_info.get("units") or [rem.spec.block_size])
                bpt = self.spec.bytes_per_token(
                    num_heads=r.num_heads, num_layers=len(layers) if layers else None
                )
                chunk_tokens = self.pipeline.chunk_tokens_for(pg_info, bpt, bp.src_unit, bp.dst_unit)
                refused = self._send_req(rem, s, key, r, loads, bp, chunk_tokens, deadline, layers)
                if refused:
                    before = len(bad)
                    bad.update(refused)
                    if len(bad) == before:  # a refusal that names none of them: no progress
                        why = f"exporter rank {s} refused the send request: {refused}"
                        bad.update({it.request_id: why for it in loads})
                    continue  # each refusal drops at least one load: bounded
                flags = self._recv(rem, s, group, r, loads, bp, chunk_tokens, deadline, layers)
                for it, flag in zip(loads, flags):
                    if flag == 1:
                        streams[it.request_id] = streams.get(it.request_id, 0) + 1
                    else:
                        bad[it.request_id] = (
                            f"exporter rank {s}: released during the stream (lease ended or aborted); not delivered"
                        )
                m, sk = self._count(bp, r.num_heads, layers)
                moved, saved = moved + m, saved + sk
                break
        self._metrics.add("dedup_bytes", saved)
        landed = {rid for rid, n in streams.items() if n == len(reads) and rid not in bad}
        return moved, landed, bad

    def _send_req(
        self, rem, s, key, r: Read, loads, bp: BatchPlan, chunk_tokens: int, deadline: float, layers=None
    ):
        """Ask source rank ``s`` to stream ``bp``'s calls; local id -> why for refused loads."""
        req = C.SendReq(
            self.engine_id,
            self.tp_rank,
            key,
            [it.params.request_id for it in loads],
            [it.params.token for it in loads],
            r.src_head_start,
            r.num_heads,
            bp.src_unit,
            [(c.src.tobytes(), c.num_tokens, c.src_offset, c.src_unit) for c in bp.calls],
            chunk_tokens,
            layers or [],
        )
        try:
            rep = self._client.call(rem.addrs[s], req, time_left(deadline))
        except C.ControlTimeout:
            self._forget(rem, "a send request timed out")
            raise
        if not isinstance(rep, C.SendReply):
            raise RuntimeError(f"send request refused: {getattr(rep, 'error', rep)}")
        if rep.ok:
            return {}
        if "*" in rep.failed:
            self._drop_pair(rem, s, rep.failed["*"])
            raise RuntimeError(rep.failed["*"])
        local_of = {it.params.request_id: it.request_id for it in loads}
        return {local_of.get(rid, rid): f"exporter rank {s}: {why}" for rid, why in rep.failed.items()}

    def _recv(
        self, rem, s, group, r: Read, loads, bp: BatchPlan, chunk_tokens: int, deadline: float, layers=None
    ) -> bytes:
        """Receive and scatter one stream; the exporter's status of it (one byte per load of
        ``loads``, 1: landed)."""
        tag = batch_tag([it.request_id for it in loads])
        hook = self._hooks.get("before_recv")
        if hook:
            hook()

        # ids checked at load() (range, repeats); disjoint loads: no repeats across them either
        disjoint = bp.distinct

        def scatter(c, wire: torch.Tensor) -> None:
            dv = view_at(self._by_unit, c.unit, c.offset, self._offset_views)
            bound = self.num_blocks * (self.spec.block_size // c.unit)
            ids = ops.CheckedIds(c.units, bound, True) if disjoint else c.units
            ops.scatter_blocks(wire, dv.caches, dv.spec, ids, c.num_tokens, r.dst_head_start, layers)

        try:
            n, flags = self.pipeline.recv_stream(
                group, 0, time_left(deadline), rem.pg_backends[s], self.spec, self.device,
                r.num_heads, bp.dst_unit, chunk_tokens, [(c.dst, c.num_tokens, c.dst_offset, c.dst_unit) for c in bp.calls],
                scatter, tag, len(layers) if layers else None, len(loads),
            )  # fmt: skip
        except Exception:
            self._drop_pair(rem, s)  # a failed stream may leave a receive posted
            raise
        self._metrics.record_ops(n, 0)
        return flags
