"""Block-id bookkeeping on the per-request path: caller's ids to a checked array, lease
refcounts and block epochs (hold, release, snapshot, check).

Each function is one native call (``csrc/ctl/kvx_ctl.cpp``, a CPython extension module built
like the CPU backend: by ``setup.py`` when a C++ compiler is found, else once on first use by
:func:`ensure`) or, when that does not load, the same operation in numpy. Both behave alike (the
tests run every case through both); the native one is faster because a request makes ~15 of
these calls and, with a cold cache between scheduler steps, each numpy call's dispatch cost
several times the work (``profiling/compare_host_cost.py``, numpy against native:
profiling/results/2026-11-23-cpu-hostcost/README.md, fourth pass).

Where the module comes from, first match wins: ``kvxfer/_prebuilt/_kvx_ctl-<hash><ext>``, the
cache directory of the CPU backend (``$KVXFER_CACHE_DIR``, ...), a build into that cache by
:func:`ensure` (which the engine calls at ``start()``). ``KVXFER_NATIVE_CTL=0`` keeps numpy.
:func:`status` says which is in use and why.

Arrays: ``ids`` int64 (or uint64) and C-contiguous, ``refcount`` int32 and ``epochs`` int64 of
one length (the number of blocks). The native functions check their arguments and every id
against that length before they write anything (``TypeError`` / ``IndexError`` naming the
problem): in C a bad id would write outside the array. The numpy ones are the calls the engine
made before, with numpy's own checks (an id past the end raises ``IndexError``; callers pass
checked ids).
"""

from __future__ import annotations

import array
import importlib.machinery
import importlib.util
import logging
import os
import threading
from pathlib import Path
from types import ModuleType

import numpy as np

from .backends import cpu_build

__all__ = [
    "ABI_VERSION",
    "any_repeat",
    "as_uint64",
    "ensure",
    "exact_ints",
    "hold",
    "ids_from_list",
    "max_id",
    "moved",
    "native",
    "release",
    "snapshot",
    "status",
    "unchanged",
]

_LOG = logging.getLogger(__name__)
ABI_VERSION = 17  # must equal kAbiVersion in csrc/ctl/kvx_ctl.cpp
_MAX_INT64 = 2**63 - 1
ENV = "KVXFER_NATIVE_CTL"
TARGET = cpu_build.CONTROL_MODULE


# --------------------------------------------------------------------------- numpy versions
# The calls the engine made before the native module (as few as numpy allows), without the
# native module's argument checks: the engine's own arrays and checked ids are all they get.
def _np_ids_from_list(x: list | tuple, need: int, num_blocks: int, unique: bool = False) -> np.ndarray:
    if type(x) is not list and type(x) is not tuple:
        raise ValueError(f"block_ids: must be a list or tuple, got {type(x).__name__}")
    if len(x) < need:
        raise ValueError(f"block_ids: {need} needed, got {len(x)}")
    part = x if len(x) == need else x[:need]
    try:  # unsigned: a negative id raises here, one max() bounds the rest
        a = np.frombuffer(array.array("Q", part), dtype=np.uint64)
    except OverflowError:
        raise ValueError(f"block_ids: out of range [0, {num_blocks})") from None
    except TypeError as e:
        raise ValueError(f"block_ids: must hold ints ({e})") from None
    if need and int(a.max()) >= num_blocks:
        raise ValueError(f"block_ids: out of range [0, {num_blocks})")
    if need and int(a.min()) <= 1 and any(type(v) is bool for v in part):  # bools hide among 0 and 1
        raise ValueError("block_ids: must hold ints, got a bool")
    if unique and need > 1 and len(set(part)) != need:
        raise ValueError("block_ids: repeated block id")
    return a.view(np.int64)


def _np_as_uint64(x: list) -> np.ndarray:
    return np.frombuffer(array.array("Q", x), dtype=np.uint64)  # OverflowError / TypeError


def _np_hold(refcount: np.ndarray, ids: np.ndarray) -> None:
    refcount[ids] += 1  # buffered: a block listed twice counts once


def _np_release(refcount: np.ndarray, epochs: np.ndarray, ids: np.ndarray) -> None:
    refcount[ids] -= 1
    epochs[ids] += refcount[ids] == 0


def _np_snapshot(epochs: np.ndarray, ids: np.ndarray) -> bytes:
    return epochs[ids].tobytes()


def _np_unchanged(epochs: np.ndarray, ids: np.ndarray, snap) -> bool:
    return epochs[ids].tobytes() == (snap if type(snap) is bytes else memoryview(snap).cast("B").tobytes())


