"""The loader against a hostile or broken exporter: what its handshake and grants say that does
not hold fails the affected loads by name (never the loader's other loads, never a load left
unreported), and a reply larger than the side channel's bound drops the peer instead of being
read."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import zmq

from kvxfer import KVCacheSpec, TransferEngine
from kvxfer import control as C
from kvxfer.transports.ipc.shm import alloc_shm_caches

SPEC = KVCacheSpec(2, 2, 16, 8, torch.float16)


def _outcome(engines, d, rids, timeout_s: float = 8.0) -> dict[str, str]:
    got: dict[str, str] = {}
    end = time.monotonic() + timeout_s
    while len(got) < len(rids) and time.monotonic() < end:
        for e in engines:
            e.poll()
        r = d.poll()
        got.update(dict.fromkeys(r.finished_recving, "done"))
        got.update({k: "failed: " + r.errors.get(k, "") for k in r.failed})
        time.sleep(0.005)
    return got


@pytest.fixture
def three():
    segs = [alloc_shm_caches(SPEC, 32, 1) for _ in range(3)]
    engines = []
    try:
        for name, seg in zip(("P", "Q"), segs):
            engines.append(
                TransferEngine(SPEC, seg.caches, 0, 1, name, transport="ipc", auth_key="k").start()
            )
        engines.append(
            TransferEngine(
                SPEC, segs[2].caches, 0, 1, "D", transport="ipc", timeout_s=3.0, auth_key="k"
            ).start()
        )
        yield engines
    finally:
        for e in engines:
            e.close()
        for s in segs:
            s.close()


def test_an_epoch_array_shorter_than_the_handshake_fails_each_load_by_name(three):
    """An exporter whose ipc entry maps fewer block epochs than its handshake's block count:
    every load of it fails naming the mismatch (the first through the messaged path, later ones
    too: no one-sided lookup raises out of load(), none is left unreported)."""
    p, _, d = three
    p._transports["ipc"]._entry["num_blocks"] = 1  # the handshake still says 32 blocks
    for rid, src, dst in (("a", [5, 6], [1, 2]), ("b", [7, 8], [3, 4]), ("c", [9, 10], [5, 6])):
        d.load(rid, p.export(rid, src, 16), dst)
        got = _outcome([p], d, [rid])
        assert got[rid].startswith("failed:") and "maps 1 block epochs" in got[rid], got
    assert d._rt.loads.pending() == 0


def test_a_grant_of_what_was_not_asked_fails_nothing(three):
    """A lease grant naming a request the loader did not ask for is ignored: the batch's loads,
    that exporter's and another engine's, land."""
    p, q, d = three
    real = p._exporter._handlers[C.ReadReq]

    def ghost(msg):
        rep = real(msg)
        if isinstance(rep, C.ReadReply):
            rep.ok.append("ghost")
            rep.epochs.append(b"")
        return rep

    p._exporter._handlers[C.ReadReq] = ghost
    d.load("a", p.export("a", [1, 2], 16), [1, 2])
    d.load("b", q.export("b", [3, 4], 16), [5, 6])
    assert _outcome([p, q], d, ["a", "b"]) == {"a": "done", "b": "done"}


def test_a_reply_over_the_message_bound_drops_the_peer(monkeypatch):
    monkeypatch.setattr(C, "MAX_MESSAGE_BYTES", 1 << 20)
    ctx = zmq.Context()
    srv = ctx.socket(zmq.ROUTER)
    srv.setsockopt(zmq.LINGER, 0)
    port = srv.bind_to_random_port("tcp://127.0.0.1")

    def answer_big() -> None:
        if srv.poll(5000):
            ident, mid, _ = srv.recv_multipart()
            srv.send_multipart([ident, mid, C.encode(C.ErrorReply("x" * (2 << 20)))])

    th = threading.Thread(target=answer_big, daemon=True)
    th.start()
    client = C.ControlClient(ctx)
    try:
        with pytest.raises((C.ControlTimeout, C.PeerGone)):
            client.call(f"tcp://127.0.0.1:{port}", C.Heartbeat("D", 0, [], []), 2.0)
    finally:
        th.join(10)
        client.close()
        srv.close(0)
        ctx.term()


def test_a_one_sided_lookup_that_raises_leaves_the_load_to_the_messaged_path(three, monkeypatch):
    """Whatever makes the one-sided lookup raise (it writes nothing), load() does not raise
    and the load is not left registered and unreported: the messaged path takes it."""
    from kvxfer.transports.ipc import onesided, target

    p, _, d = three
    d.load("a", p.export("a", [1, 2], 16), [1, 2])  # handshakes, maps P
    assert _outcome([p], d, ["a"]) == {"a": "done"}

    def broken(*a, **k):
        raise RuntimeError("lookup broke")

    monkeypatch.setattr(onesided.OneSided, "load_native", lambda *a, **k: False)  # the Python path
    monkeypatch.setattr(target.Target, "read", broken)
    d.load("b", p.export("b", [3, 4], 16), [3, 4])
    assert _outcome([p], d, ["b"]) == {"b": "done"}
    assert d.stats()["onesided"]["fallbacks"].get("lookup failed: RuntimeError") == 1
