"""A plain export in one native call (``ExportBook.export``, ``csrc/ctl/export_book_export.h``,
through ``ExportTracker.export_plain``) against the Python path it stands in for: the same
scripted exports (good ones, tokens made by a scheduler, re-exports after a release; and every
kind of bad argument) made on an engine that takes the native call and on one whose native call
is off give the same params or the same error, and leave the same records, refcounts and
gates; every refusal of the native call writes nothing (``export()`` then raises on the Python
path, naming the problem)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvxfer import TransferEngine, idops
from kvxfer.spec import KVCacheSpec

SPEC = KVCacheSpec(2, 2, 16, 4, torch.float16)
NUM_BLOCKS = 40
RIDS = ["r0", "r1", "r2", "r3", "é-4"]


@pytest.fixture(autouse=True)
def _native():
    assert idops.ensure(), idops.status()


class Side:
    """One exporter engine; ``fast``: its exports may take the native call (counted)."""

    def __init__(self, fast: bool) -> None:
        caches = [
            torch.zeros(SPEC.cache_shape(NUM_BLOCKS, 1), dtype=SPEC.dtype) for _ in range(SPEC.num_layers)
        ]
        self.eng = TransferEngine(SPEC, caches, 0, 1, "P", transport="pg", lease_s=30.0, auth_key="k").start()
        t = self.eng._rt.exports
        assert t._book is not None
        self.native = 0
        plain = t.export_plain

        def counted(*a, **k):
            got = plain(*a, **k)
            self.native += got is not None
            return got

        t.export_plain = counted if fast else (lambda *a, **k: None)

    def do(self, op: tuple):
        """Run ``op`` (on a copy of its ids: an item may change the list it is in); its result
        or (exception type, message)."""
        kind, *args = op
        if kind == "export" and type(args[1]) is list:
            ids = list(args[1])
            args[1] = [Changes(ids, x.value) if type(x) is Changes else x for x in ids]
            for x in args[1]:
                if type(x) is Changes:
                    x.ids = args[1]
        try:
            if kind == "export":
                rid, ids, n, token, ready = args
                got = self.eng.export(rid, ids, n, ready, token=token)
                del got["port"]  # each engine's own side channel
                return got
            return self.eng.abort_export(args[0])
        except (ValueError, TypeError) as e:
            return type(e), str(e)

    def state(self) -> tuple:
        t = self.eng._rt.exports
        recs = {}
        for rid in RIDS:
            e = t.lookup(rid)
            if e is not None:
                recs[rid] = (
                    e.token,
                    e.digest,
                    e.gen,
                    e.num_tokens,
                    np.asarray(e.block_ids).tolist(),
                    e.groups,
                )
        pending = self.eng._rt.order._pending
        gates = tuple(tuple(map(id, pending[rid])) if rid in pending else None for rid in RIDS)
        return recs, t.refcount.tolist(), t.epochs.tolist(), sorted(t._gone.items()), gates

    def close(self) -> None:
        self.eng.close()


class Ready:
    """A stand-in for a CUDA event: ``query()`` says whether the compute completed."""

    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


class Int(int):
    """An int subclass (no code of its own runs when read)."""


class Changes:
    """An id whose ``__index__`` changes the list it is in (its next item) before answering: an
    export must read the ids as they were when it was called."""

    def __init__(self, ids: list, value: int) -> None:
        self.ids, self.value = ids, value

    def __index__(self) -> int:
        self.ids[1] = (self.ids[1] + 1) % NUM_BLOCKS if type(self.ids[1]) is int else self.ids[1]
        return self.value


def _ids(rng: random.Random, need: int) -> list:
    """Block ids for an export needing ``need``: mostly good, else one kind of bad each."""
    good = rng.sample(range(NUM_BLOCKS), need + rng.choice([0, 0, 0, 2]))
    k = rng.randrange(14)
    if k == 0 and need > 1:
        good[-1] = good[0]  # repeated
    elif k == 1:
        good[rng.randrange(need)] = NUM_BLOCKS  # out of range
    elif k == 2:
        good[0] = -1
    elif k == 3:
        good = good[: need - 1]  # too few
    elif k == 4:
        good[rng.randrange(need)] = np.int64(
            good[0] if need == 1 else good[-1] % NUM_BLOCKS
        )  # not exactly an int
    elif k == 5:
        good[0] = True  # a bool among ints
    elif k == 6:
        good[0] = 2**70
    elif k == 7:
        good[0] = "3"
    elif k == 8:
        good = tuple(good)  # not a list: the Python path's
    return good


def _script(seed: int, side: Side, n: int = 200) -> list[tuple]:
    """Scripted exports and aborts; tokens of a scheduler made with ``side``'s secret."""
    rng = random.Random(seed)
    secret = side.eng._rt.secret
    ops, used = [], []
    for _ in range(n):
        rid = rng.choice(RIDS)
        if rng.random() < 0.35:
            ops.append(("abort", rid))
            continue
        if rng.random() < 0.04:
            rid = rng.choice(["", 7, None, ("r0",)])
        num = rng.randint(1, 5 * SPEC.block_size)
        need = SPEC.num_blocks_for(num)
        ids = _ids(rng, need)
        token = None
        k = rng.randrange(8)
        if k in (0, 1) and isinstance(rid, str) and rid:
            try:
                token = secret.new_token(rid, num, [int(x) % NUM_BLOCKS for x in list(ids)[:need]])
            except (ValueError, TypeError, OverflowError):
                token = None
            used.append(token)
        elif k == 2 and used:
            token = rng.choice(used)  # another export's, or reused after its release
        elif k == 3:
            token = "0" * 48
        elif k == 4:
            token = "zz" + "0" * 46
        ready = Ready(rng.random() < 0.5) if rng.random() < 0.2 else None
        if rng.random() < 0.03:
            ready = "not an event"
        if rng.random() < 0.05 and type(ids) is list and len(ids) > 1:
            ids[0] = Changes(ids, rng.randrange(NUM_BLOCKS))  # its __index__ changes the list
        ops.append(("export", rid, ids, num, token, ready))
    return ops


