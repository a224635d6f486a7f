"""`import kvxfer` is cheap: no CUDA work, no heavy optional imports; kernels map as kvxfer.kernels."""

import json
import subprocess
import sys


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
