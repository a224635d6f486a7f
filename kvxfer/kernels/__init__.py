"""Triton backend of :mod:`kvxfer.ops` (``backend="triton"``), installed as ``kvxfer.kernels``.

Every op is ONE launch of one kernel (:mod:`kvxfer.kernels.rows`) whatever the number of layers
and blocks: per-layer base addresses travel in a device int64 pointer table, block ids are read
on the device, and nothing on the host waits for the device (no ``.cpu()``/``.item()``).
Rows move as integer words of the widest width the alignment of row bytes, strides and
pointers allows (see :class:`kvxfer.kernels.launch.Plan`), so every dtype moves bit-exactly.

Where it runs:

* CUDA caches, when triton imports and a GPU is visible. The wire of :func:`gather` /
  :func:`scatter` may be pinned host memory (``tensor.pin_memory()`` / ``pin_memory=True``):
  CUDA's unified virtual addressing maps page-locked host allocations into the device's
  address space at the same address, so the kernel reads/writes the host buffer directly
  over PCIe/NVLink-C2C with no staging copy. Pageable host memory is rejected by
  :mod:`kvxfer.ops` before anything runs.
* CPU tensors only under Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is
  first imported); that is how CI runs these kernels without a GPU. Under the interpreter CUDA
  tensors are refused.

Module interface (see :mod:`kvxfer.backends`): ``is_available``, ``gather``, ``scatter``,
``copy``; arguments are validated by :mod:`kvxfer.ops`.

Imported by the name ``kernels`` (the repository root on ``sys.path``, e.g. tests or
``python -m`` run from the root, where transformers probes for Hugging Face's ``kernels``
package) this module imports nothing of kvxfer and has no ``__version__``, so the probe finds
no usable ``kernels`` and moves on; only the ``kvxfer.kernels`` name runs the kernels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # a relative import at import time fails under the top-level name ``kernels``
    from ..backends.base import PagedSide

__all__ = ["copy", "gather", "is_available", "scatter", "unavailable_reason", "warmup"]


def is_available(device: torch.device) -> bool:
    """Whether these kernels can run on ``device`` in this process."""
    return not unavailable_reason(device)


def unavailable_reason(device: torch.device) -> str:
    """Why these kernels cannot run on ``device`` here ("" when they can)."""
    device = torch.device(device)
    try:
        from .launch import INTERPRETED
    except ImportError as e:  # triton missing or broken
        return f"triton does not import: {e}"
    if device.type == "cuda":
        if INTERPRETED:
            return "TRITON_INTERPRET=1 is set: the interpreter runs CPU tensors only"
        return "" if torch.cuda.is_available() else "no CUDA device is visible"
    if device.type == "cpu":
        return "" if INTERPRETED else "CPU tensors need TRITON_INTERPRET=1 set before triton loads"
    return f"no Triton backend for {device.type} tensors"


def gather(src: PagedSide, wire: torch.Tensor) -> None:
    """Rows of ``src`` into the contiguous wire ``[H, L, KV, T, D]`` (device or pinned host)."""
    from .launch import move

    move(src, wire, src)


def scatter(wire: torch.Tensor, dst: PagedSide) -> None:
    """The contiguous wire ``[H, L, KV, T, D]`` (device or pinned host) into the rows of ``dst``."""
    from .launch import move

    move(wire, dst, dst)


def copy(src: PagedSide, dst: PagedSide) -> None:
    """Rows of ``src`` straight into ``dst`` (block size and layout converted in one launch)."""
    from .launch import move

    move(src, dst, src)


def warmup(side: PagedSide, wire: torch.Tensor, copy: bool = True) -> None:
    """Compile (without launching) the gather, scatter and (``copy``) copy kernels for ``side``'s
    cache shape family and SM budget and a wire like ``wire`` (its dtype and alignment: its size
    does not matter, nothing runs); a no-op under the CPU interpreter."""
    from .launch import INTERPRETED, move

    if INTERPRETED or side.device.type != "cuda":
        return
    move(side, wire, side, warmup=True)
    move(wire, side, side, warmup=True)
    if copy:
        move(side, side, side, warmup=True)
