"""The SM budget (``max_sms``): grid sizes under a budget, where a call's budget comes from, the
errors a bad one gets, and capped kernels moving bytes exactly.

CPU: the Triton kernel's persistent variant in the interpreter (poisoned destinations, every
dtype, all three layouts, partial last blocks) and the CUDA C++ kernels' launches under a budget
(the backend's own grid choice, wide blocks) run through the g++ host shim under ASan/UBSan, plus
the sm_90a PTX of the persistent variant (128-bit moves kept). GPU (``gpu``): the same through
both backends on the device.

This file is also the host-shim script of the CUDA C++ part: ``python tests/test_sm_budget.py
LIB.so`` prints one JSON line per case.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SHIM = ROOT / "tests" / "cuda_shim"
if not torch.cuda.is_available():  # tests/conftest.py does the same; here for single-file runs
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path[:0] = [str(ROOT), str(SHIM)]

from kvxfer import KVCacheSpec, Layout, dispatch, ops  # noqa: E402
from kvxfer.backends import cuda  # noqa: E402

# (op, budget, threads) the shim cases run under, and the cases: every dtype, layouts, head
# slices, partial last blocks, layer subsets; grid of 1-3 blocks so each block strides
SHIM_BUDGETS = ((1, 1024), (2, 512), (3, 96))


def _shim_cases():
    from cases import DTYPES, Case

    out = []
    for op in ("gather", "scatter", "copy"):
        for dtype in DTYPES:
            for layout in ("NHD", "HND", "MLA"):
                heads = dict(num_heads=1) if layout == "MLA" else dict(src_head_start=1, num_heads=2)
                out.append(Case(op=op, dtype=dtype, layout=layout, num_tokens=37, **heads))
        out.append(Case(op=op, layout="HND", dst_layout="NHD", dst_bs=32, src_head_start=1, num_heads=2))
        out.append(Case(op=op, dtype="e4m3", head_dim=72, num_tokens=100, layers=None, src_bs=12, dst_bs=20))
    return out


# --------------------------------------------------------------------------- grid sizes
def test_triton_grid_under_a_budget():
    pytest.importorskip("triton")
    from kvxfer.kernels import launch

    assert launch.budget_grid(500, None) == (500, False)  # no budget: one program per tile
    assert launch.budget_grid(8, 8) == (8, False)  # fits: the uncapped variant
    assert launch.budget_grid(7, 8) == (7, False)
    assert launch.budget_grid(9, 8) == (8, True)  # capped: persistent programs stride
    assert launch.budget_grid(1 << 20, 1) == (1, True)


@pytest.mark.parametrize(
    ("sms", "per_sm", "max_threads", "budget", "want"),
    [
        (132, 5, 1024, None, (660, 256)),  # no budget: one full wave of 256-thread blocks
        (132, 5, 1024, 132, (660, 256)),  # a budget of every SM is none
        (132, 5, 1024, 500, (660, 256)),
        (132, 5, 1024, 8, (8, 1024)),  # one block per SM, as wide as a wave's share of an SM
        (132, 4, 1024, 16, (16, 1024)),
        (132, 2, 1024, 32, (32, 512)),
        (132, 5, 640, 8, (8, 640)),  # the registers allow fewer threads
        (132, 5, 200, 8, (8, 192)),  # a multiple of 32
        (132, 1, 1024, 1, (1, 256)),
    ],
)
def test_cuda_launch_under_a_budget(sms, per_sm, max_threads, budget, want):
    assert cuda.budget_launch(sms, per_sm, max_threads, budget) == want


def _side(layout="NHD", num_tokens=100, heads=8, bs=16, layers=4, dtype=torch.bfloat16, nb=16):
    spec = KVCacheSpec(layers, heads, 128, bs, dtype, Layout(layout))
    caches = [torch.zeros(spec.local_cache_shape(nb, heads), dtype=dtype) for _ in range(layers)]
    return ops.make_side(caches, spec, list(range(spec.num_blocks_for(num_tokens))), num_tokens)


def test_cuda_plan_under_a_budget_uses_every_warp_of_few_blocks():
    side = _side(num_tokens=100)
    full = cuda.plan_gather(side, 1 << 30, 660)
    capped = cuda.plan_gather(side, 1 << 30, 8, threads=1024)
    assert capped.grid <= 8 and capped.block == 1024 and full.block == cuda.THREADS
    # the same items, so both cover the transfer; the capped grid's warps each take more of them
    assert capped.args[:5] == full.args[:5]
    with pytest.raises(ValueError, match="not a valid grid"):
        cuda.plan_gather(side, 1 << 30, 8, threads=100)
    with pytest.raises(ValueError, match="not a valid grid"):
        cuda.plan_gather(side, 1 << 30, 8, threads=2048)


def test_cuda_backend_sizes_its_grid_from_the_sides_budget(monkeypatch):
    """``gather``/``scatter``/``copy`` of the CUDA backend read the budget off the side: no
    budget, one full wave; with one, at most ``max_sms`` wide blocks (fake device: 132 SMs, 5
    blocks per SM, 1024 threads allowed; launches recorded, nothing runs)."""
    launched = []
    monkeypatch.setattr(cuda, "_num_sms", lambda i: 132)
    monkeypatch.setattr(cuda, "_blocks_per_sm", lambda i: 5)
    monkeypatch.setattr(cuda, "_max_threads", lambda i: 1024)
    monkeypatch.setattr(cuda, "_index", lambda d: 0)
    monkeypatch.setattr(cuda, "_device_address", lambda t, d: t.data_ptr())
    monkeypatch.setattr(cuda, "_launch", lambda plan, dev: launched.append(plan))
    side = _side(num_tokens=4096, layers=8, bs=16, nb=256)
    wire = torch.empty(side.wire_view_shape(), dtype=torch.bfloat16)
    cuda.gather(side, wire)
    side.max_sms = 16
    cuda.gather(side, wire)
    cuda.scatter(wire, side)
    cuda.copy(side, side)
    assert [(p.grid, p.block) for p in launched] == [(660, 256), (16, 1024), (16, 1024), (16, 1024)]


def test_budget_block_width_comes_from_the_kernels_register_limit(monkeypatch, caplog):
    """The widest entries' max threads per block (CuPy's RawKernel attribute, the driver's
    answer for their registers) bound a budgeted block; a failed query falls back to 256-thread
    blocks with a warning naming why."""
    import functools

    from tests.test_device_context import FakeRuntime

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=FakeRuntime()))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    limits = {f"kvx_{op}_w{w}": 1024 for op in ("gather", "scatter", "copy") for w in cuda.WIDTHS}
    limits["kvx_copy_w16"] = 768
    monkeypatch.setattr(
        cuda,
        "_kernels",
        lambda i: {n: types.SimpleNamespace(max_threads_per_block=v) for n, v in limits.items()},
    )
    monkeypatch.setattr(cuda, "_max_threads", functools.cache(cuda._max_threads.__wrapped__))
    assert cuda._max_threads(0) == 768
    monkeypatch.setattr(cuda, "_max_threads", functools.cache(cuda._max_threads.__wrapped__))
    monkeypatch.setattr(cuda, "_kernels", lambda i: {})
    with caplog.at_level("WARNING", logger="kvxfer.backends.cuda"):
        assert cuda._max_threads(0) == cuda.THREADS
    assert any(
        "max threads per block" in r.getMessage() and "KeyError" in r.getMessage() for r in caplog.records
    )


# --------------------------------------------------------------------------- where a budget comes from
class _Recorder(types.ModuleType):
    """A backend module that records the budget on the sides it is handed (moves nothing)."""

    def __init__(self) -> None:
        super().__init__("kvxfer_budget_recorder")
        self.seen: list[tuple[str, int | None]] = []
        self.is_available = lambda device: True
        self.gather = lambda side, wire: self.seen.append(("gather", side.max_sms))
        self.scatter = lambda wire, side: self.seen.append(("scatter", side.max_sms))
        self.copy = lambda s, d: self.seen.append(("copy", s.max_sms, d.max_sms))


@pytest.fixture
def recorder(monkeypatch):
    rec = _Recorder()
    monkeypatch.setitem(sys.modules, rec.__name__, rec)
    monkeypatch.setitem(ops._MODULES, "torch", rec.__name__)
    ops.reset_backends()
    yield rec
    ops.reset_backends()


def _caches(spec, nb=8):
    return [
        torch.zeros(spec.local_cache_shape(nb, spec.num_kv_heads), dtype=spec.dtype)
        for _ in range(spec.num_layers)
    ]


SPEC = KVCacheSpec(2, 2, 8, 4, torch.float16)


def test_budget_comes_from_the_call_else_the_registered_caches(recorder):
    plain = _caches(SPEC)
    reg = ops.register_caches(_caches(SPEC), SPEC, max_sms=12)
    small = ops.register_caches(_caches(SPEC), SPEC, max_sms=4)
    assert reg.max_sms == 12 and ops.register_caches(plain, SPEC).max_sms is None
    w = ops.gather_blocks(plain, SPEC, [0, 1], 8, backend="torch")
    ops.gather_blocks(reg, SPEC, [0, 1], 8, backend="torch")
    ops.gather_blocks(reg, SPEC, [0, 1], 8, backend="torch", max_sms=3)
    ops.scatter_blocks(w, reg, SPEC, [0, 1], 8, backend="torch")
    ops.copy_blocks(reg, SPEC, [0, 1], small, SPEC, [2, 3], 8, backend="torch")  # the smaller
    ops.copy_blocks(plain, SPEC, [0, 1], reg, SPEC, [2, 3], 8, backend="torch")
    ops.copy_blocks(reg, SPEC, [0, 1], small, SPEC, [2, 3], 8, backend="torch", max_sms=64)
    assert recorder.seen == [
        ("gather", None),
        ("gather", 12),
        ("gather", 3),
        ("scatter", 12),
        ("copy", 4, 4),
        ("copy", 12, 12),
        ("copy", 64, 64),
    ]


def test_a_host_wire_on_a_gpu_takes_the_host_wire_budget_when_none_is_set(monkeypatch):
    """A gather into (scatter from) pinned host memory on a GPU is PCIe-bound: with no budget
    from the call or the caches it runs capped at HOST_WIRE_MAX_SMS ($KVXFER_HOST_WIRE_MAX_SMS,
    0 for none); a set budget, a device wire or a CPU cache are left alone."""
    monkeypatch.delenv(ops.HOST_WIRE_ENV, raising=False)
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    host, dev = torch.empty(4), torch.empty(4, device="meta")  # meta: any non-host device

    def cap(budget, device, wire):
        side = types.SimpleNamespace(device=device, max_sms=budget)
        return dispatch.wire_cap(budget, side, wire), side.max_sms

    assert cap(None, gpu, host) == (ops.HOST_WIRE_MAX_SMS, ops.HOST_WIRE_MAX_SMS) == (16, 16)
    assert cap(40, gpu, host) == (40, 40)
    assert cap(None, gpu, dev) == (None, None)
    assert cap(None, cpu, host) == (None, None)
    monkeypatch.setenv(ops.HOST_WIRE_ENV, "8")
    assert cap(None, gpu, host) == (8, 8)
    monkeypatch.setenv(ops.HOST_WIRE_ENV, "0")
    assert cap(None, gpu, host) == (None, None)
    for bad in ("-1", "x"):
        monkeypatch.setenv(ops.HOST_WIRE_ENV, bad)
        with pytest.raises(ValueError, match="KVXFER_HOST_WIRE_MAX_SMS"):
            ops.host_wire_budget()


def test_engine_path_copy_carries_the_budget(recorder):
    """The engine's copies (registered caches, checked ids: the memoised sides) get the budget
    on each call, and a later call without one does not inherit it from the template."""
    a = ops.register_caches(_caches(SPEC), SPEC, max_sms=6)
    b = ops.register_caches(_caches(SPEC), SPEC)
    ids = ops.CheckedIds(__import__("numpy").array([0, 1], dtype="int64"), 8, True)
    ops.copy_blocks(a, SPEC, ids, b, SPEC, ids, 8, backend="torch")
    ops.copy_blocks(b, SPEC, ids, a, SPEC, ids, 8, backend="torch", max_sms=2)
    ops.copy_blocks(b, SPEC, ids, b, SPEC, ops.CheckedIds(ids.ids + 2, 8, True), 8, backend="torch")
    assert recorder.seen == [("copy", 6, 6), ("copy", 2, 2), ("copy", None, None)]


@pytest.mark.parametrize("bad", [0, -3, True, 2.0, "8", [8]])
def test_a_bad_budget_is_refused_before_anything_is_written(bad, recorder):
    caches = _caches(SPEC)
    for c in caches:
        c.view(torch.uint8).fill_(0xA5)
    before = [c.clone() for c in caches]
    wire = torch.ones(SPEC.wire_shape(8), dtype=SPEC.dtype)
    calls = [
        lambda: ops.gather_blocks(caches, SPEC, [0, 1], 8, backend="torch", max_sms=bad),
        lambda: ops.scatter_blocks(wire, caches, SPEC, [0, 1], 8, backend="torch", max_sms=bad),
        lambda: ops.copy_blocks(caches, SPEC, [0, 1], caches, SPEC, [2, 3], 8, backend="torch", max_sms=bad),
        lambda: ops.register_caches(caches, SPEC, max_sms=bad),
        lambda: ops.warmup(caches, SPEC, max_sms=bad),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=r"max_sms: must be a positive int"):
            call()
    assert recorder.seen == []
    assert all(torch.equal(c, b) for c, b in zip(caches, before))


def test_engine_refuses_a_bad_budget_and_reports_its_own():
    from kvxfer import TransferEngine

    with pytest.raises(ValueError, match="max_sms"):
        TransferEngine(SPEC, _caches(SPEC), 0, 1, "e", max_sms=0)
    eng = TransferEngine(SPEC, _caches(SPEC), 0, 1, "e", max_sms=24)
    assert all(v.caches.max_sms == 24 for v in eng._rank.views.views)
    stats = eng.stats()["copy_path"]
    assert stats["max_sms"] == 24 and stats["dma"] == 0 and stats["kernel"] == 0


# --------------------------------------------------------------------------- capped Triton kernels
class _GridSpy:
    """Stands in for the jitted kernel: records each launch's grid and PERSISTENT flag."""

    def __init__(self, kernel) -> None:
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.launches.append((grid[0], kw["PERSISTENT"]))
            return self.kernel[grid](*args, **kw)

        return launch


