"""Cache mappers of the ``ipc`` transport: how an exporter describes its cache memory and how
a loader maps it. ``"shm"`` (:mod:`kvxfer.transports.ipc.shm`, CPU caches in POSIX shared memory),
``"cma"`` (:mod:`kvxfer.transports.ipc.cma`, other CPU caches, read with Linux's cross-memory
attach) and ``"cuda"`` (:mod:`kvxfer.transports.ipc.cuda_mapper`, CUDA IPC handles) are registered; a
mapper module exposing ``describe(caches) -> dict | None``, ``attach(desc) -> (caches,
handle)``, ``detach(handle)`` (and ``attach_array``/``alloc_shm_array`` for the lease epochs)
plugs in under another name with :func:`register_mapper` and the engine uses it unchanged."""

from __future__ import annotations

from types import ModuleType

__all__ = ["mapper", "register_mapper"]

_MAPPERS: dict[str, str | ModuleType] = {
    "shm": "kvxfer.transports.ipc.shm",
    "cma": "kvxfer.transports.ipc.cma",
    "cuda": "kvxfer.transports.ipc.cuda_mapper",
}


def register_mapper(name: str, module: str | ModuleType) -> None:
    """Register an ``ipc`` cache mapper (module or import path) exposing describe/attach/detach."""
    _MAPPERS[name] = module


def mapper(name: str) -> ModuleType:
    """The cache mapper registered as ``name``."""
    import importlib

    m = _MAPPERS.get(name)
    if m is None:
        raise ValueError(f"ipc mapper: unknown {name!r} (registered: {sorted(_MAPPERS)})")
    if isinstance(m, str):
        m = importlib.import_module(m)
        _MAPPERS[name] = m
    return m