@pytest.mark.parametrize("seed", range(4))
def test_native_exports_equal_the_python_path_export_by_export(seed):
    fast, ref = Side(True), Side(False)
    try:
        for i, op in enumerate(_script(seed, fast)):
            a, b = fast.do(op), ref.do(op)
            assert a == b, (i, op, a, b)
            assert fast.state() == ref.state(), (i, op)
        assert fast.native >= 8, fast.native  # the native call took the common exports
    finally:
        fast.close()
        ref.close()


@pytest.fixture()
def side():
    s = Side(True)
    yield s
    s.close()


def test_a_plain_export_is_one_native_call_with_the_params_of_the_python_path(side):
    ids = [5, 9, 2]
    p = side.eng.export("r0", ids, 3 * SPEC.block_size)
    assert side.native == 1
    assert p["block_ids"] == ids and p["block_ids"] is not ids  # a copy: the caller's list may change
    ids[0] = 7
    assert p["block_ids"] == [5, 9, 2]
    e = side.eng._rt.exports.lookup("r0")
    assert e.token == p["token"] and np.asarray(e.block_ids).tolist() == [5, 9, 2] and e.gen == 0
    assert side.eng._rt.exports.refcount[[5, 9, 2]].tolist() == [1, 1, 1]
    assert side.eng._rt.secret.verify("r0", p["token"], e.digest)
    # an int subclass among the ids: native, and the params carry plain ints
    p = side.eng.export("r1", [Int(11), 12], 2 * SPEC.block_size)
    assert side.native == 2 and p["block_ids"] == [11, 12] and all(type(x) is int for x in p["block_ids"])
    # a numpy int (its __index__ is code of the caller's): the Python path, plain ints too
    p = side.eng.export("r3", [np.int64(13), 14], 2 * SPEC.block_size)
    assert side.native == 2 and p["block_ids"] == [13, 14] and all(type(x) is int for x in p["block_ids"])
    # extra ids beyond what num_tokens needs: the first ones, as the Python path
    p = side.eng.export("r2", [20, 21, 22, 23], SPEC.block_size + 1)
    assert p["block_ids"] == [20, 21]


