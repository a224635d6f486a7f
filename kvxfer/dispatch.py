"""How a validated op call runs: its SM budget, and the one dispatch tail every op goes through.

:class:`Launch` is what a call needs beyond its sides (op, backend, device, whether the copy
engines may move these tensors, the registered caches that record the path chosen), made once
per prepared copy (:mod:`kvxfer.prepared`) or once per call of the validating paths
(:mod:`kvxfer.ops`). :func:`launch` runs it: on the copy engines when
:func:`kvxfer.backends.dma.choose` says so, else on the backend's kernel
(:mod:`kvxfer.backends.registry`).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from . import tracing
from .backends import batch_copy as _batch_copy
from .backends import dma as _dma
from .backends import registry as _registry
from .backends.base import PagedSide
from .paged import PagedCache

__all__ = [
    "HOST_WIRE_ENV",
    "HOST_WIRE_MAX_SMS",
    "Launch",
    "call_budget",
    "cap",
    "check_args",
    "host_wire_budget",
    "launch",
    "launch_of",
    "wire_cap",
]


class Launch(NamedTuple):
    """One op call's dispatch, apart from its sides (immutable; a prepared copy keeps one).

    ``op``: ``"gather"`` (kernel arguments: side, wire), ``"scatter"`` (wire, side) or
    ``"copy"`` (source side, destination side). ``backend``: the name asked for (None: the
    device's default). ``engines``: the copy engines may move these tensors (CUDA ones, or CPU
    ones while a test's fake driver serves them: decided when the caches were checked, never
    per call); without them the call goes straight to the kernel, chooses nothing and records
    nothing (choosing and recording on CPU would add about an eighth to an engine-path copy
    call's host time: profiling/results/README.md, "Figures recorded without a run folder").
    ``a``, ``b``: the call's caches (source first); those registered record the choice."""

    op: str
    backend: str | None
    device: torch.device
    engines: bool
    a: object
    b: object = None


def launch_of(op: str, backend: str | None, caches, info) -> Launch:
    """The :class:`Launch` of ``op`` with ``backend`` on one side's ``caches`` (``info``: what
    checking them found, :class:`kvxfer.paged.PagedCache` ``.info`` when registered): kept on
    registered caches per (op, backend), made anew for others (their checks cost far more)."""
    if type(caches) is not PagedCache:
        return Launch(op, backend, info.device, info.engines, caches)
    memo = caches.__dict__.get("_launches")
    if memo is None:
        memo = caches.__dict__["_launches"] = {}
    how = memo.get((op, backend))
    if how is None:
        how = memo[(op, backend)] = Launch(op, backend, info.device, info.engines, caches)
    return how


def launch(how: Launch, x, y, budget: int | None, dma: bool | None) -> None:
    """Run a validated call: backend function ``how.op`` of ``how.backend`` on ``(x, y)`` (as
    :class:`Launch` orders them), or the copy engines when ``how.engines`` and
    :func:`kvxfer.backends.dma.choose` picks them (``dma``: the call's; ``budget``: the call's SM
    budget, already on its sides). A refused driver call falls back to the kernel."""
    if not how.engines:
        if dma:  # as dma.choose says it where the engines exist but cannot serve the call
            _, why = _batch_copy.copier(how.device)
            raise ValueError(f"dma=True: no batched copy for caches on {how.device}: {why}")
        _registry.run(how.backend, how.device, how.op, x, y)
        return
    op, device = how.op, how.device
    wire = y if op == "gather" else x if op == "scatter" else None
    if how.backend is not None and dma is None:
        choice = _dma.Choice("kernel", "backend named", how.backend)
    else:
        src = x if op != "scatter" else None
        dst = y if op != "gather" else None
        wire_ptr = wire.data_ptr() if wire is not None else None
        choice = _dma.choose(op, src, dst, wire_ptr, budget, dma, device)
    if choice.path == "dma":
        host = wire is not None and wire.device.type != device.type  # a pinned host wire
        with tracing.trace(op, str, choice):
            done = _batch_copy.run(
                choice.runs, device, src_host=host and op == "scatter", dst_host=host and op == "gather"
            )
        if done:
            _registry.note_backend("dma")
            _record(how, choice)
            return
        choice = _dma.Choice("kernel", "dma call failed", _dma.known_status())
    with tracing.trace(op, str, choice):
        _registry.run(how.backend, device, op, x, y)
    _record(how, choice)


def _record(how: Launch, choice: _dma.Choice) -> None:
    sa = how.a.path_stats if type(how.a) is PagedCache else None
    sb = how.b.path_stats if type(how.b) is PagedCache else None
    if sa is not None:
        sa.record(how.op, choice)
    if sb is not None and sb is not sa:
        sb.record(how.op, choice)


# --------------------------------------------------------------------------- budget


def check_args(max_sms, dma) -> None:
    """``max_sms`` and ``dma`` of an op call, checked before anything is written."""
    if max_sms is not None:
        _dma.check_max_sms(max_sms)
    if dma is not None and type(dma) is not bool:
        raise ValueError(f"dma: must be None (the rule), True or False, got {dma!r}")


def registered_budget(a, b=None) -> int | None:
    """The smaller of the SM budgets registered caches ``a`` and ``b`` carry (None: none)."""
    x = a.max_sms if type(a) is PagedCache else None
    y = b.max_sms if type(b) is PagedCache else None
    if x is None:
        return y
    return x if y is None else min(x, y)


def call_budget(max_sms, a, b=None) -> int | None:
    """The call's SM budget: ``max_sms`` when given (validated), else :func:`registered_budget`."""
    if max_sms is not None:
        return _dma.check_max_sms(max_sms)
    return registered_budget(a, b)


def cap(max_sms, src: PagedSide | None, dst: PagedSide | None, a, b=None) -> int | None:
    """Put the call's budget (``max_sms``, already checked, else the registered caches') on its
    paged sides, where the kernels read it (:class:`kvxfer.backends.base.PagedSide`); returns it."""
    got = max_sms if max_sms is not None else registered_budget(a, b)
    if got is not None:
        if src is not None:
            src.max_sms = got
        if dst is not None:
            dst.max_sms = got
    return got


# SM budget of a gather into (scatter from) a pinned host wire on a GPU when the call and its
# caches set none. Such a call is bound by PCIe, not by SMs: on an H200 an uncapped gather of a
# 4K-token Llama-3-8B request held every SM for its ~10 ms and a bf16 GEMM beside it took 8.6x as
# long, while Triton capped at 16 SMs kept 93 % of a pinned copy_ and slowed the GEMM by 26 %
# (profiling/results/2026-11-28-H200/, bench_interference). $KVXFER_HOST_WIRE_MAX_SMS overrides
# it (0: no budget).
HOST_WIRE_MAX_SMS = 16
HOST_WIRE_ENV = "KVXFER_HOST_WIRE_MAX_SMS"


def host_wire_budget() -> int | None:
    """The SM budget a host-wire gather or scatter on a GPU takes when none is set
    (:data:`HOST_WIRE_MAX_SMS`, or ``$KVXFER_HOST_WIRE_MAX_SMS``; None when that is 0)."""
    raw = os.environ.get(HOST_WIRE_ENV, "").strip()
    if not raw:
        return HOST_WIRE_MAX_SMS
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"${HOST_WIRE_ENV}={raw!r}: not an integer") from None
    if value < 0:
        raise ValueError(f"${HOST_WIRE_ENV}={value}: must be 0 (no budget) or a positive SM count")
    return value or None


def wire_cap(got: int | None, side: PagedSide, wire: torch.Tensor) -> int | None:
    """``got`` (the call's budget), or for a GPU side with a host-memory wire and no budget set,
    the host-wire budget (put on ``side``, where the kernels read it)."""
    if got is None and side.device.type == "cuda" and wire.device.type == "cpu":
        got = host_wire_budget()
        side.max_sms = got
    return got
