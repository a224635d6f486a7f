"""Threads that :meth:`~kvxfer.engine.TransferEngine.close` cannot end: its join with a bound,
and the wait at interpreter exit for the threads it left behind.

Such a thread is still in a native call its aborts could not end (a pair join a peer left
half-done); it is kept here with the time its own bound ends. At interpreter exit each is
joined until then: CPython ends a daemon thread that wakes during finalization by unwinding its
stack (pthread_exit), and a C++ frame on that stack (Gloo, the TCPStore) aborts the whole
process then ("terminate called without an active exception").
"""

from __future__ import annotations

import atexit
import logging
import threading
import time

__all__ = ["join_or_leave", "leave"]

_LOG = logging.getLogger(__name__)

_LEFT: list[tuple[threading.Thread, float]] = []  # (thread, the monotonic time its bound ends)
_LEFT_LOCK = threading.Lock()
_LEFT_HOOK: list[bool] = []  # one entry once _join_left is registered with atexit


def join_or_leave(
    threads: list[threading.Thread], timeout_s: float, bound_s: float
) -> list[threading.Thread]:
    """Join ``threads`` within ``timeout_s`` in all; those still alive then are :func:`leave`-d
    for ``bound_s`` more and returned."""
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    stuck = [t for t in threads if t.is_alive()]
    if stuck:
        leave(stuck, time.monotonic() + bound_s)
    return stuck


def leave(threads: list[threading.Thread], until: float) -> None:
    """Have the interpreter's exit wait for ``threads`` until ``until`` (``time.monotonic``)."""
    with _LEFT_LOCK:
        if not _LEFT_HOOK:
            atexit.register(_join_left)
            _LEFT_HOOK.append(True)
        _LEFT[:] = [(t, u) for t, u in _LEFT if t.is_alive()]
        _LEFT.extend((t, until) for t in threads)


def _join_left() -> None:
    """At exit: join the threads close() left behind, each until its bound (see ``_LEFT``)."""
    with _LEFT_LOCK:
        left, _LEFT[:] = list(_LEFT), []
    for t, until in left:
        t.join(max(0.0, until - time.monotonic()))
    stuck = [t.name for t, _ in left if t.is_alive()]
    if stuck:
        _LOG.warning("kvxfer: threads still in a native call at exit (past their bound): %s", stuck)
