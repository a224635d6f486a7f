"""NVTX ranges named by request and phase, so an Nsight Systems timeline shows each request's path.

``with trace("gather", request_id):`` (or ``@traced("scatter")``) pushes the range
``kvxfer.<phase> <request_id>`` in the ``kvxfer`` NVTX domain. The ``nvtx`` package is imported on
first use; when it is missing, or no NVTX tool (Nsight Systems, Nsight Compute) is attached to
the process (``nvtx`` then hands out its no-op domain, and so does this module), or
``KVXFER_NVTX=0`` is set, or :func:`set_enabled` turned tracing off, :func:`trace` returns one
shared no-op context manager (one dict lookup, no allocation), so calls can stay on the hot
path. :func:`status` says which, and why. With a tool attached, ranges go straight to the
domain object (``Domain.push_range``: the package's cheapest call), not through
``nvtx.push_range``'s lookup of the domain by name on every range.

How the engine plugs it in: the loader's batch (``load``), inside it the handshake, the lease
``grant`` round trip, per source rank the gather, send, recv, scatter and copy calls
(``with trace("copy", req_id): ops.copy_blocks(...)``) and the ``wait`` for the transfer
stream; the notifier's ``notify`` round trip; on the exporter, ``serve`` per side-channel
message (named by its type). The ranges mark host-side time; on the GPU timeline Nsight
correlates them with the kernels launched inside. ``profiling/bench_latency.py`` records the
same ranges without Nsight (a recording stand-in for ``nvtx``) to print a request's timeline.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = [
    "PHASES",
    "batch_tag",
    "enabled",
    "items_tag",
    "set_enabled",
    "status",
    "trace",
    "traced",
]

PHASES = (
    "handshake",
    "load",
    "grant",
    "gather",
    "send",
    "recv",
    "scatter",
    "copy",
    "wait",
    "status",
    "notify",
    "serve",
)
_COLORS = {
    "handshake": "purple",
    "load": "gray",  # a loader batch on the worker thread, from dispatch to its last completion
    "grant": "yellow",  # the lease grant round trip to the exporter ranks
    "gather": "green",
    "send": "blue",
    "recv": "cyan",
    "scatter": "orange",
    "copy": "red",
    "wait": "pink",  # waiting for the transfer stream's work (CUDA event polls) or a chunk's receive
    "status": "teal",  # a stream's status (which loads landed), sent after its last chunk
    "notify": "olive",  # the notifier's round trip that frees the exporter's blocks
    "serve": "brown",  # the exporter handling one side-channel message (its type)
}
DOMAIN = "kvxfer"
_NULL = contextlib.nullcontext()
F = TypeVar("F", bound=Callable[..., Any])

_state: dict[str, Any] = {"enabled": None, "nvtx": None, "domain": None, "why": "not looked at yet"}


def _env_enabled() -> bool:
    return os.environ.get("KVXFER_NVTX", "1").strip().lower() not in ("0", "false", "off", "no", "")


def _off(why: str) -> bool:
    _state["enabled"], _state["why"] = False, why
    return False


def _load() -> bool:
    """Resolve enabled-ness once: env var, whether ``nvtx`` imports, whether a tool listens."""
    if not _env_enabled():
        return _off("off: KVXFER_NVTX=0")
    if _state["nvtx"] is None:
        try:
            import nvtx
        except ImportError:
            return _off("off: the nvtx package is not installed")
        _state["nvtx"] = nvtx
    mod = _state["nvtx"]
    get_domain = getattr(mod, "get_domain", None)  # the nvtx package (stand-ins may lack it)
    dom = None
    if get_domain is not None:
        dom = get_domain(DOMAIN)
        if type(dom).__name__ == "DummyDomain":  # nvtx's own answer: no tool attached
            return _off("off: no NVTX tool attached (the nvtx package gave its no-op domain)")
    _state["domain"], _state["enabled"] = dom, True
    _state["why"] = f"on: NVTX domain {DOMAIN!r}" + ("" if dom is not None else " (a stand-in nvtx module)")
    return True


def enabled() -> bool:
    """Whether :func:`trace` emits NVTX ranges."""
    e = _state["enabled"]
    return _load() if e is None else e


def status() -> str:
    """Whether :func:`trace` emits ranges, and why (``"on: ..."`` or ``"off: ..."``)."""
    enabled()
    return _state["why"]


def set_enabled(on: bool | None, nvtx_module: Any = None) -> None:
    """Turn ranges on/off at run time (``None``: back to the env var / import default; ``True``
    still needs ``nvtx`` and, for the real package, an attached tool). ``nvtx_module`` replaces
    the ``nvtx`` package (tests, ``profiling/bench_latency.py``'s recorder)."""
    if nvtx_module is not None:
        _state["nvtx"] = nvtx_module
    if on is None:
        _state["enabled"], _state["why"] = None, "not looked at yet"
    elif on:
        _state["enabled"] = None
        _load()
    else:
        _off("off: set_enabled(False)")


class _Range:
    """A range through a stand-in module's ``push_range`` / ``pop_range``."""

    __slots__ = ("_color", "_msg", "_nvtx")

    def __init__(self, nvtx: Any, msg: str, color: str) -> None:
        self._nvtx, self._msg, self._color = nvtx, msg, color

    def __enter__(self) -> _Range:
        self._nvtx.push_range(self._msg, color=self._color, domain=DOMAIN)
        return self

    def __exit__(self, *exc: object) -> None:
        self._nvtx.pop_range(domain=DOMAIN)


class _DomainRange:
    """A range on the ``kvxfer`` domain object of the nvtx package (a tool is attached)."""

    __slots__ = ("_attrs", "_dom")

    def __init__(self, dom: Any, msg: str, color: str) -> None:
        self._dom, self._attrs = dom, dom.get_event_attributes(msg, color)

    def __enter__(self) -> _DomainRange:
        self._dom.push_range(self._attrs)
        return self

    def __exit__(self, *exc: object) -> None:
        self._dom.pop_range()


def trace(phase: str, request_id: object = None, *tag_args: object) -> contextlib.AbstractContextManager:
    """Context manager for one NVTX range ``kvxfer.<phase> <request_id>``.

    ``phase`` is one of :data:`PHASES` (``ValueError`` otherwise, also when disabled, so a typo
    is caught in CPU tests). With ``tag_args``, ``request_id`` is a function and the range is
    named ``request_id(*tag_args)``, called only when a range is made (``trace("grant",
    batch_tag, ids)``: nothing is computed for the name while tracing is off).
    """
    if phase not in _COLORS:
        raise ValueError(f"phase: must be one of {PHASES}, got {phase!r}")
    e = _state["enabled"]
    if e is False or (e is None and not _load()):
        return _NULL
    if tag_args:
        request_id = request_id(*tag_args)
    msg = f"{DOMAIN}.{phase}" if request_id is None else f"{DOMAIN}.{phase} {request_id}"
    dom = _state["domain"]
    if dom is not None:
        return _DomainRange(dom, msg, _COLORS[phase])
    return _Range(_state["nvtx"], msg, _COLORS[phase])


def traced(phase: str, request_id_arg: str = "request_id") -> Callable[[F], F]:
    """Decorator: run the function inside ``trace(phase, <its request_id_arg argument>)``; the
    request id is taken from that keyword, else it is the first positional argument that is a
    str."""
    if phase not in _COLORS:
        raise ValueError(f"phase: must be one of {PHASES}, got {phase!r}")

    def deco(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if _state["enabled"] is False:
                return fn(*args, **kwargs)
            rid = kwargs.get(request_id_arg)
            if rid is None:
                rid = next((a for a in args if isinstance(a, str)), None)
            with trace(phase, rid):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return deco


def batch_tag(request_ids) -> str:
    """NVTX name of a batch: its request id, or the first id and how many more.
    ``request_ids``: any sized collection of ids (a list, or a dict keyed by them: no copy)."""
    n = len(request_ids)
    if not n:
        return ""
    first = next(iter(request_ids))
    return first if n == 1 else f"{first}+{n - 1}"


def items_tag(items) -> str:
    """:func:`batch_tag` of the request ids of ``items`` (objects with a ``request_id``)."""
    return batch_tag([it.request_id for it in items])
