"""Exporter notification counts from the plan (heterogeneous TP, MLA, replicated heads),
lease expiry and block epochs, load reports, and the per-engine aggregator."""

import time

import numpy as np
import pytest
import torch

from kvxfer import CompletionAggregator, KVCacheSpec, exports, idops, plan_reads
from kvxfer.auth import UNAUTHORIZED, EngineSecret, content_digest
from kvxfer.completion import LoadTracker, PollResult, native_load_book
from kvxfer.exports import ALTERED, OTHER_EXPORT, RELEASED, UNKNOWN, ExportTracker

GQA = KVCacheSpec(2, 2, 8, 16, torch.float16)


@pytest.fixture(params=["python", "native"])
def load_tracker(request):
    """A new loads tracker: :class:`LoadTracker`, or the control module's ``LoadBook`` (the
    same methods and reports in C, what an engine takes when the module is in use)."""
    if request.param == "python":
        return LoadTracker
    assert idops.ensure(), idops.status()
    return lambda: native_load_book(set(), 0)


MLA = KVCacheSpec(2, 1, 8, 16, torch.float16, use_mla=True)


@pytest.fixture(params=["python", "native"], autouse=True)
def export_book(request, monkeypatch):
    """Every test here on both record keepers of :class:`ExportTracker`: its Python, and the
    control module's ``ExportBook`` (what an engine takes when the module is in use)."""
    if request.param == "python":
        monkeypatch.setattr(exports, "_ctl", lambda: None)
    else:
        assert idops.ensure(), idops.status()
    return request.param


@pytest.mark.parametrize(
    ("spec", "src_tp", "dst_tp"),
    [(GQA, 2, 1), (GQA, 1, 2), (GQA, 1, 4), (GQA, 4, 1), (GQA, 2, 4), (MLA, 2, 1), (MLA, 1, 3), (MLA, 4, 2)],
)
def test_source_frees_exactly_when_all_plan_notifications_arrived(spec, src_tp, dst_tp):
    plan = plan_reads(spec, src_tp, spec, dst_tp)
    trackers = [ExportTracker(8, 30.0) for _ in range(src_tp)]
    for t in trackers:
        t.add("r", torch.tensor([1, 2]), 20)
    released = [False] * src_tp
    for d in range(dst_tp):
        for s in plan.notify_targets(d):
            assert not released[s], f"rank {s} freed before dst rank {d} notified"
            released[s] = trackers[s].notify("r", ("D", d), plan.expected_notifications(s))
    assert all(released), "a source rank never freed (waits for a notification that never comes)"
    for t in trackers:
        out = PollResult()
        t.drain(out)
        assert out.finished_sending == {"r"} and t.held_blocks() == 0


def test_duplicate_notification_counts_once():
    t = ExportTracker(8, 30.0)
    t.add("r", torch.tensor([1]), 4)
    assert not t.notify("r", ("D", 0), 2)
    assert not t.notify("r", ("D", 0), 2)
    assert t.notify("r", ("D", 1), 2)


def test_a_notification_claiming_another_loader_layout_does_not_hold_the_export():
    """A token holder's notification as rank 3 of a 4-rank loader (4 expected) arrives first;
    the real 1-rank loader's notification (1 expected) still frees the export, and the mark of
    that same loader rank counts once with it (the key is shared)."""
    t = ExportTracker(8, 30.0)
    t.add("r", torch.tensor([1, 2]), 8)
    t.add("s", torch.tensor([3]), 4)
    assert not t.notify("r", ("D", 3), 4)  # the stranger's claim: one of four
    assert t.notify("r", ("D", 0), 1)  # the loader's own: released
    assert t.held_blocks() == 1 and t.num_live() == 1
    assert not t.notify("s", ("D", 3), 4) and not t.notify("s", ("D", 2), 4)
    assert t.notify_many(["s", "s"], ("D", 0), 1) == 1  # named twice, counted once
    assert t.held_blocks() == 0 and t.num_live() == 0


