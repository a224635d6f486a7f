"""CUDA IPC transport pieces: handle publication, cache keying/invalidation, transport choice.

On CPU a fake driver stands in for CUDA: "allocations" are uint8 CPU tensors and "opening" a
handle returns a tensor aliasing the same memory, so the per-layer rebuild and a real
``copy_blocks`` through the mapped tensors are checked byte for byte.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import multiprocessing as mp
import os
import traceback

import msgspec
import pytest
import torch

from kvxfer import ops
from kvxfer.plan import plan_reads
from kvxfer.spec import KVCacheSpec, Layout
from kvxfer.topology import probe
from kvxfer.transports.ipc import cuda_ipc
from kvxfer.transports.ipc.cuda_ipc import (
    IpcHandleCache,
    choose_transport,
    expandable_segments_enabled,
    ipc_supported,
    local_ipc_info,
    publish_caches,
)
from tests.cache_oracle import bytes_equal, expected_dst, make_cache, poisoned
from tests.test_topology import FakeNvml

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class FakeDriver:
    """Allocations are registered uint8 CPU tensors; buffer ids never repeat."""

    _ids = itertools.count(1)

    def __init__(self):
        self.allocs: dict[int, tuple[torch.Tensor, int]] = {}  # base -> (buffer, buffer id)
        self.opened: list[bytes] = []
        self.closed: list[int] = []

    def allocate(self, nbytes: int, base_from: torch.Tensor | None = None) -> torch.Tensor:
        buf = base_from if base_from is not None else torch.zeros(nbytes, dtype=torch.uint8)
        self.allocs[buf.data_ptr()] = (buf, next(self._ids))
        return buf

    def address_range(self, ptr):
        for base, (buf, _) in self.allocs.items():
            if base <= ptr < base + buf.numel():
                return base, buf.numel()
        raise RuntimeError(f"pointer {ptr:#x} is not in an allocation")

    def buffer_id(self, ptr):
        return self.allocs[self.address_range(ptr)[0]][1]

    def get_handle(self, base):
        bid = self.allocs[base][1]
        return base.to_bytes(8, "little") + bid.to_bytes(8, "little") + bytes(48)

    def open_handle(self, handle, size, device):
        self.opened.append(handle)
        base, bid = int.from_bytes(handle[:8], "little"), int.from_bytes(handle[8:16], "little")
        buf, cur = self.allocs[base]
        assert cur == bid and buf.numel() == size
        return buf.view(-1)  # aliases the "exported" memory

    def close_handle(self, mapped):
        self.closed.append(mapped.data_ptr())


def carve(driver: FakeDriver, spec: KVCacheSpec, num_blocks: int, heads: int, rank: int, pad: int = 512):
    """Per-layer caches carved out of ONE allocation (like an engine's single KV buffer), at a
    non-zero offset, filled with origin-encoding payloads."""
    src = make_cache(spec, num_blocks, heads, rank)
    per = src[0].numel() * spec.element_size
    buf = driver.allocate(pad + per * len(src) + 64)
    out = []
    for i, s in enumerate(src):
        t = buf[pad + i * per : pad + (i + 1) * per].view(spec.dtype).view(s.shape)
        t.copy_(s)
        out.append(t)
    return out


# --------------------------------------------------------------------------- publication
def test_publish_one_allocation_shared_by_layers():
    drv = FakeDriver()
    spec = KVCacheSpec(3, 4, 72, 16, torch.bfloat16)
    caches = carve(drv, spec, 10, 4, 0)
    desc = publish_caches(caches, "P", driver=drv)
    assert len(desc["allocations"]) == 1 and len(desc["layers"]) == 3
    a = desc["allocations"][0]
    assert a["base"] == caches[0].data_ptr() - 512 and len(bytes.fromhex(a["handle"])) == 64
    per = caches[0].numel() * 2
    assert [lay["offset"] for lay in desc["layers"]] == [512, 512 + per, 512 + 2 * per]
    assert desc["layers"][1]["shape"] == list(caches[1].shape) and desc["layers"][1]["dtype"] == "bfloat16"
    assert desc["pid"] == os.getpid() and desc["engine_id"] == "P"
    assert json.loads(json.dumps(desc)) == desc
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(desc)) == desc
    # separate allocations -> separate entries; bad input named
    other = [
        drv.allocate(0, base_from=c.clone().view(torch.uint8).view(-1)).view(spec.dtype).view(c.shape)
        for c in caches
    ]
    assert len(publish_caches(other, "P", driver=drv)["allocations"]) == 3
    with pytest.raises(ValueError, match=r"caches\[0\]: CUDA IPC exports CUDA tensors"):
        publish_caches(caches, "P")
    with pytest.raises(RuntimeError, match=r"caches\[0\]: cannot export"):
        publish_caches([torch.zeros(4)], "P", driver=drv)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize(
    "src_layout,src_bs,src_tp,dst_layout,dst_bs,dst_tp",
    [("NHD", 16, 2, "HND", 32, 1), ("HND", 12, 1, "NHD", 16, 2), ("NHD", 16, 1, "NHD", 16, 4)],
)
def test_mapped_caches_copy_byte_exact(dtype, src_layout, src_bs, src_tp, dst_layout, dst_bs, dst_tp):
    """Rebuilt tensors alias the exporter's layers; copy_blocks through them converts layout,
    block size and head slice exactly (P tp -> D tp, every read of D rank 0)."""
    drv = FakeDriver()
    sspec = KVCacheSpec(2, 4, 96, src_bs, dtype, Layout(src_layout))
    dspec = KVCacheSpec(2, 4, 96, dst_bs, dtype, Layout(dst_layout))
    T = 75
    src_ranks = {r: carve(drv, sspec, 9, sspec.heads_per_rank(src_tp), r) for r in range(src_tp)}
    descs = {r: publish_caches(c, "P", driver=drv) for r, c in src_ranks.items()}
    cache = IpcHandleCache(driver=drv)
    dst = poisoned(dspec, 8, dspec.heads_per_rank(dst_tp))
    want = [c.clone() for c in dst]
    g = torch.Generator().manual_seed(1)
    sids = torch.randperm(9, generator=g)[: sspec.num_blocks_for(T)]
    dids = torch.randperm(8, generator=g)[: dspec.num_blocks_for(T)]
    for rd in plan_reads(sspec, src_tp, dspec, dst_tp).reads(0):
        mapped = cache.open_caches("P", descs[rd.src_rank], "cpu")
        for m, c in zip(mapped, src_ranks[rd.src_rank]):
            assert m.data_ptr() == c.data_ptr() and m.shape == c.shape and m.stride() == c.stride()
            assert m.dtype == c.dtype
        ops.copy_blocks(
            mapped,
            sspec,
            sids,
            dst,
            dspec,
            dids,
            T,
            rd.src_head_start,
            rd.dst_head_start,
            rd.num_heads,
            backend="torch",
        )
        want = expected_dst(
            src_ranks[rd.src_rank],
            sspec,
            sids,
            want,
            dspec,
            dids,
            T,
            rd.src_head_start,
            rd.dst_head_start,
            rd.num_heads,
        )
    assert bytes_equal(dst, want)
    assert not bytes_equal(dst, poisoned(dspec, 8, dspec.heads_per_rank(dst_tp)))
    assert cache.num_opens == len({rd.src_rank for rd in plan_reads(sspec, src_tp, dspec, dst_tp).reads(0)})


# --------------------------------------------------------------------------- cache keying
def test_handle_cache_opens_once_and_keys_identity():
    drv = FakeDriver()
    spec = KVCacheSpec(2, 2, 8, 4, torch.float16)
    caches = carve(drv, spec, 3, 2, 0)
    desc = publish_caches(caches, "P", driver=drv)
    cache = IpcHandleCache(driver=drv)
    first = cache.open_caches("P", desc, "cpu")
    again = cache.open_caches("P", json.loads(json.dumps(desc)), "cpu")
    assert cache.num_opens == 1 and cache.num_hits == 1 and len(drv.opened) == 1
    assert [t.data_ptr() for t in first] == [t.data_ptr() for t in again]

    # Same pid/handle/base, but a restarted process (new token) -> a new mapping.
    restarted = dict(desc, process_token="f" * 32)
    cache.open_allocations("P", restarted, "cpu")
    # The same allocation listed by another peer name (two ranks exported by one process) is
    # opened once and shared.
    cache.open_allocations("P2", desc, "cpu")
    assert cache.num_opens == 2 and len(cache) == 2

    # Freed and reused: the exporter frees its buffer; a new allocation lands at the same
    # address with a new buffer id. A re-handshake's description must not hit the old mapping.
    base = desc["allocations"][0]["base"]
    buf, _ = drv.allocs[base]
    drv.allocate(0, base_from=buf)  # same base, next buffer id
    desc2 = publish_caches(caches, "P", driver=drv)
    assert desc2["allocations"][0]["base"] == base
    assert desc2["allocations"][0]["buffer_id"] != desc["allocations"][0]["buffer_id"]
    cache.open_caches("P", desc2, "cpu")
    assert cache.num_opens == 3
    # retain drops P's stale mappings; the old one stays open while P2 still lists it
    closed = cache.retain("P", desc2)
    assert closed == 1 and len(cache) == 2 and len(drv.closed) == 1
    cache.open_caches("P", desc2, "cpu")
    assert cache.num_opens == 3  # still cached
    assert cache.invalidate_peer("P2") == 1 and len(cache) == 1  # old allocation: last owner gone
    assert cache.invalidate_peer("P") == 1 and len(cache) == 0
    cache.open_caches("P", desc2, "cpu")
    assert cache.num_opens == 4
    cache.close()
    assert len(cache) == 0 and cache.num_closes == 4 and len(drv.closed) == 4


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda d: d.update(version=99), "version"),
        (lambda d: d.pop("process_token"), "process_token"),
        (lambda d: d["allocations"][0].update(handle="zz" * 64), "not hex"),
        (lambda d: d["allocations"][0].update(handle="00"), "128 hex chars"),
        (lambda d: d["allocations"][0].update(size=-1), r"allocations\[0\].size"),
        (lambda d: d["layers"][1].update(alloc=5), r"layers\[1\].alloc"),
        (lambda d: d["layers"][0].update(offset=1 << 40), r"layers\[0\] lies outside"),
        (lambda d: d["layers"][0].update(dtype="float128"), "unknown dtype"),
        (lambda d: d["layers"][0].update(stride=[1]), "shape/stride"),
    ],
)
def test_description_validation(mutate, match):
    drv = FakeDriver()
    caches = carve(drv, KVCacheSpec(2, 2, 8, 4, torch.float16), 3, 2, 0)
    desc = json.loads(json.dumps(publish_caches(caches, "P", driver=drv)))
    mutate(desc)
    cache = IpcHandleCache(driver=drv)
    with pytest.raises(ValueError, match=match):
        cache.open_caches("P", desc, "cpu")
    assert cache.num_opens == 0 and drv.opened == []  # nothing opened for a bad description


# --------------------------------------------------------------------------- transport choice
def info(**kw):
    base = {
        "host_id": "node1/boot-a",
        "pid": 100,
        "pid_ns": "pid:[4026531836]",
        "process_token": "a" * 32,
        "gpu_uuid": "GPU-0",
        "visible_gpus": ["GPU-0", "GPU-1"],
        "alloc_conf": "",
        "expandable_segments": False,
    }
    return base | kw


PEER = info(pid=200, process_token="b" * 32)


@pytest.mark.parametrize(
    "local,peer,ok,reason",
    [
        (info(), PEER, True, "same host, same GPU"),
        (info(), dict(PEER, gpu_uuid="GPU-1"), True, "different GPUs with peer access"),
        (info(), dict(PEER, host_id="node2/boot-b"), False, "different hosts (node1/boot-a vs node2/boot-b)"),
        (info(), dict(PEER, host_id="node1/boot-OTHER"), False, "different hosts"),
        (info(gpu_uuid=None, visible_gpus=[]), PEER, False, "no GPU: this process"),
        (info(), dict(PEER, gpu_uuid=None), False, "no GPU: the peer"),
        (
            info(),
            dict(PEER, expandable_segments=True, alloc_conf="expandable_segments:True"),
            False,
            "the peer runs PyTorch with expandable_segments",
        ),
        (info(expandable_segments=True), PEER, False, "this process runs PyTorch with expandable_segments"),
        (info(), dict(PEER, pid_ns="pid:[4026532000]"), False, "PID-namespace isolation"),
        (info(visible_gpus=["GPU-0"]), dict(PEER, gpu_uuid="GPU-1"), False, "not visible in this process"),
        (info(), dict(PEER, gpu_uuid="GPU-1", visible_gpus=["GPU-1"]), False, "not visible in the peer"),
        (info(), info(), False, "same process"),
    ],
)
def test_ipc_supported_reasons(local, peer, ok, reason):
    got, why = ipc_supported(local, peer, peer_access=lambda a, b: True)
    assert got is ok and reason in why


def test_ipc_supported_no_peer_access_and_bad_info():
    ok, why = ipc_supported(info(), dict(PEER, gpu_uuid="GPU-1"), peer_access=lambda a, b: False)
    assert not ok and "cannot access GPU GPU-1 (no peer-to-peer)" in why
    with pytest.raises(ValueError, match="peer ipc info: field 'pid'"):
        ipc_supported(info(), dict(PEER, pid="200"))
    with pytest.raises(ValueError, match="local ipc info: expected a dict"):
        ipc_supported(None, PEER)


def test_choose_transport_messages(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    far = dict(PEER, host_id="node2/boot-b")
    assert choose_transport(info(), PEER) == ("ipc", "ipc: same host, same GPU")
    t, msg = choose_transport(info(), far)
    assert t == "pg" and msg.startswith("pg: CUDA IPC cannot work: different hosts")
    with pytest.raises(ValueError, match="'ipc' requested but CUDA IPC cannot work: different hosts"):
        choose_transport(info(), far, requested="ipc")
    assert choose_transport(info(), PEER, requested="pg") == ("pg", "pg: requested")
    with pytest.raises(ValueError, match="transport: must be"):
        choose_transport(info(), PEER, requested="rdma")
    # with NVML topology: GPU 1 and 2 of the fake machine have no peer-to-peer
    topo = probe(FakeNvml())
    g = [x.uuid for x in topo.gpus]
    loc, peer = info(gpu_uuid=g[1], visible_gpus=g), dict(PEER, gpu_uuid=g[2], visible_gpus=g)
    t, msg = choose_transport(loc, peer, topology=topo, peer_access=lambda a, b: True)
    assert t == "pg" and "no peer-to-peer between GPU 1 and GPU 2" in msg
    loc, peer = info(gpu_uuid=g[0], visible_gpus=g), dict(PEER, gpu_uuid=g[1], visible_gpus=g)
    t, msg = choose_transport(loc, peer, topology=topo, peer_access=lambda a, b: True)
    assert t == "ipc" and "NVLink x4" in msg


def test_expandable_segments_parsing_and_local_info(monkeypatch):
    assert expandable_segments_enabled("expandable_segments:True")
    assert expandable_segments_enabled("max_split_size_mb:128, expandable_segments:true")
    assert not expandable_segments_enabled("expandable_segments:False")
    assert not expandable_segments_enabled("")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    li = local_ipc_info("cpu")
    assert li["expandable_segments"] and li["gpu_uuid"] is None and li["pid"] == os.getpid()
    assert json.loads(json.dumps(li)) == li
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert not local_ipc_info(None)["expandable_segments"]
    # two processes on this host agree on host_id and pid namespace
    assert li["host_id"] == local_ipc_info("cpu")["host_id"]


# --------------------------------------------------------------------------- GPU
SPEC_P = dict(
    num_layers=3, num_kv_heads=4, head_dim=96, block_size=16, dtype=torch.bfloat16, layout=Layout.NHD
)
P_TP, P_BLOCKS = 2, 320  # >10 MiB per rank: its own cudaMalloc segment in torch's allocator


def _carve_cuda(spec: KVCacheSpec, rank: int) -> list:
    src = make_cache(spec, P_BLOCKS, spec.heads_per_rank(P_TP), rank)
    per = src[0].numel()
    big = torch.empty(per * len(src) + 1024, dtype=spec.dtype, device="cuda")
    out = [big[1024 + i * per : 1024 + (i + 1) * per].view(s.shape) for i, s in enumerate(src)]
    for t, s in zip(out, src):
        t.copy_(s)
    return out


def _exporter(q_out, q_in) -> None:
    """Holds both P ranks' caches on cuda:0 (rank 0 carved from one allocation), publishes them,
    then frees rank 0's and republishes a fresh allocation with new payloads."""
    try:
        spec = KVCacheSpec(**SPEC_P)
        ranks = {r: _carve_cuda(spec, r) for r in range(P_TP)}
        torch.cuda.synchronize()
        q_out.put(("desc", {r: publish_caches(c, "P") for r, c in ranks.items()}))
        assert q_in.get(timeout=120) == "next"
        del ranks[0]
        torch.cuda.empty_cache()
        ranks[0] = _carve_cuda(spec, 7)
        torch.cuda.synchronize()
        q_out.put(("desc", {r: publish_caches(c, "P") for r, c in ranks.items()}))
        assert q_in.get(timeout=120) == "done"
        q_out.put(("ok", None))
    except BaseException:
        q_out.put(("error", traceback.format_exc()))


@pytest.mark.gpu
@needs_cuda
def test_gpu_ipc_two_processes_one_gpu():
    ctx = mp.get_context("spawn")
    q_out, q_in = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_exporter, args=(q_out, q_in), daemon=True)
    proc.start()
    try:
        sspec = KVCacheSpec(**SPEC_P)
        T = 150
        g = torch.Generator().manual_seed(3)
        sids = torch.randperm(P_BLOCKS, generator=g)[: sspec.num_blocks_for(T)]
        cache = IpcHandleCache()
        for phase, payload_ranks in (("first", {0: 0, 1: 1}), ("reused", {0: 7, 1: 1})):
            kind, descs = q_out.get(timeout=120)
            assert kind == "desc", descs
            descs = {int(k): v for k, v in descs.items()}
            lay = descs[0]["layers"]
            assert len(descs[0]["allocations"]) == 1 and lay[0]["offset"] >= 1024 * 2
            assert lay[1]["offset"] - lay[0]["offset"] == lay[0]["nbytes"]  # carved, one handle
            for dst_layout, dst_bs, dst_tp in (("HND", 32, 1), ("NHD", 24, 4), ("HND", 16, 2)):
                dspec = KVCacheSpec(3, 4, 96, dst_bs, torch.bfloat16, Layout(dst_layout))
                dids = torch.randperm(12, generator=g)[: dspec.num_blocks_for(T)]
                for drank in range(dst_tp):
                    dst = poisoned(dspec, 12, dspec.heads_per_rank(dst_tp), device="cuda")
                    want = [c.cpu() for c in dst]
                    for rd in plan_reads(sspec, P_TP, dspec, dst_tp).reads(drank):
                        src = cache.open_caches(f"P/{rd.src_rank}", descs[rd.src_rank], "cuda")
                        ops.copy_blocks(
                            src,
                            sspec,
                            sids,
                            dst,
                            dspec,
                            dids,
                            T,
                            rd.src_head_start,
                            rd.dst_head_start,
                            rd.num_heads,
                        )
                        oracle = make_cache(
                            sspec, P_BLOCKS, sspec.heads_per_rank(P_TP), payload_ranks[rd.src_rank]
                        )
                        want = expected_dst(
                            oracle,
                            sspec,
                            sids,
                            want,
                            dspec,
                            dids,
                            T,
                            rd.src_head_start,
                            rd.dst_head_start,
                            rd.num_heads,
                        )
                    torch.cuda.synchronize()
                    assert bytes_equal(dst, want), (phase, dst_layout, dst_bs, dst_tp, drank)
            if phase == "first":
                opens = cache.num_opens
                assert opens == 2
                q_in.put("next")
            else:
                assert cache.num_opens == opens + 1  # only the reallocated rank was reopened
                assert cache.retain("P/0", descs[0]) == 1 and cache.retain("P/1", descs[1]) == 0
        cache.close()
        q_in.put("done")
        kind, err = q_out.get(timeout=60)
        assert kind == "ok", err
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)


