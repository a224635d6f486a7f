"""Topology without a GPU (real NVML absent), and with a fake NVML module describing 3 GPUs."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from kvxfer import topology
from kvxfer.topology import Topology, probe, recommend_transport


class FakeNvml:
    """GPU 0 <-NVLink x4-> GPU 1; GPU 2 on PCIe, p2p with 0 only."""

    NVML_P2P_CAPS_INDEX_READ = 0
    NVML_P2P_STATUS_OK = 0
    NVML_NVLINK_MAX_LINKS = 6

    def __init__(self, fail_init=False):
        self.fail_init = fail_init
        self.shutdown = False

    def nvmlInit(self):
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self):
        self.shutdown = True

    def nvmlSystemGetDriverVersion(self):
        return b"570.1"

    def nvmlDeviceGetCount(self):
        return 3

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return "NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-0000000{h}-aaaa"

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=80 * 2**30, free=(70 + h) * 2**30)

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=f"00000000:0{h}:00.0")

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        return 40 if 2 in (a, b) else 10

    def nvmlDeviceGetNvLinkState(self, h, link):
        if h == 2:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return 1 if link < 4 else 0

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        return SimpleNamespace(busId=f"00000000:0{1 - h}:00.0")

    def nvmlDeviceGetP2PStatus(self, a, b, cap):
        return 0 if {a, b} != {1, 2} else 2


def test_no_gpu_reports_reason():
    topo = probe(FakeNvml(fail_init=True))
    assert topo.gpus == [] and "NVML unavailable" in topo.error and "Not Found" in topo.error
    assert topo.format().startswith("kvxfer topology: no GPU (")


def test_real_probe_on_this_machine_never_raises():
    topo = probe()
    assert isinstance(topo, Topology)
    if not topo.gpus:
        assert topo.error


def test_cli_without_gpu_prints_no_gpu():
    out = subprocess.run(
        [sys.executable, "-m", "kvxfer.topology"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    topo = probe()
    if not topo.gpus:
        assert "no GPU" in out.stdout
    js = subprocess.run(
        [sys.executable, "-m", "kvxfer.topology", "--json"], capture_output=True, text=True, timeout=60
    )
    assert js.returncode == 0 and "gpus" in json.loads(js.stdout)


def test_fake_nvml_gpus_and_links(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = FakeNvml()
    topo = probe(nvml)
    assert nvml.shutdown
    assert [g.uuid for g in topo.gpus] == ["GPU-00000000-aaaa", "GPU-00000001-aaaa", "GPU-00000002-aaaa"]
    assert topo.gpus[1].memory_free == 71 * 2**30 and topo.driver_version == "570.1"
    l01, l02, l12 = topo.link(0, 1), topo.link(2, 0), topo.link(1, 2)
    assert (l01.nvlink_count, l01.kind, l01.pcie, l01.p2p) == (4, "nvlink", "single-switch", True)
    assert (l02.nvlink_count, l02.kind, l02.pcie, l02.p2p) == (0, "pcie", "numa", True)
    assert (l12.nvlink_count, l12.p2p) == (0, False)
    text = topo.format()
    assert "GPU 0 <-> GPU 1: NVLink x4" in text and "GPU 1 <-> GPU 2: PCIe (numa), p2p no" in text
    assert json.loads(json.dumps(topo.to_dict()))["gpus"][2]["index"] == 2


def test_cuda_visible_devices_filters(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,GPU-00000000")
    topo = probe(FakeNvml())
    assert [g.index for g in topo.gpus] == [2, 0]
    assert len(topo.links) == 1 and topo.link(0, 2).p2p
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert probe(FakeNvml()).gpus == []
    assert len(probe(FakeNvml(), all_gpus=True).gpus) == 3


@pytest.mark.parametrize(
    "a,b,same_host,transport,reason",
    [
        ("GPU-00000000-aaaa", "GPU-00000000-aaaa", True, "ipc", "same GPU"),
        ("GPU-00000000-aaaa", "GPU-00000001-aaaa", True, "ipc", "NVLink x4 between GPU 0 and GPU 1"),
        ("GPU-00000002-aaaa", "GPU-00000000-aaaa", True, "ipc", "PCIe peer-to-peer (numa)"),
        ("GPU-00000001-aaaa", "GPU-00000002-aaaa", True, "pg", "no peer-to-peer between GPU 1 and GPU 2"),
        ("GPU-00000001-aaaa", "GPU-00000002-aaaa", False, "pg", "different hosts"),
        ("GPU-00000001-aaaa", "GPU-ffffffff", True, "ipc", "link unknown"),
    ],
)
def test_recommend_transport(monkeypatch, a, b, same_host, transport, reason):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    rec = recommend_transport(probe(FakeNvml()), a, b, same_host=same_host)
    assert rec.transport == transport and reason in rec.reason


def test_recommend_without_nvml():
    rec = recommend_transport(probe(FakeNvml(fail_init=True)), "GPU-a", "GPU-b")
    assert rec.transport == "ipc" and "NVML unavailable" in rec.reason


def test_import_does_not_probe():
    """Importing kvxfer.topology calls no NVML function (torch itself may import pynvml)."""
    code = (
        "import sys, types\n"
        "m = types.ModuleType('pynvml')\n"
        "def boom(*a):\n    raise SystemExit('nvmlInit called')\n"
        "m.nvmlInit = boom\n"
        "sys.modules['pynvml'] = m\n"
        "import kvxfer.topology as t\n"
        "print('imported', flush=True)\n"
        "t.probe()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "imported", out.stderr  # import called nothing
    assert "nvmlInit called" in out.stderr  # probe() did
    assert topology.main(["--all"]) == 0
