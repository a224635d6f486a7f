"""The native CPU backend (csrc/cpu/kvx_cpu.cpp, kvxfer.backends.cpu): exactness beyond the op
tests of test_ops.py (which run it on every dtype, layout and shape there), its threads, the GIL,
fork, how it is built, found, and fallen back from.

Exactness is checked two ways: against the independent truth of tests/kvdata.py (poison
everywhere a transfer must not write), and through the CUDA-kernel case matrix of
tests/cuda_shim/cases.py (misaligned bases, odd row sizes, slices, block sizes) against the torch
reference, once single-threaded and once forced onto several threads with streaming stores.
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from kvxfer import KVCacheSpec, Layout, ops
from kvxfer.backends import cpu, cpu_build
from tests.kvdata import as_bytes, empty_cache, first_difference, place, truth_bytes, wire_from_truth

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "cuda_shim"))

from cases import matrix, run_case  # noqa: E402

CASES = matrix()
HAS_CXX = cpu_build.find_compiler() is not None


@pytest.fixture
def forced_threads(monkeypatch):
    """Every transfer split over 3 threads (however small), streaming stores on."""
    monkeypatch.setattr(cpu, "MIN_BYTES_PER_THREAD", 1)
    monkeypatch.setattr(cpu, "STREAM_MIN_BYTES", 0)
    old = cpu.get_num_threads()
    cpu.set_num_threads(3)
    yield
    cpu.set_num_threads(old)


def _eq(got: torch.Tensor, want: torch.Tensor) -> None:
    got = got.contiguous().view(torch.uint8).reshape(want.shape)
    assert torch.equal(got, want), first_difference(got, want)


# --------------------------------------------------------------------------- availability, dispatch
def test_loads_when_a_compiler_exists():
    """CI has g++: the backend must load (a build problem fails here instead of hiding behind
    the torch fallback)."""
    if not HAS_CXX:
        pytest.skip("no C++ compiler on this machine: the fallback is tested below")
    assert cpu.is_available(torch.device("cpu")), cpu.load_error()
    assert cpu.library_path() is not None and cpu.library_path().name == cpu_build.library_name(
        cpu.source_dir()
    )


def test_default_backend_on_cpu_tensors_is_cpu():
    spec = KVCacheSpec(2, 2, 8, 4, torch.float16, Layout.NHD)
    caches = empty_cache(spec, 3, 2)
    assert ops.resolve_backend("cpu") == "cpu"
    ops.gather_blocks(caches, spec, [2, 0], 7)
    assert ops.last_backend() == "cpu"
    ops.gather_blocks(caches, spec, [2, 0], 7, backend="torch")
    assert ops.last_backend() == "torch"
    assert cpu.is_available(torch.device("cuda")) is False
    assert cpu.is_available("not a device") is False
    with pytest.raises(ValueError, match="'cpu' is not available for cuda tensors"):
        ops.resolve_backend("cuda", "cpu")


# --------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("threaded", [False, True], ids=["1thread", "3threads+stream"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_case_matrix_matches_reference(case, threaded, request):
    if threaded:
        request.getfixturevalue("forced_threads")
    run_case(case, "cpu", cpu)


@pytest.mark.parametrize("ids_kind", ["adjacent", "reversed", "random"])
@pytest.mark.parametrize(
    "src_layout,dst_layout,src_bs,dst_bs,heads",
    [
        (Layout.NHD, Layout.NHD, 16, 16, range(0, 4)),  # whole blocks contiguous on both sides
        (Layout.NHD, Layout.NHD, 16, 32, range(0, 4)),
        (Layout.HND, Layout.HND, 16, 32, range(0, 4)),
        (Layout.HND, Layout.HND, 8, 8, range(0, 4)),  # all heads of a block: one run
        (Layout.NHD, Layout.HND, 16, 32, range(1, 3)),
        (Layout.HND, Layout.NHD, 32, 16, range(3, 4)),
        ("MLA", "MLA", 16, 32, range(0, 1)),
    ],
)
@pytest.mark.parametrize("order", ["auto", "dst", "src"])
def test_runs_merge_exactly(
    src_layout, dst_layout, src_bs, dst_bs, heads, ids_kind, order, forced_threads, monkeypatch
):
    """Adjacent block ids let runs continue across blocks (one memcpy for many rows): copy,
    gather and scatter still move exactly the request's rows and nothing else, in each loop
    order of the 2-D copies (the rule, and the two the sweep compares it with)."""
    monkeypatch.setattr(cpu, "EXTRA_FLAGS", {"auto": 0, "dst": 2, "src": 4}[order])
    mla = src_layout == "MLA"

    def spec(layout, bs):
        if mla:
            return KVCacheSpec(3, 1, 64, bs, torch.bfloat16, use_mla=True)
        return KVCacheSpec(3, 4, 64, bs, torch.bfloat16, layout)

    s_spec, d_spec = spec(src_layout, src_bs), spec(dst_layout, dst_bs)
    num_tokens = 150  # partial last block on every side
    truth = truth_bytes(s_spec, num_tokens, seed=7)
    ns, nd = s_spec.num_blocks_for(num_tokens), d_spec.num_blocks_for(num_tokens)
    g = torch.Generator().manual_seed(3)
    if ids_kind == "adjacent":
        s_ids, d_ids = list(range(2, 2 + ns)), list(range(1, 1 + nd))
    elif ids_kind == "reversed":
        s_ids, d_ids = list(range(ns))[::-1], list(range(nd))[::-1]
    else:
        s_ids, d_ids = (
            torch.randperm(ns + 3, generator=g)[:ns].tolist(),
            torch.randperm(nd + 3, generator=g)[:nd].tolist(),
        )
    h_local = 1 if mla else 4
    src = empty_cache(s_spec, ns + 3, h_local)
    place(src, s_spec, truth, range(s_spec.num_kv_heads), s_ids)
    dst_start = 0 if mla else 4 - len(heads)
    kw = dict(src_head_start=heads.start, dst_head_start=dst_start, num_heads=len(heads), backend="cpu")
    dst = empty_cache(d_spec, nd + 3, h_local)
    ops.copy_blocks(src, s_spec, s_ids, dst, d_spec, d_ids, num_tokens, **kw)
    want = empty_cache(d_spec, nd + 3, h_local)
    place(want, d_spec, truth, heads, d_ids, local_head_start=dst_start)
    _eq(as_bytes(dst), as_bytes(want))

    wire = ops.gather_blocks(src, s_spec, s_ids, num_tokens, heads.start, len(heads), backend="cpu")
    _eq(wire, wire_from_truth(truth, s_spec, heads))
    dst = empty_cache(d_spec, nd + 3, h_local)
    ops.scatter_blocks(wire, dst, d_spec, d_ids, num_tokens, head_start=dst_start, backend="cpu")
    _eq(as_bytes(dst), as_bytes(want))


def test_block_ids_as_a_strided_tensor():
    """Block ids handed over as a strided view (every other entry of a table) are read as the
    values they show, not as the memory under them."""
    spec = KVCacheSpec(2, 2, 16, 4, torch.bfloat16, Layout.HND)
    truth = truth_bytes(spec, 10, seed=4)
    table = torch.tensor([5, 0, 1, 0, 3, 0])
    ids = table[::2]
    assert not ids.is_contiguous()
    src = empty_cache(spec, 6, 2)
    place(src, spec, truth, range(2), [5, 1, 3])
    _eq(ops.gather_blocks(src, spec, ids, 10, backend="cpu"), wire_from_truth(truth, spec, range(2)))
    dst = empty_cache(spec, 6, 2)
    ops.copy_blocks(src, spec, ids, dst, spec, table[1::2] + torch.tensor([1, 2, 4]), 10, backend="cpu")
    want = empty_cache(spec, 6, 2)
    place(want, spec, truth, range(2), [1, 2, 4])
    _eq(as_bytes(dst), as_bytes(want))


def test_registered_caches_keep_their_tables_across_calls():
    """The engine's path (registered caches, checked ids): the layer table and static fields
    are kept in the template's memo, the block ids taken per call; every call lands exactly."""
    import numpy as np

    spec = KVCacheSpec(3, 4, 32, 4, torch.bfloat16, Layout.NHD)
    truth = truth_bytes(spec, 10, seed=11)
    src = empty_cache(spec, 12, 4)
    place(src, spec, truth, range(4), [9, 2, 5])
    dst_spec = KVCacheSpec(3, 4, 32, 8, torch.bfloat16, Layout.HND)
    pc_src, pc_dst = (
        ops.register_caches(src, spec),
        ops.register_caches(empty_cache(dst_spec, 8, 4), dst_spec),
    )
    for src_ids, dst_ids in (([9, 2, 5], [3, 6]), ([9, 2, 5], [1, 7]), ([9, 2, 5], [0, 4])):
        ops.copy_blocks(
            pc_src, spec, ops.CheckedIds(np.array(src_ids), 12, False),
            pc_dst, dst_spec, ops.CheckedIds(np.array(dst_ids), 8, True), 10, backend="cpu",
        )  # fmt: skip
        want = empty_cache(dst_spec, 8, 4)
        place(want, dst_spec, truth, range(4), dst_ids)
        for got, w in zip(pc_dst, want):  # poison-free: blocks of earlier rounds are kept too
            for b in dst_ids:
                assert torch.equal(
                    got[:, b].contiguous().view(torch.uint8), w[:, b].contiguous().view(torch.uint8)
                )
    memos = [t.memo for t in pc_dst.__dict__["_sides"].values()]
    assert memos and all("cpu" in m for m in memos)


