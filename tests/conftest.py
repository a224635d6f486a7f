"""Test configuration: GPU markers, and the Triton interpreter on machines without a GPU."""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
# Triton kernels run on CPU tensors under the interpreter; it must be chosen before triton loads.
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    num_gpus = torch.cuda.device_count() if HAS_CUDA else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none visible)")
    skip_multi = pytest.mark.skip(reason=f"needs two CUDA GPUs ({num_gpus} visible)")
    for item in items:
        if "multigpu" in item.keywords and num_gpus < 2:
            item.add_marker(skip_multi)
        elif "gpu" in item.keywords and num_gpus < 1:
            item.add_marker(skip_gpu)