@pytest.mark.gpu
@needs_cuda
def test_gpu_stream_ordering_transfer_sees_kernel_result():
    """A gather issued on a transfer stream right after a (slow) kernel on the compute stream
    that rewrites the cache sees the new bytes, ordered by an event, not by synchronize()."""
    from kvxfer.transports.staging import record_done

    spec = KVCacheSpec(2, 4, 128, 16, torch.bfloat16)
    caches = [c.cuda() for c in make_cache(spec, 64, 4, 0)]
    ids = torch.arange(64)
    compute, transfer = torch.cuda.Stream(), torch.cuda.Stream()
    new_vals = [c.clone().fill_(3.0) for c in caches]
    torch.cuda.synchronize()
    with torch.cuda.stream(compute):
        torch.cuda._sleep(200_000_000)  # keeps the writer busy well past the gather's launch
        for c, v in zip(caches, new_vals):
            c.copy_(v)
        written = torch.cuda.Event()
        written.record(compute)
    with torch.cuda.stream(transfer):
        transfer.wait_event(written)
        wire = ops.gather_blocks(caches, spec, ids, 64 * 16)
        done = record_done()
    torch.cuda.current_stream().wait_event(done)
    assert torch.equal(
        wire.cpu().view(torch.uint8),
        ops.gather_blocks([v.cpu() for v in new_vals], spec, ids, 64 * 16).view(torch.uint8),
    )


