"""`import kvxfer` is cheap: no CUDA work, no heavy optional imports; every subpackage imports from
a plain source tree (the GPU machine runs the checkout on PYTHONPATH, uninstalled)."""

import json
import os
import subprocess
import sys

import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _probe(code: str) -> dict:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_import_is_lazy_and_does_no_cuda_work():
    out = _probe(
        "import json, sys, torch\n"
        "before = set(sys.modules)\n"
        "import kvxfer\n"
        "heavy = ['triton', 'cupy', 'zmq', 'msgspec', 'nvtx', 'pynvml', 'kvxfer.engine', 'kvxfer.kernels',"
        " 'kvxfer.backends.cuda', 'torch.distributed.distributed_c10d']\n"
        "print(json.dumps({'loaded': [m for m in heavy if m in sys.modules and m not in before],"
        " 'cuda_init': torch.cuda.is_initialized()}))"
    )
    assert out == {"loaded": [], "cuda_init": False}


def test_lazy_public_names_resolve():
    out = _probe(
        "import json, kvxfer, kvxfer.kernels\n"
        "print(json.dumps([kvxfer.TransferEngine.__name__, kvxfer.KVTransferParams.__name__,"
        " kvxfer.CompletionAggregator.__name__, kvxfer.kernels.__name__]))"
    )
    assert out == ["TransferEngine", "KVTransferParams", "CompletionAggregator", "kvxfer.kernels"]


def test_every_package_is_its_own_folder():
    """No package-dir remap: each package of pyproject.toml is the folder its dotted name says, so
    a checkout on PYTHONPATH imports what the wheel installs (a remapped ``kvxfer.kernels`` made
    a 2026-11-28 GPU run lose the Triton backend)."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        tool = tomllib.load(f)["tool"]["setuptools"]
    assert tool.get("package-dir", {}) in ({}, {"kvxfer": "kvxfer"}), tool.get("package-dir")
    missing = [
        p for p in tool["packages"] if not os.path.isfile(os.path.join(ROOT, *p.split("."), "__init__.py"))
    ]
    assert not missing, missing


def test_subpackages_import_from_the_source_tree_uninstalled():
    """Every package imports with the checkout on PYTHONPATH and no editable-install finder (the
    finder an editable install adds would hide a package the tree alone does not hold)."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        packages = tomllib.load(f)["tool"]["setuptools"]["packages"]
    code = (
        "import importlib, json, sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in type(f).__module__.lower()]\n"
        f"print(json.dumps([importlib.import_module(p).__file__ for p in {packages!r}]))"
    )
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/", env=env
    )
    assert r.returncode == 0, r.stderr
    files = json.loads(r.stdout.strip().splitlines()[-1])
    assert all(f.startswith(os.path.join(ROOT, "kvxfer")) for f in files), files
