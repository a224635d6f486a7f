"""Choosing the nixl transport (no NIXL needed): explicit nixl fails by name, auto picks it only
across hosts when both sides offer it, and an engine without NIXL says so at construction."""

from __future__ import annotations

import pytest
import torch

from kvxfer import KVCacheSpec, KVTransferParams, TransferEngine
from kvxfer import control as C
from kvxfer.transports import choice, offered
from kvxfer.transports.nixl import availability as nixl_mod

SPEC = KVCacheSpec(2, 2, 16, 8, torch.float16)
CPU = torch.device("cpu")
INFO = {"host_id": "h", "gpu_uuid": None}


def _reply(rank=0, hostname="h", transports=("ipc", "pg", "nixl"), ipc=None, nixl=None):
    return C.HelloReply(
        engine_id="P",
        tp_rank=rank,
        tp_size=1,
        spec=SPEC.to_dict(),
        compat="",
        transports=list(transports),
        hostname=hostname,
        num_blocks=8,
        ipc=ipc,
        pg={"staging_bytes": 1},
        nixl=nixl,
    )


SHM = {"mapper": "shm", "caches": {}, "epochs": "x", "num_blocks": 8, "info": INFO, "why": ""}
ENTRY = {"agent": "kvxfer/P/0/abc", "md": b"x"}


def test_explicit_nixl_needs_both_sides():
    assert choice.choose("nixl", CPU, INFO, "h", [_reply(nixl=ENTRY)], local_nixl="") == (
        "nixl",
        "nixl: requested",
    )
    cases = [
        ([_reply(nixl=None)], "", "exporter rank 0: no NIXL entry in its handshake"),
        ([_reply(nixl={"why": "UCX failed (simulated)"})], "", "exporter rank 0: UCX failed (simulated)"),
        ([_reply(transports=["pg"], nixl=ENTRY)], "", "exporter rank 0 does not offer nixl"),
        ([_reply(nixl=ENTRY), _reply(1, nixl=None)], "", "exporter rank 1"),
        ([_reply(nixl=ENTRY)], "NIXL is not installed", "this loader cannot: NIXL is not installed"),
    ]
    for replies, local, needle in cases:
        with pytest.raises(ValueError, match=r"^transport 'nixl' was asked for but cannot be used: ") as e:
            choice.choose("nixl", CPU, INFO, "h", replies, local_nixl=local)
        assert needle in str(e.value)


def test_auto_picks_nixl_only_across_hosts():
    # one host, ipc works: ipc, whatever NIXL offers
    t, why = choice.choose("auto", CPU, INFO, "h", [_reply(ipc=SHM, nixl=ENTRY)], local_nixl="")
    assert (t, why) == ("ipc", "ipc: shared memory on one host")
    # one host, ipc impossible: pg (never nixl on one host)
    t, why = choice.choose("auto", CPU, INFO, "h", [_reply(ipc=None, nixl=ENTRY)], local_nixl="")
    assert t == "pg" and why.startswith("pg: ipc cannot be used")
    # across hosts with NIXL on both sides: nixl, saying why
    t, why = choice.choose(
        "auto", CPU, INFO, "h", [_reply(hostname="other", ipc=SHM, nixl=ENTRY)], local_nixl=""
    )
    assert t == "nixl" and why == "nixl: ipc cannot be used: not on one host; both sides offer NIXL (UCX)"
    # across hosts, NIXL missing on either side: pg
    for local, entry in (("NIXL is not installed", ENTRY), ("", None)):
        t, why = choice.choose(
            "auto", CPU, INFO, "h", [_reply(hostname="other", nixl=entry)], local_nixl=local
        )
        assert t == "pg" and "not on one host" in why
    # one host, an exporter configured for nixl alone (offers nothing else): nixl, saying so
    t, why = choice.choose("auto", CPU, INFO, "h", [_reply(transports=["nixl"], nixl=ENTRY)], local_nixl="")
    assert t == "nixl" and why.startswith("nixl: the exporter offers no other transport (ipc cannot be used")
    # callers that know nothing of NIXL (default) never get it
    assert choice.choose("auto", CPU, INFO, "h", [_reply(hostname="other", nixl=ENTRY)])[0] == "pg"


@pytest.fixture
def no_nixl(monkeypatch):
    """Hide every NIXL module, as on a machine without kvxfer[nixl]."""
    monkeypatch.setattr(nixl_mod, "_api", None)
    monkeypatch.setattr(nixl_mod, "NIXL_MODULES", ("kvxfer_no_such_nixl._api",))


def test_transport_nixl_without_nixl_is_a_clear_error_at_construction(no_nixl):
    caches = [torch.zeros(SPEC.cache_shape(4, 1), dtype=SPEC.dtype) for _ in range(2)]
    with pytest.raises(nixl_mod.NixlUnavailable, match=r"transport='nixl' needs NIXL: .*kvxfer\[nixl\]"):
        TransferEngine(SPEC, caches, 0, 1, "P", transport="nixl")
    with pytest.raises(ImportError):  # NixlUnavailable is an ImportError
        nixl_mod.load_nixl()
    with pytest.raises(ValueError, match="'auto', 'ipc', 'pg' or 'nixl'"):
        TransferEngine(SPEC, caches, 0, 1, "P", transport="rdma")


def test_auto_engine_without_nixl_does_not_offer_it(no_nixl):
    caches = [torch.zeros(SPEC.cache_shape(4, 1), dtype=SPEC.dtype) for _ in range(2)]
    eng = TransferEngine(SPEC, caches, 0, 1, "P").start()
    try:
        assert "nixl" not in offered(eng._transports) and eng._transports["nixl"].agent is None
        assert "not installed" in eng._transports["nixl"].why
        prm = eng.export("r", [1], 4)
        tok, dg = prm["token"], KVTransferParams.from_dict(prm).digest()
        hello = C.Hello(**eng._rank.identity_fields(), request_id="r", token=tok, transport="nixl", digest=dg)
        rep = eng._exporter.handle(hello)
        assert "not installed" in rep.nixl["why"]  # the loader's choice names why
        with pytest.raises(ValueError, match="exporter rank 0: NIXL is not installed"):
            choice.choose("nixl", CPU, INFO, eng._rank.identity, [rep], local_nixl="")
    finally:
        eng.close()