@pytest.mark.parametrize("threaded", [False, True])
def test_copy_within_one_cache_reads_before_writing(threaded, request):
    """Source and destination blocks overlap inside one cache: every row is read before any is
    written (as the torch reference does), whatever the order the threads run in."""
    if threaded:
        request.getfixturevalue("forced_threads")
    spec = KVCacheSpec(2, 2, 32, 4, torch.float16, Layout.HND)
    truth = truth_bytes(spec, 14, seed=9)
    caches = empty_cache(spec, 6, 2)
    place(caches, spec, truth, range(2), [0, 1, 2, 3])
    ref = [c.clone() for c in caches]
    ops.copy_blocks(ref, spec, [0, 1, 2, 3], ref, spec, [1, 2, 3, 4], 14, backend="torch")
    ops.copy_blocks(caches, spec, [0, 1, 2, 3], caches, spec, [1, 2, 3, 4], 14, backend="cpu")
    assert torch.equal(as_bytes(caches), as_bytes(ref))


def test_concurrent_callers_share_the_pool_exactly(forced_threads):
    """Engine threads may copy at once: a caller that finds the pool busy runs on its own thread."""
    spec = KVCacheSpec(4, 4, 64, 16, torch.bfloat16, Layout.NHD)
    truth = truth_bytes(spec, 300, seed=11)
    ids = list(range(19))[::-1]
    src = empty_cache(spec, 20, 4)
    place(src, spec, truth, range(4), ids)
    want = wire_from_truth(truth, spec, range(4))
    errors: list[str] = []

    def worker() -> None:
        for _ in range(30):
            wire = ops.gather_blocks(src, spec, ids, 300, backend="cpu")
            got = wire.view(torch.uint8).reshape(want.shape)
            if not torch.equal(got, want):
                errors.append(first_difference(got, want))

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and errors == []


