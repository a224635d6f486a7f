"""Make a CUDA device's primary context current on the calling thread, for the driver-level
calls that act on the current context (pointer attributes, address ranges, IPC handles).

``cupy.cuda.Device(i)`` alone is not enough: entering it calls ``cudaSetDevice`` only when the
thread's current device differs from ``i``, and a thread that has made no CUDA call yet reports
device 0 with no context bound, and such a thread's pointer-attribute query answers "host
memory, device pointer 0" for pinned memory (seen on an H200: profiling/results/2026-11-26-H200/).
``cudaSetDevice`` (CUDA >= 12)
initialises the device's primary context and binds it, so :func:`bound_device` always calls it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def bound_device(index: int, runtime: Any = None) -> Iterator[None]:
    """Device ``index``'s primary context current on this thread inside the block; the thread's
    previous device is restored on exit when it differs. ``runtime``: CuPy's
    ``cupy.cuda.runtime`` (default: imported here)."""
    if runtime is None:
        import cupy

        runtime = cupy.cuda.runtime
    previous = runtime.getDevice()
    runtime.setDevice(index)
    try:
        yield
    finally:
        if previous != index:
            runtime.setDevice(previous)
