"""profiling/slim_nixl_wheel.py: the nixl-cu13 wheel the GPU session carries, repacked with only what
the nixl transport loads, still works: installed first on the path, the nixl transport's own
tests run on it (direct and staged reads over UCX on loopback)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest

from tests.test_profiling import ROOT

sys.path.insert(0, os.path.join(ROOT, "profiling"))

import slim_nixl_wheel

pytest.importorskip("nixl_cu13", reason="the test extra brings nixl-cu13")


@pytest.fixture(scope="module")
def slim_wheel(tmp_path_factory):
    """This Python's nixl-cu13 wheel from the registry, repacked: (slim path, full path)."""
    d = tmp_path_factory.mktemp("nixl")
    tag = f"{sys.version_info.major}{sys.version_info.minor}"
    res = subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(d),
         "nixl-cu13==1.5.1"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    wheels = [p for p in d.iterdir() if p.name.startswith("nixl_cu13-") and f"cp{tag}" in p.name]
    if res.returncode or not wheels:
        pytest.skip(f"the nixl-cu13 wheel could not be downloaded here: {res.stderr.strip()[-300:]}")
    full = d / "full"
    full.mkdir()
    assert slim_nixl_wheel.main([str(wheels[0]), "--keep-full", str(full)]) == 0
    return wheels[0], full / wheels[0].name


def test_the_slim_wheel_keeps_the_ucx_path_and_leaves_the_rest(slim_wheel):
    slim, full = slim_wheel
    assert slim.stat().st_size < 20 << 20 < full.stat().st_size  # measured: 56.0 -> 16.5 MiB
    with zipfile.ZipFile(slim) as zf:
        names = set(zf.namelist())
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        listed = {row.split(",")[0] for row in zf.read(record).decode().splitlines() if row}
    assert listed == names  # RECORD names exactly what is in the wheel
    assert any(n.endswith("plugins/libplugin_UCX.so") for n in names)
    assert any(n.startswith("nixl_cu13.libs/ucx/libuct_cuda") for n in names)  # VRAM over UCX
    assert not any(n.startswith("nixl_ep_cu13/") for n in names)
    assert not any("libplugin_GDS" in n or "libplugin_OBJ" in n for n in names)


def test_the_nixl_transport_runs_on_the_slim_wheel(slim_wheel, tmp_path):
    slim, _ = slim_wheel
    site = tmp_path / "site"
    res = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site), str(slim)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(site), ROOT))}
    probe = "import nixl_cu13; print(nixl_cu13.__file__)"
    where = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=60)
    assert where.stdout.startswith(str(site)), where.stdout + where.stderr  # the slim one is imported
    tests = [
        "tests/test_nixl.py::test_direct_and_staged_exact_registered_once",
        "tests/test_nixl.py::test_untouched_around_partial_blocks_direct",
    ]
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0 and "skipped" not in res.stdout, res.stdout[-3000:] + res.stderr[-2000:]