class _Bracketed:
    """Wraps the loaded library: records perf_counter just before and after each foreign call."""

    def __init__(self, lib) -> None:
        self.lib, self.calls = lib, []

    def kvx_cpu_move(self, args, n):
        t0 = time.perf_counter()
        rc = self.lib.kvx_cpu_move(args, n)
        self.calls.append((t0, time.perf_counter()))
        return rc


def test_copy_releases_the_gil(monkeypatch):
    """With a 100 s switch interval a thread holding the GIL is never made to give it up, so the
    main thread runs Python during a copy only if the foreign call released the GIL."""
    assert cpu.is_available(torch.device("cpu")), cpu.load_error()
    spec = KVCacheSpec(8, 8, 128, 16, torch.bfloat16, Layout.NHD)
    caches = [torch.ones(spec.cache_shape(520, 1), dtype=spec.dtype) for _ in range(8)]  # 8 x 34 MB
    side = ops.make_side(caches, spec, list(range(512))[::-1], 8192, 0, 8)
    wire = torch.empty(side.wire_view_shape(), dtype=spec.dtype)
    lib = _Bracketed(cpu._lib)
    monkeypatch.setattr(cpu, "_lib", lib)
    old = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    ticks: list[float] = []
    try:
        for _ in range(3):
            done = threading.Event()

            def copy_then_set(done: threading.Event = done) -> None:
                cpu.gather(side, wire)
                done.set()

            t = threading.Thread(target=copy_then_set)
            t.start()
            while not done.is_set():
                ticks.append(time.perf_counter())
                time.sleep(0)  # lets the copying thread take the GIL when it needs it
            t.join()
            t0, t1 = lib.calls[-1]
            if any(t0 < x < t1 for x in ticks):
                break
    finally:
        sys.setswitchinterval(old)
    t0, t1 = lib.calls[-1]
    inside = [x for x in ticks if t0 < x < t1]
    assert inside, f"no Python ran during {len(lib.calls)} copies of {(t1 - t0) * 1e3:.1f} ms: GIL held"


