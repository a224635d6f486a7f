"""CUDA IPC for GPU caches: publish handles at handshake, open each once, map per-layer tensors.

The ``ipc`` transport on one host lets the loader read the exporter's cache memory directly:
``ops.copy_blocks(mapped_src_caches, src_spec, src_ids, own_caches, dst_spec, dst_ids, ...)``
converts layout, block size and head slice in one kernel, with no staging.

Pieces (all CPU-testable through an injected driver; the real one is CuPy's runtime API for the
IPC handles plus the CUDA driver's ``cuMemGetAddressRange`` / ``cuPointerGetAttribute`` through
ctypes for the allocation base and the process-unique buffer id):

* :func:`local_ipc_info` / :func:`ipc_supported` / :func:`choose_transport`: what each side
  sends in its handshake, and whether CUDA IPC can work between two processes, with the reason
  when it cannot (different hosts, ``expandable_segments``, PID-namespace isolation, no GPU, the
  peer's GPU not visible here, same process) and the transport used instead.
* :func:`publish_caches`: the exporter's JSON-safe description of its per-layer caches: one
  entry per distinct allocation (IPC handle of the allocation BASE, base address, size,
  buffer id), and per layer the allocation it lives in, its byte offset there, shape, strides
  and dtype. Layers carved from one allocation share one handle.
* :class:`IpcHandleCache`: the loader's cache of opened allocations, keyed by (pid, process
  token, buffer id, handle bytes) and owned by peer engine names, so a freed-and-reused
  allocation (same address, new buffer id) or a restarted peer (same pid, new token) is never
  mistaken for the old one. Each allocation is opened once;
  :meth:`~IpcHandleCache.open_caches` rebuilds the per-layer torch tensors over the mapped
  memory; :meth:`~IpcHandleCache.invalidate_peer` forgets a peer (peer death, lease loss),
  :meth:`~IpcHandleCache.retain` drops mappings a re-handshake no longer lists.

How the engine plugs it in:

1. handshake message: ``{"ipc": local_ipc_info(cache_device), "ipc_caches":
   publish_caches(caches, engine_id) if GPU caches}``;
2. on receipt: ``transport, reason = choose_transport(local_info, peer_info, requested,
   topology.probe())``; log ``reason`` and put it in stats;
3. loader: ``src = handle_cache.open_caches(peer_engine_id, peer_desc, device)`` once per peer
   (cached), then per read ``ops.copy_blocks(src, peer_spec, ...)`` on the transfer stream
   (see :mod:`kvxfer.transports.staging` for ordering), checking the lease epoch before and after;
4. peer gone / re-handshake: ``handle_cache.invalidate_peer(peer)`` / ``retain(peer, desc)``.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import socket
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ...backends.device_context import bound_device
from ...paged import extent_bytes
from ...spec import dtype_from_name, dtype_name

__all__ = [
    "DESCRIPTION_VERSION",
    "IpcDriver",
    "IpcHandleCache",
    "choose_transport",
    "expandable_segments_enabled",
    "host_id",
    "ipc_supported",
    "local_ipc_info",
    "process_token",
    "publish_caches",
]

DESCRIPTION_VERSION = 1
_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)


# --------------------------------------------------------------------------- identity of a process
def host_id() -> str:
    """``hostname/boot id``: two processes share a host (and its GPUs) iff these are equal."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{socket.gethostname()}/{boot}"


_token: tuple[int, str] | None = None


def process_token() -> str:
    """Random id of this process (new after a fork or a restart that reuses the pid)."""
    global _token
    if _token is None or _token[0] != os.getpid():
        _token = (os.getpid(), uuid.uuid4().hex)
    return _token[1]


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _alloc_conf(env: dict | None = None) -> str:
    env = os.environ if env is None else env
    return ",".join(v for v in (env.get("PYTORCH_CUDA_ALLOC_CONF"), env.get("PYTORCH_ALLOC_CONF")) if v)


