"""The ``ipc`` transport of one engine rank (:class:`~kvxfer.transports.Transport`).

Exporter: at start it describes the rank's caches for loaders on this host and allocates the
block-epoch array and the lease-slot table in shared memory (:mod:`~kvxfer.transports.ipc.offer`,
:mod:`~kvxfer.transports.ipc.slots`); the epochs are the export tracker's, and the table follows
the tracker's leases (:meth:`IpcTransport.follow`), so a loader that maps them sees every export
and release. Loader: it maps each source rank on first use and copies straight
from it (:mod:`~kvxfer.transports.ipc.read`); once mapped, :mod:`~kvxfer.transports.ipc.onesided`
reads without a message."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ... import control
from ...engine_types import Remote
from ...ordering import event_done
from ...plan import Read
from ...tracing import items_tag, trace
from ..base import LoaderLink, StreamJob
from . import offer
from .leases import LeaseSlots
from .mappers import mapper
from .read import IpcMap, map_rank, read
from .slots import DEFAULT_SLOTS, HEADER, SLOT, ExporterSlots, SlotView

if TYPE_CHECKING:  # pragma: no cover
    from ...exports import ExportTracker
    from ...rank import Rank, Runtime

__all__ = ["IpcTransport"]

_LOG = logging.getLogger(__name__)

CLOSE_WAIT_S = 2.0  # close() waits this long for one-sided copies still reading a mapping


class IpcTransport:
    """See the module doc; ``epochs`` is the shared epoch array once offered (else None),
    ``segment`` its shared-memory segment, ``slots`` the lease-slot table
    (:class:`~kvxfer.transports.ipc.slots.ExporterSlots`, else None), ``leases`` the listener
    that keeps it following the export tracker (:meth:`follow`). ``lock`` is held while a
    mapping is used or dropped from two threads (the one-sided path runs in the caller's)."""

    name = "ipc"

    def __init__(self, rank: Rank, rt: Runtime) -> None:
        self.rank = rank
        self.rt = rt
        self.why = "not started"
        self.epochs = None
        self._entry: dict | None = None
        self.segment = None
        self.slots: ExporterSlots | None = None
        self.leases: LeaseSlots | None = None
        self.slot_segment = None
        self._maps: dict[int, tuple[Remote, dict[int, IpcMap]]] = {}  # id(remote) -> its maps
        # id(remote) -> (remote, [each exporter rank's SlotView or None], their shm handles)
        self.views: dict[int, tuple[Remote, list, list]] = {}
        self.lock = threading.RLock()
        self.busy: dict[int, list] = {}  # id(remote) -> events of one-sided copies maybe running
        self.epoch = 0  # remotes forgotten so far (a one-sided target made before is stale)

    def start(self) -> None:
        rank, rt = self.rank, self.rt
        made = offer.offer_ipc(
            rank.caches, rank.device, rank.num_blocks, rank.engine_id, rank.transport in ("auto", "ipc")
        )
        self._entry, self.epochs, self.segment = made.desc, made.epochs, made.epoch_shm
        self.why = "" if made.offered else made.desc.get("why") or "not offered"
        if made.offered:
            n = min(DEFAULT_SLOTS, max(64, 2 * rank.num_blocks))
            table, self.slot_segment = mapper("shm").alloc_shm_array(HEADER + n * SLOT, "ls")
            self.slots = ExporterSlots(table.numpy(), rt.incarnation)
            self._entry["slots"] = self.slot_segment.name
            self._entry["slot_words"] = HEADER + n * SLOT

    def follow(self, exports: ExportTracker) -> None:
        """Publish the leases of ``exports`` (the rank's tracker, over this transport's epochs) in
        the lease-slot table, when there is one."""
        if self.slots is not None:
            self.leases = LeaseSlots(
                self.slots, exports, lambda rids: self.rt.order.not_ready(rids, count=False)
            )

    def tick(self, beat: bool, expected: Callable[[int, int], int | str]) -> int:
        """The lease-slot table's tick (:meth:`LeaseSlots.tick`); exports it finished."""
        return self.leases.tick(beat, expected) if self.leases is not None else 0

    @property
    def entry(self) -> dict:
        """The ``ipc`` entry every handshake reply carries (its ``info`` also when not offered)."""
        return self._entry or {}

    def hello_entry(self, hello: control.Hello) -> dict | None:
        return self._entry

    def serves(self) -> dict:
        return {}

    def serve_stream(self, job: StreamJob) -> control.SendReply:
        return control.SendReply(ok=False, failed={"*": "ipc does not stream: the loader copies itself"})

    def setup(self, rem: Remote) -> str:
        """Map every exporter rank's lease-slot table (small, host memory) when this rank reads
        one-sided (``rank.onesided``): the one-sided path reads them before any cache is mapped,
        and marks done in the ranks it only notifies."""
        if not self.rank.onesided:
            return ""
        views, handles = [], []
        for r in rem.replies:
            entry = r.ipc or {}
            name, words = entry.get("slots"), entry.get("slot_words")
            view = None
            if isinstance(name, str) and isinstance(words, int) and HEADER + SLOT <= words <= 1 << 26:
                try:
                    table, h = mapper("shm").attach_array(name, words)
                    handles.append(h)
                    view = SlotView(table.numpy())
                except (OSError, ValueError) as e:
                    _LOG.warning(
                        "kvxfer loader %s: exporter %s rank %d's lease slots not mapped (%s); its loads "
                        "take the messaged path",
                        self.rank.engine_id, rem.engine_id, r.tp_rank, e,
                    )  # fmt: skip
            views.append(view)
        with self.lock:
            self.views[id(rem)] = (rem, views, handles)
        return ""

    def read(
        self,
        loader: LoaderLink,
        rem: Remote,
        s: int,
        reads: list[Read],
        loads: list,
        granted: dict,
        deadline: float,
        layers: list[int] | None,
    ) -> tuple[int, set[str], dict[str, str]]:
        got = self._maps.get(id(rem))
        if got is None or got[0] is not rem:
            got = self._maps[id(rem)] = (rem, {})
        mapped = got[1].get(s)
        if mapped is None:
            with self.lock:
                mapped = got[1][s] = map_rank(rem, s, self.rank.device)
        with trace("copy", items_tag, loads):
            return read(self.rank, self.rt, mapped, rem, s, reads, loads, granted, deadline, layers)

    def mapped(self, rem: Remote, s: int) -> IpcMap | None:
        """Source rank ``s`` of ``rem`` as mapped by an earlier read (None if not yet)."""
        got = self._maps.get(id(rem))
        return got[1].get(s) if got is not None and got[0] is rem else None

    def slot_views(self, rem: Remote) -> list | None:
        got = self.views.get(id(rem))
        return got[1] if got is not None and got[0] is rem else None

    def forget(self, rem: Remote) -> None:
        with self.lock:
            self.epoch += 1
            busy = [ev for ev in self.busy.pop(id(rem), ()) if not event_done(ev)]
            if busy:  # a one-sided copy may still read the mapping: unmapped by a later forget
                self.busy[id(rem)] = busy
                _LOG.warning(
                    "kvxfer loader %s: %s forgotten while %d one-sided copies from it may run; its "
                    "mappings are kept until they completed",
                    self.rank.engine_id, rem.engine_id, len(busy),
                )  # fmt: skip
                return
            got = self._maps.get(id(rem))
            if got is not None and got[0] is rem:
                del self._maps[id(rem)]
                for m in got[1].values():
                    offer.detach(m.handles)
            got = self.views.get(id(rem))
            if got is not None and got[0] is rem:
                del self.views[id(rem)]
                for h in got[2]:
                    mapper("shm").detach(h)

    def abort(self, why: str) -> None:
        if self.slots is not None:
            self.slots.shut()

    def threads(self) -> list:
        return []

    def close(self, busy: bool = False) -> None:
        end = time.monotonic() + CLOSE_WAIT_S  # one-sided copies still reading a mapping: bounded
        while any(not event_done(ev) for evs in self.busy.values() for ev in evs) and time.monotonic() < end:
            time.sleep(1e-3)
        for rem, _ in list(self._maps.values()):
            self.forget(rem)
        for rem, _, _ in list(self.views.values()):
            self.forget(rem)
        if self.segment is not None:
            mapper("shm").release_segment(self.segment)
            self.segment = None
        if self.slot_segment is not None:
            self.slots.shut()
            mapper("shm").release_segment(self.slot_segment)
            self.slot_segment = None

    def stats(self) -> dict:
        return {}