def _np_moved(epochs: np.ndarray, ids_list: list, snaps: list) -> list[int]:
    if len(ids_list) == 1 or any(memoryview(s).nbytes != 8 * a.size for a, s in zip(ids_list, snaps)):
        # one load, or a snapshot of another length (a change): byte compares
        return [i for i, (a, s) in enumerate(zip(ids_list, snaps)) if not _np_unchanged(epochs, a, s)]
    snap = np.concatenate([np.frombuffer(s, np.int64) if type(s) is bytes else s for s in snaps])
    diff = epochs[np.concatenate(ids_list)] != snap  # one gather and compare for the batch
    if not diff.any():
        return []
    starts = np.cumsum([0] + [a.size for a in ids_list[:-1]])
    return np.flatnonzero(np.logical_or.reduceat(diff, starts)).tolist()


def _np_any_repeat(arrays: list | tuple) -> bool:
    if len(arrays) == 1:
        a = arrays[0]
    elif not arrays:
        return False
    else:
        a = np.concatenate(arrays)
    if a.size and int(a.min()) < 0:
        raise ValueError(f"any_repeat: negative block id {int(a.min())}")
    srt = np.sort(a)
    return bool((srt[1:] == srt[:-1]).any())


def _np_exact_ints(x: list | tuple) -> bool:
    if type(x) is not list and type(x) is not tuple:
        raise TypeError(f"exact_ints: must be a list or tuple, got {type(x).__name__}")
    return all(type(v) is int for v in x)


def _np_max_id(ids: np.ndarray) -> int:
    return int((ids if ids.dtype.kind == "u" else ids.view(np.uint64)).max()) if ids.size else 0


def _np_params_fields(d: object, limits: tuple) -> None:
    return None  # the Python checks (kvxfer.params) take every dict


# --------------------------------------------------------------------------- native versions
def _native_functions(mod: ModuleType) -> dict:
    ids_from_seq = mod.ids_from_seq

    def ids_from_list(x: list | tuple, need: int, num_blocks: int, unique: bool = False) -> np.ndarray:
        try:
            return np.frombuffer(ids_from_seq(x, need, num_blocks, unique), dtype=np.int64)
        except TypeError as e:  # not a list/tuple, or an item that is not an int
            raise ValueError(str(e)) from None

    def as_uint64(x: list) -> np.ndarray:
        try:
            return np.frombuffer(ids_from_seq(x, len(x), _MAX_INT64, False), dtype=np.uint64)
        except ValueError as e:  # as array("Q") says it
            raise OverflowError(str(e)) from None

    return {
        "ids_from_list": ids_from_list,
        "as_uint64": as_uint64,
        "hold": mod.hold,
        "release": mod.release,
        "snapshot": mod.snapshot,
        "unchanged": mod.unchanged,
        "moved": mod.moved,
        "any_repeat": mod.any_repeat,
        "max_id": mod.max_id,
        "exact_ints": mod.exact_ints,
        "params_fields": mod.params_fields,
    }


NUMPY = {
    "ids_from_list": _np_ids_from_list,
    "as_uint64": _np_as_uint64,
    "hold": _np_hold,
    "release": _np_release,
    "snapshot": _np_snapshot,
    "unchanged": _np_unchanged,
    "moved": _np_moved,
    "any_repeat": _np_any_repeat,
    "max_id": _np_max_id,
    "exact_ints": _np_exact_ints,
    "params_fields": _np_params_fields,
}

