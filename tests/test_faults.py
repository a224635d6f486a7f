"""Faults a serving cluster meets every day, and the side channel's defences (CPU, in process).

Each test names the failure it guards against: a restarted or moved peer, repeated pair-group
keys, a failed start, lost notifications, a load chaining waits, a close stuck in a transfer,
swallowed errors, and an unauthenticated side channel.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
import zmq

from kvxfer import KVCacheSpec, KVTransferParams, TransferEngine
from kvxfer import control as C
from kvxfer.ports import free_port_base
from kvxfer.transports.ipc.shm import alloc_shm_caches

from .engine_payload import check, fill, poison, untouched

SPEC = KVCacheSpec(2, 2, 16, 8, torch.float16)


def _wait(eng, want, timeout=10.0) -> dict:
    got: dict = {}
    end = time.monotonic() + timeout
    while set(got) != set(want) and time.monotonic() < end:
        r = eng.poll()
        got.update(dict.fromkeys(r.finished_recving, "done"))
        got.update({rid: "failed: " + r.errors.get(rid, "") for rid in r.failed})
        time.sleep(0.005)
    return got


def _sent(eng, want, timeout=10.0) -> dict:
    got: dict = {}
    end = time.monotonic() + timeout
    while set(got) != set(want) and time.monotonic() < end:
        r = eng.poll()
        got.update(dict.fromkeys(r.finished_sending, "finished"))
        got.update(dict.fromkeys(r.expired, "expired"))
        time.sleep(0.005)
    return got


@pytest.fixture
def shm_pair():
    made = []

    def make(n=2, blocks=32):
        out = [alloc_shm_caches(SPEC, blocks, 1) for _ in range(n)]
        made.extend(out)
        return out

    yield make
    for s in made:
        s.close()


# --------------------------------------------------------------------------- 1: restarted peer
@pytest.mark.parametrize("same_port", [False, True])
def test_restarted_exporter_is_reached_at_once_and_never_read_stale(shm_pair, same_port):
    """P restarts (same engine id; a new port, or the same one). D's next load goes to the new
    incarnation at once (new address / new mappings) and lands the NEW bytes: never the old
    process's memory, never a timeout on the dead address."""
    s1, s2, dshm = shm_pair(3)
    port = free_port_base(1)
    d = TransferEngine(SPEC, dshm.caches, 0, 1, "D", transport="ipc", timeout_s=5.0).start()
    p1 = TransferEngine(SPEC, s1.caches, 0, 1, "P", transport="ipc", port=port).start()
    try:
        fill(s1.caches, SPEC, 0, 1, [3, 4], 12, seed=1)
        d.load("a", p1.export("a", [3, 4], 12), [5, 6])
        assert _wait(d, {"a"}) == {"a": "done"}
        p1.close()
        p2 = TransferEngine(
            SPEC, s2.caches, 0, 1, "P", transport="ipc", port=port if same_port else free_port_base(1)
        ).start()
        try:
            fill(s2.caches, SPEC, 0, 1, [3, 4], 12, seed=2)  # same blocks, other bytes
            t0 = time.monotonic()
            d.load("b", p2.export("b", [3, 4], 12), [7, 8])
            assert _wait(d, {"b"}) == {"b": "done"}
            assert time.monotonic() - t0 < 2.5  # well within timeout_s: no wait on a dead address
            assert check(dshm.caches, SPEC, 0, 1, [7, 8], 12, seed=2)  # the new bytes
        finally:
            p2.close()
    finally:
        d.close()
        p1.close()


# --------------------------------------------------------------------------- 2: pair keys
def test_pair_keys_never_repeat_across_reconnections():
    """After D drops a remote (a timeout), its new pair group key differs from every earlier
    one (a repeated key let a Gloo rendezvous read stale addresses and hang)."""
    pc = [torch.zeros(SPEC.cache_shape(32, 1), dtype=SPEC.dtype) for _ in range(2)]
    dc = [torch.zeros(SPEC.cache_shape(32, 1), dtype=SPEC.dtype) for _ in range(2)]
    p = TransferEngine(SPEC, pc, 0, 1, "P", transport="pg").start()
    d = TransferEngine(SPEC, dc, 0, 1, "D", transport="pg").start()
    keys: list[str] = []
    real = p._exporter.handle

    def spy(msg):
        if isinstance(msg, C.PairReq):
            keys.append(msg.key)
        return real(msg)

    p._exporter.handle = spy
    try:
        for i in range(3):
            fill(pc, SPEC, 0, 1, [i + 1], 5, seed=i)
            d.load(f"r{i}", p.export(f"r{i}", [i + 1], 5), [i + 10])
            assert _wait(d, {f"r{i}"}) == {f"r{i}": "done"}
            d._loader.forget(d._loader.peers.get("P"), "simulated timeout")  # as a timed-out load does
        assert len(keys) == 3 and len(set(keys)) == 3, keys
    finally:
        d.close()
        p.close()


