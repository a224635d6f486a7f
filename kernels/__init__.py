"""Triton kernels behind ``backend="triton"`` (installed as ``kvxfer.kernels``). Not built yet."""

import torch


def is_available(device: torch.device) -> bool:
    return False
