"""NVTX ranges: names, nesting, exceptions, disabled paths (a fake nvtx module records calls)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
import timeit
import types

import pytest

from kvxfer import tracing


class FakeNvtx:
    def __init__(self):
        self.calls = []

    def push_range(self, message=None, color=None, domain=None):
        self.calls.append(("push", message, color, domain))

    def pop_range(self, domain=None):
        self.calls.append(("pop", domain))


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.delenv("KVXFER_NVTX", raising=False)
    saved = dict(tracing._state)
    f = FakeNvtx()
    tracing.set_enabled(True, nvtx_module=f)
    yield f
    tracing._state.update(saved)


def test_ranges_named_by_phase_and_request(fake):
    with tracing.trace("handshake", "engine-P"), tracing.trace("gather", "req-7"):
        pass
    with tracing.trace("copy"):
        pass
    assert fake.calls == [
        ("push", "kvxfer.handshake engine-P", "purple", "kvxfer"),
        ("push", "kvxfer.gather req-7", "green", "kvxfer"),
        ("pop", "kvxfer"),
        ("pop", "kvxfer"),
        ("push", "kvxfer.copy", "red", "kvxfer"),
        ("pop", "kvxfer"),
    ]


def test_range_popped_on_exception(fake):
    with pytest.raises(KeyError), tracing.trace("scatter", "r1"):
        raise KeyError("boom")
    assert fake.calls == [("push", "kvxfer.scatter r1", "orange", "kvxfer"), ("pop", "kvxfer")]


def test_decorator_takes_request_id(fake):
    @tracing.traced("send")
    def send(request_id, nbytes):
        return nbytes * 2

    @tracing.traced("recv", request_id_arg="rid")
    def recv(buf, rid=None):
        return buf

    assert send("req-1", 3) == 6
    assert recv(5, rid="req-2") == 5
    assert send(request_id="req-3", nbytes=1) == 2
    assert [c[1] for c in fake.calls if c[0] == "push"] == [
        "kvxfer.send req-1",
        "kvxfer.recv req-2",
        "kvxfer.send req-3",
    ]
    assert send.__name__ == "send"


def test_disabled_is_noop_and_shared(fake):
    tracing.set_enabled(False)
    assert not tracing.enabled()
    a, b = tracing.trace("gather", "x"), tracing.trace("send", "y")
    assert a is b  # one shared null context: no allocation per call
    with a:
        pass

    @tracing.traced("copy")
    def f(request_id):
        return 1

    assert f("r") == 1
    assert fake.calls == []
    tracing.set_enabled(True)
    with tracing.trace("gather", "z"):
        pass
    assert len(fake.calls) == 2


def test_env_var_disables(fake, monkeypatch):
    monkeypatch.setenv("KVXFER_NVTX", "0")
    tracing.set_enabled(None)
    assert not tracing.enabled()
    with tracing.trace("copy", "r"):
        pass
    assert fake.calls == []


def test_bad_phase_rejected_even_when_disabled(fake):
    with pytest.raises(ValueError, match="phase"):
        tracing.trace("gahter", "r")
    tracing.set_enabled(False)
    with pytest.raises(ValueError, match="phase"):
        tracing.trace("bogus")
    with pytest.raises(ValueError, match="phase"):
        tracing.traced("nope")


def test_real_nvtx_package_without_profiler():
    """The installed nvtx package with no tool attached (no Nsight here): nvtx hands out its
    no-op domain, so tracing is off and says why; ranges are the shared no-op."""
    pytest.importorskip("nvtx", reason="the nvtx package is an optional dependency")
    code = (
        "import os; os.environ.pop('NVTX_INJECTION64_PATH', None)\n"
        "from kvxfer import tracing\n"
        "assert not tracing.enabled(), tracing.status()\n"
        "assert 'no NVTX tool attached' in tracing.status(), tracing.status()\n"
        "assert tracing.trace('gather', 'req-1') is tracing.trace('send', 'req-2')\n"
        "with tracing.trace('gather', 'req-1'):\n"
        "    with tracing.trace('send', 'req-1'): pass\n"
        "import sys; print('nvtx' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("NVTX_INJECTION")}
    env.pop("KVXFER_NVTX", None)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=".", env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


class DummyDomain:
    """What the nvtx package's ``get_domain`` returns when no tool is attached (its class name)."""


