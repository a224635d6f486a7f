"""The loading role of :class:`~kvxfer.engine.TransferEngine`: the worker that runs queued
loads one batch per ``poll()``, the handshake with each remote engine (cached), the reads over
``ipc`` (one fused copy from the mapped exporter cache) or ``pg``, and the notifications."""

from __future__ import annotations

import logging
import os
import queue
import time

import numpy as np
import torch

from . import control as C
from . import ops
from .engine_types import HandshakeError, LoadItem, ReleaseItem, Remote, batch_tag
from .metrics import now
from .ordering import NOT_READY, wait_event
from .params import KVTransferParams
from .plan import Read, plan_reads
from .spec import KVCacheSpec
from .tracing import trace
from .tracker import UNKNOWN
from .transports import (
    BatchPlan,
    CacheView,
    Item,
    cache_views,
    choice,
    plan_batch,
)

_LOG = logging.getLogger(__name__)


class LoaderRole:
    """Methods of :class:`~kvxfer.engine.TransferEngine` that load from remote exporters."""

    # -------------------------------------------------------------------------- worker
    def _work_loop(self) -> None:
        last_beat = time.monotonic()
        beat_every = self.lease_s / 3
        while not self._stop.is_set():
            try:
                batch = self._work.get(timeout=min(0.05, beat_every))
            except queue.Empty:
                batch = None
            if batch is None and self._stop.is_set():
                return
            if batch:
                try:
                    self._run_batch(batch)
                except Exception as e:  # every request of the batch is still reported once
                    for it in batch:
                        if self._loads.fail(it.request_id, f"internal error: {type(e).__name__}: {e}"):
                            self._metrics.add("failures")
            if time.monotonic() - last_beat >= beat_every:
                self._heartbeat()
                last_beat = time.monotonic()

    def _heartbeat(self) -> None:
        """Renew the leases of loads queued but not yet run (run ones were renewed by the grant)."""
        with self._lock:
            waiting = list(self._incoming)
        try:
            queued = [it for b in list(self._work.queue) if b for it in b]
        except Exception:  # pragma: no cover
            queued = []
        by_addr: dict[str, list[str]] = {}
        for it in waiting + queued:
            p = it.params
            for r in range(p.tp_size):
                by_addr.setdefault(f"tcp://{p.host}:{p.port + r}", []).append(p.request_id)
        for addr, rids in by_addr.items():
            self._client.send(addr, C.Heartbeat(self.engine_id, self.tp_rank, rids))

    def _fail(self, items, reason: str) -> None:
        for it in items:
            if self._loads.fail(it.request_id, reason):
                self._metrics.add("failures")

    def _run_batch(self, batch: list[LoadItem]) -> None:
        releases = [it for it in batch if isinstance(it, ReleaseItem)]
        if releases:  # TransferEngine.release: notify, move nothing
            batch = [it for it in batch if not isinstance(it, ReleaseItem)]
            self._run_releases(releases)
        groups: dict[str, list[LoadItem]] = {}
        for it in batch:
            groups.setdefault(it.params.engine_id, []).append(it)
        for engine_id, items in groups.items():
            try:
                if engine_id in self._remotes:
                    rem = self._remote(items[0].params)
                else:
                    with trace("handshake", engine_id):
                        rem = self._remote(items[0].params)
            except HandshakeError as e:
                self._fail(items, f"handshake with {engine_id}: {e}")
                continue
            self._run_remote(rem, items)

    # ------------------------------------------------------------------------ handshake
    def _remote(self, p: KVTransferParams) -> Remote:
        rem = self._remotes.get(p.engine_id)
        if rem is not None:
            return rem
        t0 = now()
        addrs = [f"tcp://{p.host}:{p.port + r}" for r in range(p.tp_size)]
        hello = C.Hello(
            **self._identity_fields(),
        )
        try:
            replies = self._client.call_many([(a, hello) for a in addrs], self.timeout_s)
        except C.ControlTimeout as e:
            for a in addrs:
                self._client.drop(a)
            raise HandshakeError(str(e)) from None
        for r, rep in enumerate(replies):
            if not isinstance(rep, C.HelloReply):
                raise HandshakeError(f"rank {r} answered {type(rep).__name__}: {getattr(rep, 'error', '')}")
            if rep.error:
                raise HandshakeError(f"rank {r}: {rep.error}")
            if rep.engine_id != p.engine_id or rep.tp_rank != r or rep.tp_size != p.tp_size:
                raise HandshakeError(
                    f"rank {r} at {addrs[r]} is engine {rep.engine_id!r} rank {rep.tp_rank}/{rep.tp_size}, "
                    f"params name {p.engine_id!r} with tp_size {p.tp_size}"
                )
        spec = KVCacheSpec.from_dict(replies[0].spec)
        mismatch = spec.model_mismatch(self.spec)
        if mismatch:
            raise HandshakeError(f"incompatible peer: {mismatch}")
        try:
            plan = plan_reads(spec, p.tp_size, self.spec, self.tp_size)
        except ValueError as e:
            raise HandshakeError(f"incompatible peer: TP {p.tp_size} -> {self.tp_size}: {e}") from None
        transport, pg_backends = self._choose_transport(replies)
        rem = Remote(
            p.engine_id, spec, p.tp_size, addrs, transport, replies, min(r.num_blocks for r in replies), plan
        )
        rem.pg_backends = pg_backends
        rem.reads, rem.notify_to = plan.reads(self.tp_rank), plan.notify_targets(self.tp_rank)
        self._remotes[p.engine_id] = rem
        self._metrics.record_handshake(p.engine_id, now() - t0, transport)
        return rem

    def _choose_transport(self, replies: list[C.HelloReply]) -> tuple[str, list[str]]:
        """Pick the transport and, for pg, each source rank's pair backend
        (kvxfer.transports.choice); the reasons go to stats()["transport_reasons"]."""
        info = self._ipc_desc["info"]
        backends: list[str] = []
        try:
            transport, why = choice.choose(
                self.transport, self.device, info, self._identity, replies, self._topology
            )
            if transport == "pg":
                backends, bwhy = choice.pair_backends(self.device, info, replies)
                why = f"{why}; {bwhy}" if bwhy else why
        except ValueError as e:
            raise HandshakeError(str(e)) from None
        self._transport_reasons[replies[0].engine_id] = why
        return transport, backends

    def _topology(self):
        if self._topo is None:
            from .topology import probe

            self._topo = probe()
        return self._topo

    # ------------------------------------------------------------------------ transfers
    def _run_remote(self, rem: Remote, items: list[LoadItem]) -> None:
        good: list[LoadItem] = []
        for it in items:
            need = rem.spec.num_blocks_for(it.params.num_tokens)
            src_ids = it.params.block_id_array()  # uint64: max() bounds both ends
            if src_ids.size != need:
                self._fail([it], f"params.block_ids: has {src_ids.size} ids, num_tokens needs {need}")
            elif int(src_ids.max()) >= rem.num_blocks:
                self._fail([it], f"params.block_ids: out of the exporter's range [0, {rem.num_blocks})")
            else:
                good.append(it)
        seen_remote: set[str] = set()
        for it in list(good):
            if it.params.request_id in seen_remote:
                good.remove(it)
                self._fail([it], f"params.request_id: {it.params.request_id!r} is loaded twice in one batch")
            seen_remote.add(it.params.request_id)
        if not good:
            return
        remote_of = {it.request_id: it.params.request_id for it in good}
        local_of = {v: k for k, v in remote_of.items()}
        plan = rem.plan
        reads = rem.reads
        src_ranks = sorted({r.src_rank for r in reads})
        alive = {it.request_id: it for it in good}
        reasons: dict[str, str] = {}
        # Lease grants from every source rank read (renews the leases). A rank that does not
        # know a request yet (its export may trail the rank that published the params) is
        # asked again until timeout_s; a released request fails at once.
        epochs: dict[int, dict[str, np.ndarray]] = {s: {} for s in src_ranks}
        todo = {s: list(alive) for s in src_ranks}
        deadline = time.monotonic() + self.timeout_s
        while any(todo.values()):
            ranks = [s for s in src_ranks if todo[s]]
            calls = [
                (
                    rem.addrs[s],
                    C.ReadReq(self.engine_id, self.tp_rank, self.tp_size, [remote_of[r] for r in todo[s]]),
                )
                for s in ranks
            ]
            try:
                grants = self._client.call_many(calls, max(0.01, deadline - time.monotonic()))
            except C.ControlTimeout as e:
                self._forget(rem)
                self._fail(good, f"lease grant: {e}")
                self._notify(rem, plan, [], [it.params.request_id for it in good])
                return
            for s, g in zip(ranks, grants):
                if not isinstance(g, C.ReadReply):
                    for rid in list(alive):
                        reasons[rid] = f"rank {s}: {getattr(g, 'error', g)}"
                    alive.clear()
                    todo = {}
                    break
                epochs[s].update(
                    {local_of[rid]: np.frombuffer(b, dtype=np.int64) for rid, b in zip(g.ok, g.epochs)}
                )
                retry = []
                for rrid, why in g.failed.items():
                    rid = local_of.get(rrid)
                    if rid not in alive:
                        continue
                    if why in (UNKNOWN, NOT_READY) and time.monotonic() < deadline:
                        retry.append(rid)
                    else:
                        del alive[rid]
                        reasons[rid] = f"exporter rank {s}: {why}"
                todo[s] = [rid for rid in retry if rid in alive]
            if any(todo.values()):
                time.sleep(0.005)
        for s in src_ranks:
            if not alive:
                break
            s_reads = [r for r in reads if r.src_rank == s]
            t0 = now()
            try:
                with self._order.on_stream():  # CUDA: the rank's load stream (kvxfer.ordering)
                    if rem.transport == "ipc":
                        with trace("copy", batch_tag(list(alive))):
                            moved, bad = self._ipc_read(rem, s, s_reads, list(alive.values()), epochs[s])
                    else:
                        moved, bad = self._pg_read(rem, s, s_reads, list(alive.values()))
                    if rem.transport == "pg" and alive:  # finished only once the scatters ran
                        self._order.wait_done(self.timeout_s)
            except Exception as e:
                moved, bad = (
                    0,
                    {rid: f"{rem.transport} read from rank {s}: {type(e).__name__}: {e}" for rid in alive},
                )
            self._metrics.record_batch(t0, now(), moved, 0)
            for rid, why in bad.items():
                if rid in alive:
                    del alive[rid]
                    reasons[rid] = why
        done = list(alive)
        t_end = now()
        lat = []
        for rid in done:
            start = self._loads.start_of(rid)
            if self._loads.finish(rid):
                lat.append(t_end - start)
        self._metrics.record_done(lat)
        failed = [it for it in good if it.request_id in reasons]
        for it in failed:
            if self._loads.fail(it.request_id, reasons[it.request_id]):
                self._metrics.add("failures")
        self._notify(rem, plan, [remote_of[r] for r in done], [it.params.request_id for it in failed])

    def _notify(self, rem: Remote, plan, done: list[str], failed: list[str]) -> None:
        if not done and not failed:
            return
        msg = C.Notify(self.engine_id, self.tp_rank, self.tp_size, done, failed)
        for s in rem.notify_to:
            self._client.send(rem.addrs[s], msg)

    def _forget(self, rem: Remote) -> None:
        """Drop a remote that stopped answering; the next load handshakes again."""
        self._remotes.pop(rem.engine_id, None)
        for _, _, handles in rem.ipc.values():
            choice.detach(handles)
        rem.ipc.clear()
        for a in rem.addrs:
            self._client.drop(a)

    def _plan(self, loads: list[LoadItem], src_bs: int, src_units: list[int]) -> BatchPlan:
        """Units and ops calls for ``loads`` from one source rank (block lists in, no per-token
        arrays unless requests with partial last blocks share a call)."""
        items = [
            Item(it.request_id, it.params.block_id_array().view(np.int64), it.block_ids, it.params.num_tokens)
            for it in loads
        ]
        return plan_batch(items, src_bs, src_units, self.spec.block_size, [v.unit for v in self._views])

    def _count(self, bp: BatchPlan, num_heads: int) -> tuple[int, int]:
        bpt = self._bpt.get(num_heads)
        if bpt is None:
            bpt = self._bpt[num_heads] = self.spec.bytes_per_token(num_heads=num_heads)
        return sum(c.num_tokens for c in bp.chunks) * bpt, bp.skipped_tokens * bpt

    def _ipc_map(self, rem: Remote, s: int):
        got = rem.ipc.get(s)
        if got is None:
            caches, ep, handles = choice.attach(rem.replies[s].ipc, self.device)
            got = rem.ipc[s] = (cache_views(caches, rem.spec), ep, handles)
        return got

    def _ipc_read(self, rem, s, reads: list[Read], loads, granted: dict[str, np.ndarray]):
        src_views, ep, _ = self._ipc_map(rem, s)
        bp = self._plan(loads, rem.spec.block_size, [v.unit for v in src_views])
        sv = next(v for v in src_views if v.unit == bp.src_unit)
        dv = self._by_unit[bp.dst_unit]
        moved = saved = calls = 0
        for r in reads:
            for ch in bp.chunks:
                ops.copy_blocks(
                    sv.caches,
                    sv.spec,
                    ch.src,
                    dv.caches,
                    dv.spec,
                    ch.dst,
                    ch.num_tokens,
                    r.src_head_start,
                    r.dst_head_start,
                    r.num_heads,
                )
                calls += 1
            m, sk = self._count(bp, r.num_heads)
            moved, saved = moved + m, saved + sk
        self._order.wait_done(self.timeout_s)  # CUDA: the copy ran before the epochs are re-read
        hook = self._hooks.get("after_ipc_copy")
        if hook:
            hook(ep)
        # One epoch check, after the copy: epochs only grow, so it also catches blocks released
        # between the grant and the copy (a separate check before the copy cost ~15 us per
        # batch and only spared copying data that is then never delivered).
        bad = self._stale(ep.numpy(), loads, granted, s)
        self._metrics.add("ops_calls", calls)
        self._metrics.add("dedup_bytes", saved)
        return moved, bad

    @staticmethod
    def _stale(ep: np.ndarray, loads, granted: dict[str, np.ndarray], s: int) -> dict[str, str]:
        """Loads whose source blocks' epochs moved since the grant snapshot -> why."""
        why = f"exporter rank {s}: blocks released before or during the copy (lease ended); not delivered"
        if any(granted[it.request_id].size != it.params.block_id_array().size for it in loads):
            # Params sliced to a suffix of the export (a load of only the tokens after a prefix
            # the loader already holds): the grant snapshot covers the whole export; its tail
            # belongs to the blocks read. More ids than exported is never valid.
            granted = dict(granted)
            for it in loads:
                g, n = granted[it.request_id], it.params.block_id_array().size
                if g.size != n:
                    granted[it.request_id] = g[g.size - n :] if n < g.size else np.full(n, -1, np.int64)
        if len(loads) == 1:
            it = loads[0]
            moved = (ep[it.params.block_id_array().view(np.int64)] != granted[it.request_id]).any()
            return {it.request_id: why} if moved else {}
        ids = [it.params.block_id_array().view(np.int64) for it in loads]
        diff = ep[np.concatenate(ids)] != np.concatenate([granted[it.request_id] for it in loads])
        if not diff.any():
            return {}
        starts = np.cumsum([0] + [a.size for a in ids[:-1]])
        per = np.logical_or.reduceat(diff, starts)
        return {loads[k].request_id: why for k in np.flatnonzero(per).tolist()}

    def _pair(self, rem: Remote, s: int):
        from .transports import pg

        got = rem.pairs.get(s)
        if got is not None:
            return got
        rem.pair_gen += 1
        key = f"{self.engine_id}/{self.tp_rank}/{os.getpid()}/{rem.pair_gen}"
        backend = rem.pg_backends[s]
        req = C.PairReq(self.engine_id, self.tp_rank, key, backend)
        rep = self._client.call(rem.addrs[s], req, self.timeout_s)
        if not isinstance(rep, C.SendReply) or not rep.ok:
            raise RuntimeError(f"pair group refused: {getattr(rep, 'failed', rep)}")
        info = rem.replies[s].pg
        store = pg.connect_store(info["host"], info["port"], self.timeout_s)
        group = pg.new_pair(store, key, 1, self.host, self.timeout_s, backend)
        got = rem.pairs[s] = (group, key)
        return got

    def _pg_read(self, rem, s, reads: list[Read], loads):
        bad: dict[str, str] = {}
        try:
            group, key = self._pair(rem, s)
        except Exception as e:
            return 0, {it.request_id: f"pg pair with rank {s}: {type(e).__name__}: {e}" for it in loads}
        moved = saved = calls = 0
        staged = getattr(self.pipeline, "streams", False)
        pg_info = rem.replies[s].pg
        for r in reads:
            for _attempt in range(3):
                loads = [it for it in loads if it.request_id not in bad]
                if not loads:
                    break
                bp = self._plan(loads, rem.spec.block_size, pg_info.get("units") or [rem.spec.block_size])
                chunks, dv = bp.chunks, self._by_unit[bp.dst_unit]
                chunk_tokens = 0
                if staged:
                    bpt = self.spec.bytes_per_token(num_heads=r.num_heads)
                    chunk_tokens = self.pipeline.chunk_tokens_for(pg_info, bpt, bp.src_unit, bp.dst_unit)
                req = C.SendReq(
                    self.engine_id,
                    self.tp_rank,
                    key,
                    [it.params.request_id for it in loads],
                    r.src_head_start,
                    r.num_heads,
                    bp.src_unit,
                    [(c.src.tobytes(), c.num_tokens) for c in chunks],
                    chunk_tokens,
                )
                try:
                    rep = self._client.call(rem.addrs[s], req, self.timeout_s)
                except C.ControlTimeout:
                    rem.pairs.pop(s, None)
                    self._forget(rem)
                    raise
                if not isinstance(rep, C.SendReply):
                    raise RuntimeError(f"send request refused: {getattr(rep, 'error', rep)}")
                if not rep.ok:
                    if "*" in rep.failed:
                        rem.pairs.pop(s, None)
                        raise RuntimeError(rep.failed["*"])
                    local_of = {it.params.request_id: it.request_id for it in loads}
                    for rid, why in rep.failed.items():
                        bad[local_of.get(rid, rid)] = f"exporter rank {s}: {why}"
                    continue
                tag = batch_tag([it.request_id for it in loads])
                try:
                    if staged:
                        calls += self.pipeline.recv_stream(
                            group, 0, self.timeout_s, rem.pg_backends[s], self.spec, self.device,
                            r.num_heads, bp.dst_unit, chunk_tokens, [(c.dst, c.num_tokens) for c in chunks],
                            self._scatterer(dv, r.dst_head_start), tag,
                        )  # fmt: skip
                    # Gloo pairs of CUDA caches carry host wires: receive into pinned memory and
                    # keep it until the CUDA scatter reading it completed.
                    host_wire = self.device.type == "cuda" and rem.pg_backends[s] == "gloo"
                    for c in chunks if not staged else ():
                        wire = torch.empty(
                            self.spec.wire_shape(c.num_tokens, r.num_heads),
                            dtype=self.spec.dtype,
                            device="cpu" if host_wire else self.device,
                            pin_memory=host_wire,
                        )
                        with trace("recv", tag):
                            self.pipeline.recv(group, wire, 0, self.timeout_s)
                        with trace("scatter", tag):
                            ops.scatter_blocks(
                                wire, dv.caches, dv.spec, c.dst, c.num_tokens, r.dst_head_start
                            )
                        if host_wire:
                            done = torch.cuda.Event()
                            done.record()
                            wait_event(done, self.timeout_s, "scatter from a host wire")
                        calls += 1
                except Exception:
                    rem.pairs.pop(s, None)  # a timed-out pair may hold a stale receive
                    raise
                m, sk = self._count(bp, r.num_heads)
                moved, saved = moved + m, saved + sk
                break
        self._metrics.add("ops_calls", calls)
        self._metrics.add("dedup_bytes", saved)
        return moved, bad

    def _scatterer(self, view: CacheView, head_start: int):
        def scatter(units, num_tokens: int, wire: torch.Tensor) -> None:
            ops.scatter_blocks(wire, view.caches, view.spec, units, num_tokens, head_start)

        return scatter

    # ------------------------------------------------------------------------ releases
    def _run_releases(self, items: list[ReleaseItem]) -> None:
        """Tell exporters that these requests will never be loaded here (TransferEngine.release).

        Each exporter rank the plan names gets the notification a failed load would send, so
        it frees the blocks once every loader rank released or loaded them. A rank that does
        not know a request yet (the params were made before the export) is asked again until
        ``timeout_s``: a notification for an unknown request would be dropped.
        """
        groups: dict[str, list[KVTransferParams]] = {}
        for it in items:
            groups.setdefault(it.params.engine_id, []).append(it.params)
        for engine_id, ps in groups.items():
            rids = list(dict.fromkeys(p.request_id for p in ps))
            try:
                rem = self._remote(ps[0])
            except HandshakeError as e:
                _LOG.warning(
                    "kvxfer %s rank %d: release of %s: handshake with %s failed (%s); the exporter "
                    "frees them when their lease ends",
                    self.engine_id, self.tp_rank, rids, engine_id, e,
                )  # fmt: skip
                continue
            todo = {s: list(rids) for s in rem.notify_to}
            deadline = time.monotonic() + self.timeout_s
            while any(todo.values()) and time.monotonic() < deadline:
                ranks = [s for s in rem.notify_to if todo[s]]
                calls = [
                    (rem.addrs[s], C.ReadReq(self.engine_id, self.tp_rank, self.tp_size, todo[s]))
                    for s in ranks
                ]
                try:
                    replies = self._client.call_many(calls, max(0.01, deadline - time.monotonic()))
                except C.ControlTimeout as e:
                    self._forget(rem)
                    _LOG.warning(
                        "kvxfer %s rank %d: release of %s: %s; the exporter frees them when their lease ends",
                        self.engine_id, self.tp_rank, rids, e,
                    )  # fmt: skip
                    todo = {}
                    break
                for s, g in zip(ranks, replies):
                    todo[s] = (
                        [r for r, why in g.failed.items() if why == UNKNOWN]
                        if isinstance(g, C.ReadReply)
                        else []
                    )
                if any(todo.values()):
                    time.sleep(0.005)
            if any(todo.values()):
                _LOG.warning(
                    "kvxfer %s rank %d: release of %s: not exported by %s within %.1fs; the exporter "
                    "frees them when their lease ends",
                    self.engine_id, self.tp_rank, sorted({r for v in todo.values() for r in v}), engine_id,
                    self.timeout_s,
                )  # fmt: skip
            if engine_id in self._remotes:
                self._notify(rem, rem.plan, [], rids)
