"""The nixl exporter's sender thread drops a staged stream that waited in its queue past its
loader's timeout (that loader gave it up; running it would hold the thread and the staging
buffers from the streams behind it), and bounds the others by what is left of that timeout.
Driven without NIXL: the loop over a stand-in transport."""

from __future__ import annotations

import queue
import threading
import time
from types import SimpleNamespace

from kvxfer.transports.nixl.pairings import Pairings
from kvxfer.transports.nixl.transport import NixlTransport


def test_a_stream_queued_past_its_loaders_timeout_is_dropped():
    jobs: queue.Queue = queue.Queue()
    sent: list[tuple[str, float]] = []
    now = time.monotonic()

    def job(key: str):
        return SimpleNamespace(msg=SimpleNamespace(key=key))

    jobs.put((job("stale#1"), now - 5.0))  # its loader's 2 s ran out while it queued
    jobs.put((job("fresh#2"), now - 0.5))
    jobs.put((job("other#3"), now))  # a loader not paired here: the rank's timeout
    jobs.put(None)
    peers = Pairings()
    for name in ("stale", "fresh"):
        assert peers.add(name, 2.0) == ("", [])
        assert peers.start(name)  # as serve_stream counts each queued stream
    me = SimpleNamespace(
        rt=SimpleNamespace(stop=threading.Event()),
        rank=SimpleNamespace(engine_id="P", tp_rank=0, timeout_s=30.0),
        _jobs=jobs,
        peers=peers,
        _stream_send=lambda j, timeout_s: sent.append((j.msg.key, timeout_s)),
    )
    NixlTransport._send_loop(me)
    assert [k for k, _ in sent] == ["fresh#2", "other#3"]
    assert 0 < sent[0][1] <= 1.5  # what is left of the loader's 2 s
    assert 29.0 < sent[1][1] <= 30.0
    assert not peers.busy("stale") and not peers.busy("fresh")  # every stream's count ended, dropped or sent