def test_notify_many_counts_each_request_once_and_frees_shared_blocks_last():
    t = ExportTracker(8, 30.0)
    t.add("a", torch.tensor([1, 2]), 20)
    t.add("b", torch.tensor([2, 3]), 20)  # shares block 2 with a
    t.add("c", torch.tensor([4]), 4)
    assert t.notify_many(["a", "zzz", "c"], ("D", 0), 2) == 0  # each waits for a second rank
    assert t.notify_many(["a", "c"], ("D", 0), 2) == 0  # a retried notification counts once
    assert t.notify_many(["a", "b", "c"], ("D", 1), 2) == 2  # a and c complete; b has one of two
    assert t.epochs[[1, 2, 3, 4]].tolist() == [1, 0, 0, 1]  # 2 is still held by b
    assert t.notify_many(["b"], ("D", 0), 2) == 1
    assert t.epochs[[1, 2, 3, 4]].tolist() == [1, 1, 1, 1] and t.held_blocks() == 0
    out = PollResult()
    t.drain(out)
    assert out.finished_sending == {"a", "b", "c"}


def test_load_tracker_finish_many_reports_each_once_with_its_latency(load_tracker):
    lt = load_tracker()
    lt.add("x", [1], 1.5)
    lt.add("y", [2], 2.5)
    assert lt.finish_many(["y", "zzz", "x", "y"], 10.0) == [7.5, 8.5]  # end - start, each once
    assert lt.finish_many(["x"], 11.0) == [] and not lt.fail("y", "late")
    out = PollResult()
    lt.drain(out)
    assert out.finished_recving == {"x", "y"} and not out.failed


def test_lease_expiry_bumps_epochs_of_unshared_blocks_only():
    t = ExportTracker(8, 0.05)
    t.add("a", torch.tensor([1, 2, 3]), 40)
    t.add("b", torch.tensor([1, 2, 4]), 40)  # n>1 sibling shares blocks 1, 2
    t.heartbeat(["b"])
    ok, bad, masks = t.grant(["a", "b", "zzz"])
    assert set(ok) == {"a", "b"} and bad == {"zzz": UNKNOWN} and masks == {}  # whole exports
    time.sleep(0.01)
    t.lease_s = 10.0
    t.heartbeat(["b"])
    t._live["a"].deadline = 0.0
    assert t.expire() == 1
    assert t.epochs[[1, 2, 3, 4]].tolist() == [0, 0, 1, 0]  # 1, 2 still held by b
    assert t.grant(["a"])[1] == {"a": RELEASED}
    assert t.abort("b") and t.epochs[[1, 2, 4]].tolist() == [1, 1, 1]
    out = PollResult()
    t.drain(out)
    assert out.expired == {"a"} and out.finished_sending == {"b"} and "lease" in out.errors["a"]
    assert t.held_blocks() == 0


def test_export_twice_rejected_and_lease_must_be_positive():
    t = ExportTracker(4, 1.0)
    t.add("r", torch.tensor([0]), 1)
    with pytest.raises(ValueError, match="already exported"):
        t.add("r", torch.tensor([1]), 1)
    with pytest.raises(ValueError, match="lease_s"):
        ExportTracker(4, 0)


def test_load_tracker_drain_merges_into_reports_the_poll_holds(load_tracker):
    """A load's ids are reported as a list whatever they were given as; a drain into a
    PollResult that already holds reports (another part's) adds to them."""
    lt = load_tracker()
    lt.add("a", np.array([3, 4], dtype=np.int64), 1.0)
    lt.add("b", (5,), 2)
    assert lt.pending() == 2
    assert lt.finish_one("a", 4.0) == 3.0 and lt.finish_one("a", 5.0) is None
    assert lt.fail("b", "why") and lt.pending() == 0
    out = PollResult(finished_recving={"z"}, failed={"q": [1]}, errors={"q": "old"})
    lt.drain(out)
    assert out.finished_recving == {"z", "a"}
    assert out.failed == {"q": [1], "b": [5]} and type(out.failed["b"]) is list
    assert out.errors == {"q": "old", "b": "why"}
    lt.drain(out2 := PollResult())
    assert out2.empty()


def test_load_tracker_reports_once(load_tracker):
    lt = load_tracker()
    lt.add("x", [5, 6], 0.0)
    lt.add("y", [7], 0.0)
    with pytest.raises(ValueError, match="already being loaded"):
        lt.add("x", [1], 0.0)
    assert lt.finish("x") and not lt.finish("x") and not lt.fail("x", "late")
    assert lt.fail("y", "boom")
    out = PollResult()
    lt.drain(out)
    assert out.finished_recving == {"x"} and out.failed == {"y": [7]} and out.errors["y"] == "boom"
    out2 = PollResult()
    lt.drain(out2)
    assert out2.empty()


