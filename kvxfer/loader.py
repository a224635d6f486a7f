"""The loading role of an engine rank: one worker thread that runs the loads ``poll()`` hands
it, batch by batch.

One load, from ``poll()`` to the notification:

1. ``poll()`` hands the loads queued since the last poll to the worker thread as one batch
   (:meth:`Loader.dispatch`); each load gets its deadline then (``timeout_s`` from now): every
   wait below ends by it.
2. :meth:`Loader._run_batch` groups the batch by remote engine and finds each one's
   :class:`~kvxfer.peer.Peer` (:meth:`Loader.peer_of`: kept while the params name its address;
   a new one, or one whose address changed or whose rank restarted, is handshaken anew,
   :func:`kvxfer.handshake.handshake`, which chooses the transport and opens its session).
3. :meth:`Loader._run_peer` checks the params against the peer, asks every source rank the
   plan reads for a lease grant (:mod:`kvxfer.grants`: renews the leases, returns block
   epochs; retried while a rank does not know a request yet or its compute is not done), then
   has the load planner move them from each source rank through the peer's session
   (:meth:`Loader._read_rank` -> :meth:`kvxfer.planner.Planner.read`), and reports every load
   once, finished only by the transport's record that its bytes arrived.
4. The exporter ranks the plan names are notified (landed, or failed) through the notifier
   (:mod:`kvxfer.notifier`), which retries until acknowledged or the lease is over.

Work on the GPU that outlives its wait is fenced (:class:`~kvxfer.ordering.FenceTimeout`):
its loads are reported, and their exporters notified, only once it has completed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from . import control, releases
from .batching import BatchPlan
from .engine_types import (
    Expired,
    HandshakeError,
    LoadItem,
    ReleaseItem,
    describe_error,
    mask_layers,
)
from .grants import RESTARTED, ask_grants, take_grants, wanted
from .handshake import handshake
from .metrics import now
from .notifier import DRAIN_S, Notifier
from .ordering import FenceTimeout, event_done
from .peer import Peer, Peers
from .planner import Planner
from .rank import Rank, Runtime
from .tracing import items_tag, trace
from .transfer import Route
from .transports import Transport

_LOG = logging.getLogger(__name__)


class Loader:
    """Loads from remote exporters for one engine rank (see the module doc).

    Args:
        rank: the rank's configuration.
        rt: what the rank's parts share while it runs (the loads in flight, counters, hooks).
        transports: the rank's transports by name (a remote's transport reads for it).
        notifier: where notifications and heartbeats go.

    ``peers``: the handshaken remote engines (:class:`~kvxfer.peer.Peers`, with why each one's
    transport was chosen); ``client``: the worker thread's side-channel client (sessions send
    their requests through it); ``planner``: the load planner."""

    def __init__(self, rank: Rank, rt: Runtime, transports: dict[str, Transport], notifier: Notifier) -> None:
        self.rank = rank
        self.rt = rt
        self.transports = transports
        self.notifier = notifier
        self.peers = Peers()
        self.peer = self.peers.get  # the peer kept for an engine id, or None (any thread)
        self.planner = Planner(rank, rt)
        self.client: control.ControlClient | None = None
        self.lock = threading.Lock()
        self.incoming: list[LoadItem] = []  # load() since the last poll()
        # (engine id, request id) of the params in ``incoming``: the one-sided path refuses a
        # load of params the next batch already holds, as the batch itself refuses a repeat
        self._incoming_keys: set[tuple[str, str]] = set()
        # the same set, read by the one-sided mode in load(): whether a load of the params key
        # (engine id, request id) waits for the next batch
        self.queued_keys = self._incoming_keys
        self.releases: list[ReleaseItem] = []  # release() since the last poll(), run as their own batch
        self.fenced: list = []  # loads held until their timed-out GPU work completed
        self._work: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._topo = None  # topology(): probed only when two different GPUs handshake

    # -------------------------------------------------------------------------- lifecycle
    def start(self, ctx) -> None:
        """Start the worker thread; its side-channel client lives in zmq context ``ctx``."""
        rank = self.rank
        self.client = control.ControlClient(ctx)
        self._thread = threading.Thread(
            target=self._work_loop, name=f"kvxfer-worker-{rank.engine_id}-{rank.tp_rank}", daemon=True
        )
        self._thread.start()

    def queue_load(self, item: LoadItem) -> None:
        """Queue a load; it starts at the next :meth:`dispatch`."""
        p = item.params
        with self.lock:
            self.incoming.append(item)
            self._incoming_keys.add((p.engine_id, p.request_id))

    def queue_releases(self, items: list[ReleaseItem]) -> None:
        with self.lock:
            self.releases.extend(items)

    def dispatch(self, timeout_s: float) -> None:
        """Hand the loads (and releases) queued since the last call to the worker thread, each
        batch with one deadline ``timeout_s`` from now (what ``poll()`` does first)."""
        if not (self.incoming or self.releases):
            return
        with self.lock:
            batch, self.incoming = self.incoming, []
            self._incoming_keys.clear()
            releases, self.releases = self.releases, []
        deadline = time.monotonic() + timeout_s  # the loads' one deadline
        for b in (releases, batch):  # releases as their own batch: they move nothing
            self._hand_over(b, deadline)

    def flush_releases(self) -> None:
        """Hand the releases queued since the last ``poll()`` to the worker (``close()``: they
        still go, while loads queued but not started are dropped)."""
        with self.lock:
            releases, self.releases = self.releases, []
        self._hand_over(releases, time.monotonic() + min(self.rank.timeout_s, DRAIN_S))

    def _hand_over(self, batch: list, deadline: float) -> None:
        """Give ``batch`` (if any) to the worker thread, each item with ``deadline``."""
        if batch:
            for it in batch:
                it.deadline = deadline
            self._work.put(batch)

    def stop(self) -> None:
        self._work.put(None)

    def threads(self) -> list[threading.Thread]:
        return [self._thread] if self._thread is not None else []

    def close(self) -> None:
        """Forget every peer (their sessions: mappings, pair groups, agents), close the client."""
        self.peers.close()
        if self.client is not None:
            self.client.close()

    # -------------------------------------------------------------------------- worker
    def _work_loop(self) -> None:
        last_beat = time.monotonic()
        beat_every = self.rank.lease_s / 3
        while not self.rt.stop.is_set():
            try:
                batch = self._work.get(timeout=min(0.05, beat_every))
            except queue.Empty:
                batch = None
            if batch is None and self.rt.stop.is_set():
                break
            if self.fenced:
                self._release_fenced()
            if batch:
                try:
                    self._run_batch(batch)
                except Exception as e:  # every request of the batch is still reported once
                    _LOG.warning(
                        "kvxfer loader %s rank %d: internal error in a batch (%s: %s)",
                        self.rank.engine_id,
                        self.rank.tp_rank,
                        type(e).__name__,
                        e,
                    )
                    self._fail(batch, f"internal error: {describe_error(e)}")
            if time.monotonic() - last_beat >= beat_every:
                self._heartbeat()
                last_beat = time.monotonic()
        self._drain_releases()

    def _drain_releases(self) -> None:
        """The engine is closing: the releases handed over before it still run (each frees an
        exporter's blocks that would otherwise stay leased until the lease ends, or for as long
        as someone renews it); queued loads that never started are dropped."""
        while True:
            try:
                batch = self._work.get_nowait()
            except queue.Empty:
                return
            if not batch or type(batch[0]) is not ReleaseItem:
                continue
            end = time.monotonic() + DRAIN_S  # within close()'s bound, whatever they were given
            for it in batch:
                it.deadline = min(it.deadline, end)
            try:
                releases.run(self, batch)
            except Exception as e:  # closing: logged, the other releases still go
                _LOG.warning(
                    "kvxfer loader %s rank %d: %d release(s) at close failed (%s)",
                    self.rank.engine_id, self.rank.tp_rank, len(batch), describe_error(e),
                )  # fmt: skip

    def _heartbeat(self) -> None:
        """Renew the leases of loads queued but not yet run (run ones were renewed by the grant)."""
        with self.lock:
            waiting = list(self.incoming)
        try:
            queued = [it for b in list(self._work.queue) if b and type(b[0]) is LoadItem for it in b]
        except Exception:  # pragma: no cover - a racing get(): the next beat catches up
            queued = []
        by_addr: dict[str, tuple[list[str], list[str]]] = {}
        for it in waiting + queued:
            p = it.params
            for r in range(p.tp_size):
                rids, toks = by_addr.setdefault(f"tcp://{p.host}:{p.port + r}", ([], []))
                rids.append(p.request_id)
                toks.append(p.token)
        deadline = time.monotonic() + self.rank.lease_s / 3
        for addr, (rids, toks) in by_addr.items():
            self.notifier.put(
                addr, control.Heartbeat(self.rank.engine_id, self.rank.tp_rank, rids, toks), deadline
            )

    def _fail(self, items, reason: str) -> None:
        for it in items:
            if self.rt.loads.fail(it.request_id, reason):
                self.rt.metrics.add("failures")

    def _run_batch(self, batch: list[LoadItem] | list[ReleaseItem]) -> None:
        """Run one batch that ``poll()`` handed over: loads, or releases (TransferEngine.release:
        notify, move nothing), never both."""
        if type(batch[0]) is ReleaseItem:
            releases.run(self, batch)
            return
        groups: dict[str, list[LoadItem]] = {}
        for it in batch:
            groups.setdefault(it.params.engine_id, []).append(it)
        for engine_id, items in groups.items():
            with trace("load", items_tag, items):
                peer = self.peers.get(engine_id)
                while items and (peer is None or not peer.serves(items[0].params)):
                    try:  # new, or moved to another address (restarted?): handshake
                        peer = self.peer_of(items[0], items[0].deadline)
                    except (HandshakeError, Expired) as e:
                        if getattr(e, "refused", False) and len(items) > 1:
                            # the exporter refused this load's params (another export's token,
                            # altered ids): it alone fails; the next load handshakes
                            self._fail(items[:1], f"handshake with {engine_id}: {e}")
                            items = items[1:]
                            continue
                        self._fail(items, f"handshake with {engine_id}: {e}")
                        self._notify_answered(getattr(e, "answered", ()), items)
                        items = []
                if items:
                    self._run_peer(peer, items)

    def _notify_answered(self, addrs, items: list[LoadItem]) -> None:
        """Tell exporter ranks that accepted a handshake that then failed (an incompatible
        peer, params naming another TP size) that ``items`` failed here, so they do not hold
        the blocks until the lease ends. A rank the plan does not have this rank notify counts
        nothing (kvxfer.exporter)."""
        if not addrs:
            return
        msg = control.Notify(
            self.rank.engine_id,
            self.rank.tp_rank,
            self.rank.tp_size,
            [],
            [it.params.request_id for it in items],
            [it.params.token for it in items],
        )
        deadline = time.monotonic() + self.rank.lease_s
        for a in addrs:
            self.notifier.put(a, msg, deadline)

    def plan(self, route: Route, src_block_size: int, loads: list, distinct: bool) -> BatchPlan:
        """The load planner's ops calls of ``loads`` along ``route`` (:meth:`Planner.plan`)."""
        return self.planner.plan(route, src_block_size, loads, distinct)

    def peer_of(self, it: LoadItem | ReleaseItem, deadline: float) -> Peer:
        """The peer ``it``'s params name: kept while they name its address; else (new, or moved:
        restarted?) the one kept is forgotten and the params' engine handshaken anew
        (:func:`kvxfer.handshake.handshake`). ``HandshakeError`` or ``Expired`` when it cannot
        be."""
        p = it.params
        peer = self.peers.get(p.engine_id)
        if peer is not None:
            if peer.serves(p):
                return peer
            _LOG.info(
                "kvxfer loader %s: engine %s moved from %s:%d to %s:%d (restarted?): handshaking anew",
                self.rank.engine_id, p.engine_id, peer.host, peer.port, p.host, p.port,
            )  # fmt: skip
            self.forget(peer, "the remote moved to a new address")
        with trace("handshake", p.engine_id):
            peer = handshake(self, it, deadline)
        self.peers.add(peer)
        return peer

    def topology(self):
        """This host's GPU topology (:func:`kvxfer.topology.probe`), probed on the first call: a
        handshake between two different GPUs asks for it (:mod:`kvxfer.handshake`)."""
        if self._topo is None:
            from .topology import probe

            self._topo = probe()
        return self._topo

    # ------------------------------------------------------------------------ transfers
    def _run_peer(self, peer: Peer, items: list[LoadItem], retried: bool = False) -> None:
        """Move ``items`` (loads of one remote) and report each once, finished or failed.

        The first round asks every source rank the plan reads for the leases of all of them. When
        every rank grants every load whole (a whole export, nothing refused: the common case) they
        are read rank by rank and reported (:meth:`_read_whole`); anything else, a layer-wise
        export, a load not known or not ready yet, a refusal or a restarted remote, continues in
        :meth:`_run_rounds` from the replies of that round."""
        good, rids, toks, digests, bad = self.planner.check(peer, items)
        for it, why in bad:
            self._fail([it], why)
        if not good:
            return
        deadline = good[0].deadline if len(good) == 1 else min(it.deadline for it in good)
        src_ranks = peer.src_ranks
        # every layer of every load, from every source rank: one message
        msg = control.ReadReq(
            self.rank.engine_id, self.rank.tp_rank, self.rank.tp_size, rids, toks, digests=digests
        )
        try:
            replies = ask_grants(self.client, [(peer.addrs[s], msg) for s in src_ranks], good, deadline)
        except (control.ControlTimeout, Expired) as e:
            self.forget(peer, f"lease grant: {e}")
            self._fail_all(peer, good, f"lease grant: {e}")
            return
        for s, g in zip(src_ranks, replies):
            if (
                type(g) is not control.ReadReply
                or g.ok != rids
                or g.incarnation != peer.replies[s].incarnation
                or any(g.layers)
            ):
                self._run_rounds(peer, good, src_ranks, replies, deadline, retried)
                return
        self._read_whole(peer, good, src_ranks, replies, deadline)

    def _read_whole(
        self, peer: Peer, good: list[LoadItem], src_ranks: list[int], replies: list, deadline: float
    ) -> None:
        """Read every layer of ``good`` from each source rank, whose grant (``replies``, in rank
        order) holds all of them in request order; report each load once."""
        alive = {it.request_id: it for it in good}
        local_ids = list(alive)
        reasons: dict[str, str] = {}
        for s, g in zip(src_ranks, replies):
            if not alive:
                break
            granted = dict(zip(local_ids, g.epochs))  # local id -> its blocks' epochs (int64 bytes)
            landed, bad = self._read_rank(peer, s, alive, granted, deadline)
            if len(landed) != len(alive):
                for rid in [rid for rid in alive if rid not in landed]:
                    del alive[rid]
                    reasons[rid] = bad[rid]
        failed = [it for it in good if it.request_id in reasons] if reasons else []
        self._complete(peer, list(alive.values()), failed, reasons)

    def _run_rounds(
        self,
        peer: Peer,
        good: list[LoadItem],
        src_ranks: list[int],
        replies: list,
        deadline: float,
        retried: bool,
    ) -> None:
        """Rounds of grants and reads until every layer of every load landed (a layer-wise export
        takes a round per group of layers that becomes ready), or the deadline; the first round's
        grants are ``replies``. Each load is reported as soon as it finished, or failed with
        its reason."""
        alive = {it.request_id: it for it in good}
        reasons: dict[str, str] = {}
        full = peer.full_mask
        need = {s: dict.fromkeys(alive, full) for s in src_ranks}  # layers still wanted, as ints
        while alive:
            if replies is None:
                ranks = [s for s in src_ranks if any(need[s][rid] for rid in alive)]
                try:
                    calls = wanted(self.rank, peer, ranks, alive, need)
                    replies = ask_grants(self.client, calls, alive.values(), deadline)
                except (control.ControlTimeout, Expired) as e:
                    self.forget(peer, f"lease grant: {e}")
                    reasons.update(dict.fromkeys(alive, f"lease grant: {e}"))
                    alive.clear()
                    break
            else:
                ranks = src_ranks
            granted = take_grants(peer, ranks, replies, alive, reasons, deadline, self.forget)
            replies = None
            if not retried and reasons and not alive and all(RESTARTED in why for why in reasons.values()):
                # The remote restarted at its address: handshake with the new incarnation at once
                # (new mappings, new pair groups) and run the batch again; params of the previous
                # start are unknown there and fail by the deadline.
                try:
                    fresh = self.peer_of(good[0], deadline)
                except (HandshakeError, Expired) as e:
                    self._fail_all(peer, good, f"handshake after a restart: {e}")
                    return
                self._run_peer(fresh, good, retried=True)
                return
            for s in ranks:
                self._read_granted(peer, s, alive, reasons, need, granted.get(s, {}), deadline)
            done = [rid for rid in alive if not any(need[s][rid] for s in src_ranks)]
            if done:
                self._complete(peer, [alive.pop(rid) for rid in done], [], {})
        if reasons:
            self._complete(peer, [], [it for it in good if it.request_id in reasons], reasons)

    def _read_granted(
        self, peer: Peer, s: int, alive: dict, reasons: dict, need: dict, granted: dict, deadline: float
    ) -> None:
        """Read from rank ``s`` the layers it granted that the loads still need, one read per
        distinct layer set (all layers of a whole export: one read)."""
        groups: dict[int, list[str]] = {}
        for rid, (_, mask) in granted.items():
            if rid in alive:
                todo = need[s][rid] & mask
                if todo:
                    groups.setdefault(todo, []).append(rid)
        L = peer.spec.num_layers
        full = peer.full_mask
        for layers_mask, rids in groups.items():
            layers = None if layers_mask == full else mask_layers(layers_mask, L)
            sub = {rid: alive[rid] for rid in rids if rid in alive}
            if not sub:
                continue
            landed, bad = self._read_rank(
                peer, s, sub, {rid: granted[rid][0] for rid in sub}, deadline, layers
            )
            for rid in rids:
                if rid in landed:
                    need[s][rid] &= ~layers_mask
                elif rid not in sub:  # fenced: reported once its GPU work completed
                    alive.pop(rid, None)
                else:
                    alive.pop(rid, None)
                    reasons[rid] = bad[rid]

    def _read_rank(
        self,
        peer: Peer,
        s: int,
        alive: dict,
        granted: dict,
        deadline: float,
        layers: list[int] | None = None,
    ) -> tuple[set[str], dict[str, str]]:
        """Read the plan's heads (and ``layers``, default all) of source rank ``s`` for the
        ``alive`` loads. Returns (the local ids that landed, local id -> why for every other
        load still in ``alive``). A load lands only by the transport's own record that its
        bytes arrived (``ipc`` and ``nixl`` direct: the copy completed and the epochs did not
        move; ``pg`` and ``nixl`` staged: the exporter's status of every stream); one with no
        such record fails, whatever else happened. Timed-out GPU work is fenced: its loads
        leave ``alive`` and are reported once it completed."""
        loads = list(alive.values())
        t0 = now()
        bad = {}
        try:
            with self.rt.order.on_stream():  # CUDA: the rank's load stream (kvxfer.ordering)
                _, landed, bad = self.planner.read(
                    peer, s, loads, granted, deadline, layers
                )  # recorded there
        except FenceTimeout as e:
            why = f"{peer.transport} read from rank {s}: {e}; reported once the GPU work completed"
            self._defer(e, peer, [it for it in loads if it.request_id not in bad], why)
            for it in loads:
                alive.pop(it.request_id, None)
            landed = set()
            self.rt.metrics.record_batch(t0, now(), 0, 0)
        except Exception as e:
            landed = set()
            bad = {it.request_id: f"{peer.transport} read from rank {s}: {describe_error(e)}" for it in loads}
            self.rt.metrics.record_batch(t0, now(), 0, 0)
        if len(landed) != len(alive) or bad:
            landed = {rid for rid in landed if rid in alive and rid not in bad}
            for rid in alive:
                if rid not in landed and rid not in bad:
                    bad[rid] = f"{peer.transport} read from rank {s}: no record that its bytes arrived"
        return landed, bad

    def _complete(
        self, peer: Peer, done: list[LoadItem], failed: list[LoadItem], reasons: dict[str, str]
    ) -> None:
        """Report each load once, ``done`` finished and ``failed`` failed with its reason in
        ``reasons``, and notify the exporter of both (one message)."""
        if done:
            self.rt.metrics.record_done(self.rt.loads.finish_many([it.request_id for it in done], now()))
        for it in failed:
            if self.rt.loads.fail(it.request_id, reasons[it.request_id]):
                self.rt.metrics.add("failures")
        self.notify(peer, done, failed)

    def _fail_all(self, peer: Peer, items: list[LoadItem], why: str) -> None:
        """:meth:`_complete` with every one of ``items`` failed for ``why``."""
        self._complete(peer, [], items, dict.fromkeys([it.request_id for it in items], why))

    def _defer(self, fence: FenceTimeout, peer: Peer, items: list[LoadItem], why: str) -> None:
        """Hold ``items`` until ``fence.event`` completed (polled by the worker), then fail them
        and notify the exporter: their blocks are never reported while GPU work touches them."""
        _LOG.warning(
            "kvxfer loader %s rank %d: %s (%d loads held)",
            self.rank.engine_id,
            self.rank.tp_rank,
            why,
            len(items),
        )
        self.fenced.append((fence, peer, items, why))

    def _release_fenced(self) -> None:
        """Fail (and notify) the held loads whose GPU work has completed."""
        still = []
        for fence, peer, items, why in self.fenced:
            if not event_done(fence.event):
                still.append((fence, peer, items, why))
                continue
            self._fail_all(peer, items, why)
        self.fenced = still

    # -------------------------------------------------------------------- notifications
    def notify(self, peer: Peer, done: list[LoadItem], failed: list[LoadItem]) -> None:
        """Queue the notification of ``done`` and ``failed`` loads of ``peer`` to every exporter
        rank the plan names (acknowledged and retried by the notifier thread until the
        exporter's lease would end anyway): this worker's, the releases' and the one-sided
        path's, after its done marks."""
        if not done and not failed:
            return
        toks = [it.params.token for it in done]
        if failed:
            toks += [it.params.token for it in failed]
        self._send_notify(
            peer,
            [it.params.request_id for it in done],
            [it.params.request_id for it in failed] if failed else [],
            toks,
        )

    def notify_ids(self, peer: Peer, done: list[tuple[str, str]], failed: list[tuple[str, str]]) -> None:
        """:meth:`notify` of loads given by their params' (request id, token)."""
        if not done and not failed:
            return
        toks = [t for _, t in done]
        toks += [t for _, t in failed]
        self._send_notify(peer, [r for r, _ in done], [r for r, _ in failed], toks)

    def _send_notify(self, peer: Peer, rids: list[str], bad: list[str], toks: list[str]) -> None:
        """Queue one notification (``rids`` done, ``bad`` failed, their tokens in that order) to
        each exporter rank the plan has this rank notify."""
        msg = control.Notify(self.rank.engine_id, self.rank.tp_rank, self.rank.tp_size, rids, bad, toks)
        deadline = time.monotonic() + self.rank.lease_s
        direct = self.rt.hooks.get("notify")  # benchmarks: deliver in this thread
        for s in peer.notify_to:
            if direct is not None:
                direct(peer.addrs[s], msg)
            else:
                self.notifier.put(peer.addrs[s], msg, deadline)

    # ------------------------------------------------------------------------- peers
    def forget(self, peer: Peer, why: str = "the remote stopped answering") -> None:
        """Drop a peer with its transport's session (pair groups, mappings, agents); the next
        load handshakes again."""
        self.peers.forget(peer)
        for a in peer.addrs:
            self.client.drop(a)
