"""The benchmarks run on CPU (--quick), produce table, JSON and PNG, and their checks can fail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
import torch

from kvxfer import KVCacheSpec, Layout, ops
from kvxfer.backends import torch_ref

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from profiling import bench_ops, verify  # noqa: E402


def _run(script: str, *args: str, timeout: int = 120, path_first: str = "") -> subprocess.CompletedProcess:
    # ROOT first (after ``path_first``); what PYTHONPATH already holds (e.g. wheels carried to a
    # GPU machine) after it
    path = os.pathsep.join(p for p in (path_first, ROOT, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    if script == "bench_ops.py" and "--device" not in args:
        args = (*args, "--device", "cpu")  # these are the CPU checks; GPU sweeps run in profiling/
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "profiling", script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


def _table_rows(stdout: str) -> list[list[str]]:
    return [line.split() for line in stdout.splitlines() if line.strip() and not line.startswith("#")]


def _load(out) -> dict:
    with open(os.path.join(out, "bench_ops.json")) as f:
        return json.load(f)


def test_bench_ops_quick_cpu(tmp_path):
    res = _run("bench_ops.py", "--quick", "--out", str(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    header = [line for line in res.stdout.splitlines() if "time(us)" in line]
    assert len(header) == 1 and "GB/s" in header[0] and "%limit" in header[0] and "#wrong" in header[0]
    rows = _table_rows(res.stdout)
    # 4 attention shapes x 2 layouts + MLA, 3 ops, 2 sizes for the torch backend at least.
    assert len(rows) >= 9 * 3 * 2
    assert all(r[-1] == "0" for r in rows), res.stdout
    data = _load(tmp_path)
    for b in ("triton", "cuda"):  # every backend either ran (interpreted, tiny) or was skipped with a note
        ran = any(r["backend"] == b for r in data["rows"])
        assert ran or f"# note: skipping backend '{b}'" in res.stdout, b
    for key in ("device", "date", "command", "torch", "triton", "kvxfer"):
        assert data["meta"][key], key
    assert len(data["rows"]) == len(rows)
    seen = {(r["model"], r["layout"], r["op"]) for r in data["rows"]}
    assert ("deepseek-v3-mla", "MLA", "copy") in seen and ("llama3-8b-1head", "NHD", "scatter") in seen
    for r in data["rows"]:
        assert r["wrong"] == 0 and r["wrong_rows"] == 0 and r["clobbered_bytes"] == 0
        assert r["bytes"] > 0 and r["gbps"] > 0 and r["limit_gbps"] > 0 and r["pct_limit"] > 0
        assert r["limit_kind"] == "cpu" and r["device"] == data["meta"]["device"]
    one_head = next(r for r in data["rows"] if r["model"] == "llama3-8b-1head")
    assert one_head["heads"] == 1 and one_head["head_dim"] * 2 == 256  # 256-byte runs
    # the native CPU backend ran every row the reference did (it builds with g++ in CI), and
    # the targets are reported for both (their values are measured, not asserted here)
    key = lambda r: (r["model"], r["layout"], r["op"], r["to"], r["tokens"])  # noqa: E731
    assert {key(r) for r in data["rows"] if r["backend"] == "cpu"} == {
        key(r) for r in data["rows"] if r["backend"] == "torch"
    }
    copies = {(r["layout"], r["to"]) for r in data["rows"] if r["model"] == "llama3-8b" and r["op"] == "copy"}
    assert copies == {(a, b) for a in ("NHD", "HND") for b in ("NHD/32", "HND/32")} | {
        ("NHD", "NHD/16"),
        ("HND", "HND/16"),
    }
    for b in ("torch", "cpu"):
        t = data["targets"][b]
        assert t["ipc"]["rows"] == 4 and t["ipc"]["target"] == 0.6 and isinstance(t["ipc"]["met"], bool)
        assert (
            t["pg"]["rows"] == 4
            and t["pg"]["target"] == 0.5
            and 0 < t["pg"]["path_fraction"] < t["pg"]["fraction"]
        )
        assert (
            f"#   ipc  {b:<6} copy 16->32: min" in res.stdout
            and f"#   pg   {b:<6} gather, scatter: min" in res.stdout
        )
    assert "backend cpu uses up to" in res.stdout
    with open(tmp_path / "bench_ops.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(tmp_path / "bench_ops.png") > 10_000


def test_bench_ops_runs_without_matplotlib_and_tqdm(tmp_path):
    """After ``pip install -e .`` alone (no profile/test extras) the benchmark still runs: the plot
    and the progress bar are skipped, each with a one-line note."""
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    for name in ("matplotlib", "tqdm"):
        (blocked / f"{name}.py").write_text(f"raise ImportError('{name} made unimportable by the test')\n")
    out = tmp_path / "out"
    res = _run(
        "bench_ops.py",
        "--quick",
        "--models",
        "llama3-8b",
        "--layouts",
        "NHD",
        "--sizes",
        "32",
        "--backends",
        "torch",  # the interpreted Triton rows would take most of its time and show nothing more
        "--out",
        str(out),
        path_first=str(blocked),
    )
    assert res.returncode == 0, res.stdout + res.stderr
    notes = [line for line in res.stdout.splitlines() if "matplotlib not installed" in line]
    assert notes == ["# note: matplotlib not installed: bench_ops.png not drawn (pip install matplotlib)"]
    assert res.stderr.count("tqdm not installed") == 1, res.stderr
    assert "Traceback" not in res.stderr
    assert (out / "bench_ops.json").is_file() and not (out / "bench_ops.png").exists()
    assert f"# wrote {out / 'bench_ops.json'}\n" in res.stdout
    assert len(_table_rows(res.stdout)) >= 5


@pytest.mark.parametrize("kind", ["result", "untouched"])
def test_bench_ops_detects_corruption(tmp_path, kind):
    res = _run(
        "bench_ops.py",
        "--quick",
        "--backends",
        "torch",
        "--corrupt",
        kind,
        "--out",
        str(tmp_path),
        "--models",
        "llama3-8b-1head,deepseek-v3-mla",
        "--sizes",
        "32,100",
    )
    assert res.returncode == 1, res.stdout + res.stderr
    assert "FAILED" in res.stdout
    rows = _load(tmp_path)["rows"]
    # per size: 1head NHD and HND (gather, scatter, copy to same, NHD/32, HND/32), MLA (gather,
    # scatter, copy to same and MLA/32)
    assert len(rows) == (2 * 5 + 4) * 2
    assert {r["to"] for r in rows if r["op"] == "copy"} == {
        "NHD/16",
        "HND/16",
        "NHD/32",
        "HND/32",
        "MLA/16",
        "MLA/32",
    }
    for r in rows:
        if kind == "untouched" and r["op"] == "gather":
            assert r["wrong"] == 0  # a gather has no memory it must leave alone
        elif kind == "untouched":
            assert r["clobbered_bytes"] == 1 and r["wrong_bytes"] == 0, r
        else:
            assert r["wrong_bytes"] == 1 and r["wrong_rows"] == 1, r


def _broken_backend() -> types.ModuleType:
    """torch_ref with classic bugs: gather drops the last token, scatter/copy write whole blocks."""
    mod = types.ModuleType("kvxfer_test_broken_backend")

    def spill(side):  # the bug: the tail of a partial last block gets written too
        if side.num_tokens % side.block_size:
            view = verify._nhd(side.caches[0], side.layout)
            view[0, int(side.block_ids[-1]), side.block_size - 1, side.head_start].fill_(0)

    def gather(src, wire):
        torch_ref.gather(src, wire)
        wire[:, :, :, -1].fill_(0)

    def scatter(wire, dst):
        torch_ref.scatter(wire, dst)
        spill(dst)

    def copy(src, dst):
        torch_ref.copy(src, dst)
        spill(dst)

    mod.is_available, mod.gather, mod.scatter, mod.copy = (lambda device: True), gather, scatter, copy
    return mod


def test_bench_ops_picks_up_backends_and_flags_a_broken_one(tmp_path, monkeypatch, capsys, request):
    """A second available backend is benchmarked (one tiny size on CPU); its bugs show in #wrong."""
    fake = _broken_backend()
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    monkeypatch.setitem(ops._MODULES, "triton", fake.__name__)
    ops.reset_backends()
    request.addfinalizer(ops.reset_backends)
    threads = torch.get_num_threads()
    try:
        rc = bench_ops.main(
            [
                "--quick",
                "--device",
                "cpu",
                "--backends",
                "torch,triton",
                "--out",
                str(tmp_path),
                "--models",
                "qwen2.5-7b,deepseek-v3-mla",
                "--sizes",
                "100,32",
            ]
        )
    finally:
        torch.set_num_threads(threads)  # --quick sets 1 thread in-process
    assert rc == 1
    rows = _load(tmp_path)["rows"]
    fake_rows = [r for r in rows if r["backend"] == "triton"]
    # Non-torch backends on CPU: the fewest bytes per token (qwen 57 KB < MLA 70 KB), first size only.
    assert {(r["model"], r["tokens"]) for r in fake_rows} == {("qwen2.5-7b", 100)}
    assert len(fake_rows) == 2 * 3
    for r in fake_rows:
        if r["op"] == "gather":  # last token of every (head, layer, kv) row group missing
            assert r["wrong_rows"] == 4 * 28 * 2 and r["clobbered_bytes"] == 0, r
        else:  # one spilled 256-byte row in the partial last block
            assert r["wrong_bytes"] == 0 and r["clobbered_bytes"] == 256, r
    assert all(r["wrong"] == 0 for r in rows if r["backend"] == "torch")
    assert "FAILED" in capsys.readouterr().out