def _forked_child(q) -> None:
    """After fork: a threaded gather must not wait for workers that exist only in the parent."""
    torch.set_num_threads(1)  # torch's own OpenMP pool is not usable after fork either
    spec = KVCacheSpec(2, 4, 64, 16, torch.float16, Layout.HND)
    truth = truth_bytes(spec, 100, seed=5)
    src = empty_cache(spec, 8, 4)
    place(src, spec, truth, range(4), [7, 1, 3, 0, 5, 2, 6])
    wire = ops.gather_blocks(src, spec, [7, 1, 3, 0, 5, 2, 6], 100, backend="cpu")
    want = wire_from_truth(truth, spec, range(4))
    q.put(bool(torch.equal(wire.view(torch.uint8).reshape(want.shape), want)))


def test_threaded_copy_after_fork(forced_threads):
    spec = KVCacheSpec(2, 4, 64, 16, torch.float16, Layout.NHD)
    ops.gather_blocks(empty_cache(spec, 8, 4), spec, list(range(7)), 100, backend="cpu")  # pool up
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_forked_child, args=(q,))
    p.start()
    p.join(timeout=60)
    if p.is_alive():
        p.kill()
        pytest.fail("the forked child hung in a threaded copy (pool inherited from the parent)")
    assert p.exitcode == 0 and q.get(timeout=5) is True


# --------------------------------------------------------------------------- threads setting
def _python(code: str, env: dict | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=timeout, cwd=ROOT
    )


def test_threads_from_env_and_setter():
    code = "from kvxfer.backends import cpu; print(cpu.get_num_threads())"
    assert _python(code, {"KVXFER_CPU_THREADS": "3"}).stdout.strip() == "3"
    res = _python(code, {"KVXFER_CPU_THREADS": "many"})
    assert res.stdout.strip() == str(min(4, len(os.sched_getaffinity(0))))
    assert "KVXFER_CPU_THREADS='many' is not a positive integer" in res.stderr
    env = {k: v for k, v in os.environ.items() if k != "KVXFER_CPU_THREADS"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert res.stdout.strip() == str(min(4, len(os.sched_getaffinity(0))))
    with pytest.raises(ValueError, match="n: must be an int"):
        cpu.set_num_threads(0)
    with pytest.raises(ValueError, match="n: must be an int"):
        cpu.set_num_threads(True)


# --------------------------------------------------------------------------- building, loading, fallback
_PROBE = """
import json, logging, sys, torch
from pathlib import Path
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
from kvxfer import KVCacheSpec, Layout, ops
from kvxfer.backends import cpu
cpu._prebuilt_dir = lambda: Path(sys.argv[1])  # as if installed without a prebuilt library
spec = KVCacheSpec(2, 2, 8, 4, torch.float16, Layout.NHD)
caches = [torch.arange(2 * 3 * 4 * 2 * 8, dtype=torch.int16).view(torch.float16).view(2, 3, 4, 2, 8) for _ in range(2)]
wire = ops.gather_blocks(caches, spec, [2, 0], 7)
ref = ops.gather_blocks(caches, spec, [2, 0], 7, backend="torch")
chosen = ops.resolve_backend("cpu")
try:
    ops.gather_blocks(caches, spec, [2, 0], 7, backend="cpu")
    forced = "ran"
except ValueError as e:
    forced = str(e)
print(json.dumps({"backend": chosen, "equal": bool(torch.equal(wire.view(torch.int16), ref.view(torch.int16))),
                  "forced": forced, "path": str(cpu.library_path()), "error": cpu.load_error()}))
"""


def _probe(tmp_path: Path, env: dict) -> tuple[dict, str]:
    res = subprocess.run(
        [sys.executable, "-c", _PROBE, str(tmp_path / "no-prebuilt")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "KVXFER_CACHE_DIR": str(tmp_path / "cache"), **env},
        timeout=300,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1]), res.stderr


@pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler: nothing to build lazily with")
def test_lazy_build_into_cache_dir_on_first_use(tmp_path):
    out, log = _probe(tmp_path, {})
    assert out["backend"] == "cpu" and out["equal"] and out["forced"] == "ran", out
    assert out["path"] == str(tmp_path / "cache" / cpu_build.library_name(cpu.source_dir()))
    assert "compiling it once into" in log and "kvxfer CPU backend: loaded" in log
    out, log = _probe(tmp_path, {})  # second process: found in the cache, not rebuilt
    assert out["backend"] == "cpu" and "compiling" not in log


def test_falls_back_to_torch_with_a_warning_when_the_compiler_fails(tmp_path):
    out, log = _probe(tmp_path, {"CXX": "false"})
    assert out["backend"] == "torch" and out["equal"], out
    assert out["forced"].startswith(
        "backend: 'cpu' is not available for cpu tensors here (the native library did not load: BuildError"
    )
    assert "exited with 1" in out["error"] and out["path"] == "None"
    warnings = [line for line in log.splitlines() if line.startswith("WARNING")]
    # the attempt, why it failed, and the dispatcher's fallback naming the same reason
    assert len(warnings) == 3 and "compiling it once into" in warnings[0], warnings
    assert "'cpu' unavailable for cpu tensors" in warnings[2] and "exited with 1" in warnings[2]
    assert "kvxfer CPU backend unavailable" in warnings[1] and "torch reference" in warnings[1]
    assert "false -std=c++17" in warnings[1]


def test_falls_back_when_no_compiler_exists(tmp_path):
    out, log = _probe(tmp_path, {"CXX": str(tmp_path / "no-such-compiler")})
    assert out["backend"] == "torch" and "FileNotFoundError" in out["error"], out
    assert "kvxfer CPU backend unavailable" in log


def test_library_rejects_a_foreign_abi(tmp_path, monkeypatch):
    if cpu.library_path() is None:
        pytest.skip(f"library not loaded: {cpu.load_error()}")
    abi = cpu_build.ABI_VERSION  # the library's own (it was loaded)
    monkeypatch.setattr(cpu_build, "ABI_VERSION", 999)
    with pytest.raises(OSError, match=f"ABI version {abi}, this kvxfer needs 999"):
        cpu._open(cpu.library_path())


def _setup_module():
    spec = importlib.util.spec_from_file_location("kvxfer_setup", ROOT / "setup.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_setup_builds_the_library_under_the_name_the_loader_wants(tmp_path, capsys):
    if not HAS_CXX:
        pytest.skip("no C++ compiler")
    lib = _setup_module().build_native(tmp_path, "CPU_LIBRARY")
    assert lib is not None and lib.name == cpu_build.library_name(cpu.source_dir())
    assert cpu._open(lib).kvx_cpu_abi_version() == cpu_build.ABI_VERSION
    assert "kvxfer: " in capsys.readouterr().out


@pytest.mark.parametrize("cxx", ["false", "/no/such/c++"])
def test_setup_reports_a_failing_compiler_without_failing(tmp_path, monkeypatch, capsys, cxx):
    monkeypatch.setenv("CXX", cxx)
    assert _setup_module().build_native(tmp_path, "CPU_LIBRARY") is None
    out = capsys.readouterr().out
    assert "kvxfer: WARNING: CPU_LIBRARY not built" in out and "compiled on first use" in out
    assert not list(tmp_path.glob("*.so")) and not list(tmp_path.glob(".libkvx*"))


def test_source_hash_names_the_library():
    name = cpu_build.library_name(cpu.source_dir())
    assert name.startswith("libkvx_cpu-") and name.endswith(".so") and len(name) == len("libkvx_cpu-.so") + 16