def test_aggregator_waits_for_every_rank_and_reports_once():
    agg = CompletionAggregator(2)
    assert agg.add(0, PollResult(finished_recving={"a", "b"})).empty()
    out = agg.add(1, PollResult(finished_recving={"a"}, failed={"b": [3, 4]}, errors={"b": "lease"}))
    assert out.finished_recving == {"a"} and out.failed == {"b": [3, 4]} and out.errors["b"] == "lease"
    assert agg.add(0, PollResult(finished_sending={"s"})).empty()
    out = agg.add(1, PollResult(expired={"s"}))
    assert out.expired == {"s"} and not out.finished_sending
    assert agg.pending() == 0
    with pytest.raises(ValueError, match="tp_rank"):
        agg.add(2, PollResult())


class _FakeEvent:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


@pytest.mark.parametrize("how", ["notify", "abort", "expire"])
def test_release_is_reported_only_after_inflight_gathers_completed(how):
    """A pg gather of a request's blocks may still be queued on the GPU when its lease ends or
    it is aborted: the epochs move at once (ipc readers see it), but the caller hears that the
    blocks are free only once the gather has run, so it cannot overwrite them first."""
    tr = ExportTracker(16, lease_s=0.05 if how == "expire" else 30.0)
    tr.add("r", np.array([3, 4]), 20)
    ev = _FakeEvent()
    tr.track_gather(["r", "not-exported"], ev)
    before = tr.epochs[[3, 4]].clone()
    if how == "notify":
        assert tr.notify("r", ("D", 0), 1)
    elif how == "abort":
        assert tr.abort("r")
    else:
        time.sleep(0.06)
        assert tr.expire() == 1
    assert bool((tr.epochs[[3, 4]] > before).all())  # released for readers right away
    out = PollResult()
    tr.drain(out)
    assert out.empty() and tr.num_deferred() == 1
    ev.done = True
    out = PollResult()
    tr.drain(out)
    got = out.expired if how == "expire" else out.finished_sending
    assert got == {"r"} and tr.num_deferred() == 0
    if how == "expire":
        assert "lease expired" in out.errors["r"]


def test_completed_gathers_do_not_delay_release():
    tr = ExportTracker(8, lease_s=30.0)
    tr.add("r", np.array([1]), 4)
    ev = _FakeEvent()
    ev.done = True
    tr.track_gather(["r"], ev)
    assert tr.notify("r", ("D", 0), 1)
    out = PollResult()
    tr.drain(out)
    assert out.finished_sending == {"r"}


def test_grant_gives_the_ready_layers_of_layer_wise_exports_only():
    """A grant returns, besides the epochs, the layers a loader may read now: for layer-wise
    exports only (whole ones need no mask), what mark_layers marked and whose events completed."""
    t = ExportTracker(8, 10.0)
    t.add("whole", np.array([1, 2]), 32)
    t.add("lw", np.array([3, 4]), 32, num_layers=4)

    class Ev:
        done = False

        def query(self):
            return self.done

    ev = Ev()
    t.mark_layers("lw", np.array([True, False, False, False]), [])
    t.mark_layers("lw", np.array([False, True, False, False]), [ev])
    ok, bad, masks = t.grant(["whole", "lw", "gone"])
    assert set(ok) == {"whole", "lw"} and bad == {"gone": UNKNOWN} and set(masks) == {"lw"}
    assert masks["lw"].tolist() == [True, False, False, False]  # layer 1's compute still running
    ev.done = True
    assert t.grant(["lw"])[2]["lw"].tolist() == [True, True, False, False]


