"""The in-process harness of the host-cost benchmarks (``bench_engine.py``,
``bench_host_floor.py``): a null copy kernel in place of the CPU backends, a loopback side
channel answered in the caller's thread, and caches whose layers alias one shared-memory
layer."""

from __future__ import annotations

import dataclasses
import sys
import time

from kvxfer import KVCacheSpec, TransferEngine, ops
from kvxfer import control as C
from kvxfer.transports.ipc.shm import alloc_shm_caches


class NullKernel:
    """Stands in for the CPU backends (native ``cpu`` and the ``torch`` reference, whichever ops
    picks) during the host-cost measurement: every check, plan and message of the engine runs;
    only the data movement itself (the kernel) is skipped."""

    __name__ = "kvxfer_bench_null_backend"
    copies = 0  # calls that reached it: host_cost checks the engine's copies did

    @staticmethod
    def is_available(device) -> bool:
        return True

    @staticmethod
    def gather(src, wire) -> None:
        pass

    @staticmethod
    def scatter(wire, dst) -> None:
        pass

    @staticmethod
    def copy(src, dst) -> None:
        NullKernel.copies += 1


def use_null_backend() -> dict:
    """Route the CPU backends (native ``cpu`` and the ``torch`` reference) to :class:`NullKernel`;
    returns what :func:`restore_backends` needs to undo it."""
    saved = dict(ops._MODULES)
    sys.modules["kvxfer_bench_null_backend"] = NullKernel  # type: ignore[assignment]
    for name in ("torch", "cpu"):
        ops._MODULES[name] = "kvxfer_bench_null_backend"
    ops.reset_backends()
    return saved


def restore_backends(saved: dict) -> None:
    ops._MODULES.update(saved)
    ops.reset_backends()


class Loopback:
    """The loader's side-channel client, answered in this thread by the exporter's own handler.

    Messages are encoded and decoded exactly as over zmq; the socket hop itself (latency, not
    host work) is left out. Time spent on the exporter's side (decode, handle, encode reply)
    is accumulated in ``exporter_s``.
    """

    def __init__(self, exporter: TransferEngine) -> None:
        self.exporter = exporter
        self.exporter_s = 0.0

    def _deliver(self, msg):
        buf = C.encode(msg)
        t0 = time.perf_counter()
        reply = self.exporter._exporter.handle(C.decode(buf))
        out = None if reply is None else C.encode(reply)
        self.exporter_s += time.perf_counter() - t0
        return None if out is None else C.decode(out)

    def call_many(self, calls, timeout_s, partial=False):
        return [self._deliver(msg) for _, msg in calls]

    def call(self, addr, msg, timeout_s):
        return self._deliver(msg)

    def send(self, addr, msg) -> None:
        self._deliver(msg)

    def drop(self, addr) -> None:
        pass

    def close(self) -> None:
        pass


def aliased_shm_caches(spec: KVCacheSpec, num_blocks: int):
    """Caches whose layers all alias one shared-memory layer (no data moves, so 32 layers of a
    4K-token cache need not take 32 x the memory); mappable by the ipc transport."""
    one = alloc_shm_caches(dataclasses.replace(spec, num_layers=1), num_blocks, 1)
    return one, [one.caches[0]] * spec.num_layers