def test_publish_makes_the_cache_device_context_current_for_driver_calls():
    """cuMemGetAddressRange / cuPointerGetAttribute act on the current context: every driver
    call of a layer runs inside the driver's context() for that layer's device, and a driver
    error is raised naming the layer (the engine then says why ipc is not offered)."""
    calls: list[tuple[str, object]] = []

    class CtxDriver(FakeDriver):
        active = None

        @contextlib.contextmanager
        def context(self, device):
            calls.append(("enter", device))
            CtxDriver.active = device
            try:
                yield
            finally:
                CtxDriver.active = None

        def address_range(self, ptr):
            calls.append(("address_range", CtxDriver.active))
            return super().address_range(ptr)

        def buffer_id(self, ptr):
            calls.append(("buffer_id", CtxDriver.active))
            return super().buffer_id(ptr)

    drv = CtxDriver()
    spec = KVCacheSpec(2, 4, 8, 16, torch.float16)
    caches = carve(drv, spec, 4, 4, 0)
    publish_caches(caches, "P", driver=drv)
    assert [c for c in calls if c[0] != "enter"] and all(
        dev == caches[0].device for kind, dev in calls if kind != "enter"
    ), calls

    class Broken(CtxDriver):
        def address_range(self, ptr):
            raise RuntimeError("cuMemGetAddressRange failed with CUresult 201")

    with pytest.raises(RuntimeError, match=r"caches\[0\]: cannot export a CUDA IPC handle.*CUresult 201"):
        publish_caches(caches, "P", driver=Broken())


def test_offer_failure_is_logged_with_the_reason(caplog, monkeypatch):
    """A driver error while exporting handles is reported (warning + the reason the engine
    puts in its handshake), not silently turned into a pg fallback."""
    import types

    from kvxfer.transports.ipc import cuda_mapper

    def refuse(caches, engine_id, driver=None):
        raise RuntimeError("caches[0]: cannot export a CUDA IPC handle: CUresult 201")

    monkeypatch.setattr(cuda_ipc, "publish_caches", refuse)
    monkeypatch.setattr(cuda_mapper, "handle_cache", lambda driver=None: types.SimpleNamespace(driver=None))
    fake_cuda_layer = types.SimpleNamespace(device=torch.device("cuda", 0))
    with caplog.at_level("WARNING", logger="kvxfer.transports.ipc.cuda_mapper"):
        desc, why = cuda_mapper.offer([fake_cuda_layer], "P")
    assert desc is None and "CUresult 201" in why
    assert any(
        "ipc not offered" in r.getMessage() and "CUresult 201" in r.getMessage() for r in caplog.records
    )