# --------------------------------------------------------------------------- 4: failed start
def test_failed_start_leaks_nothing(monkeypatch):
    """A start that fails after binding its socket and publishing its epoch array (here: the pg
    store cannot be served) releases the zmq context, its threads and sockets, the shared
    memory segment and the key file, and raises the cause."""
    import os

    from kvxfer.transports.pg import groups as pg

    shm = alloc_shm_caches(SPEC, 8, 1)
    threads_before = threading.active_count()
    segs_before = set(os.listdir("/dev/shm"))

    def boom(*a, **k):
        raise OSError("address in use (simulated)")

    monkeypatch.setattr(pg, "serve_store", boom)
    port = free_port_base(1)
    eng = TransferEngine(SPEC, shm.caches, 0, 1, "P", port=port)
    try:
        with pytest.raises(OSError, match="simulated"):
            eng.start()
        assert eng._ctx.closed
        assert threading.active_count() == threads_before
        mine = {n for n in set(os.listdir("/dev/shm")) - segs_before if f"_{os.getpid()}_" in n}
        assert mine == set()  # no epoch segment (other jobs on the machine may make theirs)
        from kvxfer.auth import key_path

        assert not key_path("P", port).exists()  # rank 0's key file removed with the rest
        with zmq.Context() as ctx, ctx.socket(zmq.ROUTER) as s:
            s.bind(f"tcp://127.0.0.1:{port}")  # the port is free again
    finally:
        shm.close()


def test_port_in_use_fails_start_cleanly():
    port = free_port_base(1)
    with zmq.Context() as ctx, ctx.socket(zmq.ROUTER) as s:
        s.bind(f"tcp://127.0.0.1:{port}")
        eng = TransferEngine(
            SPEC, [torch.zeros(SPEC.cache_shape(4, 1), dtype=SPEC.dtype)] * 2, 0, 1, "P", port=port
        )
        with pytest.raises(zmq.ZMQError):
            eng.start()
        assert eng._ctx.closed


# --------------------------------------------------------------------------- 5: lost messages
def test_lost_notifications_are_retried_until_acknowledged(shm_pair):
    """A third of the notifications (and of their acks) are lost: every delivered request is still
    reported finished on P — never expired — because notifications are acknowledged and
    retried."""
    s, dshm = shm_pair(2)
    # a notification is retried (backing off to 1 s) until the lease: with 30% of each lost,
    # all ~10 tries of one fail with probability ~1e-5
    p = TransferEngine(SPEC, s.caches, 0, 1, "P", transport="ipc", lease_s=6.0).start()
    d = TransferEngine(SPEC, dshm.caches, 0, 1, "D", transport="ipc", lease_s=6.0).start()
    faults = C.FaultInjector(drop=0.3, seed=7, only=lambda m: isinstance(m, (C.Notify, C.Ack)))
    C.set_fault_injector(faults)
    try:
        want = {f"r{i}" for i in range(12)}
        for i in range(12):
            d.load(f"r{i}", p.export(f"r{i}", [i], 3), [i])
            assert _wait(d, {f"r{i}"}) == {f"r{i}": "done"}
        got = _sent(p, want, timeout=15)
        assert got == dict.fromkeys(want, "finished"), got
        assert faults.dropped > 0 and p.stats()["expirations"] == 0 and p.stats()["blocks_held"] == 0
    finally:
        C.set_fault_injector(None)
        d.close()
        p.close()


