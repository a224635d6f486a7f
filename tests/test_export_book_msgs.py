"""The exporter's native answers to a lease grant request and a notification (``ExportBook.grant``
and ``.notify``, ``csrc/ctl/export_book_msgs.h``) against the Python they stand in for: the same
scripted messages (verified, forged, altered, unknown, released, layer-wise, repeated, from a
rank that may not notify) sent to an exporter on the native book and to one without the
control module get the same replies, the same leases renewed and the same exports released;
and the native calls answer None (the Python path's cue) with nothing written for every message
that is not the common one."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
import torch

from kvxfer import KVTransferParams, TransferEngine, exports, idops
from kvxfer import control as C
from kvxfer.spec import KVCacheSpec

SPEC = KVCacheSpec(2, 2, 16, 4, torch.float16)
NUM_BLOCKS = 48


@pytest.fixture(autouse=True)
def _native():
    assert idops.ensure(), idops.status()


def _engine(native: bool, monkeypatch) -> TransferEngine:
    caches = [torch.zeros(SPEC.cache_shape(NUM_BLOCKS, 1), dtype=SPEC.dtype) for _ in range(SPEC.num_layers)]
    with monkeypatch.context() as m:
        if not native:
            m.setattr(exports, "_ctl", lambda: None)
        eng = TransferEngine(SPEC, caches, 0, 1, f"P{int(native)}", transport="pg", lease_s=30.0).start()
    assert (eng._rt.exports._book is not None) is native
    return eng


class Side:
    """One exporter and the params of what it exported, by request id."""

    def __init__(self, native: bool, monkeypatch) -> None:
        self.eng = _engine(native, monkeypatch)
        self.params: dict[str, dict] = {}
        self.python_grants = 0
        self.python_notifies = 0
        t = self.eng._rt.exports
        grant, notify_many = t.grant, t.notify_many

        def counted_grant(*a, **k):
            self.python_grants += 1
            return grant(*a, **k)

        def counted_notify(*a, **k):
            self.python_notifies += 1
            return notify_many(*a, **k)

        t.grant, t.notify_many = counted_grant, counted_notify

    def close(self) -> None:
        self.eng.close()

    def export(self, rid: str, ids: list[int], streaming: bool) -> None:
        self.params[rid] = self.eng.export(rid, ids, len(ids) * SPEC.block_size - 1, streaming=streaming)

    def token(self, rid: str, how: str) -> str:
        if rid not in self.params:
            return "ab" * 24
        tok = self.params[rid]["token"]
        if how == "forged":
            return tok[:-1] + ("0" if tok[-1] != "0" else "1")
        if how == "other":  # an authentic token of another export
            others = [p["token"] for r, p in self.params.items() if r != rid]
            return others[0] if others else tok
        return tok

    def digest(self, rid: str, how: str) -> bytes:
        if rid not in self.params:
            return bytes(16)
        dg = KVTransferParams.from_dict(self.params[rid]).digest()
        return bytes([dg[0] ^ 1]) + dg[1:] if how == "altered" else dg

    def deadlines(self) -> dict[str, float]:
        return {rid: e.deadline for rid, e in self.eng._rt.exports._live.items()}


def _reply_of(rep) -> tuple:
    if isinstance(rep, C.ReadReply):
        return ("grant", rep.ok, rep.epochs, sorted(rep.failed.items()), rep.layers)
    if isinstance(rep, C.Ack):
        return ("ack", sorted(rep.failed.items()))
    return (type(rep).__name__, getattr(rep, "error", None))


def _send(side: Side, step: tuple):
    kind, rids, hows, extra = step
    toks = [side.token(r, h) for r, h in zip(rids, hows)]
    if kind == "grant":
        dgs = [side.digest(r, h) for r, h in zip(rids, hows)]
        return side.eng._exporter.handle(C.ReadReq("D", 0, 1, rids, toks, digests=dgs))
    rank, tp = extra
    return side.eng._exporter.handle(C.Notify("D", rank, tp, rids, [], toks))


def _script(seed: int, n: int = 160) -> list[tuple]:
    rng = random.Random(seed)
    steps, exported, k = [], [], 0
    for _ in range(n):
        r = rng.random()
        if r < 0.25 or not exported:
            rid = f"r{k}"
            k += 1
            ids = rng.sample(range(NUM_BLOCKS), rng.randint(1, 5))
            steps.append(("export", rid, ids, rng.random() < 0.15))
            exported.append(rid)
            continue
        m = rng.randint(1, 3)
        rids = [rng.choice(exported) if rng.random() < 0.9 else f"unknown{k}" for _ in range(m)]
        hows = [rng.choice(["ok"] * 8 + ["forged", "other", "altered"]) for _ in range(m)]
        if r < 0.65:
            if len(set(rids)) == len(rids):  # a repeated id is refused before any grant
                steps.append(("grant", rids, hows, None))
        else:
            tp = rng.choice([1, 1, 1, 2, 2, 3, 4, 20])
            rank = rng.choice([0, 0, 1, tp - 1, tp, 17])
            steps.append(("notify", rids, hows, (rank, tp)))
    return steps


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_native_answers_equal_the_python_ones_message_by_message(monkeypatch, seed):
    sides = [Side(True, monkeypatch), Side(False, monkeypatch)]
    fast_grants = fast_notifies = 0
    try:
        for step in _script(seed):
            if step[0] == "export":
                for s in sides:
                    s.export(step[1], step[2], step[3])
                continue
            t0 = time.monotonic()
            before = [s.deadlines() for s in sides]
            counts = (sides[0].python_grants, sides[0].python_notifies)
            got = [_reply_of(_send(s, step)) for s in sides]
            assert got[0] == got[1], step
            fast_grants += step[0] == "grant" and sides[0].python_grants == counts[0]
            fast_notifies += step[0] == "notify" and sides[0].python_notifies == counts[1]
            finished = [set(s.eng.poll().finished_sending) for s in sides]
            assert finished[0] == finished[1], step
            after = [s.deadlines() for s in sides]
            assert after[0].keys() == after[1].keys(), step
            renewed = [{r for r in a if a[r] != b.get(r)} for a, b in zip(after, before)]
            assert renewed[0] == renewed[1], step
            if step[0] == "grant" and got[0][1]:
                lease = sides[0].eng._rt.exports.lease_s
                assert all(after[0][r] >= t0 + lease for r in got[0][1] if r in after[0]), step
        # both paths ran: the native one for the common messages, Python for the others
        assert fast_grants > 5 and fast_notifies > 5
        assert sides[0].python_grants > 0 and sides[0].python_notifies > 0
    finally:
        for s in sides:
            s.close()


def _book_with(n: int, layerwise: int = -1):
    """A native book holding ``n`` exports r0.. (ids 2i, 2i+1, epochs 10 x id; ``layerwise``:
    that one layer-wise), their tokens and digests."""
    ctl = idops.native()
    rc, ep = np.zeros(64, np.int32), np.arange(64, dtype=np.int64) * 10
    book = ctl.ExportBook(rc, ep, 8, 8)
    toks, dgs = [], []
    for i in range(n):
        tok, dg = f"{i:02d}" * 24, bytes([i]) * 16
        marked = np.zeros(4, bool) if i == layerwise else None
        book.add(f"r{i}", np.array([2 * i, 2 * i + 1]), 8, 5.0, tok, dg, 0, None, marked, True)
        toks.append(tok)
        dgs.append(dg)
    return book, toks, dgs


def test_grant_renews_and_snapshots_every_id_in_one_call():
    book, toks, dgs = _book_with(3)
    got = book.grant(["r2", "r0"], [toks[2], toks[0]], [dgs[2], dgs[0]], 99.0)
    assert got == [np.array([40, 50]).tobytes(), np.array([0, 10]).tobytes()]
    assert [book.live[f"r{i}"].deadline for i in range(3)] == [99.0, 5.0, 99.0]
    assert book.grant(["r1"], [toks[1]], [dgs[1]], 1.0) == [np.array([20, 30]).tobytes()]
    assert book.live["r1"].deadline == 5.0  # a lease never shortened


@pytest.mark.parametrize(
    "case",
    ["unknown", "forged", "shorter", "not ascii", "altered", "no digest", "layer-wise", "lengths", "empty"],
)
def test_grant_answers_none_and_writes_nothing_for_any_other_request(case):
    book, toks, dgs = _book_with(3, layerwise=2 if case == "layer-wise" else -1)
    rids, tk, dg = ["r0", "r1"], toks[:2], dgs[:2]
    if case == "unknown":
        rids = ["r0", "r9"]
    elif case == "forged":
        tk = [toks[0], toks[1][:-1] + "x"]
    elif case == "shorter":
        tk = [toks[0], toks[1][:-1]]
    elif case == "not ascii":
        tk = [toks[0], toks[1][:-1] + "é"]
    elif case == "altered":
        dg = [dgs[0], bytes(16)]
    elif case == "no digest":
        dg = [dgs[0], None]
    elif case == "layer-wise":
        rids, tk, dg = ["r0", "r2"], [toks[0], toks[2]], [dgs[0], dgs[2]]
    elif case == "lengths":
        dg = dgs[:1]
    elif case == "empty":
        rids, tk, dg = [], [], []
    was = {r: e.deadline for r, e in book.live.items()}
    assert book.grant(rids, tk, dg, 99.0) is None
    assert {r: e.deadline for r, e in book.live.items()} == was  # r0, verified, not renewed either


def _want(tp: int, rank: int) -> int | str:
    return "refused: no plan" if tp == 3 else tp


def test_notify_counts_each_sender_once_and_answers_the_completed_ids():
    book, toks, _ = _book_with(3)
    assert book.notify(["r0", "r1"], toks[:2], 0, 2, _want) == []
    assert book.notify(["r0", "r0"], [toks[0]] * 2, 0, 2, _want) == []  # a repeat counts once
    assert book.notify(["r0", "r2"], [toks[0], toks[2]], 1, 2, _want) == ["r0"]
    assert book.live["r0"].notified_by == {2: {0, 1}} and book.live["r2"].notified_by == {2: {1}}
    assert book.notify(["r1"], toks[1:2], 0, 1, _want) == ["r1"]  # counted per expected count
    assert "r0" in book.live  # the caller releases


@pytest.mark.parametrize("case", ["unknown", "forged", "refused", "rank past tp", "rank past marks", "tp 0"])
def test_notify_answers_none_and_counts_nothing_for_any_other_notification(case):
    book, toks, _ = _book_with(2)
    rids, tk, rank, tp = ["r0", "r1"], toks[:2], 0, 2
    if case == "unknown":
        rids = ["r0", "r7"]
    elif case == "forged":
        tk = [toks[0], toks[0]]
    elif case == "refused":
        tp = 3
    elif case == "rank past tp":
        rank = 2
    elif case == "rank past marks":
        rank, tp = 16, 20
    elif case == "tp 0":
        tp = 0
    assert book.notify(rids, tk, rank, tp, _want) is None
    assert all(not e.notified_by for e in book.live.values())


def test_grant_and_notify_refuse_bad_arguments_by_name():
    book, toks, dgs = _book_with(1)
    with pytest.raises(TypeError, match=r"ExportBook\.grant takes 4"):
        book.grant(["r0"], toks, dgs)
    with pytest.raises(TypeError):
        book.grant(["r0"], toks, dgs, "soon")
    with pytest.raises(TypeError, match="expected must be callable"):
        book.notify(["r0"], toks, 0, 1, 3)
    with pytest.raises(TypeError, match=r"ExportBook\.notify takes 5"):
        book.notify(["r0"], toks, 0, 1)
    assert book.live["r0"].deadline == 5.0 and not book.live["r0"].notified_by


def test_notify_holds_the_ids_while_expected_runs_python():
    """``expected`` is Python: a list it empties (or anything it frees) is not read afterwards."""
    book, toks, _ = _book_with(2)
    ids = ["r0", "r1"]

    def expected(tp: int, rank: int) -> int:
        ids.clear()
        return 1

    assert book.notify(ids, list(toks), 0, 1, expected) == ["r0", "r1"]


class _Str(str):
    def __hash__(self) -> int:  # Python code run by a dict lookup
        return str.__hash__(self)


def test_ids_tokens_or_digests_of_other_types_take_the_python_path():
    book, toks, dgs = _book_with(2)
    assert book.grant([_Str("r0")], toks[:1], dgs[:1], 99.0) is None
    assert book.grant(["r0"], [_Str(toks[0])], dgs[:1], 99.0) is None
    assert book.grant(["r0"], toks[:1], [bytearray(dgs[0])], 99.0) is None
    assert book.grant(("r0",), tuple(toks[:1]), tuple(dgs[:1]), 99.0) is None
    assert book.notify([_Str("r0")], toks[:1], 0, 1, _want) is None
    assert book.live["r0"].deadline == 5.0 and not book.live["r0"].notified_by