@pytest.mark.parametrize(
    "case",
    ["live", "out of range", "repeated", "too few", "bool", "forged token", "reused token", "empty id"],
)
def test_every_refusal_writes_nothing_and_the_python_path_names_it(side, case):
    eng = side.eng
    t = eng._rt.exports
    secret = eng._rt.secret
    eng.export("r0", [1, 2], 2 * SPEC.block_size)
    eng.abort_export("r0")
    old = eng.export("r0", [1, 2], 2 * SPEC.block_size)["token"]  # generation 1
    eng.abort_export("r0")
    eng.export("r1", [3], 1)
    args = {
        "live": ("r1", [4], 1, None),
        "out of range": ("r2", [NUM_BLOCKS], 1, None),
        "repeated": ("r2", [5, 5], 2 * SPEC.block_size, None),
        "too few": ("r2", [5], 2 * SPEC.block_size, None),
        "bool": ("r2", [True], 1, None),
        "forged token": ("r2", [5], 1, secret.new_token("r2", 2, [5])),  # made for other content
        "reused token": ("r0", [1, 2], 2 * SPEC.block_size, old),
        "empty id": ("", [5], 1, None),
    }[case]
    before = (t.refcount.tolist(), t.epochs.tolist(), t.num_live(), side.native)
    with pytest.raises(ValueError) as got:
        eng.export(*args[:3], token=args[3])
    assert (t.refcount.tolist(), t.epochs.tolist(), t.num_live(), side.native) == before
    assert got.value.args[0].split(":")[0] in ("request_id", "block_ids", "token"), got.value


@pytest.mark.parametrize("fast", [True, False])
def test_a_refused_export_leaves_no_gate_and_a_live_ones_gate_stays(fast):
    side = Side(fast)
    try:
        eng, order = side.eng, side.eng._rt.order
        with pytest.raises(ValueError, match="block_ids"):
            eng.export("r0", [NUM_BLOCKS], 1, Ready(False))
        assert not order.gated("r0")
        eng.export("r1", [3], 1, Ready(False))
        assert side.native == int(fast) and order.not_ready(["r1"], count=False) == ["r1"]
        with pytest.raises(ValueError, match="already exported"):
            eng.export("r1", [4], 1, Ready(True))  # refused: its (completed) compute is not r1's
        assert order.not_ready(["r1"], count=False) == ["r1"]  # r1 still waits for its own compute
    finally:
        side.close()


def test_the_native_call_refuses_bad_arguments_by_name():
    book = idops.native().ExportBook(np.zeros(8, np.int32), np.zeros(8, np.int64), 4, 4)
    call = (np.frombuffer, np.dtype(np.int64))
    with pytest.raises(TypeError, match=r"ExportBook\.export"):
        book.export("r", [1], 1, 4, 1.0, b"k", None, True)
    with pytest.raises(ValueError, match="need 0"):
        book.export("r", [1], 0, 4, 1.0, b"k", None, True, *call)
    assert book.export("r", [1], 1, 4, 1.0, b"", None, True, *call) is None  # a key the token refuses
    assert not book.live
    tok, ids, exact = book.export("r", [1], 1, 4, 1.0, b"k", None, True, *call)
    assert exact and ids.tolist() == [1] and len(tok) == 48 and list(book.live) == ["r"]


def test_gates_a_refused_export_set_never_drop_a_live_exports_compute():
    from kvxfer.ordering import StreamOrder

    order = StreamOrder(torch.device("cpu"))
    own, late = Ready(False), Ready(True)
    assert order.mark("r", own)[0]  # the live export's gate
    gated, undo = order.mark("r", late)  # a refused re-export's, while a grant looks
    assert gated and order.not_ready(["r"], count=False) == ["r"]  # still the live one's compute
    order.restore("r", undo)
    assert order.not_ready(["r"], count=False) == ["r"] and order._pending["r"] == [own]
    # two exports of one id at once: the refused one's undo leaves the other's gate
    _, a = order.mark("x", Ready(False))
    _, b = order.mark("x", Ready(False))
    order.restore("x", a)
    assert "x" in order._pending and len(order._pending["x"]) == 2
    order.restore("x", b)
    assert order._pending["x"] == a[0]  # back to the first call's
    order.restore("x", a)
    assert "x" not in order._pending
    # nothing written (no events): nothing to undo
    assert order.mark("y", None) == (False, None)
    order.restore("y", None)
