"""The exporter's side channel against hostile peers: a flood cannot keep its loop from ticking,
made-up ids cost a bounded number of MACs, a token that is not ASCII is refused (not raised on),
and an export released and made again while a send request is checked is not opened by the
earlier export's token."""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest
import torch
import zmq

from kvxfer import KVCacheSpec, TransferEngine
from kvxfer import control as C
from kvxfer.auth import UNAUTHORIZED, EngineSecret, tokens_match
from kvxfer.exports import MAX_FORGED, UNKNOWN, ExportTracker
from kvxfer.transports.ipc.shm import alloc_shm_caches

SPEC = KVCacheSpec(2, 2, 16, 8, torch.float16)


def test_serve_once_returns_within_its_budget_while_messages_keep_coming():
    ctx = zmq.Context()
    srv = C.ControlServer(ctx, "127.0.0.1", 0)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(f"tcp://127.0.0.1:{srv.port}")
        num = 12
        for i in range(num):
            dealer.send_multipart([i.to_bytes(8, "little"), C.encode(C.Heartbeat("D", 0, [], []))])
        time.sleep(0.3)  # the frames reach the server's queue
        per_msg_s = 0.006

        def slow(msg):
            time.sleep(per_msg_s)
            return C.Ack({})

        first = srv.serve_once(slow, 1000)
        # each message takes >= 6 ms: the budget ends the call after this many, queued or not
        assert 1 <= first <= math.ceil(C.SERVE_BUDGET_S / per_msg_s) + 1 < num
        taken, end = first, time.monotonic() + 10
        while taken < num and time.monotonic() < end:
            taken += srv.serve_once(slow, 100)
        assert taken == num
        got = set()
        while len(got) < num and dealer.poll(2000):
            mid, payload = dealer.recv_multipart()
            assert isinstance(C.decode(payload), C.Ack)
            got.add(int.from_bytes(mid, "little"))
        assert got == set(range(num))  # every message answered, none lost to the budget
    finally:
        dealer.close(0)
        srv.close()
        ctx.term()


def _tracker_with(
    secret: EngineSecret, rid: str, ids: list[int], num_tokens: int
) -> tuple[ExportTracker, str]:
    t = ExportTracker(64, lease_s=60.0)
    arr = np.array(ids, dtype=np.int64)
    token, digest = secret.export_token(rid, bytes(8), num_tokens, arr)
    t.add(rid, arr, num_tokens, token=token, digest=digest)
    return t, token


def test_made_up_ids_cost_at_most_max_forged_macs():
    secret = EngineSecret("P", 0, 0)
    t, _ = _tracker_with(secret, "live", [1, 2], 16)
    calls = [0]

    def counting(rid, tok, dg):
        calls[0] += 1
        return secret.verify(rid, tok, dg)

    num = 500
    rids = [f"fake{i}" for i in range(num)]
    with t.lock:
        ok, bad, _ = t.grant(rids, ["0" * 48] * num, counting, [bytes(16)] * num)
    assert not ok and bad == dict.fromkeys(rids, UNAUTHORIZED)
    assert calls[0] == MAX_FORGED  # not one MAC per made-up id

    # authentic tokens of requests not exported here all verify: the bound counts failures only
    calls[0] = 0
    digests = [bytes(16)] * num
    tokens = [secret.token(r, bytes(8), d) for r, d in zip(rids, digests)]
    with t.lock:
        ok, bad, _ = t.grant(rids, tokens, counting, digests)
    assert not ok and bad == dict.fromkeys(rids, UNKNOWN)
    assert calls[0] == num


def test_a_token_that_is_not_ascii_is_refused_not_raised_on():
    secret = EngineSecret("P", 0, 0)
    t, token = _tracker_with(secret, "live", [1, 2], 16)
    odd = token[:-1] + "\u00e9"  # as long as a token, one character not ASCII
    assert not secret.verify("live", odd, bytes(16))
    assert not tokens_match(token, odd)
    with t.lock:
        ok, bad, _ = t.grant(["live", "other"], [odd, odd], secret.verify, [bytes(16), bytes(16)])
    assert not ok and bad == {"live": UNAUTHORIZED, "other": UNAUTHORIZED}
    assert t.notify_many(["live"], 0, 1, [odd], secret.verify, bad := {}) == 0
    assert bad == {"live": UNAUTHORIZED}
    assert t.num_live() == 1


