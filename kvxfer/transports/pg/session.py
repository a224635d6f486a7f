"""The ``pg`` transport's session with one peer: a pair group with each source rank (joined on
first use), the send request that starts the exporter's stream
(:func:`kvxfer.transports.streams.ask_stream`), and the staged receive that scatters each chunk
as it lands, then the stream's status (which loads landed: the transfer's record)."""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

from ... import control
from ...engine_types import LoadItem, time_left
from ...transfer import Done, Outcome, Route, Transfer
from ..base import LoaderLink
from ..streams import PairFailed, ask_paired, ask_stream, stream_scatters, take_status
from . import groups
from .groups import UNKNOWN_PAIR

if TYPE_CHECKING:  # pragma: no cover
    from ...peer import Peer
    from ...plan import Read
    from ...rank import Rank, Runtime

__all__ = ["PgSession"]


class PgSession:
    """The ``pg`` session with ``peer`` (see the module doc): ``pairs``, source rank -> (pair
    group, key)."""

    def __init__(self, rank: Rank, rt: Runtime, peer: Peer, link: LoaderLink) -> None:
        self.rank = rank
        self.rt = rt
        self.peer = peer
        self.link = link
        self.pairs: dict[int, tuple] = {}

    def routes(self, source: int, reads: list[Read]) -> list[Route]:
        """One stream per head slice, in the units the exporter's pg entry offers."""
        sbs = self.peer.spec.block_size
        units = self.peer.replies[source].pg.get("units") or [sbs]
        return [Route([r], units, self.rank.units) for r in reads]

    def start_whole(self, source: int, load, deadline: float) -> None:
        """Nothing moves unplanned here: every transfer is planned (:meth:`start`)."""
        return None

    def start(self, transfer: Transfer) -> Done:
        """Pair with the source rank (once), ask it to stream ``transfer`` and receive it; the
        stream has ended when this returns (its scatters may still run on the load stream: the
        completion waits for them)."""
        s, loads = transfer.source, transfer.loads
        rank, rt, peer = self.rank, self.rt, self.peer
        into = transfer.landing or rank  # where the chunks are scattered
        (r,) = transfer.reads
        bp, layers, deadline = transfer.plan, transfer.layers, transfer.deadline
        bpt = into.spec.bytes_per_token(num_heads=r.num_heads, num_layers=len(layers) if layers else None)
        chunk_tokens = rank.pipeline.chunk_tokens_for(peer.replies[s].pg, bpt, bp.src_unit, bp.dst_unit)
        used: list = []  # the pair group the request went over, and its key

        def pair() -> str:
            used[:] = self._pair(s, loads[0], deadline)
            return used[1]

        try:
            refused = ask_paired(
                pair,
                lambda key: ask_stream(
                    self.link, rank, "pg", peer, s, key, r, loads, bp, chunk_tokens, deadline, layers
                ),
                lambda why: self.drop(s, why),
                UNKNOWN_PAIR,
                deadline,
            )
        except PairFailed as e:
            why = f"pg pair with rank {s}: {e}"
            return Done(Outcome(set(), dict.fromkeys([it.request_id for it in loads], why), {}, None, 0))
        group = used[0]
        if refused:
            return Done(Outcome(set(), {}, refused, None, 0))
        try:
            hook = rt.hooks.get("before_recv")
            if hook:
                hook()
            stream, scatter = stream_scatters(into, r, bp, chunk_tokens, loads, layers)
            n, flags = rank.pipeline.recv_stream(
                group, 0, peer.pg_backends[s], rank.device, stream, scatter, time_left(deadline), len(loads)
            )
        except Exception:
            self.drop(s, "a stream failed")  # a failed stream may leave a receive posted
            raise
        landed, failed = take_status(loads, flags, s)
        if landed:  # finished only once the scatters ran
            rt.order.wait_done(time_left(deadline))
        return Done(Outcome(landed, failed, {}, None, n))

    def _pair(self, s: int, token_of: LoadItem, deadline: float) -> tuple:
        """The pair group with source rank ``s``: joined now (asking it with ``token_of``'s
        params) unless it was; (group, key). Keys never repeat."""
        pair = self.pairs.get(s)
        if pair is None:
            rank, peer = self.rank, self.peer
            key = f"{rank.engine_id}/{rank.tp_rank}/{secrets.token_hex(8)}"
            backend = peer.pg_backends[s]
            p = token_of.params
            req = control.PairReq(
                rank.engine_id, rank.tp_rank, key, backend, p.request_id, p.token, p.digest()
            )
            rep = self.link.client.call(peer.addrs[s], req, time_left(deadline))
            if not isinstance(rep, control.SendReply) or not rep.ok:
                raise RuntimeError(f"pair group refused: {getattr(rep, 'failed', rep)}")
            info = peer.replies[s].pg
            left = time_left(deadline)
            store = groups.connect_store(info["host"], info["port"], left)
            pair = self.pairs[s] = (
                groups.new_pair(store, key, 1, rank.host, left, backend, bound_s=rank.timeout_s),
                key,
            )
        return pair

    def drop(self, s: int, why: str = "an op failed or timed out") -> None:
        """Abort and forget the pair group with source rank ``s`` (the next transfer re-pairs)."""
        pair = self.pairs.pop(s, None)
        if pair is not None:
            groups.discard_pair(pair[0], why)

    def close(self, why: str = "the remote is forgotten") -> None:
        for s in list(self.pairs):
            self.drop(s, why)