def expandable_segments_enabled(alloc_conf: str) -> bool:
    """True if a PyTorch allocator config string turns on ``expandable_segments`` (its cache
    allocations are then virtual-memory mappings that ``cudaIpcGetMemHandle`` cannot export)."""
    for item in alloc_conf.split(","):
        key, _, value = item.partition(":")
        if key.strip() == "expandable_segments" and value.strip().lower() in ("true", "1"):
            return True
    return False


def local_ipc_info(device: torch.device | str | None) -> dict:
    """This process's IPC facts for the handshake (JSON-safe). ``device`` is the cache device;
    CUDA is queried only when it is a CUDA device."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    gpu_uuid, visible = None, []
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        visible = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
        gpu_uuid = visible[index]
    conf = _alloc_conf()
    return {
        "host_id": host_id(),
        "pid": os.getpid(),
        "pid_ns": _pid_namespace(),
        "process_token": process_token(),
        "gpu_uuid": gpu_uuid,
        "visible_gpus": visible,
        "alloc_conf": conf,
        "expandable_segments": expandable_segments_enabled(conf),
    }


_INFO_FIELDS = {
    "host_id": str,
    "pid": int,
    "process_token": str,
    "visible_gpus": list,
    "expandable_segments": bool,
}


def _check_info(info: Any, who: str) -> None:
    if not isinstance(info, dict):
        raise ValueError(f"{who} ipc info: expected a dict, got {type(info).__name__}")
    for field, typ in _INFO_FIELDS.items():
        if not isinstance(info.get(field), typ):
            raise ValueError(f"{who} ipc info: field {field!r} missing or not a {typ.__name__}")
    if info.get("gpu_uuid") is not None and not isinstance(info["gpu_uuid"], str):
        raise ValueError(f"{who} ipc info: field 'gpu_uuid' must be a str or None")


def ipc_supported(
    local: dict, peer: dict, peer_access: Callable[[str, str], bool] | None = None
) -> tuple[bool, str]:
    """Whether this process can open the peer's CUDA IPC handles (and vice versa), and why not.

    ``local``/``peer`` come from :func:`local_ipc_info`. ``peer_access(local_uuid, peer_uuid)``
    says whether this process's GPU can map memory of the peer's GPU (default: torch's
    ``can_device_access_peer``; only asked for two different GPUs).
    """
    _check_info(local, "local")
    _check_info(peer, "peer")
    if local["host_id"] != peer["host_id"]:
        return False, f"different hosts ({local['host_id']} vs {peer['host_id']}): CUDA IPC needs one host"
    if local["gpu_uuid"] is None or peer["gpu_uuid"] is None:
        side = "this process" if local["gpu_uuid"] is None else "the peer"
        return False, f"no GPU: {side} has no CUDA cache (CPU caches use shared memory, not CUDA IPC)"
    if local["pid"] == peer["pid"] and local["process_token"] == peer["process_token"]:
        return False, "same process: CUDA IPC handles cannot be opened by the process that exported them"
    for who, info in (("the peer", peer), ("this process", local)):
        if info["expandable_segments"]:
            return False, (
                f"{who} runs PyTorch with expandable_segments ({info.get('alloc_conf')!r}): its cache "
                "allocations cannot be exported with cudaIpcGetMemHandle"
            )
    if local.get("pid_ns") and peer.get("pid_ns") and local["pid_ns"] != peer["pid_ns"]:
        return False, (
            f"PID-namespace isolation ({local['pid_ns']} vs {peer['pid_ns']}): CUDA IPC needs the "
            "processes in one PID namespace (e.g. containers started with --pid=host --ipc=host)"
        )
    if peer["gpu_uuid"] not in local["visible_gpus"]:
        return (
            False,
            f"the peer's GPU {peer['gpu_uuid']} is not visible in this process (CUDA_VISIBLE_DEVICES)",
        )
    if local["gpu_uuid"] != peer["gpu_uuid"]:
        if local["gpu_uuid"] not in peer["visible_gpus"]:
            return (
                False,
                f"this GPU {local['gpu_uuid']} is not visible in the peer process (CUDA_VISIBLE_DEVICES)",
            )
        access = peer_access or _torch_peer_access(local["visible_gpus"])
        if not access(local["gpu_uuid"], peer["gpu_uuid"]):
            return False, f"GPU {local['gpu_uuid']} cannot access GPU {peer['gpu_uuid']} (no peer-to-peer)"
        return True, "same host, different GPUs with peer access"
    return True, "same host, same GPU"


def _torch_peer_access(visible: list[str]) -> Callable[[str, str], bool]:
    def access(a: str, b: str) -> bool:
        return bool(torch.cuda.can_device_access_peer(visible.index(a), visible.index(b)))

    return access


def choose_transport(
    local: dict, peer: dict, requested: str = "auto", topology: Any = None, peer_access=None
) -> tuple[str, str]:
    """Pick ``"ipc"`` or ``"pg"`` for a pair of GPU engines at handshake; returns (transport,
    message). ``requested="ipc"`` that cannot work raises ``ValueError`` with the reason (never
    a silent fallback to something slower than asked for); ``"auto"`` falls back to ``pg`` and
    says why. ``topology`` (:func:`kvxfer.topology.probe` result) refines the choice by link.
    """
    if requested not in ("auto", "ipc", "pg"):
        raise ValueError(f"transport: must be 'auto', 'ipc' or 'pg', got {requested!r}")
    if requested == "pg":
        return "pg", "pg: requested"
    ok, why = ipc_supported(local, peer, peer_access)
    if not ok:
        if requested == "ipc":
            raise ValueError(f"transport: 'ipc' requested but CUDA IPC cannot work: {why}")
        return "pg", f"pg: CUDA IPC cannot work: {why}"
    if topology is not None:
        from ...topology import recommend_transport

        rec = recommend_transport(topology, local["gpu_uuid"], peer["gpu_uuid"])
        if rec.transport != "ipc":
            if requested == "ipc":
                raise ValueError(f"transport: 'ipc' requested but {rec.reason}")
            return "pg", f"pg: {rec.reason}"
        return "ipc", f"ipc: {why}; {rec.reason}"
    return "ipc", f"ipc: {why}"


# --------------------------------------------------------------------------- driver
class IpcDriver(Protocol):
    """The CUDA calls this module needs (injectable for tests)."""

    def address_range(self, ptr: int) -> tuple[int, int]:
        """(base, size) of the allocation containing ``ptr``."""

    def buffer_id(self, ptr: int) -> int:
        """Process-unique id of the allocation containing ``ptr`` (never reused)."""

    def get_handle(self, base: int) -> bytes:
        """IPC handle (64 bytes) of the allocation starting at ``base``."""

    def open_handle(self, handle: bytes, size: int, device: torch.device) -> torch.Tensor:
        """Map a peer's allocation; a 1-D uint8 tensor of ``size`` bytes over it."""

    def close_handle(self, mapped: torch.Tensor) -> None:
        """Unmap what :meth:`open_handle` returned."""


