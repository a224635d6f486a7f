"""The exporter's lease-slot table, following the export tracker's leases.

:class:`LeaseSlots` is what the ``ipc`` transport subscribes to its rank's
:class:`~kvxfer.exports.ExportTracker` (:meth:`~kvxfer.exports.ExportTracker.subscribe`): each
lease the tracker opens gets a slot in the table (:class:`~kvxfer.transports.ipc.slots.ExporterSlots`),
a renewal moves its end, a release closes it before the released blocks' epochs move. Every side
channel tick (and ``poll()``) :meth:`LeaseSlots.tick` publishes the heartbeat, sets the ready
flags of exports whose compute completed, and hands the done marks loaders wrote back to the
tracker, which counts them as those loader ranks' notifications.

With the control module, the tracker's native book follows the table instead of calling the
listener (:meth:`~kvxfer.exports.ExportTracker.follow_slots`): the slot writes happen in the
book's own calls, and the tick has the tracker take the done marks
(:meth:`~kvxfer.exports.ExportTracker.take_marks`); the heartbeat and the ready flags stay here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ...exports import ExportTracker
from .slots import ExporterSlots

__all__ = ["LeaseSlots"]

_LOG = logging.getLogger(__name__)


class LeaseSlots:
    """A lease listener (:class:`~kvxfer.exports.LeaseListener`) that publishes every lease of
    ``exports`` in the lease-slot table ``slots``; ``not_ready(request_ids)`` says which exports'
    compute is still writing their blocks (:meth:`kvxfer.ordering.StreamOrder.not_ready`).

    Its methods run under the tracker's lock (the listener calls) or on the thread that ticks
    (:meth:`tick`, which takes that lock itself)."""

    def __init__(
        self, slots: ExporterSlots, exports: ExportTracker, not_ready: Callable[[list[str]], list[str]]
    ) -> None:
        self.slots = slots
        self._exports = exports
        self._not_ready = not_ready
        self._slot: dict[str, int] = {}  # request id -> its slot (the listener's calls only)
        self._unready: dict[str, int] = {}  # request id -> its slot whose ready flag is not set yet
        state = slots.native_state()
        # the book writes the table in its own calls, or this listener follows the leases
        self.native = state is not None and exports.follow_slots(*state[:4], self._unready, state[4])
        if not self.native:
            exports.subscribe(self)

    # -------------------------------------------------------------------- the tracker's calls
    def opened(
        self, request_id: str, token: str, digest: bytes, deadline: float, ready: bool, layerwise: bool
    ) -> None:
        """A lease was opened: give it a slot (none when no loader reads one-sided from here,
        or the probed slots are taken: its loads take the messaged path)."""
        if not token:
            return
        i = self.slots.open(request_id, token, digest, deadline, ready, layerwise)
        if i >= 0:
            self._slot[request_id] = i
            if not ready:
                self._unready[request_id] = i

    def renewed(self, request_id: str, deadline: float) -> None:
        i = self._slot.get(request_id)
        if i is not None:
            self.slots.renew(i, deadline)

    def closed(self, request_id: str) -> None:
        """A lease ended (before its blocks' epochs move): close its slot. A slot that cannot be
        closed shuts the whole table (no loader reads one-sided from it any more, and a copy in
        flight fails its check), so the release goes on; logged."""
        i = self._slot.pop(request_id, None)
        if i is None:
            return
        self._unready.pop(request_id, None)
        try:
            self.slots.close(i)
        except Exception as e:
            _LOG.warning(
                "kvxfer exports: the lease slot of %r could not be closed (%s: %s); one-sided reads "
                "from this rank are shut off, the release goes on",
                request_id, type(e).__name__, e,
            )  # fmt: skip
            try:
                self.slots.shut()
            except Exception as e2:  # nothing a loader could map is left: nothing to shut
                _LOG.warning(
                    "kvxfer exports: shutting the lease-slot table failed too (%s: %s)", type(e2).__name__, e2
                )

    # -------------------------------------------------------------------- the ticks
    def tick(self, beat: bool, expected: Callable[[int, int], int | str]) -> int:
        """The heartbeat (``beat``), the ready flags of exports whose compute completed, and the
        done marks loaders wrote, counted by the tracker as notifications (``expected``:
        :meth:`kvxfer.exporter.Exporter.expected_from`). Returns the exports that finished; one
        load when there is nothing to do."""
        slots = self.slots
        if beat:
            slots.beat()
        if self._unready:
            with self._exports.lock:
                rids = list(self._unready)
                still = set(self._not_ready(rids))
                for rid in rids:
                    if rid not in still:
                        slots.set_ready(self._unready.pop(rid))
        if self.native:
            return self._exports.take_marks(expected)
        if not slots.marked():
            return 0
        with self._exports.lock:
            return self._exports.count_marks(slots.take_done(), expected)

    def shut(self) -> None:
        """The engine is closing: no loader reads one-sided from here any more."""
        self.slots.shut()