def _triton_interp():
    pytest.importorskip("triton")
    from kvxfer.kernels import launch

    if not launch.INTERPRETED:
        pytest.skip("CPU kernel tests need TRITON_INTERPRET=1 before triton loads")
    return launch


def _triton_matrix():
    from tests.triton_cases import ALL_DTYPES, Case

    out = []
    for op in ("gather", "scatter", "copy"):
        for layout in ("NHD", "HND", "MLA"):
            for dt in ALL_DTYPES:
                out.append((op, Case(layout=layout, dtype=dt, dst_block_size=32 if op != "gather" else None)))
        out.append((op, Case(layout="HND", dst_layout="NHD", head_start=3, num_heads=1, dst_heads_local=2)))
        out.append(
            (op, Case(head_dim=5, dtype=torch.int8, layout="HND", dst_layout="NHD", dst_block_size=12))
        )
    return out


TRITON_MATRIX = _triton_matrix()


@pytest.mark.parametrize("budget", [1, 3])
@pytest.mark.parametrize(
    "item",
    TRITON_MATRIX,
    ids=[f"{op}-{c.layout}-{str(c.dtype)[6:]}-d{c.head_dim}" for op, c in TRITON_MATRIX],
)
def test_capped_triton_kernel_is_byte_exact(item, budget, monkeypatch, request):
    """The persistent variant (grid capped at ``budget`` programs striding over the tiles)
    against the plain expectation and the torch reference, destinations poisoned: every dtype,
    NHD/HND/MLA, head slices, partial last blocks, layer subsets in wire order."""
    launch = _triton_interp()
    from tests.triton_cases import RUNNERS

    spy = _GridSpy(launch.move_rows_kernel)
    monkeypatch.setattr(launch, "move_rows_kernel", spy)
    monkeypatch.setattr(launch, "_INTERP_MAX_BLOCK_T", 8)  # several tiles per row group
    launch._cached_plan.cache_clear()  # plans made with the default tile are cached
    request.addfinalizer(launch._cached_plan.cache_clear)
    # the runners pass plain caches: every call gets the budget registered caches would carry
    monkeypatch.setattr(dispatch, "registered_budget", lambda a, b=None: budget)
    op, case = item
    RUNNERS[op](case, "cpu")
    assert spy.launches and all(g == budget and p for g, p in spy.launches), spy.launches


