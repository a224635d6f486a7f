"""bound_device: a CUDA device's context bound on the calling thread for driver-level calls,
on a thread that made no CUDA call yet too (the H200 failure of 2026-11-26). Driven through a
fake CuPy runtime whose binding is per thread, as the real one's is: nothing runs on a GPU."""

from __future__ import annotations

import threading

import pytest
import torch

from kvxfer.backends.device_context import bound_device


class FakeRuntime:
    """``getDevice`` answers 0 on a thread that never called ``setDevice`` (as CUDA does),
    ``bound()`` says which device's context the thread has bound (None: none)."""

    def __init__(self) -> None:
        self._local = threading.local()
        self.calls: list[tuple[str, int]] = []

    def getDevice(self) -> int:  # CuPy's name
        return getattr(self._local, "device", None) or 0

    def setDevice(self, i: int) -> None:  # CuPy's name
        self.calls.append(("setDevice", i))
        self._local.device = i

    def bound(self) -> int | None:
        return getattr(self._local, "device", None)


def _on_fresh_thread(fn):
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # re-raised below
            out["error"] = exc

    th = threading.Thread(target=run)
    th.start()
    th.join(10)
    assert not th.is_alive()
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_binds_device_0_on_a_thread_that_reports_device_0_already():
    rt = FakeRuntime()

    def body():
        assert rt.getDevice() == 0 and rt.bound() is None  # what a fresh thread reports
        with bound_device(0, rt):
            inside = rt.bound()
        return inside, rt.bound()

    assert _on_fresh_thread(body) == (0, 0)  # bound inside, and it stays bound (same device)
    assert rt.calls == [("setDevice", 0)]


def test_restores_the_threads_previous_device_when_it_differs():
    rt = FakeRuntime()

    def body():
        rt.setDevice(1)
        with bound_device(0, rt):
            inside = rt.bound()
        return inside, rt.bound()

    assert _on_fresh_thread(body) == (0, 1)
    assert rt.calls == [("setDevice", 1), ("setDevice", 0), ("setDevice", 1)]


def test_restores_on_an_exception():
    rt = FakeRuntime()

    def body():
        rt.setDevice(2)
        with pytest.raises(RuntimeError, match="driver call failed"), bound_device(0, rt):
            raise RuntimeError("driver call failed")
        return rt.bound()

    assert _on_fresh_thread(body) == 2


def test_ipc_driver_context_binds_the_cache_device_on_a_fresh_thread():
    """The IPC driver's context() (around cuMemGetAddressRange / cuPointerGetAttribute) binds the
    cache device's context; before, it entered ``cupy.cuda.Device``, which binds nothing on a
    thread whose current device is already that index."""
    from kvxfer.transports.ipc.cuda_ipc import CudaIpcDriver

    rt = FakeRuntime()
    drv = object.__new__(CudaIpcDriver)  # no libcuda here: only the context is exercised
    drv._rt = rt

    def body():
        with drv.context(torch.device("cuda", 0)):
            return rt.bound()

    assert _on_fresh_thread(body) == 0