def test_grant_and_notify_verify_each_token_before_touching_the_request():
    """With tokens, a request whose token does not verify is refused and left alone (no
    renewal, no count): a live export opens with exactly its own token and, on a grant, its
    own content digest (else ALTERED); one not live is told UNKNOWN (or RELEASED) only with a
    token the secret made for it and the digest presented (``verify``); an authentic token of
    another export of a live id is OTHER_EXPORT."""
    secret = EngineSecret("P", 0, 0)
    ids = {"a": [1, 2], "b": [3], "gone": [4], "new": [5]}
    dg = {r: content_digest(10, np.array(v, dtype=np.int64)) for r, v in ids.items()}
    tok = {r: secret.token(r, bytes(8), dg[r]) for r in ids}
    t = ExportTracker(8, 30.0)
    for r in ("a", "b", "gone"):
        t.add(r, np.array(ids[r]), 10, token=tok[r], digest=dg[r])
    assert t.abort("gone")
    t._live["a"].deadline = t._live["b"].deadline = 0.0
    ask = ["a", "b", "new", "gone"]
    forged = [tok["a"], "X" * 48, tok["new"], tok["gone"]]
    digests = [dg["a"], dg["b"], dg["new"], dg["gone"]]
    ok, bad, _ = t.grant(ask, forged, secret.verify, digests)
    assert list(ok) == ["a"] and t._live["a"].deadline > 0  # granted and renewed
    assert bad == {"b": UNAUTHORIZED, "new": UNKNOWN, "gone": RELEASED}
    assert t._live["b"].deadline == 0.0  # a forged token renews nothing
    ok, bad, _ = t.grant(["new", "a"], ["Z" * 48, 7], secret.verify, [dg["new"], dg["a"]])
    assert not ok and bad == {"new": UNAUTHORIZED, "a": UNAUTHORIZED}  # a non-str token too
    ok, bad, _ = t.grant(["a"], [tok["a"]], secret.verify, [dg["b"]])  # a's token, b's blocks
    assert not ok and bad == {"a": ALTERED}
    later = secret.token("a", (1).to_bytes(8, "big"), dg["a"])  # authentic, another export of "a"
    ok, bad, _ = t.grant(["a"], [later], secret.verify, [dg["a"]])
    assert not ok and bad == {"a": OTHER_EXPORT}
    refused: dict = {}
    n = t.notify_many(["a", "b", "new"], ("D", 0), 1, [tok["a"], "X" * 48, "Y" * 48], secret.verify, refused)
    assert n == 1 and refused == {"b": UNAUTHORIZED}  # "new" is not live: nothing to count
    assert "b" in t._live and "a" not in t._live  # b was not counted, a was released


def test_a_released_request_id_exported_again_gets_the_next_generation():
    t = ExportTracker(8, 30.0)
    assert t.generation("r") == 0
    t.add("r", np.array([1]), 4, token="t0", gen=0)
    assert t.generation("r") == 0  # live: its generation is taken only once it is released
    t.abort("r")
    assert t.generation("r") == 1
    with pytest.raises(ValueError, match="already used"):
        t.add("r", np.array([1]), 4, token="t0", gen=1)  # the released export's own token
    t.add("r", np.array([1]), 4, token="t1", gen=1)
    t.abort("r")
    assert t.generation("r") == 2


def test_a_notification_naming_a_request_twice_releases_and_reports_it_once():
    """One notification naming the same request twice (a raw ``["V", "V"]``, or an honest loader
    that loaded the same params under two local ids) counts its sender once: the export is
    released once and reported in finished_sending once, nothing raises, no block stays held."""
    t = ExportTracker(8, 30.0)
    t.add("V", torch.tensor([1, 2]), 20)
    t.add("W", torch.tensor([3]), 4)
    assert t.notify_many(["V", "V", "W", "V"], ("D", 0), 1) == 2
    assert t.notify_many(["V", "V"], ("D", 0), 1) == 0  # already released: nothing more
    out = PollResult()
    t.drain(out)
    assert out.finished_sending == {"V", "W"} and t.held_blocks() == 0 and t.num_live() == 0
    assert t.epochs[[1, 2, 3]].tolist() == [1, 1, 1]  # each block released once
    # a request that needs two ranks: the same rank twice in one message is still one of two
    t.add("X", torch.tensor([4]), 4)
    assert t.notify_many(["X", "X"], ("D", 0), 2) == 0 and t.num_live() == 1
    assert t.notify_many(["X"], ("D", 1), 2) == 1


def test_a_release_of_an_id_no_longer_live_is_skipped_not_raised():
    """Releasing ids one of which is no longer live (released by a racing path) releases the
    others and raises nothing."""
    t = ExportTracker(8, 30.0)
    t.add("a", torch.tensor([1]), 4)
    t.add("b", torch.tensor([2]), 4)
    with t.lock:
        t._release_many(["a", "a", "zzz", "b"])
    assert t.num_live() == 0 and t.held_blocks() == 0
    assert t.epochs[[1, 2]].tolist() == [1, 1]


