"""Views of a span of raw memory, so one indexing op can reach every layer's separate tensor.

A paged cache is a list of per-layer allocations. To gather from all of them with a single
vectorised op (no per-layer Python loop), the reference backend views the address range that
covers all of them as one tensor of ``unit``-byte rows and indexes it with precomputed row
numbers. Only the indexed rows are ever touched; gaps between allocations are never read.
"""

from __future__ import annotations

import ctypes
import math

import torch

_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def tensor_extent(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, one past last byte] that ``t`` can address (non-negative strides)."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def word_for(unit: int, *addresses: int) -> torch.dtype:
    """Widest integer dtype whose size divides ``unit`` and every address."""
    for size, dtype in _WORDS:
        if unit % size == 0 and all(a % size == 0 for a in addresses):
            return dtype
    raise AssertionError("unreachable: 1 divides everything")


def as_units(t: torch.Tensor, unit: int, dtype: torch.dtype) -> torch.Tensor:
    """``[n, unit // word]`` view of contiguous ``t`` as ``dtype`` words."""
    word = torch.empty((), dtype=dtype).element_size()
    return t.reshape(-1).view(torch.uint8).view(dtype).view(-1, unit // word)


def common_unit(*values: int) -> int:
    """Greatest common divisor of the non-zero values (the largest row granularity)."""
    return math.gcd(*[abs(v) for v in values if v]) or 1


def _cpu_bytes(base: int, nbytes: int) -> torch.Tensor:
    buf = (ctypes.c_ubyte * nbytes).from_address(base)
    return torch.frombuffer(buf, dtype=torch.uint8)


def _cuda_bytes(base: int, nbytes: int, device: torch.device) -> torch.Tensor:
    try:
        import cupy
    except ImportError as e:  # pragma: no cover - GPU only
        raise RuntimeError(
            "the torch reference backend on CUDA tensors needs cupy to view cache memory "
            "(pip install cupy-cuda12x or cupy-cuda13x, matching torch.version.cuda), or use backend='triton' / 'cuda'"
        ) from e
    index = device.index if device.index is not None else torch.cuda.current_device()
    with cupy.cuda.Device(index):
        mem = cupy.cuda.UnownedMemory(base, nbytes, owner=None, device_id=index)
        arr = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
        return torch.from_dlpack(arr)


def unit_rows(base: int, end: int, unit: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[n, unit // word]`` view, as ``dtype`` words, of the bytes ``[base, end)`` (end rounded up).

    ``base`` and ``unit`` must be multiples of the word size.
    """
    word = torch.empty((), dtype=dtype).element_size()
    nbytes = -(-(end - base) // unit) * unit
    raw = _cpu_bytes(base, nbytes) if device.type == "cpu" else _cuda_bytes(base, nbytes, device)
    return raw.view(dtype).view(-1, unit // word)