class CudaIpcDriver:
    """The real driver: CuPy's runtime API for IPC handles, libcuda for base and buffer id."""

    _CU_POINTER_ATTRIBUTE_BUFFER_ID = 7

    def __init__(self) -> None:
        import cupy  # lazy: only GPU processes need it

        self._rt = cupy.cuda.runtime
        self._cupy = cupy
        self._cu = ctypes.CDLL("libcuda.so.1")
        self._cu.cuMemGetAddressRange_v2.argtypes = [
            ctypes.POINTER(ctypes.c_uint64),
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.c_uint64,
        ]
        self._cu.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed with CUresult {rc}")

    def address_range(self, ptr: int) -> tuple[int, int]:
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self._check(
            self._cu.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr),
            "cuMemGetAddressRange",
        )
        return int(base.value), int(size.value)

    def buffer_id(self, ptr: int) -> int:
        out = ctypes.c_uint64()
        self._check(
            self._cu.cuPointerGetAttribute(ctypes.byref(out), self._CU_POINTER_ATTRIBUTE_BUFFER_ID, ptr),
            "cuPointerGetAttribute(BUFFER_ID)",
        )
        return int(out.value)

    def get_handle(self, base: int) -> bytes:
        return bytes(self._rt.ipcGetMemHandle(base))

    def context(self, device: torch.device):
        """Make ``device``'s primary context current on this thread for driver calls
        (cuMemGetAddressRange and cuPointerGetAttribute act on the current one), on a thread
        that has made no CUDA call yet too (:mod:`kvxfer.backends.device_context`)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        return bound_device(index, self._rt)

    def open_handle(self, handle: bytes, size: int, device: torch.device) -> torch.Tensor:
        """Map a peer's allocation into ``device``'s context (peer access enabled on demand when
        it lives on another GPU) and view it, without a copy, as a tensor *of that device*:
        kernels launched there read the peer's memory in place."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        with bound_device(index, self._rt):
            ptr = self._rt.ipcOpenMemHandle(handle, self._rt.cudaIpcMemLazyEnablePeerAccess)
            mem = self._cupy.cuda.UnownedMemory(ptr, size, None, index)
            arr = self._cupy.ndarray(
                (size,), dtype=self._cupy.uint8, memptr=self._cupy.cuda.MemoryPointer(mem, 0)
            )
            # DLPack carries the device id we give (torch.as_tensor with a device would copy
            # the whole allocation when CUDA reports the memory as another GPU's).
            t = torch.from_dlpack(arr)
        if t.data_ptr() != ptr or t.device != torch.device("cuda", index):
            self._rt.ipcCloseMemHandle(ptr)
            raise RuntimeError(
                f"ipc open: mapped {size} bytes at {ptr:#x} on cuda:{index}, but the tensor view is "
                f"at {t.data_ptr():#x} on {t.device} (a copy, not a mapping)"
            )
        return t

    def close_handle(self, mapped: torch.Tensor) -> None:
        with bound_device(mapped.device.index, self._rt):
            self._rt.ipcCloseMemHandle(mapped.data_ptr())


