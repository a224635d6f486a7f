"""An exporter rank keeps at most ``max_pairs`` nixl pairings: a new one evicts the idle pairing
used least recently (its remote agent removed), is refused by name when every pairing has a
stream queued or running, and a stream to an evicted pairing is refused with the marker a
loader pairs anew on, driven without NIXL (the transport's handlers over a stand-in agent); and,
where NIXL imports, a loader whose pairing was evicted pairs anew once."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from kvxfer import TransferEngine, control
from kvxfer.transports.nixl.agent import nixl_status
from kvxfer.transports.nixl.pairings import MAX_PAIRS, UNKNOWN_NIXL_PAIR, Pairings
from kvxfer.transports.nixl.transport import NixlTransport

from .engine_payload import check, fill, untouched
from .test_nixl import HND32, NHD16, _caches, _wait, ucx  # noqa: F401 (ucx: the fixture)


class FakeAgent:
    """What the handlers use of a NIXL agent: remote agents loaded and removed."""

    def __init__(self) -> None:
        self.remotes: set[str] = set()
        self.loaded: list[str] = []
        self.removed: list[str] = []

    def add_remote(self, md: bytes, expect: str | None = None, user: str = "read") -> str:
        name = md.decode()  # the stand-in metadata is the agent's name
        if expect is not None and name != expect:
            from kvxfer.transports.nixl.agent import NixlError

            raise NixlError(f"NIXL metadata names agent {name!r}, the handshake named {expect!r}")
        assert user == "pair"
        self.remotes.add(name)
        self.loaded.append(name)
        return name

    def remove_remote(self, name: str, user: str = "read") -> None:
        assert user == "pair"
        self.remotes.discard(name)
        self.removed.append(name)


def _transport(max_pairs: int) -> tuple[NixlTransport, FakeAgent]:
    rank = SimpleNamespace(engine_id="P", tp_rank=0, timeout_s=30.0, transport="nixl")
    t = NixlTransport(rank, SimpleNamespace())
    t.agent, t.why = FakeAgent(), ""
    t.peers = Pairings(max_pairs)
    return t, t.agent


def _pair(t: NixlTransport, name: str, md: str | None = None) -> control.SendReply:
    msg = SimpleNamespace(agent=name, md=(md or name).encode(), timeout_s=5.0)
    return t.serve_pair(msg)


def _stream(t: NixlTransport, name: str) -> control.SendReply:
    return t.serve_stream(SimpleNamespace(msg=SimpleNamespace(key=f"{name}#00ff")))


def test_a_pairing_past_the_cap_evicts_the_least_recently_used_idle_one():
    t, agent = _transport(2)
    assert _pair(t, "a").ok and _pair(t, "b").ok
    time.sleep(0.002)
    assert _stream(t, "a").ok  # a streams: used last, and busy
    assert _pair(t, "c").ok  # evicts b (idle, least recently used), not a
    assert agent.removed == ["b"] and agent.remotes == {"a", "c"}
    assert "b" not in t.peers and "a" in t.peers and "c" in t.peers and len(t.peers) == 2
    rep = _stream(t, "b")  # b's loader pairs anew on this refusal
    assert not rep.ok and UNKNOWN_NIXL_PAIR in rep.failed["*"] and "b#00ff" in rep.failed["*"], rep
    assert _pair(t, "b").ok  # evicts c: a is still streaming
    assert agent.removed == ["b", "c"] and agent.remotes == {"a", "b"}
    assert t.peers.busy("a") == 1 and t._jobs.qsize() == 1


def test_a_pairing_is_refused_by_name_when_every_pairing_streams_and_keeps_nothing():
    t, agent = _transport(2)
    for name in ("a", "b"):
        assert _pair(t, name).ok and _stream(t, name).ok
    rep = _pair(t, "c")
    assert not rep.ok and rep.failed["*"].startswith("busy: 2 nixl pairings"), rep
    assert agent.removed == ["c"] and agent.remotes == {"a", "b"} and "c" not in t.peers
    t.peers.done("b")  # b's stream ended: b may go
    assert _pair(t, "c").ok and agent.removed == ["c", "b"] and agent.remotes == {"a", "c"}


def test_pairing_again_refreshes_and_bad_metadata_changes_no_pairing():
    t, agent = _transport(1)
    assert _pair(t, "a").ok and _pair(t, "a").ok  # the same agent: refreshed in place
    assert not agent.removed and len(t.peers) == 1
    rep = _pair(t, "x", md="y")  # metadata naming another agent: refused before any eviction
    assert not rep.ok and "handshake named 'x'" in rep.failed["*"], rep
    assert "x" not in t.peers and "a" in t.peers and not agent.removed
    assert _stream(t, "a").ok
    rep = _pair(t, "a", md="z")  # a failed refresh of a: a stays paired, its stream counted
    assert not rep.ok and "a" in t.peers and t.peers.busy("a") == 1 and agent.remotes == {"a"}


def test_a_forgotten_pairings_queued_streams_keep_it_busy_once_it_pairs_again():
    """The sender forgets a pairing whose loader looked gone while another of its streams is
    queued; the loader pairs again under the same name: the queued stream's count still holds
    it (not evictable), and that stream's end does not free the new pairing's own stream."""
    t, agent = _transport(1)
    assert _pair(t, "a").ok and _stream(t, "a").ok and _stream(t, "a").ok
    t.peers.done("a")  # the first stream failed: its loader looked gone
    assert t.peers.forget("a")
    assert _pair(t, "a").ok and _stream(t, "a").ok  # paired anew, a new stream
    t.peers.done("a")  # the old queued stream ends
    rep = _pair(t, "b")
    assert not rep.ok and rep.failed["*"].startswith("busy: 1 nixl pairings"), rep
    t.peers.done("a")
    assert _pair(t, "b").ok and agent.removed == ["b", "a"]


def test_pairings_count_streams_and_forget():
    p = Pairings(3)
    assert p.add("a", 2.5) == ("", [])
    assert p.timeout_s("a", 30.0) == 2.5 and p.timeout_s("zz", 30.0) == 30.0
    assert not p.start("zz")  # not paired: nothing counted
    assert p.start("a") and p.start("a") and p.busy("a") == 2
    p.done("a")
    p.done("zz")  # a stream of an agent forgotten meanwhile: no effect
    assert p.busy("a") == 1
    assert p.forget("a") and not p.forget("a") and "a" not in p
    assert p.busy("a") == 1 and not p.start("a")  # its queued stream still ends its count
    p.done("a")
    assert p.busy("a") == 0
    for bad in (0, -1, True, 2.0, "3"):
        with pytest.raises(ValueError, match="max_pairs"):
            Pairings(bad)
    assert Pairings().max_pairs == MAX_PAIRS


@pytest.mark.skipif(bool(nixl_status()), reason=f"NIXL not importable here: {nixl_status()}")
@pytest.mark.usefixtures("ucx")
def test_a_loader_whose_pairing_the_exporter_evicted_pairs_anew():
    """P evicts D's staged-read pairing (its cap reached) and removes D's agent: D's next staged
    load is refused its stream, pairs anew once and lands; a pairing that cannot be made again
    fails the load by name, no retry loop."""
    pc, dc = _caches(NHD16), _caches(HND32)
    p = TransferEngine(NHD16, pc, 0, 1, "P", transport="nixl").start()
    d = TransferEngine(HND32, dc, 0, 1, "D", transport="nixl", timeout_s=5.0).start()
    try:
        fill(pc, NHD16, 0, 1, [2, 3], 20, seed=1)
        fill(pc, NHD16, 0, 1, [8, 9], 30, seed=2)
        fill(pc, NHD16, 0, 1, [12, 13], 24, seed=3)
        d.load("a", p.export("a", [2, 3], 20), [4])
        assert _wait(d, {"a"}) == {"a": "done"}
        pt, name = p._transports["nixl"], d._transports["nixl"].agent.name
        assert name in pt.peers
        assert pt.peers.forget(name)  # as an eviction does
        pt.agent.remove_remote(name)
        d.load("b", p.export("b", [8, 9], 30), [6])
        assert _wait(d, {"b"}) == {"b": "done"}
        assert check(dc, HND32, 0, 1, [6], 30, seed=2) and check(dc, HND32, 0, 1, [4], 20, seed=1)
        assert name in pt.peers  # paired anew
        full = Pairings(1)  # D forgotten again, and its one place held by a loader streaming
        assert full.add("other", 5.0) == ("", []) and full.start("other")
        pt.peers = full
        pt.agent.remove_remote(name)
        d.load("c", p.export("c", [12, 13], 24), [7])
        got = _wait(d, {"c"})
        assert got["c"].startswith("failed:") and "busy: 1 nixl pairings" in got["c"], got
        assert untouched(dc, HND32, {4, 6}, {4: 20, 6: 30})
    finally:
        d.close()
        p.close()


@pytest.mark.skipif(bool(nixl_status()), reason=f"NIXL not importable here: {nixl_status()}")
@pytest.mark.usefixtures("ucx")
def test_evicting_a_pairing_keeps_the_agent_this_rank_reads_from():
    """A and B load from each other (staged both ways): B's agent holds A's agent for B's own
    loads and for A's pairing. B evicting A's pairing drops only the pairing's use: B's next
    load from A still reads A's agent."""
    ac, bc = _caches(NHD16), _caches(HND32)
    a = TransferEngine(NHD16, ac, 0, 1, "A", transport="nixl", timeout_s=5.0).start()
    b = TransferEngine(HND32, bc, 0, 1, "B", transport="nixl", timeout_s=5.0).start()
    try:
        fill(bc, HND32, 0, 1, [2], 20, seed=1)
        a.load("x", b.export("x", [2], 20), [4, 5])
        assert _wait(a, {"x"}) == {"x": "done"}
        fill(ac, NHD16, 0, 1, [6, 7], 20, seed=2)
        b.load("y", a.export("y", [6, 7], 20), [3])
        assert _wait(b, {"y"}) == {"y": "done"}
        bt, name = b._transports["nixl"], a._transports["nixl"].agent.name
        assert bt.agent._remotes[name] == {"pair", "read"}
        assert bt.peers.forget(name)  # as an eviction does
        bt.agent.remove_remote(name, "pair")
        assert bt.agent._remotes[name] == {"read"}
        fill(ac, NHD16, 0, 1, [8, 9], 20, seed=3)
        b.load("z", a.export("z", [8, 9], 20), [5])
        assert _wait(b, {"z"}) == {"z": "done"}
        assert check(bc, HND32, 0, 1, [5], 20, seed=3) and check(bc, HND32, 0, 1, [3], 20, seed=2)
        assert check(ac, NHD16, 0, 1, [4, 5], 20, seed=1)
    finally:
        b.close()
        a.close()
