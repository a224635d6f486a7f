"""CUDA C++ kernels (csrc/) on a machine without a GPU.

- nvcc compiles csrc/ for sm_80, sm_90a and compute_90 PTX with the build's own command;
- the same kernel bodies, compiled by g++ with ASan + UBSan through the host shim, run the whole
  test matrix (tests/cuda_shim/cases.py) in one sanitized subprocess and match the torch
  reference byte for byte; each case is reported as its own test;
- the wheel builds with and without nvcc and ships the sources (and the fatbin with nvcc);
- the backend's pure-Python parts (availability, copy width, launch plans, source inlining).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from kvxfer import ops
from kvxfer.backends import cuda
from kvxfer.prepared import prepared_copy
from kvxfer.spec import KVCacheSpec, Layout

ROOT = Path(__file__).resolve().parents[1]
SHIM = ROOT / "tests" / "cuda_shim"
sys.path.insert(0, str(SHIM))

from cases import matrix  # noqa: E402
from host_kernels import HostKernels, build  # noqa: E402

CASES = matrix()


def _setup_module():
    spec = importlib.util.spec_from_file_location("kvxfer_setup", ROOT / "setup.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # setup() only runs as __main__
    return mod


# --------------------------------------------------------------------------- nvcc
@pytest.fixture(scope="session")
def nvcc_build(tmp_path_factory):
    setup_mod = _setup_module()
    nvcc = setup_mod.find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (PATH, CUDA_HOME): cannot check the CUDA compile")
    out = tmp_path_factory.mktemp("nvcc") / setup_mod.FATBIN
    cmd = [*setup_mod.nvcc_command(nvcc, out), "-Xptxas", "-v"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    return res, out


def test_nvcc_compiles_fatbin_for_sm80_sm90a_and_ptx(nvcc_build):
    res, out = nvcc_build
    assert res.returncode == 0, f"nvcc failed:\n{res.stderr[-4000:]}"
    assert out.stat().st_size > 10_000
    # ptxas reports each entry for each SASS target; the PTX target is embedded unassembled.
    for arch in ("sm_80", "sm_90a"):
        for name in cuda._entry_names():
            assert f"Compiling entry function '{name}' for '{arch}'" in res.stderr, (name, arch)


def test_nvcc_kernels_do_not_spill(nvcc_build):
    res, _ = nvcc_build
    spills = re.findall(r"(\d+) bytes spill stores", res.stderr)
    assert spills and all(s == "0" for s in spills), res.stderr[-2000:]


class _Nvrtc:
    """libnvrtc through ctypes (the ``nvidia-cuda-nvrtc`` wheel of the test extra), so the
    fallback source is compiled in CI without CuPy or a GPU."""

    def __init__(self) -> None:
        import ctypes
        import importlib.util

        spec = importlib.util.find_spec("nvidia.cuda_nvrtc")
        if spec is None or not spec.submodule_search_locations:
            raise OSError("the nvidia-cuda-nvrtc wheel is not installed")
        lib_dir = Path(next(iter(spec.submodule_search_locations))) / "lib"
        libs = sorted(lib_dir.glob("libnvrtc.so.*"))
        if not libs:
            raise OSError(f"no libnvrtc.so.* in {lib_dir}")
        self.lib = ctypes.CDLL(str(libs[0]))
        self.c = ctypes

    def ptx(self, code: str, name: str, options: list[str]) -> tuple[int, str, str]:
        """(nvrtcResult of the compile, PTX or "", log)."""
        c = self.c
        prog = c.c_void_p()
        rc = self.lib.nvrtcCreateProgram(c.byref(prog), code.encode(), name.encode(), 0, None, None)
        assert rc == 0, f"nvrtcCreateProgram: {rc}"
        try:
            opts = (c.c_char_p * len(options))(*[o.encode() for o in options])
            rc = self.lib.nvrtcCompileProgram(prog, len(options), opts)
            size = c.c_size_t()
            self.lib.nvrtcGetProgramLogSize(prog, c.byref(size))
            log = c.create_string_buffer(size.value)
            self.lib.nvrtcGetProgramLog(prog, log)
            if rc != 0:
                return rc, "", log.value.decode()
            self.lib.nvrtcGetPTXSize(prog, c.byref(size))
            buf = c.create_string_buffer(size.value)
            assert self.lib.nvrtcGetPTX(prog, buf) == 0
            return rc, buf.value.decode(), log.value.decode()
        finally:
            self.lib.nvrtcDestroyProgram(c.byref(prog))


def test_nvrtc_compiles_the_runtime_fallback_source():
    """The self-contained source the backend hands NVRTC when no prebuilt binary loads."""
    try:
        nvrtc = _Nvrtc()
    except OSError as e:  # the test extra installs the wheel; elsewhere say what is missing
        pytest.skip(f"NVRTC not loadable (pip install nvidia-cuda-nvrtc-cu12): {e}")
    code = cuda.inline_source(cuda.source_dir() / "kvx_kernels.cu")
    for arch in ("compute_80", "compute_90"):
        rc, ptx, log = nvrtc.ptx(code, "kvx_kernels.cu", ["-std=c++17", f"--gpu-architecture={arch}"])
        assert rc == 0, f"NVRTC ({arch}) failed:\n{log}"
        entries = set(re.findall(r"\.entry (\w+)\(", ptx))
        assert entries == set(cuda._entry_names()), (arch, entries)


# --------------------------------------------------------------------------- host shim
@pytest.fixture(scope="session")
def shim_lib(tmp_path_factory) -> Path:
    """The ASan/UBSan g++ build of the host shim (built once per session)."""
    if shutil.which("g++") is None:
        pytest.skip("g++ not found: cannot build the host shim")
    return build(tmp_path_factory.mktemp("kvx_shim"))


def _run_sanitized(script: str, lib: Path) -> tuple[dict, str]:
    """Run ``tests/cuda_shim/<script> LIB`` under ASan/UBSan (a bad address aborts the process);
    {id: result line} of what it printed, and the tail of its stderr."""
    asan = subprocess.run(
        ["g++", "-print-file-name=libasan.so"], capture_output=True, text=True
    ).stdout.strip()
    env = dict(
        os.environ,
        LD_PRELOAD=asan,
        ASAN_OPTIONS="detect_leaks=0:abort_on_error=1",
        UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1",
    )
    res = subprocess.run(
        [sys.executable, str(SHIM / script), str(lib)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        cwd=ROOT,
    )
    results = {}
    for line in res.stdout.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            results[d["id"]] = d
    return results, f"exit {res.returncode}\n{res.stderr[-6000:]}"


@pytest.fixture(scope="session")
def shim_results(shim_lib):
    """Run the matrix once through the ASan/UBSan g++ build; {case id: result}, and stderr."""
    return _run_sanitized("run_matrix.py", shim_lib)


@pytest.fixture(scope="session")
def shim_engine_results(shim_lib):
    """The engine's transfers (tests/cuda_shim/run_engine.py) with every op launched through the
    ASan/UBSan g++ build of the CUDA kernels; {scenario id: result}, and stderr."""
    return _run_sanitized("run_engine.py", shim_lib)


ENGINE_SCENARIOS = (
    "pg-staged-bf16",
    "pg-whole-bf16",
    "pg-staged-e4m3",
    "pg-whole-e4m3",
    "pg-staged-nhd16-hnd32-partial",
    "pg-staged-hnd32-nhd16",
    "ipc-nhd16-hnd32-partial",
)


@pytest.mark.parametrize("sid", ENGINE_SCENARIOS)
def test_shim_engine_transfers(shim_engine_results, sid):
    """What a GPU run launches for a transfer through the engine (pg whole and staged in chunks,
    the one-GPU test's caches, bf16 and fp8; offset views of a partial load; ipc), run on CPU
    buffers under ASan/UBSan: every address in bounds, the bytes exact, the rest poisoned."""
    results, stderr = shim_engine_results
    assert sid in results, f"sanitized engine run stopped before this scenario:\n{stderr}"
    r = results[sid]
    assert r["ok"], r["error"]
    want = {"kvx_copy"} if sid.startswith("ipc") else {"kvx_gather", "kvx_scatter"}
    assert {e.rsplit("_", 1)[0] for e in r["launches"]} == want, r["launches"]


def test_case_ids_unique():
    assert len({c.id for c in CASES}) == len(CASES)


def test_shim_fastdiv(shim_results):
    results, stderr = shim_results
    assert "fastdiv" in results, f"host shim run crashed before any case:\n{stderr}"
    assert results["fastdiv"]["ok"], results["fastdiv"]["error"]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_shim_matrix(shim_results, case):
    results, stderr = shim_results
    assert case.id in results, f"sanitized host shim run stopped before this case:\n{stderr}"
    r = results[case.id]
    assert r["ok"], r["error"]
    assert len(r["entry"]) == 1, f"expected one launch, got {r['entry']}"


def test_shim_covers_every_width_and_op(shim_results):
    results, _ = shim_results
    launched = {e.split()[0] for r in results.values() for e in r["entry"]}
    assert launched == set(cuda._entry_names())


def test_shim_runs_in_process_without_sanitizers(tmp_path_factory):
    """The unsanitized build through the same ctypes path (a failure here points at the harness)."""
    lib = build(tmp_path_factory.mktemp("kvx_shim_plain"), sanitize=False)
    from cases import Case, run_case

    run_case(Case(op="gather", dtype="fp16", layout="HND", head_dim=3, src_bs=5), "cpu", HostKernels(lib, 2))


# --------------------------------------------------------------------------- wheel
def _wheel(tmp_path: Path, env: dict) -> zipfile.ZipFile:
    """Build a wheel from a copy of the tracked sources (setuptools would reuse ROOT/build/)."""
    src = tmp_path / "src"
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    for f in files:
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ROOT / f, src / f)
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(src),
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            "-q",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    (whl,) = tmp_path.glob("kvxfer-*.whl")
    return zipfile.ZipFile(whl)


def test_wheel_builds_without_nvcc(tmp_path):
    path = [
        d for d in os.environ.get("PATH", "").split(os.pathsep) if not os.path.exists(os.path.join(d, "nvcc"))
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH")}
    env["PATH"] = os.pathsep.join(path)
    names = _wheel(tmp_path, env).namelist()
    assert "kvxfer/csrc/kvx_kernels.cu" in names and "kvxfer/csrc/kvx_copy.cuh" in names
    assert "kvxfer/csrc/cpu/kvx_cpu.cpp" in names  # for the CPU backend's build on first use
    assert not any(n.endswith(".fatbin") for n in names)
    # The CPU backend library is built whenever a C++ compiler is there, nvcc or not.
    from kvxfer.backends import cpu_build

    cpu_libs = [n for n in names if n.startswith("kvxfer/_prebuilt/libkvx_cpu-")]
    ctl = [n for n in names if n.startswith("kvxfer/_prebuilt/_kvx_ctl-")]  # kvxfer/idops.py
    assert "kvxfer/csrc/ctl/kvx_ctl.cpp" in names
    if cpu_build.find_compiler() is not None:
        assert cpu_libs == [f"kvxfer/_prebuilt/{cpu_build.library_name(ROOT / 'csrc')}"]
        assert ctl == [f"kvxfer/_prebuilt/{cpu_build.library_name(ROOT / 'csrc', cpu_build.CONTROL_MODULE)}"]
    else:
        assert cpu_libs == [] and ctl == []


def test_wheel_builds_with_a_failing_cxx(tmp_path):
    """A broken C++ compiler must not fail the install: the wheel builds without the CPU library
    (the backend compiles it on first use, or falls back to the torch reference)."""
    env = dict(os.environ, CXX="false", KVXFER_NO_NVCC="1")
    names = _wheel(tmp_path, env).namelist()
    assert "kvxfer/csrc/cpu/kvx_cpu.cpp" in names and "kvxfer/csrc/ctl/kvx_ctl.cpp" in names
    assert not any("libkvx_cpu" in n or "_kvx_ctl" in n for n in names)


def test_wheel_ships_fatbin_with_nvcc(tmp_path, nvcc_build):
    names = _wheel(tmp_path, dict(os.environ)).namelist()
    assert "kvxfer/_prebuilt/kvxfer_kernels.fatbin" in names
    assert "kvxfer/csrc/kvx_common.cuh" in names


# --------------------------------------------------------------------------- backend (no GPU)
def test_is_available_false_without_gpu_never_raises():
    assert cuda.is_available(torch.device("cpu")) is False
    if not torch.cuda.is_available():
        assert cuda.is_available(torch.device("cuda")) is False
        assert cuda.is_available(torch.device("cuda", 3)) is False
    assert cuda.is_available("not a device") is False


def test_copy_width():
    assert cuda.copy_width(256, 4096, 0, 1 << 40) == 16
    assert cuda.copy_width(6, 4096) == 2
    assert cuda.copy_width(64, 8) == 8
    assert cuda.copy_width(64, 12) == 4
    assert cuda.copy_width(64, 1 << 20, 5) == 1


def test_inlined_source_is_self_contained():
    code = cuda.inline_source(cuda.source_dir() / "kvx_kernels.cu")
    assert not re.search(r'#\s*include\s+"', code.split("#else")[0])
    for name in cuda._entry_names():
        assert f"kvx_{name.split('_')[1]}_w" in code
    assert code.count("struct FastDiv") == 1


def _side(layout="NHD", num_tokens=100, head_dim=128, heads=8, num_heads=8, layers=4, bs=16):
    spec = KVCacheSpec(layers, heads, head_dim, bs, torch.bfloat16, Layout(layout))
    caches = [torch.zeros(spec.local_cache_shape(16, heads), dtype=torch.bfloat16) for _ in range(layers)]
    return ops.make_side(caches, spec, list(range(spec.num_blocks_for(num_tokens))), num_tokens, 0, num_heads)


def test_plan_one_launch_and_bounded_grid():
    side = _side(num_tokens=200)
    launch = cuda.plan_gather(side, 1 << 30, max_blocks=528)
    assert launch.name == "kvx_gather_w16" and launch.block == cuda.THREADS
    assert 1 <= launch.grid <= 528
    h, n_layers, kv, t, row_bytes, chunk = launch.args[:6]
    assert (h, n_layers, kv, t, row_bytes) == (8, 4, 2, 200, 256)
    assert 1 <= chunk <= t
    # device tables: layer bases then block ids, in one tensor the pointer args point into
    meta = launch.meta
    assert launch.args[6] == meta.data_ptr() and launch.args[7] == meta.data_ptr() + 8 * 4
    assert meta[:4].tolist() == side.layer_ptrs()
    assert meta[4:].tolist() == side.block_ids.tolist()


def test_plan_head_slice_folds_head_start_into_layer_bases():
    spec = KVCacheSpec(2, 8, 64, 16, torch.float16, Layout.HND)
    caches = [torch.zeros(spec.local_cache_shape(4, 8), dtype=torch.float16) for _ in range(2)]
    side = ops.make_side(caches, spec, [3, 1], 20, head_start=5, num_heads=1)
    launch = cuda.plan_scatter(1 << 30, side, max_blocks=4)
    head_bytes = 16 * 64 * 2
    assert launch.meta[:2].tolist() == [p + 5 * head_bytes for p in side.layer_ptrs()]
    assert launch.args[:6][0] == 1


def test_plan_copy_takes_narrowest_width_of_both_sides():
    a = _side(head_dim=128)
    spec = KVCacheSpec(4, 8, 128, 16, torch.bfloat16, Layout.NHD)
    layer_bytes = 2 * 16 * 16 * 8 * 128 * 2
    raw = torch.zeros(layer_bytes * 4 + 2, dtype=torch.uint8)
    caches = [
        raw[2 + i * layer_bytes : 2 + (i + 1) * layer_bytes].view(torch.bfloat16).view(2, 16, 16, 8, 128)
        for i in range(4)
    ]
    b = ops.make_side(caches, spec, list(range(7)), 100, 0, 8)
    assert cuda.plan_copy(a, b, 4).name == "kvx_copy_w2"


def _fake_cupy_runtime(attrs: dict):
    """A fake CuPy whose runtime binds devices per thread (``tests.test_device_context``) and
    answers pointer attributes from ``attrs`` only on a thread that bound one, as the real
    runtime answers per context (the H200 failure of 2026-11-26: device pointer 0)."""
    import types

    from tests.test_device_context import FakeRuntime

    class Runtime(FakeRuntime):
        memoryTypeHost = 1

        def pointerGetAttributes(self, p):  # CuPy's name
            mapped = self.bound() is not None
            return types.SimpleNamespace(
                type=attrs["type"], devicePointer=attrs["devicePointer"] if mapped else 0
            )

    rt = Runtime()
    return types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=rt)), rt


def test_device_address_of_host_memory_must_be_pinned_and_mapped(monkeypatch):
    """The pinned wire's address comes from the driver's pointer attributes; memory that is not
    pinned host memory, or has no device mapping, is refused naming the address, never handed
    to a kernel (an illegal address on the GPU)."""
    import sys

    from kvxfer.backends import cuda as kc

    attrs = {"type": 1, "devicePointer": 0x7000}
    fake, _ = _fake_cupy_runtime(attrs)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    t = torch.empty(64, dtype=torch.uint8)
    dev = torch.device("cuda", 0)
    assert kc._device_address(t, dev) == 0x7000
    for bad in ({"type": 0, "devicePointer": 0x7000}, {"type": 1, "devicePointer": 0}):
        attrs.update(bad)
        with pytest.raises(ValueError, match=f"wire: host memory at {t.data_ptr():#x} is not pinned.*cuda:0"):
            kc._device_address(t, dev)


def test_device_address_binds_the_device_context_on_a_fresh_thread(monkeypatch):
    """A thread whose first CUDA call is the pinned wire's address lookup (the staged exporter's
    side-channel thread) binds the cache device's context before asking: before this, the
    lookup answered device pointer 0 there and the gather was refused. The thread's previous
    device is restored when it differs."""
    import sys
    import threading

    from kvxfer.backends import cuda as kc

    fake, rt = _fake_cupy_runtime({"type": 1, "devicePointer": 0x7000})
    monkeypatch.setitem(sys.modules, "cupy", fake)
    t = torch.empty(64, dtype=torch.uint8)
    got: dict = {}

    def fresh_thread():
        try:
            got["addr"] = kc._device_address(t, torch.device("cuda", 0))
            got["device_after"] = rt.bound()
            rt.setDevice(1)  # a thread working on another device keeps it
            kc._device_address(t, torch.device("cuda", 0))
            got["restored"] = rt.bound()
        except Exception as exc:  # surfaced by the asserts below
            got["error"] = exc

    th = threading.Thread(target=fresh_thread)
    th.start()
    th.join(10)
    assert not th.is_alive()
    assert "error" not in got, got.get("error")
    assert got == {"addr": 0x7000, "device_after": 0, "restored": 1}


def test_launch_logs_kernel_stream_and_addresses_at_debug(monkeypatch, caplog):
    """At DEBUG every CUDA C++ launch is logged with its kernel, stream, grid and arguments
    (addresses in hex): what an illegal-address report needs. Driven through fake cupy/torch
    stream objects: nothing runs."""
    import sys
    import types

    from kvxfer.backends import cuda as kc
    from tests.test_device_context import FakeRuntime

    launched = []
    rt = FakeRuntime()

    class _Ctx:
        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=rt))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(
        kc, "_kernels", lambda i: {"kvx_gather_w16": lambda g, b, a: launched.append((g, b, a, rt.bound()))}
    )
    monkeypatch.setattr(kc, "_cupy_stream", lambda ptr, i: _Ctx())
    monkeypatch.setattr(kc.torch.cuda, "current_stream", lambda d: types.SimpleNamespace(cuda_stream=0xABC))
    plan = kc.Launch("kvx_gather_w16", 7, 256, (3, 0x7F0000001000), None)
    with caplog.at_level("DEBUG", logger="kvxfer.backends.cuda"):
        kc._launch(plan, torch.device("cuda", 0))
    assert launched and launched[0][0] == (7,)
    assert launched[0][3] == 0, "launched without the device's context bound on this thread"
    msg = next(r.getMessage() for r in caplog.records if r.name == "kvxfer.backends.cuda")
    assert (
        "kvx_gather_w16" in msg
        and "stream 0xabc" in msg
        and "0x7f0000001000" in msg
        and "grid 7 x 256" in msg
    )


class _FakeRawKernel:
    """What the backend reads of a ``cupy.RawKernel``: ``.kernel`` (a ``cupy.cuda.function.Function``)
    and its ``.ptr``, the CUfunction handle; a RawKernel itself has no ``ptr`` (on the H200 of
    2026-11-26 the occupancy query failed with that AttributeError and fell back to 4 per SM)."""

    __slots__ = ("kernel",)

    def __init__(self, name: str) -> None:
        import types

        self.kernel = types.SimpleNamespace(ptr=name)


def test_fake_raw_kernel_mirrors_cupy():
    """The fake above has the attributes cupy's classes have (checked where cupy is installed)."""
    cupy = pytest.importorskip(
        "cupy", reason="cupy is not installed: the fake's shape is checked where it is"
    )
    assert hasattr(cupy.RawKernel, "kernel")
    assert not hasattr(cupy.RawKernel, "ptr")
    assert hasattr(cupy.cuda.function.Function, "ptr")