class FakeDomain:
    """A live domain of the nvtx package: attributes made once per range, push and pop on it."""

    def __init__(self, calls):
        self.calls = calls

    def get_event_attributes(self, message=None, color=None):
        return (message, color)

    def push_range(self, attributes=None):
        self.calls.append(("push", *attributes))

    def pop_range(self):
        self.calls.append(("pop",))


def _package(domain_for) -> types.SimpleNamespace:
    asked = []

    def get_domain(name):
        asked.append(name)
        return domain_for(name)

    return types.SimpleNamespace(get_domain=get_domain, asked=asked)


def test_ranges_go_to_the_domain_object_when_a_tool_listens(monkeypatch):
    monkeypatch.delenv("KVXFER_NVTX", raising=False)
    saved = dict(tracing._state)
    calls: list = []
    pkg = _package(lambda name: FakeDomain(calls))
    try:
        tracing.set_enabled(True, nvtx_module=pkg)
        assert tracing.enabled() and tracing.status().startswith("on: NVTX domain 'kvxfer'")
        with tracing.trace("grant", "r1"), tracing.trace("copy", "r1"):
            pass
        assert calls == [
            ("push", "kvxfer.grant r1", "yellow"),
            ("push", "kvxfer.copy r1", "red"),
            ("pop",),
            ("pop",),
        ]
        assert pkg.asked == ["kvxfer"]  # the domain is looked up once, not per range
    finally:
        tracing._state.update(saved)


def test_no_tool_attached_turns_tracing_off_with_the_reason(monkeypatch):
    monkeypatch.delenv("KVXFER_NVTX", raising=False)
    saved = dict(tracing._state)
    pkg = _package(lambda name: DummyDomain())
    try:
        tracing.set_enabled(True, nvtx_module=pkg)
        assert not tracing.enabled()
        assert "no NVTX tool attached" in tracing.status()
        assert tracing.trace("copy", "r") is tracing.trace("grant", "r")
        tracing.set_enabled(False)
        assert tracing.status() == "off: set_enabled(False)"
        monkeypatch.setenv("KVXFER_NVTX", "0")
        tracing.set_enabled(None)
        assert tracing.status() == "off: KVXFER_NVTX=0"
    finally:
        tracing._state.update(saved)


def test_import_kvxfer_does_not_import_nvtx():
    code = "import sys, kvxfer, kvxfer.tracing; print('nvtx' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=".")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_disabled_cost_is_small(fake):
    """Informational bound only (not a timing assertion on speed): disabled trace() is a few
    attribute lookups; we check it stays within 50x of an empty function call."""
    tracing.set_enabled(False)
    n = 20000
    t_trace = timeit.timeit(lambda: tracing.trace("gather", "r"), number=n)
    t_empty = timeit.timeit(lambda: None, number=n)
    assert t_trace < 50 * t_empty + 0.05


def test_batch_tag_names_a_batch_from_a_list_or_a_dict_of_its_ids():
    from kvxfer.tracing import batch_tag

    assert batch_tag([]) == "" and batch_tag({}) == ""
    assert batch_tag(["r1"]) == "r1" and batch_tag({"r1": 0}) == "r1"
    assert batch_tag(["r1", "r2", "r3"]) == "r1+2" and batch_tag(dict.fromkeys(["r1", "r2", "r3"])) == "r1+2"


class ThreadedFakeNvtx:
    """Records pushes and pops with the pushing thread (NVTX range stacks are per thread)."""

    def __init__(self):
        self.calls = []

    def push_range(self, message=None, color=None, domain=None):
        self.calls.append(("push", threading.get_ident(), message))

    def pop_range(self, domain=None):
        self.calls.append(("pop", threading.get_ident(), None))


def test_a_range_name_function_runs_only_when_a_range_is_made(fake):
    made = []

    def make(x):
        made.append(x)
        return f"tag-{x}"

    tracing.set_enabled(False)
    with tracing.trace("load", make, 1):
        pass
    assert made == [] and fake.calls == []
    tracing.set_enabled(True)
    with tracing.trace("load", make, 2):
        pass
    assert made == [2] and fake.calls[0][1] == "kvxfer.load tag-2"
    assert tracing.items_tag([types.SimpleNamespace(request_id=r) for r in ("a", "b")]) == "a+1"