_driver: IpcDriver | None = None


def _default_driver() -> IpcDriver:
    global _driver
    if _driver is None:
        _driver = CudaIpcDriver()
    return _driver


# --------------------------------------------------------------------------- exporter side
def _extent_bytes(t: torch.Tensor) -> int:
    if any(s < 0 for s in t.stride()):
        raise ValueError(f"caches: negative strides {t.stride()} are not supported")
    return extent_bytes(t)


def publish_caches(caches: Sequence[torch.Tensor], engine_id: str, driver: IpcDriver | None = None) -> dict:
    """JSON-safe description of one rank's per-layer caches for its handshake.

    ``{"version", "engine_id", "host_id", "pid", "process_token", "allocations": [{"handle"
    (hex of the 64-byte IPC handle of the allocation base), "base", "size", "buffer_id"}],
    "layers": [{"alloc", "offset", "nbytes", "shape", "stride", "dtype"}]}``; ``offset`` is the
    layer's first byte relative to its allocation's base.
    """
    if isinstance(caches, torch.Tensor) or not isinstance(caches, Sequence) or not caches:
        raise ValueError("caches: must be a non-empty list of per-layer tensors")
    if driver is None:
        for i, c in enumerate(caches):
            if not isinstance(c, torch.Tensor) or c.device.type != "cuda":
                raise ValueError(f"caches[{i}]: CUDA IPC exports CUDA tensors, got {getattr(c, 'device', c)}")
        driver = _default_driver()
    allocs: list[dict] = []
    by_base: dict[int, int] = {}
    layers = []
    for i, c in enumerate(caches):
        ptr = c.data_ptr()
        context = getattr(driver, "context", None)
        try:
            with context(c.device) if context is not None else contextlib.nullcontext():
                base, size = driver.address_range(ptr)
                if base not in by_base:
                    buffer_id = driver.buffer_id(base)
                    handle = driver.get_handle(base)
                    by_base[base] = len(allocs)
                    allocs.append(
                        {"handle": handle.hex(), "base": base, "size": size, "buffer_id": buffer_id}
                    )
        except Exception as e:
            hint = " (expandable_segments is on)" if expandable_segments_enabled(_alloc_conf()) else ""
            raise RuntimeError(f"caches[{i}]: cannot export a CUDA IPC handle{hint}: {e}") from e
        nbytes = _extent_bytes(c)
        offset = ptr - base
        if offset < 0 or offset + nbytes > size:
            raise ValueError(
                f"caches[{i}]: bytes [{offset}, {offset + nbytes}) outside its allocation of {size}"
            )
        layers.append(
            {
                "alloc": by_base[base],
                "offset": offset,
                "nbytes": nbytes,
                "shape": list(c.shape),
                "stride": list(c.stride()),
                "dtype": dtype_name(c.dtype),
            }
        )
    return {
        "version": DESCRIPTION_VERSION,
        "engine_id": engine_id,
        "host_id": host_id(),
        "pid": os.getpid(),
        "process_token": process_token(),
        "allocations": allocs,
        "layers": layers,
    }