def _fake_occupancy(monkeypatch, fits: dict[str, int] | Exception):
    """The CUDA backend with fake kernels (their function's ``ptr`` = their name) and a fake
    driver whose occupancy query answers ``fits[name]`` (or raises ``fits``), on a device with 132 SMs."""
    import sys
    import types

    from kvxfer.backends import cuda as kc
    from tests.test_device_context import FakeRuntime

    asked = []

    def occupancy(ptr, threads, smem):
        asked.append((ptr, threads, smem))
        if isinstance(fits, Exception):
            raise fits
        return fits[ptr]

    driver = types.SimpleNamespace(occupancyMaxActiveBlocksPerMultiprocessor=occupancy)
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=FakeRuntime(), driver=driver))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    names = kc._entry_names()
    monkeypatch.setattr(kc, "_kernels", lambda i: {n: _FakeRawKernel(n) for n in names})
    monkeypatch.setattr(kc, "_num_sms", lambda i: 132)
    monkeypatch.setattr(kc, "_blocks_per_sm", functools.cache(kc._blocks_per_sm.__wrapped__))  # a fresh cache
    return kc, asked


def test_grid_is_one_full_wave_of_the_widest_entries(monkeypatch):
    """The persistent grid holds as many blocks per SM as the driver says fit for the widest
    entry points (the most registers), the fewest of the three ops: on an H200 a fixed 4 per
    SM gave 0.8 waves where 5 fit (ncu, 2026-11-26)."""
    fits = {n: 8 for n in cuda._entry_names()}
    fits.update({"kvx_gather_w16": 5, "kvx_scatter_w16": 6, "kvx_copy_w16": 5})
    kc, asked = _fake_occupancy(monkeypatch, fits)
    assert kc._max_blocks(torch.device("cuda", 0)) == 132 * 5
    assert sorted(a[0] for a in asked) == ["kvx_copy_w16", "kvx_gather_w16", "kvx_scatter_w16"]
    assert {a[1:] for a in asked} == {(kc.THREADS, 0)}
    kc._max_blocks(torch.device("cuda", 0))
    assert len(asked) == 3, "asked once per device"


