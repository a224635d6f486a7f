"""Transfer statistics: counts, bytes, latency percentiles, busy-time throughput.

Throughput is bytes over *wall-clock busy time*: the union of the [start, end] intervals of
all transfers, so overlapping transfers are not double counted (summing per-transfer times
would understate throughput; dividing by total elapsed time would include idle gaps).
"""

from __future__ import annotations

import collections
import threading
import time

__all__ = ["Metrics", "percentile"]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` in [0, 100] of ``values`` (0.0 when empty)."""
    if not values:
        return 0.0
    v = sorted(values)
    k = max(0, min(len(v) - 1, int(-(-q * len(v) // 100)) - 1))
    return v[k]


class Metrics:
    """Thread-safe counters of one engine rank. Times are ``time.perf_counter()`` seconds.

    Latency percentiles cover the last ``max_samples`` transfers (a long-running server's
    figures follow its recent traffic). Busy time is kept as a running union of the transfer
    intervals, in constant memory: they are recorded in start order (one worker thread records
    them), so each one either extends the open span or closes it and opens the next.
    """

    def __init__(self, max_samples: int = 100_000) -> None:
        self._lock = threading.Lock()
        self.transfers = 0  # requests received successfully
        self.latency_sum_s = 0.0  # their latencies summed (a mean over any interval: a difference)
        self.bytes_received = 0  # wire bytes that crossed into this rank (loads)
        self.bytes_sent = 0  # wire bytes this rank sent (pg exports)
        self.failures = 0  # loads reported failed
        self.expirations = 0  # exports whose lease expired
        self.handshakes = 0
        self.handshake_s = 0.0
        self.ops_calls = 0  # gather/scatter/copy calls issued for loads
        self.dedup_bytes = 0  # wire bytes not sent because an n>1 sibling carried them
        self.notify_failures = 0  # notifications/heartbeats never acknowledged (given up)
        self._latency: collections.deque[float] = collections.deque(maxlen=max_samples)
        self._busy_closed = 0.0  # busy seconds of the spans closed so far
        self._span: tuple[float, float] | None = None  # the open span of overlapping transfers
        self.transports: dict[str, str] = {}  # remote engine -> transport
        self._books: list = []  # follow(): load books that record their one-sided loads natively

    def follow(self, book) -> None:
        """Count the one-sided loads the control module's ``LoadBook`` reports from now on: it
        keeps their bytes, ops calls, latencies and busy time natively in each ``poll()``
        (``record_into``: the latencies go into this object's window), and :meth:`snapshot` adds
        its ``lane_stats()``. Busy time is then the union of each one's intervals, summed: loads
        of the two paths that overlap count twice there."""
        with self._lock:
            book.record_into(self._latency)
            self._books.append(book)

    def record_handshake(self, engine_id: str, seconds: float, transport: str) -> None:
        with self._lock:
            self.handshakes += 1
            self.handshake_s += seconds
            self.transports[engine_id] = transport

    def record_batch(self, start: float, end: float, nbytes: int, calls: int, dedup_bytes: int = 0) -> None:
        """One (batch, source rank) transfer that moved ``nbytes`` wire bytes in ``calls`` ops
        calls (``dedup_bytes``: wire bytes an n>1 sibling carried for it)."""
        self.record_loads(start, end, nbytes, calls, (), dedup_bytes)

    def record_done(self, latencies: list[float]) -> None:
        with self._lock:
            self.transfers += len(latencies)
            self.latency_sum_s += sum(latencies)
            self._latency.extend(latencies)

    def record_load(self, start: float, end: float, nbytes: int, calls: int, latency: float | None) -> None:
        """One load moved on its own (one-sided): :meth:`record_batch` and :meth:`record_done`
        (``latency``: when it landed, else None) under one lock."""
        self.record_loads(start, end, nbytes, calls, () if latency is None else (latency,))

    def record_loads(
        self, start: float, end: float, nbytes: int, calls: int, latencies, dedup_bytes: int = 0
    ) -> None:
        """Loads reported at once (the one-sided native lane's ``poll()``, or one: :meth:`record_load`):
        the earliest ``start``, their wire bytes and ops calls, the landed ones' latencies, under
        one lock."""
        with self._lock:
            self.bytes_received += nbytes
            self.ops_calls += calls
            self.dedup_bytes += dedup_bytes
            span = self._span
            if span is None or start > span[1]:
                if span is not None:
                    self._busy_closed += span[1] - span[0]
                self._span = (start, end)
            else:  # overlaps the open span (an earlier start can only come from a racing recorder)
                self._span = (min(span[0], start), max(span[1], end))
            if latencies:
                self.transfers += len(latencies)
                self.latency_sum_s += sum(latencies)
                self._latency.extend(latencies)

    def add(self, field: str, n: int = 1) -> None:
        with self._lock:
            setattr(self, field, getattr(self, field) + n)

    def snapshot(self) -> dict:
        """JSON-safe dict of everything above, with p50/p90/p99 latency and busy throughput."""
        with self._lock:
            lat = list(self._latency)
            span = self._span
            busy = self._busy_closed + (span[1] - span[0] if span is not None else 0.0)
            out = {
                "transfers": self.transfers,
                "latency_sum_s": self.latency_sum_s,
                "bytes": self.bytes_received,
                "bytes_sent": self.bytes_sent,
                "failures": self.failures,
                "expirations": self.expirations,
                "handshakes": self.handshakes,
                "handshake_s": self.handshake_s,
                "ops_calls": self.ops_calls,
                "dedup_bytes": self.dedup_bytes,
                "notify_failures": self.notify_failures,
                "transports": dict(self.transports),
            }
        for book in self._books:
            nbytes, calls, transfers, latency_sum, book_busy = book.lane_stats()
            out["bytes"] += nbytes
            out["ops_calls"] += calls
            out["transfers"] += transfers
            out["latency_sum_s"] += latency_sum
            busy += book_busy
        out["busy_s"] = busy
        out["throughput_Bps"] = out["bytes"] / busy if busy > 0 else 0.0
        for q in (50, 90, 99):
            out[f"p{q}_s"] = percentile(lat, q)
        return out


now = time.perf_counter  # the clock of every recorded time (an alias: no wrapper frame)
