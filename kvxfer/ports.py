"""Finding free TCP ports on this host (a TP engine binds ``base + rank`` for each rank)."""

from __future__ import annotations

import random
import socket


def free_port_base(n: int, lo: int = 20000, hi: int = 60000, host: str = "127.0.0.1") -> int:
    """A base port such that ``base .. base+n-1`` are free right now (racy, like any such probe)."""
    for _ in range(200):
        base = random.randrange(lo, hi - n)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                s.bind((host, p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no range of {n} free ports found in [{lo}, {hi})")
