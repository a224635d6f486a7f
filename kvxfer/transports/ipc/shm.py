"""CPU caches in POSIX shared memory, and mapping another process's caches by name.

:func:`alloc_shm_caches` allocates one rank's per-layer caches inside one shared-memory
segment and registers them, so :func:`describe` can tell a loader on the same host where they
are; :func:`attach` maps them (zero copy) in the loader, which then runs ``copy_blocks`` from
them straight into its own cache. :func:`alloc_shm_array` does the same for a small int64
array (the exporter's per-block lease epochs).
"""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

import torch

from ...spec import KVCacheSpec, dtype_from_name, dtype_name

__all__ = [
    "ShmCaches",
    "alloc_shm_array",
    "alloc_shm_caches",
    "attach",
    "attach_array",
    "describe",
    "detach",
    "release_segment",
]

_ALIGN = 256
_lock = threading.Lock()
# base address -> (segment name, size); one entry per live segment this process created.
_SEGMENTS: dict[int, tuple[str, int]] = {}


def _new_name(tag: str) -> str:
    return f"kvx_{tag}_{os.getpid()}_{uuid.uuid4().hex[:8]}"


def _base(shm: shared_memory.SharedMemory) -> torch.Tensor:
    return torch.frombuffer(shm.buf, dtype=torch.uint8)


@dataclass
class ShmCaches:
    """Per-layer caches (``caches[l]``) living in shared-memory segment ``name``.

    Keep this object alive while the caches are used; :meth:`close` unlinks the segment
    (loaders that mapped it keep their mapping until they unmap).
    """

    caches: list[torch.Tensor]
    name: str
    _shm: shared_memory.SharedMemory

    def close(self) -> None:
        release_segment(self._shm)
        self.caches = []


def release_segment(shm: shared_memory.SharedMemory) -> None:
    """Forget, close and unlink a segment this process created."""
    with _lock:
        for base, (name, _) in list(_SEGMENTS.items()):
            if name == shm.name:
                del _SEGMENTS[base]
    _close(shm, unlink=True)


def _close(shm: shared_memory.SharedMemory, unlink: bool) -> None:
    with contextlib.suppress(BufferError):  # tensors still view it; unmapped when they go
        shm.close()
    if unlink:
        with contextlib.suppress(FileNotFoundError):
            shm.unlink()


def _create(nbytes: int, tag: str) -> shared_memory.SharedMemory:
    shm = shared_memory.SharedMemory(name=_new_name(tag), create=True, size=max(nbytes, 1))
    with _lock:
        _SEGMENTS[_base(shm).data_ptr()] = (shm.name, shm.size)
    return shm


def alloc_shm_caches(
    spec: KVCacheSpec, num_blocks: int, tp_size: int, fill: float | int | None = None
) -> ShmCaches:
    """Allocate one rank's caches (``spec.cache_shape(num_blocks, tp_size)`` per layer) in shm."""
    shape = spec.cache_shape(num_blocks, tp_size)
    numel = 1
    for s in shape:
        numel *= s
    layer_bytes = -(-numel * spec.element_size // _ALIGN) * _ALIGN
    shm = _create(layer_bytes * spec.num_layers, "kv")
    raw = _base(shm)
    caches = [
        raw[i * layer_bytes : i * layer_bytes + numel * spec.element_size].view(spec.dtype).view(shape)
        for i in range(spec.num_layers)
    ]
    if fill is not None:
        for c in caches:
            c.view(torch.uint8).fill_(0) if fill == 0 else c.fill_(fill)
    return ShmCaches(caches, shm.name, shm)


def alloc_shm_array(n: int, tag: str = "ep") -> tuple[torch.Tensor, shared_memory.SharedMemory]:
    """A zeroed int64 tensor ``[n]`` in a new shm segment, and the segment (close+unlink it)."""
    shm = _create(8 * n, tag)
    t = _base(shm)[: 8 * n].view(torch.int64)
    t.zero_()
    return t, shm


def describe(caches: list[torch.Tensor]) -> dict | None:
    """Where ``caches`` live, if every layer is in one registered segment; else None."""
    with _lock:
        segs = list(_SEGMENTS.items())
    first = caches[0]
    for base, (name, size) in segs:
        ok = all(
            base <= c.data_ptr() and c.data_ptr() + c.numel() * c.element_size() <= base + size
            for c in caches
        )
        if ok:
            return {
                "name": name,
                "size": size,
                "offsets": [c.data_ptr() - base for c in caches],
                "shape": list(first.shape),
                "stride": list(first.stride()),
                "dtype": dtype_name(first.dtype),
            }
    return None


def _attach(name: str) -> shared_memory.SharedMemory:
    # Python < 3.13 registers even attached segments with the resource tracker, which would
    # unlink the exporter's segment when this (loader) process exits, or drop the creator's
    # registration when the tracker is shared. Attach without registering.
    with _lock:
        register = resource_tracker.register
        resource_tracker.register = lambda *a, **k: None
        try:
            return shared_memory.SharedMemory(name=name, create=False)
        finally:
            resource_tracker.register = register


def attach(desc: dict) -> tuple[list[torch.Tensor], shared_memory.SharedMemory]:
    """Map caches described by :func:`describe` from another process (raises OSError if absent)."""
    shm = _attach(desc["name"])
    raw = _base(shm)
    dtype = dtype_from_name(desc["dtype"])
    es = torch.empty((), dtype=dtype).element_size()
    shape, stride = tuple(desc["shape"]), tuple(desc["stride"])
    extent = (sum((n - 1) * s for n, s in zip(shape, stride)) + 1) * es
    caches = [raw[off : off + extent].view(dtype).as_strided(shape, stride) for off in desc["offsets"]]
    return caches, shm


def attach_array(name: str, n: int) -> tuple[torch.Tensor, shared_memory.SharedMemory]:
    """Map an int64 ``[n]`` array made by :func:`alloc_shm_array` in another process."""
    shm = _attach(name)
    return _base(shm)[: 8 * n].view(torch.int64), shm


def detach(shm: shared_memory.SharedMemory) -> None:
    """Unmap a segment mapped by :func:`attach` (never unlinks it)."""
    _close(shm, unlink=False)
