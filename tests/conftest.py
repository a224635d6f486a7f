"""Test configuration: GPU markers, and the Triton interpreter on machines without a GPU."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

# Engine key files (kvxfer.auth) of the test engines go to a private directory removed at
# exit, not to the machine's /dev/shm (crash tests leave theirs behind on purpose).
_KEY_DIR = tempfile.mkdtemp(prefix="kvxfer-test-keys-")
os.environ["XDG_RUNTIME_DIR"] = _KEY_DIR
atexit.register(shutil.rmtree, _KEY_DIR, True)
# Triton kernels run on CPU tensors under the interpreter; it must be chosen before triton loads.
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


# $KVXFER_FAILURES_NOW: a file each failing test's report is appended to as it fails, not at the
# end of the run, so a run its time limit cuts short (a GPU session's step) still says why
_FAILURES_NOW = os.environ.get("KVXFER_FAILURES_NOW", "")


def pytest_runtest_logreport(report):
    if _FAILURES_NOW and report.failed:
        with open(_FAILURES_NOW, "a") as f:
            f.write(
                f"=== {report.nodeid} ({report.when}, {report.duration:.1f} s)\n{report.longreprtext}\n\n"
            )


def pytest_collection_modifyitems(config, items):
    num_gpus = torch.cuda.device_count() if HAS_CUDA else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none visible)")
    skip_multi = pytest.mark.skip(reason=f"needs two CUDA GPUs ({num_gpus} visible)")
    for item in items:
        if "multigpu" in item.keywords and num_gpus < 2:
            item.add_marker(skip_multi)
        elif "gpu" in item.keywords and num_gpus < 1:
            item.add_marker(skip_gpu)
