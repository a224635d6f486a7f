"""Tier 1: the vLLM connector without vLLM installed: its import (and the clear error where vLLM
is needed), and ``ConnectorConfig`` read from vLLM's config: ports, data parallelism,
``kv_connector_extra_config``, the advertised host, and every setting refused by name."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvxfer.vllm.config import ConnectorConfig, default_host

from .vllm_fakes import vllm_config

# ----------------------------------------------------------------------------- import


def test_import_without_vllm_and_clear_error():
    code = (
        "import sys, json\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'vllm' or name.startswith('vllm.'):\n"
        "            raise ModuleNotFoundError(f\"No module named '{name}'\")\n"
        "sys.meta_path.insert(0, Block())\n"
        "import kvxfer.vllm\n"
        "from kvxfer.vllm import scheduler, worker, layout, config\n"
        "err = ''\n"
        "try:\n"
        "    kvxfer.vllm.KvxferConnector\n"
        "except ImportError as e:\n"
        "    err = str(e)\n"
        "print(json.dumps({'err': err, 'registered': kvxfer.vllm.register(),"
        " 'vllm': any(m.startswith('vllm') for m in sys.modules)}))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "needs vLLM" in out["err"] and "pip install" in out["err"], out
    assert out["registered"] is False and out["vllm"] is False


# ----------------------------------------------------------------------------- config


def test_config_from_vllm_ports_dp_and_extra():
    c = ConnectorConfig.from_vllm(
        vllm_config(
            tp=2,
            port=20000,
            dp_rank=3,
            dp_size=4,
            extra={"lease_s": 5, "transport": "pg", "host": "192.0.2.3"},
        )
    )
    assert (c.engine_id, c.base_port, c.tp_size, c.lease_s, c.transport) == ("E-dp3", 20006, 2, 5.0, "pg")
    assert c.host == "192.0.2.3"  # the advertised host comes from kv_connector_extra_config
    assert c.exports and c.loads
    consumer = ConnectorConfig.from_vllm(vllm_config(role="kv_consumer", tp=2))
    assert not consumer.exports and consumer.base_port == 0  # free ports: nobody dials a consumer


def test_config_default_host(monkeypatch, caplog):
    from kvxfer.vllm import config as cfgmod

    extra_free = vllm_config()
    del extra_free.kv_transfer_config.kv_connector_extra_config["host"]
    monkeypatch.setenv("VLLM_HOST_IP", "192.0.2.7")
    assert ConnectorConfig.from_vllm(extra_free).host == "192.0.2.7"
    monkeypatch.delenv("VLLM_HOST_IP")
    monkeypatch.setattr(cfgmod.socket, "gethostbyname", lambda name: "198.51.100.4")
    assert default_host() == "198.51.100.4"
    monkeypatch.setattr(cfgmod.socket, "gethostbyname", lambda name: "127.0.1.1")
    with caplog.at_level("WARNING"):
        assert default_host() == "127.0.0.1"
    assert "advertising 127.0.0.1" in caplog.text and "kv_connector_extra_config.host" in caplog.text
    consumer = vllm_config(role="kv_consumer")
    del consumer.kv_transfer_config.kv_connector_extra_config["host"]
    assert ConnectorConfig.from_vllm(consumer).host == "127.0.0.1"  # bound only, never advertised


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"pp": 2}, "pipeline_parallel_size"),
        ({"dcp": 2}, "decode_context_parallel_size"),
        ({"role": "kv_sender"}, "kv_role"),
        ({"port": 65535, "tp": 2}, "kv_port"),
        ({"extra": {"transport": "rdma"}}, "transport"),
        ({"extra": {"lease_s": 0}}, "lease_s"),
        ({"extra": {"reuse_min_gain": 0.5}}, "reuse_min_gain"),
        ({"extra": {"host": ""}}, "kv_connector_extra_config.host"),
        ({"extra": {"max_sms": 0}}, "kv_connector_extra_config.max_sms"),
        ({"extra": {"max_sms": 8.5}}, "kv_connector_extra_config.max_sms"),
        ({"extra": {"onesided": "yes"}}, "kv_connector_extra_config.onesided"),
    ],
)
def test_config_rejects_naming_the_setting(kw, needle):
    with pytest.raises(ValueError, match=needle):
        ConnectorConfig.from_vllm(vllm_config(**kw))