def test_heartbeat_renews_only_what_its_tokens_open():
    secret = EngineSecret("P", 0, 0)
    t, token = _tracker_with(secret, "x", [1, 2], 16)
    e = t.lookup("x")
    e.deadline = time.monotonic() + 1.0
    assert t.heartbeat(["x"], ["0" * 48], secret.verify) == {"x": UNAUTHORIZED}
    assert e.deadline < time.monotonic() + 2.0  # not renewed
    assert t.heartbeat(["x", "gone"], [token, "0" * 48], secret.verify) == {}
    assert e.deadline > time.monotonic() + 50.0  # renewed for the tracker's lease_s


class _Stub:
    """Stands for pg's stream serving: what a send request that passed every check reaches."""

    def __init__(self) -> None:
        self.jobs: list = []

    def serve_stream(self, job):
        self.jobs.append(job)
        return C.SendReply(ok=True, failed={})


@pytest.fixture
def exporter_p():
    shm = alloc_shm_caches(SPEC, 32, 1)
    p = TransferEngine(SPEC, shm.caches, 0, 1, "P", transport="pg", lease_s=5.0).start()
    try:
        yield p
    finally:
        p.close()
        shm.close()


def test_a_send_request_is_checked_and_looked_up_in_one_hold(exporter_p):
    """The engine's thread aborts ``x`` and exports it again (other blocks, a new token) right
    after the send request's tokens verified: it waits for the check to end, so the request,
    made with the first export's token for the second export's blocks, is refused."""
    p = exporter_p
    ex, tr = p._exporter, p._rt.exports
    stub, pg = _Stub(), ex.transports["pg"]
    ex.transports["pg"] = stub
    old = p.export("x", [3, 4], 12)
    racer: list[threading.Thread] = []
    real = tr.unauthorized

    def then_race(*a, **k):
        bad = real(*a, **k)
        if not racer:

            def again():
                p.abort_export("x")
                p.export("x", [20, 21], 12)

            th = threading.Thread(target=again, daemon=True)
            racer.append(th)
            th.start()
            th.join(0.3)  # blocked on the tracker's lock the request's check holds
        return bad

    tr.unauthorized = then_race
    try:
        calls = [(np.array([20, 21], np.int64).tobytes(), 12, 0, 0)]
        req = C.SendReq("D", 0, "k", ["x"], [old["token"]], 0, 1, 8, calls, 8, [], "pg")
        rep = ex.handle(req)
    finally:
        tr.unauthorized = real
        ex.transports["pg"] = pg
    racer[0].join(10)
    assert not racer[0].is_alive()
    assert not rep.ok and not stub.jobs, rep  # the first export holds blocks 3, 4 only
    assert tr.lookup("x").block_ids.tolist() == [20, 21]  # the second export was made after
    ex.transports["pg"] = stub
    try:
        rep = ex.handle(req)  # and the first export's token does not open it
    finally:
        ex.transports["pg"] = pg
    assert not rep.ok and rep.failed == {"*": UNAUTHORIZED} and not stub.jobs


def test_a_lease_request_naming_a_request_twice_is_refused(exporter_p):
    """A held long poll is checked again on every pass of the side channel: a request named
    many times over would make each pass cost that many lookups."""
    from kvxfer.exporter import REPEATED

    p = exporter_p
    prm = p.export("x", [3, 4], 12)
    digest = p._rt.exports.lookup("x").digest
    twice = C.ReadReq("D", 0, 1, ["x", "x"], [prm["token"]] * 2, wait_s=5.0, digests=[digest] * 2)
    assert p._exporter.handle(twice) == C.ErrorReply(REPEATED)
    once = C.ReadReq("D", 0, 1, ["x"], [prm["token"]], digests=[digest])
    rep = p._exporter.handle(once)
    assert isinstance(rep, C.ReadReply) and rep.ok == ["x"]
