"""GPU topology through NVML (nvidia-ml-py, imported lazily): GPUs, memory, NVLink/PCIe links.

``python -m kvxfer.topology`` prints it; without a GPU (or without the NVML library) it says
"no GPU" and why, and exits 0.

How the engine plugs it in: probe once at start-up (``topo = probe()``), put
``topo.to_dict()`` in stats, and at handshake pass it to
:func:`kvxfer.transports.ipc.cuda_ipc.choose_transport`, which calls :func:`recommend_transport`
for the two GPUs (identified by UUID, since ``CUDA_VISIBLE_DEVICES`` renumbers devices per
process) once CUDA IPC itself can work.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["GpuInfo", "Link", "Recommendation", "Topology", "main", "probe", "recommend_transport"]


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as NVML sees it (``index`` is NVML's, not CUDA's)."""

    index: int
    name: str
    uuid: str
    memory_total: int
    memory_free: int
    pci_bus_id: str


@dataclass(frozen=True)
class Link:
    """How GPUs ``a`` and ``b`` (NVML indices) connect: ``nvlink_count`` active NVLinks between
    them; ``pcie`` the common PCIe ancestor (``"board"``, ``"single-switch"``,
    ``"multi-switch"``, ``"host-bridge"``, ``"numa"``, ``"system"``, or ``"unknown"``);
    ``p2p`` whether NVML reports peer-to-peer reads as supported."""

    a: int
    b: int
    nvlink_count: int
    pcie: str
    p2p: bool

    @property
    def kind(self) -> str:
        return "nvlink" if self.nvlink_count else "pcie"


@dataclass
class Topology:
    """GPUs and pairwise links; ``error`` says why there are none (no driver, no GPU)."""

    gpus: list[GpuInfo] = field(default_factory=list)
    links: list[Link] = field(default_factory=list)
    driver_version: str | None = None
    error: str | None = None

    def by_uuid(self, gpu_uuid: str) -> GpuInfo | None:
        for g in self.gpus:
            if g.uuid == gpu_uuid or g.uuid.removeprefix("GPU-") == gpu_uuid.removeprefix("GPU-"):
                return g
        return None

    def link(self, a: int, b: int) -> Link | None:
        for lk in self.links:
            if {lk.a, lk.b} == {a, b}:
                return lk
        return None

    def to_dict(self) -> dict:
        return asdict(self)

    def format(self) -> str:
        if not self.gpus:
            return f"kvxfer topology: no GPU ({self.error or 'NVML reports 0 devices'})"
        lines = [f"kvxfer topology: {len(self.gpus)} GPU(s), driver {self.driver_version}"]
        for g in self.gpus:
            lines.append(
                f"  GPU {g.index}: {g.name}  {g.memory_total / 2**30:.1f} GiB "
                f"({g.memory_free / 2**30:.1f} GiB free)  {g.uuid}  pci {g.pci_bus_id}"
            )
        for lk in self.links:
            desc = f"NVLink x{lk.nvlink_count}" if lk.nvlink_count else f"PCIe ({lk.pcie})"
            lines.append(f"  GPU {lk.a} <-> GPU {lk.b}: {desc}, p2p {'yes' if lk.p2p else 'no'}")
        return "\n".join(lines)


_PCIE_LEVELS = {
    0: "board",
    10: "single-switch",
    20: "multi-switch",
    30: "host-bridge",
    40: "numa",
    50: "system",
}


def _visible(gpus: list[GpuInfo], env: str | None) -> list[GpuInfo]:
    """Apply ``CUDA_VISIBLE_DEVICES`` (indices or UUID prefixes) to NVML's list."""
    if env is None:
        return gpus
    out = []
    for tok in (t.strip() for t in env.split(",")):
        if not tok:
            break
        if tok.isdigit():
            match = [g for g in gpus if g.index == int(tok)]
        else:
            match = [g for g in gpus if g.uuid.startswith(tok) or g.uuid.removeprefix("GPU-").startswith(tok)]
        if len(match) != 1:
            break  # CUDA stops at the first invalid entry
        out.append(match[0])
    return out