def test_triton_budget_wider_than_the_work_keeps_one_program_per_tile(monkeypatch):
    launch = _triton_interp()
    spy = _GridSpy(launch.move_rows_kernel)
    monkeypatch.setattr(launch, "move_rows_kernel", spy)
    spec = KVCacheSpec(2, 2, 8, 4, torch.bfloat16)
    caches = _caches(spec)
    ops.gather_blocks(caches, spec, [0, 1], 8, backend="triton", max_sms=1000)
    ops.gather_blocks(caches, spec, [0, 1], 8, backend="triton", max_sms=2)
    tiles = 2 * 2 * 2  # heads x layers x K/V, one tile of 8 tokens each
    assert spy.launches == [(tiles, False), (2, True)]


_PTX_SCRIPT = """
import json, sys, torch
from kvxfer.kernels.aot import compile_ptx, nhd_plan
plan = nhd_plan(torch.bfloat16, 128)
json.dump({op: compile_ptx(op, plan, 90, persistent=True) for op in ("gather", "scatter", "copy")}, sys.stdout)
"""


def test_persistent_variant_compiles_for_sm90a_with_128_bit_moves(tmp_path):
    """The capped grid's kernel (a loop over tiles, the budget's warps) keeps the uncapped one's
    vector width: every global store of an aligned bf16 move is 128 bits."""
    pytest.importorskip("triton")
    import re

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", _PTX_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    wide = re.compile(r"\.(v4\.b32|v4\.u32|v2\.b64|v2\.u64)\b")
    from kvxfer.kernels.launch import DEFAULT_BUDGET_NUM_WARPS

    for op, text in json.loads(proc.stdout).items():
        stores = re.findall(r"\bst\.global(?:\.[\w]+)*", text)
        assert stores and all(wide.search(s) for s in stores), (op, set(stores))
        assert ".target sm_90a" in text
        assert f".reqntid {32 * DEFAULT_BUDGET_NUM_WARPS}" in text, op


