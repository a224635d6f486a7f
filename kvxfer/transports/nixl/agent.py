"""NIXL agents for the ``nixl`` transport: one-sided READs over UCX, and notifications.

`NIXL <https://github.com/ai-dynamo/nixl>`_ (NVIDIA's inference transfer library) moves bytes
between registered memory of two processes — on one host or across hosts (InfiniBand, RoCE,
EFA, TCP through UCX) — and delivers short notifications. kvxfer uses it as its third
transport: the loader READs the exporter's memory, either the cache blocks themselves (*direct*)
or staging buffers the exporter gathered into (*staged*, :mod:`kvxfer.transports.nixl.staged`).

This module wraps one ``nixl_agent`` per engine rank (:class:`NixlAgent`):

* memory is registered once per allocation (caches, lease epochs, staging pools), never per
  request;
* ``read()`` prepares both descriptor lists (``N x 3`` numpy arrays from
  :mod:`kvxfer.transports.nixl.descs`), posts one READ and polls it, every wait bounded by
  the caller's deadline (and by the engine's stop event); a READ that outlives its deadline
  is cancelled, or, when NIXL cannot cancel it, handed back as a :class:`XferFence` whose
  ``query()`` turns true once it ended — the caller must not reuse its memory before;
* notifications are drained by whichever thread calls :meth:`NixlAgent.poll` (a pump thread
  does it every ``pump_s`` so the passive side of a transfer keeps making progress; with
  NIXL's own progress thread off, a peer that never calls into NIXL stalls the first
  connection) and routed by key into mailboxes (:meth:`NixlAgent.open_box`); a message for no
  open mailbox is dropped.

NIXL is optional (``pip install 'kvxfer[nixl]'``). Nothing here imports it before an agent is
made; :func:`nixl_status` says whether it can be imported, without importing it. kvxfer lowers
NIXL's own Python logger (which prints INFO lines on stdout) to WARNING unless
``$NIXL_LOG_LEVEL`` is set.

Thread safety: every agent call goes through one lock, so the agent itself runs with
``NIXL_THREAD_SYNC_NONE``; calls are short (nothing in NIXL blocks).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Annotated, Any

import msgspec
import numpy as np
import torch

from ...limits import MAX_ID_CHARS, MAX_REQUESTS
from ...ordering import poll_pause
from .descs import storages

_LOG = logging.getLogger(__name__)

__all__ = [
    "NIXL_MODULES",
    "NixlAgent",
    "NixlError",
    "NixlUnavailable",
    "XferFence",
    "XferTimeout",
    "load_nixl",
    "mem_of",
    "nixl_status",
    "require_nixl",
]

# Where the NIXL Python API lives: the meta package (``nixl``, picks the CUDA 12/13 build at
# import) or one build directly (``nixl-cu12`` / ``nixl-cu13`` wheels).
NIXL_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")
INSTALL_HINT = "pip install 'kvxfer[nixl]' (NIXL 1.5; with a CPU torch: pip install nixl-cu13==1.5.1)"

_api: Any = None


class NixlUnavailable(ImportError):
    """NIXL cannot be imported here (the message names why and how to install it)."""


class NixlError(RuntimeError):
    """A NIXL call failed, or a transfer ended in error (the message names which and why);
    ``peer_gone``: NIXL reported the peer disconnected (its process died or it closed)."""

    def __init__(self, message: str, peer_gone: bool = False) -> None:
        super().__init__(message)
        self.peer_gone = peer_gone


class XferTimeout(NixlError):
    """A READ did not finish by its deadline and NIXL could not cancel it: ``fence.query()``
    turns true once it ended; its destination must not be reused or reported before."""

    def __init__(self, message: str, fence: XferFence) -> None:
        super().__init__(message)
        self.fence = fence


def nixl_status() -> str:
    """``""`` when a NIXL Python API can be imported, else why not (never imports it)."""
    if _api is not None:
        return ""
    for name in NIXL_MODULES:
        top = name.partition(".")[0]
        try:
            if importlib.util.find_spec(top) is not None:
                return ""
        except (ImportError, ValueError):  # pragma: no cover - a broken install
            continue
    return f"NIXL is not installed (no module {', '.join(m.partition('.')[0] for m in NIXL_MODULES)}): {INSTALL_HINT}"


def require_nixl(what: str = "transport='nixl'") -> None:
    """Raise :class:`NixlUnavailable` naming ``what`` when NIXL cannot be imported."""
    why = nixl_status()
    if why:
        raise NixlUnavailable(f"{what} needs NIXL: {why}")


def load_nixl():
    """Import the NIXL Python API (first of :data:`NIXL_MODULES` that imports); raises
    :class:`NixlUnavailable` with every import error when none does."""
    global _api
    if _api is not None:
        return _api
    errors = []
    for name in NIXL_MODULES:
        try:
            mod = importlib.import_module(name)
        except Exception as e:  # ImportError, or a build for another CUDA that fails to load
            errors.append(f"{name}: {type(e).__name__}: {e}")
            continue
        if not os.environ.get("NIXL_LOG_LEVEL"):
            logging.getLogger("nixl").setLevel(logging.WARNING)
        _api = mod
        return mod
    raise NixlUnavailable("NIXL could not be imported (" + "; ".join(errors) + f"). {INSTALL_HINT}")


def _bindings():
    return importlib.import_module(load_nixl().__name__.rpartition(".")[0] + "._bindings")


def mem_of(t: torch.Tensor) -> tuple[str, int]:
    """NIXL memory type and device id of a tensor: ``("DRAM", 0)`` or ``("VRAM", index)``."""
    if t.device.type == "cuda":  # pragma: no cover - GPU only
        return "VRAM", int(t.device.index or 0)
    return "DRAM", 0


class _Notif(msgspec.Struct, array_like=True):
    """One notification kvxfer sends over NIXL: ``kind`` (one letter), the mailbox ``key``, up
    to three ints (chunk index, slot, bytes) and bytes (a stream's status)."""

    kind: Annotated[str, msgspec.Meta(max_length=4)]
    key: Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)]
    a: int = 0
    b: int = 0
    c: int = 0
    data: Annotated[bytes, msgspec.Meta(max_length=MAX_REQUESTS)] = b""


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(_Notif)