@pytest.mark.parametrize("layout", ["NHD", "HND", "MLA"])
def test_oracle_counts_wrong_rows_exactly(layout):
    """Gathering one wrong block is reported as exactly that block's rows."""
    mla = layout == "MLA"
    spec = KVCacheSpec(3, 1 if mla else 4, 64, 8, torch.bfloat16, Layout.NHD if mla else Layout(layout), mla)
    caches = [torch.empty(spec.cache_shape(10, 1), dtype=spec.dtype) for _ in range(3)]
    verify.fill_random(caches, seed=1)
    ids, T = torch.tensor([7, 2, 5, 0]), 29  # 3 full blocks + 5 tokens
    wire = ops.gather_blocks(
        caches, spec, ids, T, head_start=1 if not mla else 0, num_heads=2 if not mla else None
    )
    ok = verify.check_wire(wire, caches, layout, ids, 8, T, 1 if not mla else 0)
    assert ok == {"wrong_bytes": 0, "wrong_rows": 0}
    bad = ops.gather_blocks(
        caches, spec, torch.tensor([7, 3, 5, 0]), T, 1 if not mla else 0, 2 if not mla else None
    )
    res = verify.check_wire(bad, caches, layout, ids, 8, T, 1 if not mla else 0)
    heads, kv = (1, 1) if mla else (2, 2)
    assert res["wrong_rows"] == 8 * heads * kv * 3  # block 1's 8 tokens, every head/kv/layer