# --------------------------------------------------------------------------- 6: deadlines
def test_one_deadline_per_load_even_when_every_step_is_slow(shm_pair):
    """Every reply of the exporter takes 0.4 s (handshake, grants...), with timeout_s = 1: the
    load ends (failed, naming the deadline) within its one deadline, not after a chain of
    separate timeouts."""
    s, dshm = shm_pair(2)
    p = TransferEngine(SPEC, s.caches, 0, 1, "P", transport="pg").start()
    d = TransferEngine(SPEC, dshm.caches, 0, 1, "D", transport="pg", timeout_s=1.0).start()
    C.set_fault_injector(
        C.FaultInjector(delay_s=0.4, only=lambda m: isinstance(m, (C.HelloReply, C.ReadReply, C.SendReply)))
    )
    try:
        d.load("x", p.export("x", [1, 2], 10), [3, 4])
        t0 = time.monotonic()
        got = _wait(d, {"x"}, timeout=10)
        took = time.monotonic() - t0
        assert "x" in got and took < 1.0 + 0.6, (got, took)  # deadline + one in-flight reply
        if got["x"] != "done":
            assert "deadline" in got["x"] or "no reply" in got["x"], got
    finally:
        C.set_fault_injector(None)
        d.close()
        p.close()


def test_close_is_bounded_with_a_worker_stuck_in_a_transfer(shm_pair):
    """The exporter never sends (its sender is parked): D's worker waits in a receive. close()
    returns within its bound anyway (pair groups are aborted first)."""
    from kvxfer.engine import CLOSE_TIMEOUT_S

    pc = [torch.zeros(SPEC.cache_shape(32, 1), dtype=SPEC.dtype) for _ in range(2)]
    dc = [torch.zeros(SPEC.cache_shape(32, 1), dtype=SPEC.dtype) for _ in range(2)]
    p = TransferEngine(SPEC, pc, 0, 1, "P", transport="pg").start()
    d = TransferEngine(SPEC, dc, 0, 1, "D", transport="pg", timeout_s=60.0).start()
    parked = threading.Event()
    p._hooks["before_send"] = lambda: (parked.set(), time.sleep(30))
    try:
        d.load("x", p.export("x", [1], 5), [2])
        d.poll()
        assert parked.wait(10)
        time.sleep(0.2)  # D is now inside its receive
        t0 = time.monotonic()
        d.close()
        assert time.monotonic() - t0 < CLOSE_TIMEOUT_S + 1.0
    finally:
        d.close()
        p._hooks.clear()
        p.close()


# --------------------------------------------------------------------------- 7: errors logged
def test_a_failing_handler_is_logged_and_the_channel_keeps_serving(caplog):
    """An exception inside a message handler becomes an ErrorReply and a warning naming it;
    the side channel goes on serving."""
    pc = [torch.zeros(SPEC.cache_shape(8, 1), dtype=SPEC.dtype) for _ in range(2)]
    p = TransferEngine(SPEC, pc, 0, 1, "P", transport="pg").start()
    ctx = zmq.Context()
    client = C.ControlClient(ctx)
    addr = f"tcp://127.0.0.1:{p.port}"
    try:
        prm = p.export("r", [1], 4)
        ex = p._rt.exports
        real = ex.notify_verified, ex.notify_many

        def broken(*args, **kwargs):
            raise RuntimeError("a bug in the notification path")

        ex.notify_verified = ex.notify_many = broken
        bad = C.Notify("D", 0, 1, ["r"], [], [prm["token"]])
        with caplog.at_level(logging.WARNING, logger="kvxfer.control"):
            rep = client.call(addr, bad, 5.0)
        assert isinstance(rep, C.ErrorReply) and "a bug in the notification path" in rep.error
        assert any("handler failed on Notify" in r.getMessage() for r in caplog.records)
        ex.notify_verified, ex.notify_many = real
        dg = KVTransferParams.from_dict(prm).digest()
        ok = client.call(addr, C.ReadReq("D", 0, 1, ["r"], [prm["token"]], digests=[dg]), 5.0)
        assert isinstance(ok, C.ReadReply) and ok.ok == ["r"]
    finally:
        client.close()
        ctx.term()
        p.close()


