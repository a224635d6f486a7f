"""Tier 1: the vLLM connector's worker setting up its engine (vLLM not installed): the ports a
consumer and a producer bind (one in use named, also as early as vLLM first loads the connector
class), the engine's threads not bound to the worker's pinned core, and
``kv_connector_extra_config`` reaching the engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from kvxfer import TransferEngine
from kvxfer.ports import free_port_base
from kvxfer.vllm.config import ConnectorConfig
from kvxfer.vllm.worker import WorkerSide

from .vllm_adapter_servers import _KINDS, HD, HEADS
from .vllm_fakes import vllm_config


def test_ports_consumer_free_and_producer_in_use_named(caplog):
    """A kv_consumer binds free ports (TP 2: two consumers on one host need no kv_port); an
    exporting server whose port is taken fails naming the port and the fix."""
    import socket

    make, backend, _, bs = _KINDS["fa16"]
    workers = []
    try:
        for _ in range(2):
            cfg = ConnectorConfig.from_vllm(vllm_config(role="kv_consumer", tp=2, block_size=bs, port=14579))
            for r in range(2):
                w = WorkerSide(cfg, r)
                w.register(
                    {"l0": make(4, 2)}, backend=backend, head_size=HD, total_kv_heads=HEADS, use_mla=False
                )
                workers.append(w)
        assert len({w.engine.port + w.tp_rank for w in workers}) == 4
        base = free_port_base(1)
        with socket.socket() as held:
            held.bind(("127.0.0.1", base))
            held.listen()
            cfg = ConnectorConfig.from_vllm(vllm_config(role="kv_producer", block_size=bs, port=base))
            w = WorkerSide(cfg, 0)
            with pytest.raises(RuntimeError, match=f"side-channel port {base} on 127.0.0.1 is in use") as ei:
                w.register(
                    {"l0": make(4, 4)}, backend=backend, head_size=HD, total_kv_heads=HEADS, use_mla=False
                )
            assert "another kv_port" in str(ei.value)
    finally:
        for w in workers:
            w.close()


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs CPU affinity calls and two CPUs",
)
def test_engine_threads_are_not_bound_to_the_workers_pinned_core():
    """vLLM's CPU worker binds its main thread to one core (GOMP_CPU_AFFINITY), the same core for
    every server on a host; the engine's threads, started from that thread, would inherit it and
    stall behind busy-waiting workers. They run on every CPU of the process; the calling thread
    keeps its binding."""
    make, backend, _, bs = _KINDS["fa16"]
    wide = os.sched_getaffinity(0)
    pinned = {min(wide)}
    out: dict = {}

    def as_vllm_worker():  # a thread of its own: pytest's thread keeps its affinity
        os.sched_setaffinity(0, pinned)
        cfg = ConnectorConfig.from_vllm(
            vllm_config(role="kv_producer", block_size=bs, port=free_port_base(1))
        )
        w = WorkerSide(cfg, 0)
        try:
            w.register({"l0": make(4, 4)}, backend=backend, head_size=HD, total_kv_heads=HEADS, use_mla=False)
            out["caller"] = os.sched_getaffinity(0)
            prefix = f"kvxfer-server-{cfg.engine_id}-"
            out["engine"] = [
                os.sched_getaffinity(t.native_id) for t in threading.enumerate() if t.name.startswith(prefix)
            ]
        finally:
            w.close()

    t = threading.Thread(target=as_vllm_worker)
    t.start()
    t.join(60)
    assert out["caller"] == pinned
    assert out["engine"] and all(a == wide for a in out["engine"]), (out, wide)


def test_extra_config_reaches_the_engine():
    """``max_sms``, ``onesided`` and ``transport`` in kv_connector_extra_config are what the
    worker's engine is built with (the only way a vLLM deployment sets the SM budget)."""
    make, backend, _, bs = _KINDS["fa16"]
    seen: dict = {}

    def factory(*a, **kw):
        seen.update(kw)
        return TransferEngine(*a, **kw)

    for extra, want in (
        ({}, (None, True, "auto")),
        ({"max_sms": 12, "onesided": False, "transport": "pg"}, (12, False, "pg")),
    ):
        cfg = ConnectorConfig.from_vllm(
            vllm_config(
                role="kv_producer",
                block_size=bs,
                port=free_port_base(1),
                extra={"host": "127.0.0.1", **extra},
            )
        )
        assert (cfg.max_sms, cfg.onesided, cfg.transport) == want
        w = WorkerSide(cfg, 0, engine_factory=factory)
        try:
            w.register({"l0": make(4, 4)}, backend=backend, head_size=HD, total_kv_heads=HEADS, use_mla=False)
            assert (seen["max_sms"], seen["onesided"], seen["transport"]) == want
            assert w.engine.stats()["onesided"].get("off", False) is (not want[1])
        finally:
            w.close()


def test_port_in_use_is_named_when_vllm_first_loads_the_connector_class():
    """An exporting server's kv_port in use is reported when vLLM's config checks load the
    connector class in the API server process (KVConnectorFactory.get_connector_class), before
    any model loads, not when the worker binds after loading it. Main process only, once, and
    only before it started a child (the engine core); a consumer, or a free port, passes."""
    code = (
        "import importlib, json, socket\n"
        "held = socket.socket()\n"
        "held.bind(('127.0.0.1', 0))\n"
        "held.listen()\n"
        "class KVC:\n"
        "    kv_role = 'kv_producer'\n"
        "    kv_port = held.getsockname()[1]\n"
        "    kv_connector_extra_config = {'host': '127.0.0.1'}\n"
        "def get_connector_class(kv_transfer_config):  # vLLM's call, as far as the frame goes\n"
        "    return getattr(importlib.import_module(kv_transfer_config.path), 'KvxferConnector')\n"
        "out = {'port': KVC.kv_port}\n"
        "for role, path in (('kv_consumer', 'kvxfer.vllm'), ('kv_producer', 'kvxfer.vllm')):\n"
        "    KVC.kv_role, KVC.path = role, path\n"
        "    try:\n"
        "        get_connector_class(KVC())\n"
        "        out[role] = 'no error'\n"
        "    except Exception as e:\n"
        "        out[role] = f'{type(e).__name__}: {e}'\n"
        "    import kvxfer.vllm\n"
        "    kvxfer.vllm._ports_checked = False\n"
        "import multiprocessing, time\n"
        "child = multiprocessing.get_context('spawn').Process(target=time.sleep, args=(30,))\n"
        "child.start()  # the engine core started: its worker may hold the port by now\n"
        "try:\n"
        "    get_connector_class(KVC())\n"
        "    out['after_engine_start'] = 'no error'\n"
        "except Exception as e:\n"
        "    out['after_engine_start'] = f'{type(e).__name__}: {e}'\n"
        "child.kill()\n"
        "print(json.dumps(out))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert not out["kv_consumer"].startswith("RuntimeError"), out  # a consumer binds no kv_port
    want = f"RuntimeError: kvxfer connector: side-channel port {out['port']} on 127.0.0.1 is in use"
    assert out["kv_producer"].startswith(want) and "another kv_port" in out["kv_producer"], out
    # a first lookup after the server started its engine core (vLLM's stat logger) is not the
    # early check: the port may be this server's own worker's
    assert not out["after_engine_start"].startswith("RuntimeError"), out