def test_sweep_cpu_runs_and_checks_every_column(tmp_path):
    """The CPU backend's sweep (its decisions' evidence) keeps running: tiny, one round."""
    out = tmp_path / "sweep.json"
    res = _run(
        "sweep_cpu.py",
        "--tokens",
        "20",
        "--iters",
        "1",
        "--flush-mb",
        "1",
        "--configs",
        "torch,shim,1/off/dst,2/on/auto",
        "--json",
        str(out),
        timeout=240,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    cells = json.loads(out.read_text())["results"][0]["cells"]
    assert len(cells) == 8 * 4 and all(v > 0 for v in cells.values())
    assert "copy HND->NHD/32 | shim" in cells and "gather NHD | 2/on/auto | 256KiB" in cells


def test_bench_plan_quick(tmp_path):
    res = _run("bench_plan.py", "--quick", "--out", str(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "per-request host cost" in res.stdout
    with open(tmp_path / "bench_plan.json") as f:
        data = json.load(f)
    steps = [r["step"] for r in data["rows"]]
    assert len(steps) == 8 and any(s.startswith("make_side") for s in steps)
    assert all(r["median_us"] > 0 and r["tokens"] == 4096 and r["layers"] == 32 for r in data["rows"])


def test_profiler_scripts_parse():
    for script in ("nsys.sh", "ncu.sh", "gpu_validate.sh", "gpu_wheels.sh", "gpu_session.sh"):
        res = subprocess.run(
            ["bash", "-n", os.path.join(ROOT, "profiling", script)], capture_output=True, text=True
        )
        assert res.returncode == 0, res.stderr


def test_bench_ops_reports_a_failing_backend(tmp_path, monkeypatch, capsys, request):
    """A backend that raises fails the run with an error row; its other rows of that op are skipped."""
    mod = types.ModuleType("kvxfer_test_raising_backend")

    def boom(*args):
        raise RuntimeError("kernel launch failed")

    mod.is_available, mod.gather, mod.scatter, mod.copy = (lambda device: True), boom, boom, boom
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setitem(ops._MODULES, "cuda", mod.__name__)
    ops.reset_backends()
    request.addfinalizer(ops.reset_backends)
    threads = torch.get_num_threads()
    try:
        rc = bench_ops.main(
            [
                "--quick",
                "--device",
                "cpu",
                "--backends",
                "cuda",
                "--out",
                str(tmp_path),
                "--models",
                "qwen2.5-7b",
                "--layouts",
                "NHD",
                "--ops",
                "gather",
                "--sizes",
                "100,32",
                "--threads",
                "1",
            ]
        )
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert rc == 1 and "ERROR gather/cuda" in out and "kernel launch failed" in out and "FAILED" in out
    rows = _load(tmp_path)["rows"]
    assert len(rows) == 1 and "kernel launch failed" in rows[0]["error"]


def test_compare_host_cost_runs_two_trees_interleaved(tmp_path):
    """Same tree on both sides: every case timed on both, ratios finite; a tree that cannot
    run the benchmark makes it fail, naming the tree."""
    r = _run("compare_host_cost.py", ROOT, ROOT, "--rounds", "1", timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(out["cases"]) == {"1x4096", "8x4096", "8x2K-4K", "1x4096-1s", "8x4096-1sb"}
    for c in out["cases"].values():
        assert c["base_us"] > 0 and c["work_us"] > 0 and 0 < c["ratio"] < 100
        assert c["ratio_q1"] <= c["ratio"] <= c["ratio_q3"] and len(c["pair_ratios"]) == 1
        for side in ("p", "d"):  # each engine's process: its share of the total, on both trees
            assert 0 < c[f"{side}_base_us"] < c["base_us"] and 0 < c[f"{side}_work_us"] < c["work_us"]
            assert 0 < c[f"{side}_ratio"] < 100
    bad = _run("compare_host_cost.py", str(tmp_path), ROOT, "--rounds", "1", timeout=300)
    assert bad.returncode != 0 and str(tmp_path) in bad.stderr


def test_bench_batching_quick_both_plans_exact(tmp_path):
    res = _run(
        "bench_batching.py", "--quick", "--device", "cpu", "--backends", "cpu,torch", "--out", str(tmp_path)
    )
    assert res.returncode == 0, res.stdout + res.stderr
    with open(tmp_path / "bench_batching.json") as f:
        rows = json.load(f)["rows"]
    assert {(r["to"], r["backend"], r["plan"]) for r in rows} == {
        (to, b, p)
        for to in ("NHD/16", "NHD/32", "HND/16")
        for b in ("cpu", "torch")
        for p in ("slots", "split", "blocks")
    }
    assert all(r["wrong"] == 0 and r["gbps"] > 0 and r["frac"] > 0 for r in rows)
    for r in rows:  # 8 requests of 100-400 tokens, 7 end inside a block (seed 0)
        if r["plan"] == "slots":  # every token a slot, HND's through the kernels' slot addressing
            assert r["calls"] == 1 and r["ids"] == 2 * r["tokens"]
        elif r["plan"] == "split":
            assert r["calls"] == 2 and r["ids"] < r["tokens"] // 2
        else:  # no slot view: the whole blocks, then a call per tail
            assert r["calls"] == 8 and r["ids"] < r["tokens"] // 2


def test_bench_batching_counts_a_misplaced_tail(tmp_path, monkeypatch, capsys):
    """The verification is real: tails written one slot off land outside the requests and miss
    their own rows; the split rows count both and the run fails."""
    from profiling import bench_batching

    real = bench_batching.plan_batch

    def shifted(items, *a):
        bp = real(items, *a)
        if len(bp.calls) == 2:  # the split plan: its tail call, one slot on (a tail has
            # fewer tokens than a block, so the shifted slots stay inside their blocks)
            bp.calls[1].dst = bp.calls[1].dst + 1
        return bp

    monkeypatch.setattr(bench_batching, "plan_batch", shifted)
    rc = bench_batching.main(
        ["--quick", "--device", "cpu", "--backends", "cpu", "--to", "16", "--out", str(tmp_path)]
    )
    assert rc == 1
    with open(tmp_path / "bench_batching.json") as f:
        rows = {r["plan"]: r for r in json.load(f)["rows"]}
    assert rows["slots"]["wrong"] == 0 and rows["split"]["wrong"] > 0
    assert "1 rows WRONG" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.timeout(1200)  # two runs under callgrind, each importing torch: 2.5-6.5 min on 2 cores
def test_count_host_instructions_counts_the_request_path():
    """callgrind's per-iteration count of bench_engine.host_cost: positive, with the engine's
    native id conversion among the functions (a few iterations: the figure, not its size)."""
    import shutil

    if shutil.which("valgrind") is None or shutil.which("callgrind_annotate") is None:
        pytest.skip("valgrind is not installed here")
    from profiling import count_host_instructions as chi

    r = chi.count(ROOT, batch=1, short=3, long=8)
    assert 50_000 < r["per_iteration"] < 5_000_000, r["per_iteration"]
    assert any("ids_from_seq" in k or "idops" in k or "_PyEval" in k for k in r["functions"])


def test_sweep_triton_tiles_plumbing(tmp_path):
    """sweep_triton_tiles runs bench_ops once per configuration with the knobs in its
    environment and tabulates each row's fraction per configuration (here through the torch
    backend on CPU: the plumbing only, the knobs act on Triton's GPU tiles)."""
    script = os.path.join(ROOT, "profiling", "sweep_triton_tiles.py")
    res = subprocess.run(
        [sys.executable, script, "--backend", "torch", "--device", "cpu", "--models", "llama3-8b",
         "--ops", "gather,copy", "--sizes", "32", "--tiles", "8192,16384", "--warps", "8",
         "--iters", "1", "--warmup", "0", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    table = [ln for ln in res.stdout.splitlines() if ln.strip() and not ln.startswith("#")]
    assert len(table) == 2 and all(ln.split()[1] in ("gather", "copy") for ln in table), res.stdout
    got = json.loads((tmp_path / "sweep_triton_tiles.json").read_text())
    assert got["configs"] == ["8192/8*", "16384/8"]  # * the default (kvxfer/kernels/launch.py)
    assert {r["op"] for r in got["rows"]} == {"gather", "copy"}
    assert all(set(r["pct_limit"]) == {"8192/8", "16384/8"} and r["wrong"] == 0 for r in got["rows"])
    for cfg in ("tile8192_warps8", "tile16384_warps8"):
        assert (tmp_path / cfg / "bench_ops.json").is_file()


def test_bench_interference_quick_cpu(tmp_path):
    """bench_interference's plumbing on CPU: the GEMM loop beside each transfer path (kernel at
    every budget, DMA through the memmove stand-in, copy_), verification, table and JSON. The
    numbers are not judged here (nor on CPU at all: no SMs, no copy engines)."""
    res = _run("bench_interference.py", "--quick", "--device", "cpu", "--out", str(tmp_path), timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    header = [ln for ln in res.stdout.splitlines() if "GEMM+%" in ln and "time(us)" in ln]
    assert len(header) == 1 and all(c in header[0] for c in ("bytes", "time(us)", "GB/s", "%copy_", "#wrong"))
    assert "memmove stand-in" in res.stdout and "targets: judged on a GPU run only" in res.stdout
    # NHD gathers of 8 heads are no runs: the DMA row says why instead of a time
    assert "NHD gather dma: n/a (dma=True: this gather is not whole-block copies" in res.stdout
    data = json.loads((tmp_path / "bench_interference.json").read_text())
    rows = data["rows"]
    timed = [r for r in rows if "time_us" in r]
    assert len(timed) == len(_table_rows(res.stdout)) == 2 * 2 * 6 - 1  # layouts x ops x paths, less the n/a
    paths = {(r["layout"], r["op"], r["path"]) for r in timed}
    for layout in ("NHD", "HND"):
        for b in ("all", "32", "16", "8"):
            assert (layout, "copy", f"kernel@{b}") in paths and (layout, "gather", f"kernel@{b}") in paths
        assert (layout, "copy", "dma") in paths and (layout, "gather", "copy_") in paths
    assert ("HND", "gather", "dma") in paths and ("NHD", "gather", "dma") not in paths
    for r in timed:
        assert r["wrong"] == 0 and r["bytes"] == 32 * 32 * 2 * 8 * 128 * 2, r
        assert r["gbps"] > 0 and r["pct_limit"] > 0 and r["limit_kind"] == "cpu"
        # how many iterations ran entirely beside the other loop depends on the OS scheduling the
        # two threads of a shared VM: only the consistency of what is reported is checked here
        nc, ng = r["counted"]
        assert nc >= 0 and ng >= 0 and (r["busy_time_us"] is None) == (nc == 0), r
        assert (r["gemm_slowdown_pct"] is None) == (ng == 0), r
        if r["kind"] != "copy_":
            assert (r["ran"] == "dma") == (r["kind"] == "dma"), r
    assert data["gemm"]["n"] == 256 and data["dma_rule"]["small_budget_sms"] > 0


def test_bench_interference_counts_wrong_bytes(tmp_path):
    """The verification pass can fail: each transfer's result broken on purpose makes every
    transfer row wrong and the run exit 1."""
    res = _run(
        "bench_interference.py", "--quick", "--device", "cpu", "--layouts", "HND", "--budgets", "all,8",
        "--corrupt", "result", "--out", str(tmp_path), timeout=300,
    )  # fmt: skip
    assert res.returncode == 1, res.stdout + res.stderr
    rows = json.loads((tmp_path / "bench_interference.json").read_text())["rows"]
    moved = [r for r in rows if r["kind"] != "copy_"]
    assert len(moved) == 2 * 3 and all(r["wrong"] > 0 for r in moved), moved


def test_bench_interference_counts_only_iterations_beside_the_other_loop():
    """The contended times take the iterations that ran entirely while the other loop ran."""
    from profiling import bench_interference as bi

    gemms = [(1.0, 2.0), (2.0, 3.0), (3.0, 4.0), (4.0, 5.0)]
    copies = [(0.5, 1.5), (1.5, 2.0), (2.0, 3.5), (3.5, 5.5)]
    assert bi.inside(copies, gemms) == [0.5, 1.5]  # the first starts before, the last ends after
    assert bi.inside(gemms, copies) == [1.0, 1.0, 1.0, 1.0]
    assert bi.inside(copies, []) == [] and bi.inside([], gemms) == []


def test_bench_side_channel_runs_two_trees_with_the_exporter_in_another_process():
    """Same tree on both sides, one round of a few calls: every figure of kvxfer's side channel
    and of bare pyzmq measured, the grant checked unaltered on the way back, the ratios finite."""
    r = _run("bench_side_channel.py", "--trees", ROOT, ROOT, "--rounds", "1", "--calls", "30", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["bench"] == "side_channel" and list(out["trees"]) == [ROOT]
    for side in ("kvxfer", "zmq"):
        got = out["trees"][ROOT][side]
        assert got["grant"]["cpu_us"] > 0 and got["grant"]["wall_us"] >= got["grant"]["cpu_us"] * 0.5
        assert got["notify"]["cpu_us"] > 0 and got["server_cpu_us"] > 0
    ratios = out["ratio_b_over_a"]
    assert all(0 < ratios[k][m] < 100 for k in ("grant", "notify") for m in ("cpu_us", "wall_us"))
    assert 0 < ratios["server_cpu_us"] < 100
