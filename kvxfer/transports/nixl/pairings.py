"""The loader agents an exporter rank is paired with (``NixlPairReq``), at most ``max_pairs``.

A pairing loads the loader agent's metadata into this rank's NIXL agent (a remote agent, and a
connection once a stream ran), so that staged streams can notify it. A loader that restarts
pairs again under a new agent name: unbounded, pairings would pile up for as long as the
exporter runs. So at most ``max_pairs`` are kept; a new pairing beyond that evicts the one used
least recently among those with no stream queued or running (the transport removes its remote
agent), and is refused by name when every pairing has one. A loader whose pairing was evicted
is refused its next stream with :data:`UNKNOWN_NIXL_PAIR` and pairs anew once
(:meth:`kvxfer.transports.nixl.session.NixlSession`), as the ``pg`` transport's pairs do.
"""

from __future__ import annotations

import threading
import time

__all__ = ["MAX_PAIRS", "UNKNOWN_NIXL_PAIR", "Pairings"]

UNKNOWN_NIXL_PAIR = "unknown nixl pairing"
# Loader agents an exporter rank keeps paired (a remote agent and a connection each): every
# rank of many decode engines at once, with room for restarts.
MAX_PAIRS = 256


class Pairings:
    """The paired loader agents of one exporter rank (thread-safe; see the module doc).

    Args:
        max_pairs: pairings kept at once (>= 1).
    """

    def __init__(self, max_pairs: int = MAX_PAIRS) -> None:
        if isinstance(max_pairs, bool) or not isinstance(max_pairs, int) or max_pairs < 1:
            raise ValueError(f"max_pairs: must be an int >= 1, got {max_pairs!r}")
        self.max_pairs = max_pairs
        self._lock = threading.Lock()
        self._timeout_s: dict[str, float] = {}  # agent name -> the loader's timeout_s
        self._used: dict[str, float] = {}  # agent name -> when it last paired or streamed
        self._busy: dict[str, int] = {}  # agent name -> its streams queued or running

    def add(self, name: str, timeout_s: float) -> tuple[str, list[str]]:
        """Pair agent ``name`` (again: refreshed). Returns ``("", evicted)``: the agent names
        evicted to make room, whose remote agents the caller removes; or ``(why, [])`` when
        every pairing has a stream queued or running (nothing changed)."""
        with self._lock:
            evicted: list[str] = []
            if name not in self._timeout_s and len(self._timeout_s) >= self.max_pairs:
                idle = [(self._used[n], n) for n in self._timeout_s if not self._busy.get(n)]
                if not idle:
                    return (
                        f"busy: {len(self._timeout_s)} nixl pairings have streams queued or running; "
                        "try again later",
                        [],
                    )
                old = min(idle)[1]
                self._drop(old)
                evicted.append(old)
            self._timeout_s[name] = float(timeout_s)
            self._used[name] = time.monotonic()
            return "", evicted

    def start(self, name: str) -> bool:
        """A stream to agent ``name`` is queued (False: not paired here; nothing counted).
        Each True is ended by one :meth:`done`."""
        with self._lock:
            if name not in self._timeout_s:
                return False
            self._busy[name] = self._busy.get(name, 0) + 1
            self._used[name] = time.monotonic()
            return True

    def done(self, name: str) -> None:
        """A stream :meth:`start` counted ended (sent, failed or dropped)."""
        with self._lock:
            k = self._busy.get(name, 0) - 1
            if k > 0:
                self._busy[name] = k
            else:
                self._busy.pop(name, None)

    def busy(self, name: str) -> int:
        """Streams to agent ``name`` queued or running."""
        return self._busy.get(name, 0)

    def timeout_s(self, name: str, default: float) -> float:
        """The timeout agent ``name`` paired with (``default`` when it is not paired)."""
        return self._timeout_s.get(name, default)

    def forget(self, name: str) -> bool:
        """Unpair agent ``name`` (its loader is gone; its streams still queued keep their
        counts); whether it was paired."""
        with self._lock:
            return self._drop(name)

    def _drop(self, name: str) -> bool:
        # its busy count stays: each stream still queued ends it (done), also after the agent
        # paired again under the same name, which then is not evictable while they run
        self._used.pop(name, None)
        return self._timeout_s.pop(name, None) is not None

    def __contains__(self, name: object) -> bool:
        return name in self._timeout_s

    def __len__(self) -> int:
        return len(self._timeout_s)
