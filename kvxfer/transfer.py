"""The seam between the load planner and the transports: what a transport's session with a peer
is asked to move, and what it answers.

The planner (:mod:`kvxfer.planner`) asks a peer's :class:`Session` how the plan's reads of one
source rank move (:meth:`Session.routes`: which head slices go together, in which units each
side may be addressed), plans the ops calls of a batch once per :class:`Route`, and hands them
over as a :class:`Transfer` (a lone whole load first goes to :meth:`Session.start_whole`, which
moves it with nothing planned where the session can). The session moves the bytes (a copy from
a mapped cache, a stream, NIXL READs) and returns a :class:`Completion` to poll or wait on,
whose :class:`Outcome` is the transport's record of what arrived. Checking that record (the
epochs after a one-sided read, a stream's status), and reporting each load once, is the
planner's and the loader's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from .batching import BatchPlan
    from .engine_types import LoadItem
    from .plan import Read

__all__ = ["Completion", "Done", "Outcome", "Route", "Session", "Transfer"]


class Route(NamedTuple):
    """How some of the plan's reads of one source rank move: ``reads`` (head slices) that one
    transfer carries together, and the units each side of its ops calls may name (source:
    what the exporter's caches offer this way; destination: this rank's), coarsest first."""

    reads: list[Read]
    src_units: Sequence[int]
    dst_units: Sequence[int]


class Transfer(NamedTuple):
    """Prepared copies: the ops calls of ``plan`` (both sides' unit ids, token counts) for each
    head slice of ``reads``, of ``layers`` (None: all), for ``loads``, from source rank
    ``source``; every wait ends by ``deadline`` (monotonic). ``landing``: where a staged
    transport scatters instead of this rank's caches (an object with ``views``, ``spec`` and
    ``num_blocks``: :class:`kvxfer.groups.state_group.StateLanding`); it forces the staged way.
    ``blocks``: the source blocks the copies read, where fewer than the loads' ids (a group of
    a request of several: what a transport that first fetches the source reads)."""

    source: int
    reads: list[Read]
    plan: BatchPlan
    loads: list[LoadItem]
    layers: list[int] | None
    deadline: float
    landing: Any = None
    blocks: np.ndarray | None = None


class Outcome(NamedTuple):
    """A completed transfer, as its transport recorded it.

    ``landed``: the local ids the transport holds a record of (a copy or READ that completed,
    to be checked against ``epochs``; or a stream whose status said 1); ``failed``: local id ->
    why; ``refused``: local id -> why the exporter refused it before anything moved (the
    planner plans again without it); ``epochs``: the source rank's block epochs read after the
    copy (one-sided reads; None when the record is a stream's status); ``calls``: ops calls."""

    landed: set[str]
    failed: dict[str, str]
    refused: dict[str, str]
    epochs: np.ndarray | None
    calls: int


class Completion(Protocol):
    """A transfer in flight: :meth:`done` polls, :meth:`wait` blocks (bounded)."""

    def done(self) -> bool:
        """Whether the transfer has completed (never blocks)."""

    def wait(self, deadline: float) -> Outcome:
        """Its outcome, once completed; by ``deadline`` (monotonic) at the latest, else
        :class:`~kvxfer.ordering.FenceTimeout` (GPU work still running) or a timeout."""


class Done:
    """A transfer that completed before its session returned (a stream)."""

    __slots__ = ("outcome",)

    def __init__(self, outcome: Outcome) -> None:
        self.outcome = outcome

    def done(self) -> bool:
        return True

    def wait(self, deadline: float) -> Outcome:
        return self.outcome


class Session(Protocol):
    """A transport's session with one peer (:class:`~kvxfer.peer.Peer`): what it made for it
    (mappings, pair groups, NIXL descriptors) and the transfers it moves."""

    def routes(self, source: int, reads: list[Read]) -> list[Route]:
        """How ``reads`` of source rank ``source`` move, in order (may map or connect it)."""

    def start(self, transfer: Transfer) -> Completion:
        """Start moving ``transfer``; an error raised here fails its loads, naming it."""

    def start_whole(self, source: int, load: LoadItem, deadline: float) -> tuple[Completion, int] | None:
        """Start moving every layer of one whole ``load`` (nothing held here, an engine without
        groups) from source rank ``source`` along every read of the plan, with nothing planned,
        when the session can (``ipc``: its prepared copies take the load's ids as they are); its
        completion and wire bytes. The planner calls it only for such a load whose source ids
        it checked (:meth:`~kvxfer.planner.Planner.check`: their count and range), ``load()``
        having checked the local ones. None, with nothing started: the planner plans it and
        calls :meth:`start`."""

    def close(self) -> None:
        """Drop what was made for the peer (the peer was forgotten)."""