# The functions in use (bound by _use): module attributes, so callers write idops.hold(...).
ids_from_list = _np_ids_from_list
"""``ids_from_list(x, need, num_blocks, unique=False)``: the first ``need`` ids of the list or
tuple ``x`` as a new writable int64 array, each an int (anything with ``__index__``: numpy ints,
and bools as 0/1, as Python takes them) in ``[0, num_blocks)``, with ``unique`` none repeated;
``ValueError`` naming ``block_ids`` otherwise."""
as_uint64 = _np_as_uint64
"""``as_uint64(x)``: the list of ints ``x`` as a new uint64 array, unbounded but for the type
(``OverflowError`` for an id that does not fit, ``TypeError`` for one that is not an int; the
native one also for ids from 2**63 on): params carry ids the exporter's block count bounds
only after the handshake (:func:`max_id` then)."""
params_fields = _np_params_fields
"""``params_fields(d, limits)``: ``(fields, ids, digest)`` of a params dict whose every field is
plainly good (exact types, no ``groups``): a new dict of the params' fields, ``bytes`` of the
block ids as uint64 and their :func:`kvxfer.auth.content_digest`; None otherwise, and
always without the native module: :meth:`kvxfer.params.KVTransferParams.from_dict` then checks
it field by field (``csrc/ctl/params_fields.h`` says what "plainly" means)."""
hold = _np_hold
"""``hold(refcount, ids)``: one more holder of each block (a block listed twice counts once)."""
release = _np_release
"""``release(refcount, epochs, ids)``: one holder less of each block (listed twice: once); the
epoch of a block no longer held goes up by one."""
snapshot = _np_snapshot
"""``snapshot(epochs, ids) -> bytes``: ``epochs[ids]`` as native int64 bytes."""
unchanged = _np_unchanged
"""``unchanged(epochs, ids, snap) -> bool``: whether ``epochs[ids]`` still equals the bytes-like
``snap`` (a :func:`snapshot`)."""
moved = _np_moved
"""``moved(epochs, ids_list, snaps) -> list[int]``: the indices ``i`` whose ``epochs[ids_list[i]]``
no longer equal ``snaps[i]`` (each a :func:`snapshot` of as many ids, bytes or int64 array):
the loads of a batch whose blocks were released since their grant."""
any_repeat = _np_any_repeat
"""``any_repeat(arrays) -> bool``: whether the int64 arrays (a list or tuple), read as one list,
name some id twice; ids are ``>= 0`` (``ValueError`` otherwise). One pass over a set where
numpy concatenates and sorts."""
max_id = _np_max_id
"""``max_id(ids) -> int``: the largest of 8-byte int ``ids`` read as unsigned (0 when empty)."""
exact_ints = _np_exact_ints
"""``exact_ints(x) -> bool``: whether every item of the list or tuple ``x`` is exactly an ``int``
(no bool, numpy int or other subclass): then ``x`` is JSON-safe as the ids it holds, and
``export()`` hands a copy of it out in the params instead of converting its checked array back
(the check and a slice cost less than ``tolist()``)."""

_lock = threading.Lock()
_state: dict = {"native": None, "why": "not looked for yet", "tried_build": False}


def _use(functions: dict) -> None:
    globals().update(functions)


def _import(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader("_kvx_ctl", str(path))
    spec = importlib.util.spec_from_file_location("_kvx_ctl", path, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    if mod.abi_version() != ABI_VERSION:
        raise ImportError(f"{path}: ABI version {mod.abi_version()}, this kvxfer needs {ABI_VERSION}")
    return mod


def _candidates(csrc: Path) -> list[Path]:
    name = cpu_build.library_name(csrc, TARGET)
    return [cpu_build.prebuilt_dir() / name, cpu_build.cache_dir() / name]


def _resolve(build: bool) -> None:
    """Load the native module if it is there (or, with ``build``, compile it once); else keep
    numpy and record why."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "off", "no"):
        _state["why"] = f"{ENV}=0: numpy"
        return
    try:
        csrc = cpu_build.source_dir(TARGET)
        path = next((p for p in _candidates(csrc) if p.is_file()), None)
        if path is None:
            if not build:
                _state["why"] = "not built yet (TransferEngine.start() builds it)"
                return
            _LOG.warning(
                "kvxfer control helpers: no prebuilt %s (installed without a C++ compiler, or "
                "sources changed since); compiling it once into %s",
                cpu_build.library_name(csrc, TARGET),
                cpu_build.cache_dir(),
            )
            path = cpu_build.build(cpu_build.cache_dir(), csrc, target=TARGET)
        mod = _import(path)
    except Exception as e:
        _state["why"] = f"numpy ({type(e).__name__}: {e})"
        if build:
            _LOG.warning(
                "kvxfer control helpers: the native module did not load, numpy is used "
                "(~1.3x the host time per request): %s: %s",
                type(e).__name__,
                e,
            )
        return
    _use(_native_functions(mod))
    _state["native"], _state["why"] = mod, f"native: {path}"
    _LOG.info("kvxfer control helpers: %s", path)


def ensure() -> bool:
    """Load the native module, building it once if it is missing and a compiler is found
    (a WARNING says so); True when native functions are in use. Never raises."""
    with _lock:
        if _state["native"] is None and not _state["tried_build"]:
            _resolve(build=True)
            _state["tried_build"] = True
    return _state["native"] is not None


def native() -> ModuleType | None:
    """The native module when its functions are in use (for the lease-slot table's calls,
    :mod:`kvxfer.transports.ipc.slots`), else None."""
    return _state["native"]


def status() -> str:
    """``"native: <path>"``, or ``"numpy (<why>)"``."""
    return _state["why"]


with _lock:
    _resolve(build=False)  # a prebuilt or cached module: no compiler run at import