# --------------------------------------------------------------------------- capped CUDA C++ kernels (host shim)
class _ShimLaunch:
    """The CUDA backend's own ``gather``/``scatter``/``copy`` (its grid under the side's budget)
    with each launch run by the g++ build of the kernels on CPU tensors."""

    def __init__(self, lib: str, budget: int, threads: int) -> None:
        from host_kernels import HostKernels

        self.host = HostKernels(lib)
        self.budget, self.threads = budget, threads
        self.launches: list = []

    def install(self) -> None:
        cuda._num_sms = lambda i: 64
        cuda._blocks_per_sm = lambda i: 4
        cuda._max_threads = lambda i: self.threads
        cuda._index = lambda d: 0
        cuda._device_address = lambda t, d: t.data_ptr()

        def launch(plan, dev):
            self.launches.append(plan)
            self.host._run(plan)

        cuda._launch = launch

    def gather(self, side, wire):
        side.max_sms = self.budget
        cuda.gather(side, wire)

    def scatter(self, wire, side):
        side.max_sms = self.budget
        cuda.scatter(wire, side)

    def copy(self, src, dst):
        src.max_sms = dst.max_sms = self.budget
        cuda.copy(src, dst)


def _shim_main(lib: str) -> int:
    from cases import run_case

    for budget, threads in SHIM_BUDGETS:
        for case in _shim_cases():
            k = _ShimLaunch(lib, budget, threads)
            k.install()
            try:
                run_case(case, "cpu", k)
                err = None
                if not k.launches or any(p.grid > budget or p.block != threads for p in k.launches):
                    err = f"launches {[(p.grid, p.block) for p in k.launches]} exceed the budget"
            except Exception as e:  # reported per case
                err = f"{type(e).__name__}: {e}"
            cid = f"{case.id}@{budget}x{threads}"
            print(json.dumps({"id": cid, "ok": err is None, "error": err}), flush=True)
    return 0


