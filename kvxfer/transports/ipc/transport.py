"""The ``ipc`` transport of one engine rank (:class:`~kvxfer.transports.Transport`).

Exporter: at start it describes the rank's caches for loaders on this host and allocates the
block-epoch array and the lease-slot table in shared memory (:mod:`~kvxfer.transports.ipc.offer`,
:mod:`~kvxfer.transports.ipc.slots`); the epochs are the export tracker's, and the table follows
the tracker's leases (:meth:`IpcTransport.follow`), so a loader that maps them sees every export
and release. Loader: a session per peer (:mod:`~kvxfer.transports.ipc.session`) maps each source
rank on first use and copies straight from it; once mapped, its one-sided mode
(:mod:`~kvxfer.transports.ipc.onesided`) reads without a message."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ... import control
from ..base import LoaderLink, StreamJob
from . import offer
from .leases import LeaseSlots
from .mappers import mapper
from .session import IpcSession
from .slots import DEFAULT_SLOTS, HEADER, SLOT, ExporterSlots, SlotView

if TYPE_CHECKING:  # pragma: no cover
    from ...exports import ExportTracker
    from ...peer import Peer
    from ...rank import Rank, Runtime

__all__ = ["IpcTransport"]

_LOG = logging.getLogger(__name__)

CLOSE_WAIT_S = 2.0  # close() waits this long for one-sided copies still reading a mapping


class IpcTransport:
    """See the module doc; ``epochs`` is the shared epoch array once offered (else None),
    ``segment`` its shared-memory segment, ``slots`` the lease-slot table
    (:class:`~kvxfer.transports.ipc.slots.ExporterSlots`, else None), ``leases`` the listener
    that keeps it following the export tracker (:meth:`follow`)."""

    name = "ipc"
    ticks = True  # the lease-slot table: heartbeat, ready flags, done marks

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
        self._lingering: list[IpcSession] = []  # closed sessions whose mappings copies still read

    def start(self) -> None:
        rank = self.rank
        made = offer.offer_ipc(
            list(rank.caches), rank.device, rank.num_blocks, rank.engine_id, rank.transport in ("auto", "ipc")
        )
        self._entry, self.epochs, self.segment = made.desc, made.epochs, made.epoch_shm
        self.why = "" if made.offered else made.desc.get("why") or "not offered"
        if made.offered:
            n = min(DEFAULT_SLOTS, max(64, 2 * rank.num_blocks))
            table, self.slot_segment = mapper("shm").alloc_shm_array(HEADER + n * SLOT, "ls")
            self.slots = ExporterSlots(table.numpy(), self.rt.incarnation)
            self._entry["slots"] = self.slot_segment.name
            self._entry["slot_words"] = HEADER + n * SLOT

    def follow(self, exports: ExportTracker) -> None:
        """Publish the leases of ``exports`` (the rank's tracker, over this transport's epochs) in
        the lease-slot table, when there is one."""
        if self.slots is not None:
            order = self.rt.order
            self.leases = LeaseSlots(self.slots, exports, lambda rids: order.not_ready(rids, count=False))

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

    # ------------------------------------------------------------------ loader
    def open(self, peer: Peer, link: LoaderLink) -> IpcSession:
        """A session with ``peer``. When this rank reads one-sided (``rank.onesided``) every
        exporter rank's lease-slot table (small, host memory) is mapped now: the one-sided mode
        reads them before any cache is mapped, and marks done in the ranks it only notifies."""
        self._unmap_idle()
        views: list[SlotView | None] = []
        handles: list = []
        if self.rank.onesided:
            for r in peer.replies:
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
                            "kvxfer loader %s: exporter %s rank %d's lease slots not mapped (%s); its "
                            "loads take the messaged path",
                            self.rank.engine_id, peer.engine_id, r.tp_rank, e,
                        )  # fmt: skip
                views.append(view)
        return IpcSession(self.rank, self.rt, peer, views, handles, self._linger)

    def _linger(self, session: IpcSession) -> None:
        """``session`` closed while one-sided copies may still read its mappings: they are
        dropped once those completed (at the next :meth:`open` or :meth:`close`)."""
        _LOG.warning(
            "kvxfer loader %s: %s forgotten while one-sided copies from it may run; its mappings "
            "are kept until they completed",
            self.rank.engine_id, session.peer.engine_id,
        )  # fmt: skip
        self._lingering.append(session)

    def _unmap_idle(self, force: bool = False) -> None:
        still = []
        for s in self._lingering:
            if force or s.idle():
                s.unmap()
            else:
                still.append(s)
        self._lingering = still

    # ------------------------------------------------------------------ both
    def abort(self, why: str) -> None:
        if self.slots is not None:
            self.slots.shut()

    def threads(self) -> list:
        return []

    def close(self, busy: bool = False) -> None:
        end = time.monotonic() + CLOSE_WAIT_S  # one-sided copies still reading a mapping: bounded
        while any(not s.idle() for s in self._lingering) and time.monotonic() < end:
            time.sleep(1e-3)
        self._unmap_idle(force=True)
        if self.segment is not None:
            mapper("shm").release_segment(self.segment)
            self.segment = None
        if self.slot_segment is not None:
            self.slots.shut()
            mapper("shm").release_segment(self.slot_segment)
            self.slot_segment = None

    def stats(self) -> dict:
        return {}
