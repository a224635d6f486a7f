"""NVTX ranges: names, nesting, exceptions, disabled paths (a fake nvtx module records calls)."""

from __future__ import annotations

import subprocess
import sys
import timeit

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
    """The installed nvtx package works with no profiler attached, in a fresh interpreter."""
    code = (
        "from kvxfer import tracing\n"
        "assert tracing.enabled()\n"
        "with tracing.trace('gather', 'req-1'):\n"
        "    with tracing.trace('send', 'req-1'): pass\n"
        "import sys; print('nvtx' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=".")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


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
    from kvxfer.engine_types import batch_tag

    assert batch_tag([]) == "" and batch_tag({}) == ""
    assert batch_tag(["r1"]) == "r1" and batch_tag({"r1": 0}) == "r1"
    assert batch_tag(["r1", "r2", "r3"]) == "r1+2" and batch_tag(dict.fromkeys(["r1", "r2", "r3"])) == "r1+2"
