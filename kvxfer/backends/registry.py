"""Which backend runs an op: the registry of backend modules, their availability (and why
not), the default order per device (``$KVXFER_CUDA_BACKENDS`` reorders it for CUDA tensors),
``$KVXFER_BACKEND``, and the dispatch :mod:`kvxfer.ops` calls once its arguments are validated.

A backend is loaded on first use; availability is probed once per (backend, device type) and
never changes within a process (:func:`reset_backends` forgets it, for tests that swap a
module in). A backend passed over is logged once as a warning with the reason.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from types import ModuleType

import torch

_LOG = logging.getLogger(__name__)

__all__ = [
    "BACKENDS",
    "CUDA_ORDER_ENV",
    "FORCE_ENV",
    "backend_status",
    "cuda_order",
    "last_backend",
    "module",
    "reset_backends",
    "resolve_backend",
    "run",
]

BACKENDS = ("torch", "triton", "cuda", "cpu")
_MODULES = {
    "torch": "kvxfer.backends.torch_ref",
    "triton": "kvxfer.kernels",
    "cuda": "kvxfer.backends.cuda",
    "cpu": "kvxfer.backends.cpu",
}
_local = threading.local()
_available: dict[tuple[str, str], bool] = {}


_loaded: dict[str, ModuleType] = {}
_resolved: dict[tuple[torch.device, str | None, str], tuple[str, object]] = {}  # -> (name, function)


def module(name: str) -> ModuleType:
    """The backend module ``name`` (imported on first use)."""
    mod = _loaded.get(name)
    if mod is None:
        mod = _loaded[name] = importlib.import_module(_MODULES[name])
    return mod


_why: dict[tuple[str, str], str] = {}  # (backend, device type) -> why it is unavailable
_warned: set[tuple[str, str]] = set()
FORCE_ENV = "KVXFER_BACKEND"  # forces the backend of calls made with backend=None
CUDA_ORDER_ENV = "KVXFER_CUDA_BACKENDS"  # the order backend=None tries on CUDA tensors
# Triton first: faster than the CUDA C++ kernels on every device row measured, equal into pinned
# memory, at ~30 us more host time per call (profiling/results/2026-11-26-H200/README.md).
CUDA_ORDER = ("triton", "cuda", "torch")


def _is_available(name: str, device: torch.device) -> bool:
    key = (name, device.type)
    if key not in _available:
        try:
            mod = module(name)
            ok = bool(mod.is_available(device))
            why = (
                ""
                if ok
                else (getattr(mod, "unavailable_reason", lambda d: "")(device) or "is_available() is false")
            )
        except ImportError as e:
            ok, why = False, f"import failed: {e}"
        _available[key] = ok
        _why[key] = why
    return _available[key]


def _default_order(device: torch.device) -> tuple[str, ...]:
    if device.type == "cpu":
        return ("cpu", "torch")
    return cuda_order()


def cuda_order() -> tuple[str, ...]:
    """The backends ``backend=None`` tries, in order, on CUDA tensors: ``$KVXFER_CUDA_BACKENDS``
    (a comma list, e.g. ``cuda,triton,torch``) when set, else Triton, CUDA C++, torch. Unlike
    ``$KVXFER_BACKEND`` it leaves CPU tensors alone, and a backend it names that is unusable is
    passed over with a warning, not an error. Names outside :data:`BACKENDS` raise."""
    raw = os.environ.get(CUDA_ORDER_ENV, "").strip()
    if not raw:
        return CUDA_ORDER
    order = tuple(n.strip() for n in raw.split(",") if n.strip())
    bad = [n for n in order if n not in BACKENDS]
    if bad or not order:
        raise ValueError(f"${CUDA_ORDER_ENV}={raw!r}: names must be among {BACKENDS}, got {bad or order}")
    return order


def resolve_backend(device: torch.device | str, backend: str | None = None) -> str:
    """The backend a call on ``device`` with ``backend`` would use (raises if unusable).

    ``backend=None`` takes ``$KVXFER_BACKEND`` when set (an unusable forced backend raises,
    naming why), else the first available of :func:`cuda_order` on CUDA tensors (Triton,
    CUDA C++, torch unless ``$KVXFER_CUDA_BACKENDS`` says otherwise), of the native CPU backend
    and torch on CPU tensors. A backend passed over is logged once as a warning with the reason.
    """
    device = torch.device(device)
    if backend is None:
        forced = os.environ.get(FORCE_ENV, "").strip()
        if forced:
            return _require(forced, device, f"${FORCE_ENV}")
        order = _default_order(device)
        for name in order:
            if _is_available(name, device):
                return name
            key = (name, device.type)
            if key not in _warned:
                _warned.add(key)
                _LOG.warning(
                    "kvxfer ops: backend %r unavailable for %s tensors (%s); falling back to the next of %s",
                    name,
                    device.type,
                    _why.get(key, ""),
                    order,
                )
        return "torch"
    return _require(backend, device, "backend")


def _require(backend: str, device: torch.device, what: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"{what}: must be one of {BACKENDS} or None, got {backend!r}")
    if not _is_available(backend, device):
        why = _why.get((backend, device.type), "")
        raise ValueError(f"{what}: {backend!r} is not available for {device.type} tensors here ({why})")
    return backend


def backend_status(device: torch.device | str = "cuda") -> dict[str, dict]:
    """Per backend, for tensors on ``device``: ``{"available": bool, "reason": why not (""),
    "default": True for the one ``backend=None`` picks}``, plus ``"loaded_from"`` for the CUDA
    C++ kernels once loaded (``"fatbin:<path>"`` or ``"nvrtc"``). Never raises."""
    device = torch.device(device)
    out: dict[str, dict] = {}
    try:
        default = resolve_backend(device)
    except ValueError as e:
        default = f"error: {e}"
    for name in BACKENDS:
        ok = _is_available(name, device)
        row = {"available": ok, "reason": _why.get((name, device.type), ""), "default": name == default}
        if name == "cuda" and ok and device.type == "cuda":
            row["loaded_from"] = module("cuda").loaded_from(device.index or 0)
        out[name] = row
    if not any(r["default"] for r in out.values()):
        out["error"] = {"available": False, "reason": default, "default": False}
    return out


def reset_backends() -> None:
    """Forget which backends loaded and were chosen (after swapping a backend module in tests)."""
    _available.clear()
    _why.clear()
    _warned.clear()
    _resolved.clear()
    _loaded.clear()


def last_backend() -> str | None:
    """Name of the backend that ran the most recent op on this thread (None before any)."""
    return getattr(_local, "backend", None)


def note_backend(name: str) -> None:
    """Record ``name`` as what ran this thread's latest op (the copy engines: ``"dma"``)."""
    _local.backend = name


def run(backend: str | None, device: torch.device, fn: str, *args) -> None:
    """Run backend function ``fn`` (``gather``/``scatter``/``copy``) of ``backend`` (None: the
    default for ``device``) on validated arguments, and remember its name for :func:`last_backend`."""
    key = (device, backend, fn)  # the device itself: its ``.type`` is a torch call
    got = _resolved.get(key)
    if got is None:  # availability never changes within a process: resolve once per key
        name = resolve_backend(device, backend)
        got = _resolved[key] = (name, getattr(module(name), fn))
    got[1](*args)
    _local.backend = got[0]