def encode_notif(kind: str, key: str, a: int = 0, b: int = 0, c: int = 0, data: bytes = b"") -> bytes:
    return _enc.encode(_Notif(kind, key, a, b, c, data))


class XferFence:
    """A READ (and the descriptor lists it uses) kept alive until it ended: ``query()`` is true
    once NIXL reports it done or failed, or it could be released (cancelled)."""

    def __init__(self, agent: NixlAgent, handle, dlists: Sequence) -> None:
        self._agent, self._handle, self._dlists = agent, handle, list(dlists)
        self._ended = False

    def query(self) -> bool:
        if not self._ended and self._agent._closed:
            self._ended = True  # the agent (and its transfers) are gone
        if not self._ended:
            # done or failed: released; still running: ended only if NIXL could cancel it
            self._ended = self._agent.release_read(self._handle, self._dlists, quiet=True)
        return self._ended


class NixlAgent:
    """One NIXL agent (UCX backend) of an engine rank; see the module doc.

    Args:
        name: the agent's name, unique among the agents that talk to it (kvxfer uses
            ``kvxfer/<engine id>/<rank>/<incarnation>``).
        backends: NIXL backends to create (``["UCX"]``).
        pump_s: pause of the pump thread between two calls into NIXL.
        stop: an event that aborts every wait (the engine's close()).
    """

    def __init__(
        self,
        name: str,
        backends: Sequence[str] = ("UCX",),
        pump_s: float = 0.001,
        stop: threading.Event | None = None,
    ) -> None:
        api = load_nixl()
        b = _bindings()
        self.errors = tuple(
            getattr(b, n) for n in dir(b) if n.startswith("nixl") and n.endswith("Error")
        ) or (Exception,)
        self._disconnect = getattr(b, "nixlRemoteDisconnectError", None)
        cfg = api.nixl_agent_config(
            enable_prog_thread=False,
            enable_listen_thread=False,
            backends=list(backends),
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE,
        )
        self._lock = threading.RLock()
        self.agent = api.nixl_agent(name, cfg)
        missing = [x for x in backends if x not in self.agent.backends]
        if missing:
            raise NixlError(
                f"NIXL backend(s) {missing} could not be created (plugins: {self.agent.plugin_list})"
            )
        self.name = name
        self.backends = list(backends)
        self._stop = stop if stop is not None else threading.Event()
        self._halt = threading.Event()  # this agent's own stop (close())
        self._pump_s = pump_s
        self._regs: list = []
        self._registered: dict[int, int] = {}  # allocation address -> bytes
        self._remotes: set[str] = set()
        self._boxes: dict[str, deque] = {}
        self._cond = threading.Condition(threading.Lock())
        self._pump: threading.Thread | None = None
        self._closed = False
        self.num_reads = 0
        self.num_descs = 0
        self.num_notifs = 0

    def stopping(self) -> bool:
        """The engine or this agent is closing: every wait ends."""
        return self._stop.is_set() or self._halt.is_set()

    # ----------------------------------------------------------------------- calls
    def _call(self, what: str, fn, *args, **kw):
        """Run one agent call under the lock; NIXL's errors become :class:`NixlError`."""
        if self._closed:
            raise NixlError(f"NIXL {what}: the agent is closed")
        try:
            with self._lock:
                return fn(*args, **kw)
        except self.errors as e:
            gone = self._disconnect is not None and isinstance(e, self._disconnect)
            raise NixlError(
                f"NIXL {what} failed: {type(e).__name__}: {e}" + (" (the peer disconnected)" if gone else ""),
                peer_gone=gone,
            ) from None

    def register(self, tensors: Sequence[torch.Tensor], what: str) -> Any:
        """Register the allocations behind ``tensors`` (each once: one already registered is
        skipped); returns a handle for :meth:`deregister` (None when nothing was new). Memory
        type from the tensors' device (DRAM / VRAM)."""
        if not tensors:
            return None
        mem, dev = mem_of(tensors[0])
        new = [(a, n) for a, n in storages(tensors) if a not in self._registered]
        if not new:
            return None
        arr = np.array([(a, n, dev) for a, n in new], dtype=np.uint64)
        reg = self._call(f"register_memory({what})", self.agent.register_memory, arr, mem)
        if reg is None:
            raise NixlError(f"NIXL register_memory({what}): descriptors refused")
        for a, n in new:
            self._registered[a] = n
        handle = (reg, [a for a, _ in new])
        self._regs.append(handle)
        return handle

    def deregister(self, handle: Any) -> None:
        """Undo one :meth:`register` (never raises)."""
        if handle is None or handle not in self._regs or self._closed:
            return
        self._regs.remove(handle)
        for a in handle[1]:
            self._registered.pop(a, None)
        try:
            self._call("deregister_memory", self.agent.deregister_memory, handle[0])
        except NixlError as e:  # pragma: no cover - NIXL refused
            _LOG.debug("kvxfer nixl %s: %s", self.name, e)

    def metadata(self, conn_only: bool = False) -> bytes:
        """This agent's metadata for a peer: connection info and registered memory (what a peer
        needs to READ from here), or with ``conn_only`` only the connection info (what a peer
        needs to notify this agent; it learns nothing of its memory)."""
        if not conn_only:
            return bytes(self._call("get_agent_metadata", self.agent.get_agent_metadata))
        b = _bindings()
        empty = b.nixlRegDList(b.DRAM_SEG)
        return bytes(
            self._call("get_partial_agent_metadata", self.agent.get_partial_agent_metadata, empty, True, [])
        )

    def add_remote(self, md: bytes, expect: str | None = None) -> str:
        """Load a peer's metadata; returns its agent name (``NixlError`` when it is not
        ``expect``). Loading the same agent again refreshes it."""
        name = self._call("add_remote_agent", self.agent.add_remote_agent, md)
        if isinstance(name, bytes):
            name = name.decode()
        self._remotes.add(name)
        if expect is not None and name != expect:
            self.remove_remote(name)
            raise NixlError(f"NIXL metadata names agent {name!r}, the handshake named {expect!r}")
        return name

    def remove_remote(self, name: str) -> None:
        """Forget a peer (disconnects); never raises."""
        if name not in self._remotes or self._closed:
            return
        self._remotes.discard(name)
        try:
            self._call("remove_remote_agent", self.agent.remove_remote_agent, name)
        except NixlError as e:
            _LOG.debug("kvxfer nixl %s: %s", self.name, e)

    def connect(self, name: str) -> None:
        """Start connecting to a loaded peer now (optional; the first READ would)."""
        try:
            self._call("make_connection", self.agent.make_connection, name)
        except NixlError as e:
            _LOG.debug("kvxfer nixl %s: %s (the first transfer connects)", self.name, e)

    # ----------------------------------------------------------------------- transfers
    def _state(self, handle) -> str:
        try:
            return self._call("check_xfer_state", self.agent.check_xfer_state, handle)
        except NixlError:
            return "ERR"

    def release_read(self, handle, dlists: Sequence, quiet: bool = False) -> bool:
        """Release a transfer handle (cancels an active one) and its descriptor lists; False
        when NIXL cannot (the transfer still runs: keep everything)."""
        try:
            self._call("release_xfer_handle", handle.release)
        except NixlError as e:
            if not quiet:
                _LOG.warning("kvxfer nixl %s: %s; the transfer is fenced until it ends", self.name, e)
            return False
        for d in dlists:
            try:
                self._call("release_dlist_handle", d.release)
            except NixlError as e:  # pragma: no cover - NIXL refused to free a list
                _LOG.debug("kvxfer nixl %s: %s", self.name, e)
        return True

    def start_read(
        self,
        local: np.ndarray,
        local_mem: str,
        remote_agent: str,
        remote: np.ndarray,
        remote_mem: str,
        notif: bytes = b"",
    ) -> tuple[Any, list]:
        """Post one READ of ``remote`` descriptors (``N x 3``, in the peer's memory) into
        ``local`` ones (pairwise, equal lengths); returns ``(handle, dlists)`` for
        :meth:`finish` or :meth:`poll_read`."""
        if local.shape != remote.shape or not np.array_equal(local[:, 1], remote[:, 1]):
            raise ValueError("nixl read: local and remote descriptors must pair with equal lengths")
        n = local.shape[0]
        lh = self._call("prep_xfer_dlist(local)", self.agent.prep_xfer_dlist, "", local, local_mem)
        try:
            rh = self._call(
                "prep_xfer_dlist(remote)", self.agent.prep_xfer_dlist, remote_agent, remote, remote_mem
            )
        except NixlError:
            self._call("release_dlist_handle", lh.release)
            raise
        idx = np.arange(n, dtype=np.int32)
        try:
            h = self._call("make_prepped_xfer", self.agent.make_prepped_xfer, "READ", lh, idx, rh, idx, notif)
            st = self._call("transfer", self.agent.transfer, h)
        except NixlError:
            for d in (lh, rh):
                with contextlib.suppress(NixlError):
                    self._call("release_dlist_handle", d.release)
            raise
        self.num_reads += 1
        self.num_descs += n
        if st == "ERR":
            self.release_read(h, [lh, rh], quiet=True)
            raise NixlError(f"NIXL READ from {remote_agent} failed when posted")
        return h, [lh, rh]

    def poll_read(self, handle) -> str:
        """``"DONE"``, ``"PROC"`` or ``"ERR"`` (progresses the transfer)."""
        return self._state(handle)

    def finish(self, handle, dlists: list, deadline: float, what: str) -> None:
        """Wait until the READ ``handle`` is done (polling, :func:`~kvxfer.ordering.poll_pause`
        between polls), then release it. Raises :class:`NixlError` when it failed or the engine
        stops, and :class:`XferTimeout` (with a fence) when the deadline passed and it cannot be
        cancelled."""
        start = time.monotonic()
        first = True
        while True:
            st = self._state(handle)
            if st == "DONE":
                self.release_read(handle, dlists)
                return
            if st == "ERR":
                self.release_read(handle, dlists, quiet=True)
                raise NixlError(f"NIXL {what}: the transfer failed (peer gone or memory not registered)")
            if self.stopping() or time.monotonic() >= deadline:
                why = "the engine is closing" if self.stopping() else "the deadline passed"
                if self.release_read(handle, dlists, quiet=True):
                    raise NixlError(f"NIXL {what}: {why}; the transfer was cancelled")
                raise XferTimeout(
                    f"NIXL {what}: {why} and the transfer cannot be cancelled; fenced until it ends",
                    XferFence(self, handle, dlists),
                )
            if not first:  # the first re-poll comes at once
                time.sleep(poll_pause(time.monotonic() - start))
            first = False

    def read(
        self,
        local: np.ndarray,
        local_mem: str,
        remote_agent: str,
        remote: np.ndarray,
        remote_mem: str,
        deadline: float,
        what: str,
        notif: bytes = b"",
    ) -> None:
        """:meth:`start_read` then :meth:`finish`."""
        h, dl = self.start_read(local, local_mem, remote_agent, remote, remote_mem, notif)
        self.finish(h, dl, deadline, what)

    # ----------------------------------------------------------------------- notifications
    def send_notif(self, peer: str, msg: bytes) -> None:
        self._call("send_notif", self.agent.send_notif, peer, msg)

    def ping(self, peer: str, key: str) -> None:
        """A no-op notification to ``peer`` (ignored there): raises :class:`NixlError` with
        ``peer_gone`` when the peer is dead, which waiting for its notifications never tells."""
        self.send_notif(peer, encode_notif("P", key))

    def open_box(self, key: str) -> None:
        """Start keeping the notifications addressed to ``key``."""
        with self._cond:
            self._boxes.setdefault(key, deque())

    def close_box(self, key: str) -> None:
        with self._cond:
            self._boxes.pop(key, None)

    def poll(self) -> int:
        """Drain NIXL's notifications into the open mailboxes (progresses the agent); returns
        how many arrived. Undecodable ones, and ones for no open mailbox, are dropped."""
        got = self._call("get_new_notifs", self.agent.get_new_notifs)
        if not got:
            return 0
        n = 0
        with self._cond:
            for peer, msgs in got.items():
                for raw in msgs:
                    n += 1
                    try:
                        m = _dec.decode(raw)
                    except Exception:  # DecodeError, ValidationError, RecursionError
                        _LOG.debug(
                            "kvxfer nixl %s: dropped an undecodable notification from %s", self.name, peer
                        )
                        continue
                    box = self._boxes.get(m.key)
                    if box is not None:
                        box.append((peer, m))
            self.num_notifs += n
            self._cond.notify_all()
        return n

    def take(self, key: str) -> list[tuple[str, _Notif]]:
        """The notifications waiting in mailbox ``key`` (emptied)."""
        with self._cond:
            box = self._boxes.get(key)
            if not box:
                return []
            out = list(box)
            box.clear()
            return out

    def wait_box(self, key: str, deadline: float) -> list[tuple[str, _Notif]]:
        """Poll until mailbox ``key`` holds something or ``deadline`` (or the engine's stop):
        returns what it held (empty on a timeout)."""
        pause = 0.0
        while True:
            got = self.take(key)
            if got:
                return got
            self.poll()
            got = self.take(key)
            if got or self.stopping() or time.monotonic() >= deadline:
                return got
            if pause:
                time.sleep(pause)
            pause = min(5e-4, pause * 2 + 2e-5)

    # ----------------------------------------------------------------------- pump and close
    def start_pump(self, thread_name: str) -> None:
        """Call into NIXL every ``pump_s`` from a daemon thread (the passive side's progress)."""
        if self._pump is not None:
            return

        def run() -> None:
            while not self.stopping():
                try:
                    self.poll()
                except NixlError as e:
                    if self._closed:
                        return
                    _LOG.debug("kvxfer nixl %s: pump: %s", self.name, e)
                time.sleep(self._pump_s)

        self._pump = threading.Thread(target=run, name=thread_name, daemon=True)
        self._pump.start()

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the pump, forget every peer, deregister memory and free the agent. Idempotent."""
        if self._closed:
            return
        self._halt.set()
        if self._pump is not None:
            self._pump.join(timeout_s)
        for name in list(self._remotes):
            self.remove_remote(name)
        for handle in list(self._regs):
            self.deregister(handle)
        self._closed = True
        with self._lock:
            self.agent = None

    def stats(self) -> dict:
        return {
            "nixl_reads": self.num_reads,
            "nixl_descs": self.num_descs,
            "nixl_notifs": self.num_notifs,
            "nixl_registered_bytes": sum(self._registered.values()),
        }