def _check_description(desc: Any) -> None:
    """Validate a peer's description (it came over the network); ValueError naming the field."""
    if not isinstance(desc, dict):
        raise ValueError(f"ipc description: expected a dict, got {type(desc).__name__}")
    if desc.get("version") != DESCRIPTION_VERSION:
        raise ValueError(f"ipc description: version {desc.get('version')!r}, expected {DESCRIPTION_VERSION}")
    for field, typ in (("pid", int), ("process_token", str), ("allocations", list), ("layers", list)):
        if not isinstance(desc.get(field), typ):
            raise ValueError(f"ipc description: field {field!r} missing or not a {typ.__name__}")
    for i, a in enumerate(desc["allocations"]):
        for field in ("base", "size", "buffer_id"):
            if not isinstance(a.get(field), int) or a[field] < 0:
                raise ValueError(f"ipc description: allocations[{i}].{field} must be a non-negative int")
        h = a.get("handle")
        if not isinstance(h, str) or len(h) != 2 * _HANDLE_BYTES:
            raise ValueError(
                f"ipc description: allocations[{i}].handle must be {2 * _HANDLE_BYTES} hex chars"
            )
        try:
            bytes.fromhex(h)
        except ValueError:
            raise ValueError(f"ipc description: allocations[{i}].handle is not hex") from None
    for i, lay in enumerate(desc["layers"]):
        if not isinstance(lay, dict):
            raise ValueError(f"ipc description: layers[{i}] must be a dict")
        a = lay.get("alloc")
        if not isinstance(a, int) or not 0 <= a < len(desc["allocations"]):
            raise ValueError(f"ipc description: layers[{i}].alloc {a!r} is not an allocation index")
        for field in ("offset", "nbytes"):
            if not isinstance(lay.get(field), int) or lay[field] < 0:
                raise ValueError(f"ipc description: layers[{i}].{field} must be a non-negative int")
        if lay["offset"] + lay["nbytes"] > desc["allocations"][a]["size"]:
            raise ValueError(f"ipc description: layers[{i}] lies outside allocation {a}")
        shape, stride = lay.get("shape"), lay.get("stride")
        if not (isinstance(shape, list) and isinstance(stride, list) and len(shape) == len(stride)):
            raise ValueError(f"ipc description: layers[{i}].shape/stride must be lists of equal length")
        if not isinstance(lay.get("dtype"), str):
            raise ValueError(f"ipc description: layers[{i}].dtype must be a dtype name")
        dtype_from_name(lay["dtype"])


# --------------------------------------------------------------------------- loader side
@dataclass(frozen=True)
class _Key:
    """Identity of one exported allocation: never equal for a freed-and-reused allocation
    (new buffer id) or a restarted exporter (new process token), even at the same address."""

    pid: int
    process_token: str
    buffer_id: int
    handle: str