# the listener's path: the book's own writes to the table cannot fail
@pytest.mark.parametrize("export_book", ["python"], indirect=True)
def test_a_release_completes_and_is_reported_when_its_slot_cannot_be_published(caplog, export_book):
    """The lease slot of an export cannot be closed (publishing to the table raised): the release
    still completes (blocks freed, epochs moved, reported once), and the table is shut so no
    loader reads one-sided from it any more; logged."""
    from kvxfer.transports.ipc.leases import LeaseSlots
    from kvxfer.transports.ipc.slots import H_OPEN, H_READERS, HEADER, SLOT, ExporterSlots

    table = np.zeros(HEADER + 64 * SLOT, dtype=np.int64)
    t = ExportTracker(8, 30.0)
    slots = ExporterSlots(table, "inc")
    LeaseSlots(slots, t, lambda rids: [])  # subscribes itself to the tracker's leases
    table[H_READERS] = 1
    t.add("a", np.array([1, 2]), 20, token="00" * 24, digest=bytes(16))
    assert list(slots.owner.values()) == ["a"]  # "a" has a slot

    def broken(i):
        raise OSError("the table is gone")

    slots.close = broken
    with caplog.at_level("WARNING", logger="kvxfer.transports.ipc.leases"):
        assert t.abort("a")
    out = PollResult()
    t.drain(out)
    assert out.finished_sending == {"a"} and t.held_blocks() == 0 and t.epochs[[1, 2]].tolist() == [1, 1]
    assert table[H_OPEN] == 0 and "could not be closed" in caplog.text


def test_released_ids_are_forgotten_oldest_first_in_batches(monkeypatch):
    """Past ``GONE_KEPT`` released ids the oldest are forgotten, a batch at a time (the newest
    ``GONE_KEPT`` always kept): a forgotten id's next export is generation 0 again."""
    monkeypatch.setattr(exports, "GONE_KEPT", 8)
    monkeypatch.setattr(exports, "GONE_SLACK", 1)  # the book's: GONE_KEPT // 64, at least 1
    t = ExportTracker(8, 30.0)
    sizes = []
    for k in range(30):
        t.add(f"r{k}", np.array([k % 8]), 4)
        assert t.abort(f"r{k}")
        sizes.append(len(t._gone))
    assert max(sizes) == 9 and sizes[-1] in (8, 9)
    assert list(t._gone)[-8:] == [f"r{k}" for k in range(22, 30)]
    assert t.generation("r29") == 1 and t.generation("r0") == 0


class _Clock:
    """Stands for the ``time`` module in :mod:`kvxfer.exports`: a monotonic clock set by hand."""

    def __init__(self) -> None:
        self.t = 1000.0

    def monotonic(self) -> float:
        return self.t


def test_expire_releases_each_lease_when_it_ends_though_it_looks_only_when_one_may_have(monkeypatch):
    """``expire()`` skips its look at the live exports until the earliest lease may have ended.
    Through exports made after a look (also after a look that found none live), a renewal and an
    export released early, each lease ends exactly when it passes: never early, never missed."""
    clock = _Clock()
    monkeypatch.setattr(exports, "time", clock)
    t = ExportTracker(16, 10.0)
    assert t.expire() == 0  # a look with nothing live
    clock.t += 3
    t.add("a", np.array([1]), 8)  # ends at +13
    clock.t += 2
    assert t.expire() == 0
    t.add("b", np.array([2]), 8)  # ends at +15
    t.add("c", np.array([3]), 8)  # released early below
    clock.t += 1
    assert t.abort("c")
    clock.t = 1000 + 12.9
    assert t.expire() == 0 and t.num_live() == 2
    clock.t = 1000 + 13.1
    assert t.expire() == 1 and t.lookup("a") is None and t.lookup("b") is not None
    t.heartbeat(["b"])  # renewed at +13.1: ends at +23.1, not +15
    clock.t = 1000 + 16
    assert t.expire() == 0 and t.lookup("b") is not None
    t.add("d", np.array([4]), 8)  # ends at +26
    clock.t = 1000 + 23.0
    assert t.expire() == 0
    clock.t = 1000 + 23.2
    assert t.expire() == 1 and t.lookup("b") is None and t.lookup("d") is not None
    clock.t = 1000 + 26.1
    assert t.expire() == 1 and t.num_live() == 0
    out = PollResult()
    t.drain(out)
    assert out.expired == {"a", "b", "d"} and out.finished_sending == {"c"}
    assert all("lease expired" in out.errors[r] for r in "abd")
    assert t.epochs[[1, 2, 3, 4]].tolist() == [1, 1, 1, 1] and t.held_blocks() == 0
