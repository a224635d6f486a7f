"""The nixl transport on CUDA caches (marked ``gpu``: skipped without a GPU, and without NIXL):
VRAM registered with NIXL, direct READs into device memory (GPUDirect RDMA where the NIC has
it; UCX's CUDA transports on one host), staged reads through device staging buffers and through
pinned host staging (``pin_memory=True``), byte for byte with everything else untouched."""

from __future__ import annotations

import time

import pytest
import torch

from kvxfer import KVCacheSpec, TransferEngine
from kvxfer.transports.nixl.agent import nixl_status
from kvxfer.transports.pg.pipeline import StagedPipeline

from .engine_payload import check, fill, poison, untouched

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(bool(nixl_status()), reason=f"NIXL not importable here: {nixl_status()}"),
]

NHD16 = KVCacheSpec(4, 8, 128, 16, torch.bfloat16)
HND32 = KVCacheSpec(4, 8, 128, 32, torch.bfloat16, layout="HND")


@pytest.fixture(autouse=True)
def _ucx_env(monkeypatch):
    # UCX picks its transports; its network ones on loopback, as bench_transfer's nixl rows (which
    # moved their bytes on the 2026-11-28 H200 while these tests failed, reason not returned)
    monkeypatch.delenv("UCX_TLS", raising=False)
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")


def _caches(spec, nb=64):
    c = [
        torch.empty(spec.cache_shape(nb, 1), dtype=spec.dtype, device="cuda") for _ in range(spec.num_layers)
    ]
    poison(c)
    return c


def _wait(eng, rid, timeout=30.0) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        r = eng.poll()
        if rid in r.finished_recving:
            return "done"
        if rid in r.failed:
            return "failed: " + r.errors.get(rid, "")
        time.sleep(0.002)
    return "timeout"


@pytest.mark.parametrize(
    ("dst", "pin", "path"),
    [(NHD16, False, "direct"), (HND32, False, "staged"), (HND32, True, "staged")],
    ids=["direct-vram", "staged-device-buffers", "staged-pinned-host"],
)
def test_cuda_caches_over_nixl(dst, pin, path):
    pipe = StagedPipeline(buffer_bytes=4 << 20, pin_memory=pin)
    pc, dc = _caches(NHD16), _caches(dst)
    p = TransferEngine(NHD16, pc, 0, 1, "P", transport="nixl", pipeline=pipe).start()
    d = TransferEngine(dst, dc, 0, 1, "D", transport="nixl", pipeline=pipe).start()
    try:
        src_ids = list(range(3, 3 + NHD16.num_blocks_for(1000)))
        dst_ids = list(range(1, 1 + dst.num_blocks_for(1000)))[::-1]
        fill(pc, NHD16, 0, 1, src_ids, 1000, seed=5)
        d.load("g", p.export("g", src_ids, 1000), dst_ids)
        assert _wait(d, "g") == "done"
        torch.cuda.synchronize()
        assert check(dc, dst, 0, 1, dst_ids, 1000, seed=5)
        assert untouched(
            [c.cpu() for c in dc],
            dst,
            set(dst_ids),
            {dst_ids[-1]: 1000 - (len(dst_ids) - 1) * dst.block_size},
        )
        assert f"rank 0 {path}" in d.stats()["transport_reasons"]["P"]
        assert p._transports["nixl"].entry["mem"] == "VRAM"
    finally:
        d.close()
        p.close()