@pytest.fixture(scope="module")
def shim_budget_results(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("g++ not found: cannot build the host shim")
    from host_kernels import build

    lib = build(tmp_path_factory.mktemp("kvx_shim_budget"))
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
        [sys.executable, str(Path(__file__)), str(lib)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=ROOT,
    )
    got = {}
    for line in res.stdout.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            got[d["id"]] = d
    return got, f"exit {res.returncode}\n{res.stderr[-6000:]}"


def _shim_ids() -> list[str]:
    return [f"{c.id}@{b}x{t}" for b, t in SHIM_BUDGETS for c in _shim_cases()]


@pytest.mark.parametrize("cid", _shim_ids())
def test_capped_cuda_kernels_through_the_host_shim(shim_budget_results, cid):
    """Launches the CUDA backend sizes under a budget (1-3 blocks of 96-1024 threads: each warp
    strides over many items) run under ASan/UBSan: every address in bounds, the bytes those of
    the torch reference, untouched blocks still poison."""
    got, stderr = shim_budget_results
    assert cid in got, f"the sanitized run stopped before this case:\n{stderr}"
    assert got[cid]["ok"], got[cid]["error"]


# --------------------------------------------------------------------------- GPU
def gpu(fn):
    fn = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")(fn)
    return pytest.mark.gpu(fn)


@gpu
@pytest.mark.parametrize("budget", [1, 8, 32])
@pytest.mark.parametrize("op", ["gather", "scatter", "copy"])
def test_capped_triton_kernel_on_the_gpu(op, budget, monkeypatch):
    from tests.triton_cases import RUNNERS, Case

    # the runners pass plain caches: every call gets the budget registered caches would carry
    monkeypatch.setattr(dispatch, "registered_budget", lambda a, b=None: budget)
    for case in (
        Case(layout="NHD", num_tokens=1000, dst_block_size=32),
        Case(layout="HND", dtype=torch.float8_e4m3fn, dst_layout="NHD"),
        Case(layout="MLA", dtype=torch.float32),
    ):
        RUNNERS[op](case, "cuda")


@gpu
def test_warmup_with_a_budget_leaves_nothing_to_compile_gpu():
    """Registered caches with a budget: ``ops.warmup`` compiles the capped (persistent) variants
    too, so no request size compiles on the request path."""
    from tests.test_kernels_triton import _num_compiled

    spec = KVCacheSpec(2, 8, 128, 16, torch.bfloat16, "NHD")
    caches = ops.register_caches(
        [torch.zeros(spec.local_cache_shape(600, 8), dtype=spec.dtype, device="cuda") for _ in range(2)],
        spec,
        max_sms=8,
    )
    assert ops.warmup(caches, spec, backend="triton") == "triton"
    torch.cuda.synchronize()
    before = _num_compiled()
    for n in (1, 7, 17, 33, 100, 1000, 4096):
        nb = spec.num_blocks_for(n)
        wire = ops.gather_blocks(caches, spec, list(range(nb)), n, backend="triton")
        ops.scatter_blocks(wire, caches, spec, list(range(300, 300 + nb)), n, backend="triton")
        ops.copy_blocks(
            caches, spec, list(range(nb)), caches, spec, list(range(300, 300 + nb)), n, backend="triton"
        )
    torch.cuda.synchronize()
    assert _num_compiled() == before


@gpu
@pytest.mark.parametrize("budget", [1, 8, 32])
def test_capped_cuda_kernels_on_the_gpu(budget):
    """The CUDA C++ backend's launches under a budget, on the device: byte-exact, poison kept."""
    from cases import Case, run_case

    class Capped:
        def gather(self, side, wire):
            side.max_sms = budget
            cuda.gather(side, wire)

        def scatter(self, wire, side):
            side.max_sms = budget
            cuda.scatter(wire, side)

        def copy(self, src, dst):
            src.max_sms = dst.max_sms = budget
            cuda.copy(src, dst)

    for op in ("gather", "scatter", "copy"):
        for case in (
            Case(op=op, num_tokens=2000, num_layers=4, layers=None),
            Case(op=op, dtype="e4m3", layout="HND", dst_layout="NHD", dst_bs=32),
            Case(op=op, layout="MLA", dtype="fp32", num_tokens=300),
        ):
            run_case(case, "cuda", Capped())


if __name__ == "__main__":
    sys.exit(_shim_main(sys.argv[1]))