class IpcHandleCache:
    """Opened peer allocations, each opened once, keyed so reuse can never alias (see module doc).

    A mapping is shared by every peer engine name that listed it (e.g. two ranks exported by
    one process) and closed when the last of them is invalidated. Thread-safe. ``driver``
    defaults to :class:`CudaIpcDriver` (created on first open).
    """

    def __init__(self, driver: IpcDriver | None = None) -> None:
        self._driver = driver
        self._lock = threading.Lock()
        self._mapped: dict[_Key, torch.Tensor] = {}
        self._owners: dict[_Key, set[str]] = {}
        self.num_opens = 0
        self.num_hits = 0
        self.num_closes = 0

    @property
    def driver(self) -> IpcDriver:
        if self._driver is None:
            self._driver = _default_driver()
        return self._driver

    def __len__(self) -> int:
        with self._lock:
            return len(self._mapped)

    @staticmethod
    def _keys(desc: dict) -> list[_Key]:
        return [
            _Key(desc["pid"], desc["process_token"], a["buffer_id"], a["handle"]) for a in desc["allocations"]
        ]

    def open_allocations(
        self, peer_engine: str, desc: dict, device: torch.device | str
    ) -> list[torch.Tensor]:
        """Map every allocation of ``desc`` (once per identity); uint8 tensors in ``desc`` order."""
        _check_description(desc)
        device = torch.device(device)
        out = []
        with self._lock:
            for key, a in zip(self._keys(desc), desc["allocations"]):
                t = self._mapped.get(key)
                if t is None:
                    t = self.driver.open_handle(bytes.fromhex(a["handle"]), a["size"], device)
                    if t.dtype != torch.uint8 or t.dim() != 1 or t.numel() != a["size"]:
                        raise RuntimeError(
                            f"ipc open: driver returned {t.dtype}{tuple(t.shape)} for {a['size']} bytes"
                        )
                    self._mapped[key] = t
                    self._owners[key] = set()
                    self.num_opens += 1
                else:
                    self.num_hits += 1
                self._owners[key].add(peer_engine)
                out.append(t)
        return out

    def open_caches(self, peer_engine: str, desc: dict, device: torch.device | str) -> list[torch.Tensor]:
        """The peer's per-layer cache tensors over mapped memory (shape, strides, dtype from
        ``desc``). Valid until the peer is invalidated; then drop them."""
        allocs = self.open_allocations(peer_engine, desc, device)
        layers = []
        for lay in desc["layers"]:
            dtype = dtype_from_name(lay["dtype"])
            es = torch.empty((), dtype=dtype).element_size()
            if lay["offset"] % es or lay["nbytes"] % es:
                raise ValueError(f"ipc description: layer offset {lay['offset']} not aligned to {dtype}")
            span = sum((n - 1) * st for n, st in zip(lay["shape"], lay["stride"])) + 1
            if math.prod(lay["shape"]) and span * es > lay["nbytes"]:
                raise ValueError(
                    f"ipc description: layer shape/stride span {span * es} > nbytes {lay['nbytes']}"
                )
            raw = allocs[lay["alloc"]][lay["offset"] : lay["offset"] + lay["nbytes"]]
            layers.append(raw.view(dtype).as_strided(lay["shape"], lay["stride"]))
        return layers

    def _release(self, peer_engine: str, keep: set[_Key] | None) -> int:
        closed = 0
        for k in list(self._mapped):
            owners = self._owners[k]
            if peer_engine in owners and (keep is None or k not in keep):
                owners.discard(peer_engine)
                if not owners:
                    self.driver.close_handle(self._mapped.pop(k))
                    del self._owners[k]
                    self.num_closes += 1
                    closed += 1
        return closed

    def invalidate_peer(self, peer_engine: str) -> int:
        """Forget ``peer_engine``'s mappings; returns how many were closed (a mapping another
        peer name still lists stays open)."""
        with self._lock:
            return self._release(peer_engine, None)

    def retain(self, peer_engine: str, desc: dict) -> int:
        """After a re-handshake: forget this peer's mappings that ``desc`` no longer lists."""
        _check_description(desc)
        keep = set(self._keys(desc))
        with self._lock:
            return self._release(peer_engine, keep)

    def close(self) -> None:
        """Unmap everything."""
        with self._lock:
            for k in list(self._mapped):
                self.driver.close_handle(self._mapped.pop(k))
                del self._owners[k]
                self.num_closes += 1