# --------------------------------------------------------------------------- 8: authentication
def test_side_channel_answers_only_holders_of_the_params(shm_pair):
    """Without a request's token a peer learns nothing and frees nothing: no cache description
    (shm names, IPC handles), no lease or epochs, no release; another engine's params do not
    open this one's requests; garbage never stops the engine."""
    s, dshm = shm_pair(2)
    p = TransferEngine(SPEC, s.caches, 0, 1, "P", transport="auto", lease_s=30.0).start()
    ctx = zmq.Context()
    client = C.ControlClient(ctx)
    addr = f"tcp://127.0.0.1:{p.port}"
    try:
        fill(s.caches, SPEC, 0, 1, [2], 6, seed=3)
        prm = p.export("victim", [2], 6)
        ident = dict(
            engine_id="E",
            tp_rank=0,
            tp_size=1,
            spec=SPEC.to_dict(),
            compat="",
            transports=["ipc", "pg"],
            hostname="h",
        )
        forged = "f" * 48
        for hello in (C.Hello(**ident), C.Hello(**ident, request_id="victim", token=forged)):
            rep = client.call(addr, hello, 5.0)
            assert isinstance(rep, C.ErrorReply) and "unauthorized" in rep.error
            assert "kvx_" not in C.encode(rep).decode("latin-1")  # no segment names leak
        rep = client.call(addr, C.ReadReq("E", 0, 1, ["victim"], [forged]), 5.0)
        assert rep.ok == [] and rep.epochs == [] and "unauthorized" in rep.failed["victim"]
        rep = client.call(addr, C.Notify("E", 0, 1, ["victim"], [], [forged]), 5.0)
        assert "unauthorized" in rep.failed["victim"]
        rep = client.call(
            addr, C.SendReq("E", 0, "k", ["victim"], [forged], 0, 2, 8, [(b"", 6, 0, 0)], 8), 5.0
        )
        assert not rep.ok and "unauthorized" in rep.failed["*"]
        rep = client.call(addr, C.PairReq("E", 0, "k", "gloo", "victim", forged), 5.0)
        assert not rep.ok and "unauthorized" in rep.failed["*"]
        # another engine's params (a valid token of another secret) do not open this request
        other = TransferEngine(
            SPEC, [torch.zeros(SPEC.cache_shape(8, 1), dtype=SPEC.dtype)] * 2, 0, 1, "O"
        ).start()
        try:
            tok_other = other.export("victim", [1], 6)["token"]
        finally:
            other.close()
        rep = client.call(addr, C.ReadReq("E", 0, 1, ["victim"], [tok_other]), 5.0)
        assert "unauthorized" in rep.failed["victim"]
        assert p.stats()["exports_live"] == 1 and p.stats()["finished_exports"] == 0
        # garbage: raw frames, undecodable payloads, wrong frame counts
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(addr)
        for frames in (
            [b"x" * 8, b"\xff\xfe garbage"],
            [b"short", b""],
            [b"a", b"b", b"c"],
            [b"\x00" * 8, C.encode(C.Ack({}))[:3]],
        ):
            raw.send_multipart(frames)
        time.sleep(0.2)
        raw.close(0)
        # the rightful holder still gets everything
        d = TransferEngine(SPEC, dshm.caches, 0, 1, "D", transport="ipc").start()
        try:
            poison(dshm.caches)
            d.load("victim", prm, [9])
            assert _wait(d, {"victim"}) == {"victim": "done"}
            assert check(dshm.caches, SPEC, 0, 1, [9], 6, seed=3)
            assert untouched(dshm.caches, SPEC, {9}, {9: 6})
        finally:
            d.close()
    finally:
        client.close()
        ctx.term()
        p.close()


def test_engines_of_one_host_share_the_secret_and_a_cluster_key_replaces_it(tmp_path, monkeypatch):
    """Ranks of one engine (same id and base port) make the same tokens; a new start of the
    engine (after rank 0 closed) makes new ones; a cluster key gives the same secret anywhere."""
    from kvxfer.auth import EngineSecret

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("KVXFER_AUTH_KEY", raising=False)
    r0, r1 = EngineSecret("E", 7000, 0), EngineSecret("E", 7000, 1)
    dg = bytes(16)
    assert r0.secret == r1.secret and r0.token("q", bytes(8), dg) == r1.token("q", bytes(8), dg)
    assert oct(r0.path.stat().st_mode & 0o777) == "0o600"
    assert EngineSecret("E", 7002, 0).secret != r0.secret  # another engine (port)
    r1.close()
    assert r0.path.exists()  # only rank 0 removes it
    r0.close()
    assert EngineSecret("E", 7000, 0).secret != r1.secret  # the next start draws a new one
    a, b = EngineSecret("E", 7000, 0, auth_key="k"), EngineSecret("E", 9999, 3, auth_key="k")
    assert a.secret == b.secret and a.path is None
    monkeypatch.setenv("KVXFER_AUTH_KEY", "k")
    assert EngineSecret("E", 1, 0).secret == a.secret
