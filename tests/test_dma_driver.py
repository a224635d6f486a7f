"""The copy-engine path's real driver call (kvxfer/backends/batch_copy.py): its prototypes and
attribute structs checked against the toolkit's ``cuda.h``, the driver loaded only when a call
wants it, and on a GPU (``gpu``) the real ``cuMemcpyBatchAsync``, byte-exact with poison, on
device and pinned host memory, and taken by the rule under a small SM budget.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvxfer import ops
from kvxfer.backends import batch_copy

from .dma_helpers import (
    POISON,
    FakeDriver,
    _bytes,
    _caches,
    _rule_on,  # noqa: F401  (autouse: the rule applies, $KVXFER_DMA=rule)
    _spec,
)


# --------------------------------------------------------------------------- the call's shape vs cuda.h
def _cuda_include() -> Path | None:
    cands = [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = Path(nvcc).resolve()
        cands.append(str(real.parent.parent))
        try:  # a wrapper script (exec /usr/local/cuda-X/bin/nvcc)
            m = re.search(r"(/\S+)/bin/nvcc", real.read_text(errors="ignore"))
            if m:
                cands.append(m.group(1))
        except OSError:
            pass
    for c in cands:
        if c and (Path(c) / "include" / "cuda.h").is_file():
            return Path(c) / "include"
    return None


_CTYPES_OF = {
    "CUdeviceptr *": ctypes.POINTER(ctypes.c_uint64),
    "size_t *": ctypes.POINTER(ctypes.c_size_t),
    "size_t": ctypes.c_size_t,
    "CUmemcpyAttributes *": ctypes.POINTER(batch_copy.CUmemcpyAttributes),
    "CUstream": ctypes.c_void_p,
}


def _declarations(header: str, name: str) -> list[list[str]]:
    """Parameter types of every declaration of ``name`` in ``header``."""
    out = []
    for m in re.finditer(rf"CUresult\s+CUDAAPI\s+{name}\s*\(([^)]*)\)\s*;", header):
        params = [" ".join(p.split()) for p in m.group(1).split(",")]
        types_ = [re.sub(r"\s*\w+$", "", p) for p in params]  # drop the parameter names
        out.append([re.sub(r"\s*\*\s*", " *", t).strip() for t in types_])
    return out


def test_the_prototypes_match_cuda_h():
    """Both forms of the call as declared by the toolkit's cuda.h: ``cuMemcpyBatchAsync_v2``
    (what cuda.h 13 calls ``cuMemcpyBatchAsync``) and the 12.8 form exported under the plain
    name (``failIdx`` before the stream); the fake above is an instance of the same prototype."""
    inc = _cuda_include()
    if inc is None:
        pytest.skip("no CUDA toolkit cuda.h here (CUDA_HOME, /usr/local/cuda, nvcc): cannot compare")
    header = (inc / "cuda.h").read_text(errors="ignore")
    v2 = _declarations(header, "cuMemcpyBatchAsync_v2")
    plain = _declarations(header, "cuMemcpyBatchAsync")
    assert v2, "cuda.h declares no cuMemcpyBatchAsync_v2"
    assert re.search(r"#define\s+cuMemcpyBatchAsync\s+__CUDA_API_PTSZ\(cuMemcpyBatchAsync_v2\)", header)
    for t in v2:
        assert [_CTYPES_OF[x] for x in t] == list(batch_copy.ARGTYPES[2]), t
    legacy = [t for t in plain if len(t) == 9]
    assert legacy, plain
    for t in legacy:
        assert [_CTYPES_OF[x] for x in t] == list(batch_copy.ARGTYPES[1]), t
    assert (
        batch_copy.PROTOTYPES[2]._argtypes_ == batch_copy.ARGTYPES[2]
        and batch_copy.PROTOTYPES[2]._restype_ is ctypes.c_int
    )
    assert isinstance(FakeDriver(2).fn, batch_copy.PROTOTYPES[2]) and isinstance(
        FakeDriver(1).fn, batch_copy.PROTOTYPES[1]
    )
    with pytest.raises(TypeError, match="PROTOTYPES"):
        batch_copy.BatchCopier(lambda *a: 0, 2, "not a prototype")


_LAYOUT_C = r"""
#include <stddef.h>
#include <stdio.h>
#include <cuda.h>
int main(void) {
  printf("%zu %zu %zu %zu %zu %zu %zu %zu %zu\n", sizeof(CUmemcpyAttributes), sizeof(CUmemLocation),
         offsetof(CUmemcpyAttributes, srcAccessOrder), offsetof(CUmemcpyAttributes, srcLocHint),
         offsetof(CUmemcpyAttributes, dstLocHint), offsetof(CUmemcpyAttributes, flags),
         offsetof(CUmemLocation, id), sizeof(CUdeviceptr), sizeof(CUresult));
  printf("%d %d %d %d\n", (int)CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, (int)CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE,
         (int)CU_MEM_LOCATION_TYPE_DEVICE, (int)CU_MEM_LOCATION_TYPE_HOST);
  return 0;
}
"""


def test_the_attribute_structs_match_cuda_h(tmp_path):
    """Sizes, field offsets and constants of the ctypes structs against a C compile of cuda.h."""
    inc = _cuda_include()
    cc = shutil.which("cc") or shutil.which("gcc")
    if inc is None or cc is None:
        pytest.skip("needs cuda.h and a C compiler to compare the struct layout")
    (tmp_path / "l.c").write_text(_LAYOUT_C)
    subprocess.run(
        [cc, "-I", str(inc), "-o", str(tmp_path / "l"), str(tmp_path / "l.c")], check=True, timeout=60
    )
    sizes, consts = subprocess.run(
        [str(tmp_path / "l")], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    A, L = batch_copy.CUmemcpyAttributes, batch_copy.CUmemLocation
    assert [int(x) for x in sizes.split()] == [
        ctypes.sizeof(A),
        ctypes.sizeof(L),
        A.srcAccessOrder.offset,
        A.srcLocHint.offset,
        A.dstLocHint.offset,
        A.flags.offset,
        L.id.offset,
        ctypes.sizeof(ctypes.c_uint64),
        ctypes.sizeof(ctypes.c_int),
    ]
    assert [int(x) for x in consts.split()] == [
        batch_copy.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
        batch_copy.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE,
        batch_copy.CU_MEM_LOCATION_TYPE_DEVICE,
        batch_copy.CU_MEM_LOCATION_TYPE_HOST,
    ]


def test_importing_kvxfer_does_no_cuda_work():
    """The DMA module loads the driver only when a call wants it."""
    code = (
        "import sys, kvxfer, kvxfer.ops, kvxfer.backends.batch_copy as b\n"
        "assert b._copiers == {} and 'cupy' not in sys.modules\n"
        "import ctypes\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.stdout.strip() == "ok", res.stderr


# --------------------------------------------------------------------------- GPU
def gpu(fn):
    fn = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")(fn)
    return pytest.mark.gpu(fn)


def _real_copier():
    batch_copy.install_copier(None)
    c, why = batch_copy.copier(torch.device("cuda"))
    if c is None:
        v = ctypes.c_int(0)
        ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(v))
        if v.value < batch_copy.MIN_DRIVER:
            pytest.skip(f"driver CUDA {v.value}: cuMemcpyBatchAsync needs 12.8 ({why})")
        pytest.fail(f"a 12.8+ driver ({v.value}) but no batched copy: {why}")
    return c


@gpu
@pytest.mark.parametrize("stream", ["default", "side"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
@pytest.mark.parametrize(("layout", "hs", "n"), [("NHD", 0, None), ("HND", 1, 2), ("MLA", 0, None)])
def test_copy_through_the_copy_engines_gpu(layout, hs, n, dtype, stream):
    _real_copier()
    spec = _spec(layout, heads=4, dim=64, bs=16, layers=3, dtype=dtype)
    src = [c.cuda() for c in _caches(spec, 40, "random", seed=3)]
    dst = [c.cuda() for c in _caches(spec, 40, "poison")]
    ref = [c.cpu() for c in dst]
    s_ids = [*range(4, 20), 33, 2, 35]  # a long adjacent stretch, then scattered
    d_ids = [*range(10, 26), 0, 39, 30]
    kw = dict(src_head_start=hs, dst_head_start=hs, num_heads=n, layers=[2, 0])
    s = torch.cuda.Stream() if stream == "side" else torch.cuda.current_stream()
    with torch.cuda.stream(s):
        ops.copy_blocks(src, spec, s_ids, dst, spec, d_ids, 19 * 16, dma=True, **kw)
        assert ops.last_backend() == "dma"
    torch.cuda.synchronize()
    ops.copy_blocks([c.cpu() for c in src], spec, s_ids, ref, spec, d_ids, 19 * 16, backend="torch", **kw)
    assert torch.equal(_bytes([c.cpu() for c in dst]), _bytes(ref))


@gpu
@pytest.mark.parametrize("where", ["device", "pinned"])
@pytest.mark.parametrize(("layout", "hs", "n"), [("HND", 0, None), ("HND", 3, 1), ("MLA", 0, None)])
def test_gather_and_scatter_through_the_copy_engines_gpu(layout, hs, n, where):
    _real_copier()
    spec = _spec(layout, heads=4, dim=128, bs=16, layers=4, dtype=torch.bfloat16)
    src = [c.cuda() for c in _caches(spec, 64, "random", seed=4)]
    ids = [*range(8, 40), 60, 1]
    T = len(ids) * 16
    shape = spec.wire_shape(T, 1 if layout == "MLA" else (n or 4), 3)
    wire = (
        torch.empty(shape, dtype=spec.dtype, pin_memory=True)
        if where == "pinned"
        else torch.empty(shape, dtype=spec.dtype, device="cuda")
    )
    wire.view(torch.uint8).fill_(POISON)
    kw = dict(head_start=hs, num_heads=n, layers=[3, 0, 1])
    ops.gather_blocks(src, spec, ids, T, out=wire, dma=True, **kw)
    assert ops.last_backend() == "dma"
    torch.cuda.synchronize()
    want = ops.gather_blocks([c.cpu() for c in src], spec, ids, T, backend="torch", **kw)
    assert torch.equal(_bytes([wire.cpu()]), _bytes([want]))
    dst = [c.cuda() for c in _caches(spec, 64, "poison")]
    ops.scatter_blocks(wire, dst, spec, list(range(63, 29, -1)), T, head_start=hs, layers=[3, 0, 1], dma=True)
    torch.cuda.synchronize()
    ref = _caches(spec, 64, "poison")
    ops.scatter_blocks(
        want, ref, spec, list(range(63, 29, -1)), T, head_start=hs, layers=[3, 0, 1], backend="torch"
    )
    assert torch.equal(_bytes([c.cpu() for c in dst]), _bytes(ref))


@gpu
def test_a_small_budget_sends_whole_blocks_to_the_copy_engines_gpu():
    """Through the rule: registered caches with an 8-SM budget, a whole-block ipc-like copy goes
    to DMA, a partial one to a capped kernel; both exact; stats and last backend say so."""
    _real_copier()
    spec = _spec("NHD", heads=8, dim=128, bs=16, layers=4, dtype=torch.bfloat16)
    src = ops.register_caches([c.cuda() for c in _caches(spec, 80, "random", seed=5)], spec, max_sms=8)
    dst = ops.register_caches([c.cuda() for c in _caches(spec, 80, "poison")], spec, max_sms=8)
    ref = [c.cpu() for c in dst]
    ops.copy_blocks(src, spec, list(range(32)), dst, spec, list(range(40, 72)), 512)
    assert ops.last_backend() == "dma"
    ops.copy_blocks(src, spec, [32, 33], dst, spec, [72, 73], 20)
    assert ops.last_backend() != "dma"
    torch.cuda.synchronize()
    srcc = [c.cpu() for c in src]
    ops.copy_blocks(srcc, spec, list(range(32)), ref, spec, list(range(40, 72)), 512, backend="torch")
    ops.copy_blocks(srcc, spec, [32, 33], ref, spec, [72, 73], 20, backend="torch")
    assert torch.equal(_bytes([c.cpu() for c in dst]), _bytes(ref))
    st = ops.path_stats(dst)
    assert st["reasons"] == {"copy dma: budget small": 1, "copy kernel: dma does not apply": 1}
    assert st["dma_path"].startswith("cuda on: cuMemcpyBatchAsync")