@contextlib.contextmanager
def _traced_pair(monkeypatch, transport: str, onesided: bool = False):
    """P and D engines (``transport``) with ranges recorded by a threaded stand-in nvtx:
    yields (p, d, recorder); both closed and tracing restored after."""
    import torch

    from kvxfer import KVCacheSpec, TransferEngine
    from kvxfer.transports.ipc.shm import alloc_shm_caches

    monkeypatch.delenv("KVXFER_NVTX", raising=False)
    saved = dict(tracing._state)
    rec = ThreadedFakeNvtx()
    tracing.set_enabled(True, nvtx_module=rec)
    spec = KVCacheSpec(2, 2, 16, 8, torch.float16)
    src, dst = alloc_shm_caches(spec, 8, 1, fill=3), alloc_shm_caches(spec, 8, 1, fill=0)
    p = TransferEngine(spec, src.caches, 0, 1, "P", transport=transport, lease_s=30).start()
    d = TransferEngine(
        spec, dst.caches, 0, 1, "D", transport=transport, lease_s=30, onesided=onesided
    ).start()
    try:
        yield p, d, rec
    finally:
        d.close()
        p.close()
        src.close()
        dst.close()
        tracing._state.update(saved)


def _land(p, d, rid: str, src_ids: list[int], dst_ids: list[int]) -> None:
    """Export ``rid`` on P, load it on D, and poll both until it landed and P freed it."""
    d.load(rid, p.export(rid, src_ids, 12), dst_ids)
    end = time.monotonic() + 20
    done = sent = False
    while not (done and sent) and time.monotonic() < end:
        done = done or rid in d.poll().finished_recving
        sent = sent or rid in p.poll().finished_sending
        time.sleep(0.002)
    assert done and sent, rid


@pytest.mark.parametrize("transport", ["ipc", "pg"])
def test_one_load_shows_its_whole_path_as_ranges(monkeypatch, transport):
    """What an Nsight user sees of one request: on D's worker the load with its grant round trip
    and its copy (or recv and scatter), the notifier's round trip, and on P the messages served;
    every range is closed on the thread that opened it."""
    with _traced_pair(monkeypatch, transport) as (p, d, rec):
        _land(p, d, "req-9", [1, 2], [5, 6])
    names = [m for kind, _, m in rec.calls if kind == "push"]
    want = ["kvxfer.load req-9", "kvxfer.grant req-9", "kvxfer.notify req-9"]
    want += ["kvxfer.serve ReadReq req-9", "kvxfer.serve Notify req-9"]
    want += ["kvxfer.copy req-9"] if transport == "ipc" else ["kvxfer.recv req-9", "kvxfer.scatter req-9"]
    assert set(want) <= set(names), names
    depth: dict[int, int] = {}
    for kind, tid, _ in rec.calls:
        depth[tid] = depth.get(tid, 0) + (1 if kind == "push" else -1)
        assert depth[tid] >= 0, "a range popped on a thread that did not push it"
    assert all(v == 0 for v in depth.values()), depth
    # the grant and the copy are inside the load range of the same (worker) thread
    load_tid = next(t for k, t, m in rec.calls if m == "kvxfer.load req-9")
    assert next(t for k, t, m in rec.calls if m == "kvxfer.grant req-9") == load_tid


def test_a_one_sided_load_shows_its_copy_as_a_range(monkeypatch):
    """A load read one-sided (launched in the caller's thread) still opens its copy range while
    ranges are made, though it skips the range's context when they are not."""
    with _traced_pair(monkeypatch, "ipc", onesided=True) as (p, d, rec):
        _land(p, d, "first", [1, 2], [5, 6])
        _land(p, d, "second", [3, 4], [6, 7])
        assert d.stats()["onesided"]["loads"] == 1  # the second: the first handshook
    names = [m for kind, _, m in rec.calls if kind == "push"]
    assert "kvxfer.copy second" in names, names


def test_engine_stats_say_whether_ranges_are_made_and_why(fake):
    import torch

    from kvxfer import KVCacheSpec, TransferEngine

    spec = KVCacheSpec(2, 2, 16, 8, torch.float16)
    caches = [torch.zeros(spec.cache_shape(4, 1), dtype=spec.dtype) for _ in range(2)]
    eng = TransferEngine(spec, caches, 0, 1, "S", transport="ipc").start()
    try:
        assert eng.stats()["nvtx"].startswith("on: NVTX domain 'kvxfer'")
        tracing.set_enabled(False)
        assert eng.stats()["nvtx"] == "off: set_enabled(False)"
    finally:
        eng.close()
