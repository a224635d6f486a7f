"""Finding free TCP ports on this host (a TP engine binds ``base + rank`` for each rank)."""

from __future__ import annotations

import collections
import random
import socket
import threading


def _ephemeral() -> tuple[int, int]:
    """The range the kernel hands out to outgoing connections (Linux), else IANA's."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 49152, 65535


_GIVEN_KEPT = 4096  # ports this process handed out lately, never handed out again meanwhile
_GIVEN: set[int] = set()
_ORDER: collections.deque = collections.deque()
_LOCK = threading.Lock()


def free_port_base(n: int, lo: int = 20000, hi: int = 60000, host: str = "127.0.0.1") -> int:
    """A base port such that ``base .. base+n-1`` are free right now (racy, like any such probe),
    and none handed out by one of this process's last calls (their ports were closed after the
    probe and may not be bound yet: two engines of one test would collide).

    Ports the kernel may give an outgoing connection (zmq, Gloo and TCPStore clients open many)
    are avoided when ``[lo, hi)`` leaves room below that range: such a port, free when probed,
    can be taken by a connection before the engine binds it."""
    eph_lo, _ = _ephemeral()
    if eph_lo - lo > 4 * n:
        hi = min(hi, eph_lo)
    for _ in range(200):
        base = random.randrange(lo, hi - n)
        if any(p in _GIVEN for p in range(base, base + n)):
            continue  # handed out by an earlier call and perhaps not bound yet: free to the probe
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                s.bind((host, p))
                socks.append(s)
            with _LOCK:
                if any(p in _GIVEN for p in range(base, base + n)):
                    continue  # another thread took it meanwhile
                _GIVEN.update(range(base, base + n))
                _ORDER.extend(range(base, base + n))
                while len(_ORDER) > _GIVEN_KEPT:
                    _GIVEN.discard(_ORDER.popleft())
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no range of {n} free ports found in [{lo}, {hi})")