@pytest.mark.parametrize("answer", [RuntimeError("cuOccupancy failed"), 0])
def test_grid_falls_back_to_the_fixed_blocks_per_sm_and_says_why(monkeypatch, caplog, answer):
    fits = answer if isinstance(answer, Exception) else {n: answer for n in cuda._entry_names()}
    kc, _ = _fake_occupancy(monkeypatch, fits)
    with caplog.at_level("WARNING", logger="kvxfer.backends.cuda"):
        assert kc._max_blocks(torch.device("cuda", 0)) == 132 * kc.BLOCKS_PER_SM
    msg = " ".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert "occupancy" in msg and f"{kc.BLOCKS_PER_SM} " in msg
    if isinstance(answer, Exception):
        assert "cuOccupancy failed" in msg


def test_plans_of_a_registered_cache_keep_its_layer_table_per_head_slice():
    """The engine's sides share their template's memo: the layer bases are computed once per
    (cache, head slice, layers) and every later plan carries the same table, its own ids."""
    spec = KVCacheSpec(3, 4, 64, 16, torch.float16, Layout.HND)
    pc = ops.register_caches(
        [torch.zeros(spec.local_cache_shape(8, 4), dtype=torch.float16) for _ in range(3)], spec
    )
    head_bytes = 16 * 64 * 2
    for head_start in (0, 2, 0, 2):
        for ids in ([3, 1], [7, 0]):
            side, _ = prepared_copy(pc, pc, head_start, head_start, 2, None).sides(
                ops.CheckedIds(np.array(ids), 8, True), ops.CheckedIds(np.array(ids), 8, True), 20
            )
            assert side.memo is not None
            launch = cuda.plan_gather(side, 1 << 30, max_blocks=4)
            assert launch.meta[:3].tolist() == [c.data_ptr() + head_start * head_bytes for c in pc]
            assert launch.meta[3:].tolist() == ids
            assert side.memo["cuda"].layers.tolist() == launch.meta[:3].tolist()
    fresh = ops.make_side(list(pc), spec, [3, 1], 20, 2, 2)  # a side made once: no memo
    assert fresh.memo is None
    assert cuda.plan_gather(fresh, 1 << 30, 4).meta.tolist() == [
        c.data_ptr() + 2 * head_bytes for c in pc
    ] + [3, 1]