def _text(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def probe(nvml: Any = None, all_gpus: bool = False) -> Topology:
    """Query NVML. ``nvml`` is the ``pynvml`` module (injectable for tests); ``all_gpus``
    ignores ``CUDA_VISIBLE_DEVICES``. Never raises for a missing driver or GPU: the returned
    :class:`Topology` has no GPUs and ``error`` says why."""
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError as e:
            return Topology(error=f"nvidia-ml-py not installed ({e})")
    try:
        nvml.nvmlInit()
    except Exception as e:
        return Topology(error=f"NVML unavailable: {type(e).__name__}: {e}")
    try:
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        handles, gpus = [], []
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            mem = nvml.nvmlDeviceGetMemoryInfo(h)
            pci = nvml.nvmlDeviceGetPciInfo(h)
            handles.append(h)
            gpus.append(
                GpuInfo(
                    i,
                    _text(nvml.nvmlDeviceGetName(h)),
                    _text(nvml.nvmlDeviceGetUUID(h)),
                    int(mem.total),
                    int(mem.free),
                    _text(pci.busId),
                )
            )
        if not all_gpus:
            gpus = _visible(gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
        links = []
        for x, ga in enumerate(gpus):
            for gb in gpus[x + 1 :]:
                links.append(_link(nvml, handles, ga, gb))
        return Topology(gpus, links, driver, None if gpus else "NVML reports no visible GPU")
    except Exception as e:
        return Topology(error=f"NVML query failed: {type(e).__name__}: {e}")
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def _link(nvml: Any, handles: list, ga: GpuInfo, gb: GpuInfo) -> Link:
    ha, hb = handles[ga.index], handles[gb.index]
    try:
        level = _PCIE_LEVELS.get(int(nvml.nvmlDeviceGetTopologyCommonAncestor(ha, hb)), "unknown")
    except Exception:
        level = "unknown"
    nvlinks = 0
    for ln in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            if not nvml.nvmlDeviceGetNvLinkState(ha, ln):
                continue
            remote = _text(nvml.nvmlDeviceGetNvLinkRemotePciInfo(ha, ln).busId)
        except Exception:
            break
        if remote.lower() == gb.pci_bus_id.lower():
            nvlinks += 1
    try:
        p2p = nvml.nvmlDeviceGetP2PStatus(ha, hb, nvml.NVML_P2P_CAPS_INDEX_READ) == nvml.NVML_P2P_STATUS_OK
    except Exception:
        p2p = nvlinks > 0
    return Link(ga.index, gb.index, nvlinks, level, p2p)


@dataclass(frozen=True)
class Recommendation:
    transport: str  # "ipc" or "pg"
    reason: str


def recommend_transport(topo: Topology, gpu_a: str, gpu_b: str, same_host: bool = True) -> Recommendation:
    """``ipc`` or ``pg`` for two GPUs (UUIDs) by their link, with the reason.

    Same GPU, NVLink, or PCIe with peer-to-peer: ``ipc`` (the loader's kernel reads the peer's
    memory directly). No peer-to-peer between them: ``pg`` (NCCL stages through host memory
    itself; a direct mapping cannot be opened). Different hosts: ``pg``. GPUs NVML does not
    know (no NVML here): ``ipc`` with the link marked unknown, since CUDA IPC checks decided.
    """
    if not same_host:
        return Recommendation("pg", "different hosts: CUDA IPC needs one host")
    if gpu_a == gpu_b:
        return Recommendation("ipc", "same GPU")
    a, b = topo.by_uuid(gpu_a), topo.by_uuid(gpu_b)
    if a is None or b is None:
        return Recommendation("ipc", f"link unknown to NVML ({topo.error or 'GPU not listed'})")
    lk = topo.link(a.index, b.index)
    if lk is None:
        return Recommendation("ipc", "link unknown to NVML")
    if lk.nvlink_count:
        return Recommendation("ipc", f"NVLink x{lk.nvlink_count} between GPU {a.index} and GPU {b.index}")
    if lk.p2p:
        return Recommendation("ipc", f"PCIe peer-to-peer ({lk.pcie}) between GPU {a.index} and GPU {b.index}")
    return Recommendation("pg", f"no peer-to-peer between GPU {a.index} and GPU {b.index} (PCIe {lk.pcie})")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    topo = probe(all_gpus="--all" in argv)
    if "--json" in argv:
        import json

        print(json.dumps(topo.to_dict(), indent=2))
    else:
        print(topo.format())
    return 0


if __name__ == "__main__":
    sys.exit(main())
