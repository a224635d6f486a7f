"""NIXL agents for the ``nixl`` transport: one-sided READs over UCX, and notifications.

`NIXL <https://github.com/ai-dynamo/nixl>`_ (NVIDIA's inference transfer library) moves bytes
between registered memory of two processes — on one host or across hosts (InfiniBand, RoCE,
EFA, TCP through UCX) — and delivers short notifications. kvxfer uses it as its third
transport: the loader READs the exporter's memory, either the cache blocks themselves (*direct*)
or staging buffers the exporter gathered into (*staged*, :mod:`kvxfer.transports.nixl.staged`).

This module wraps one ``nixl_agent`` per engine rank (:class:`NixlAgent`):

* memory is registered once per allocation (caches, lease epochs, staging pools), never per
  request;
* descriptor lists a peer's READs index are prepared once (:meth:`NixlAgent.prep`, NIXL's
  ``prep_xfer_dlist``; ``N x 3`` numpy arrays from :mod:`kvxfer.transports.nixl.descs`) and
  released by their owner (:meth:`NixlAgent.release_prep`; ``stats()["nixl_dlists"]`` counts
  the live ones); a READ then names descriptors by index (:meth:`NixlAgent.start_prepped`,
  ``make_prepped_xfer``). A READ of descriptors no list holds (a partial block's runs, a
  staging chunk) goes through NIXL's combined call (:meth:`NixlAgent.start_read`,
  ``initialize_xfer``), which leaves no list behind;
* :meth:`NixlAgent.finish` polls a READ's transfers, every wait bounded by the caller's
  deadline (and by the engine's stop event); a READ that outlives its deadline is cancelled,
  or, when NIXL cannot cancel it, handed back as a :class:`XferFence` whose ``query()`` turns
  true once it ended — the caller must not reuse its memory before (a transfer keeps its own
  copy of the descriptors it was made from: releasing a list does not touch it);
* notifications are drained by whichever thread calls :meth:`NixlAgent.poll` (a pump thread
  does it every ``pump_s`` so the passive side of a transfer keeps making progress; with
  NIXL's own progress thread off, a peer that never calls into NIXL stalls the first
  connection) and routed by key into mailboxes (:meth:`NixlAgent.open_box`); a message for no
  open mailbox is dropped.

NIXL is optional (``pip install 'kvxfer[nixl]'``): nothing imports it before an agent is made
(:mod:`kvxfer.transports.nixl.availability`: :func:`nixl_status`, :func:`load_nixl`,
re-exported here).

Thread safety: every agent call goes through one lock, so the agent itself runs with
``NIXL_THREAD_SYNC_NONE``; calls are short (nothing in NIXL blocks).
"""

from __future__ import annotations

import contextlib
import logging
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
from .availability import NIXL_MODULES, NixlUnavailable, load_nixl, nixl_bindings, nixl_status, require_nixl
from .descs import storages

_LOG = logging.getLogger(__name__)

__all__ = [
    "NIXL_MODULES",
    "NixlAgent",
    "NixlError",
    "NixlUnavailable",
    "Prepped",
    "XferFence",
    "XferTimeout",
    "load_nixl",
    "mem_of",
    "nixl_status",
    "require_nixl",
]


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
    """A READ's transfers kept alive until they ended: ``query()`` is true once NIXL reports
    each done or failed, or it could be released (cancelled)."""

    def __init__(self, agent: NixlAgent, handles: Sequence) -> None:
        self._agent, self._handles = agent, list(handles)

    def query(self) -> bool:
        if self._handles and self._agent._closed:
            self._handles = []  # the agent (and its transfers) are gone
        # done or failed: released; still running: ended only if NIXL could cancel it
        self._handles = [h for h in self._handles if not self._agent.release_read(h, quiet=True)]
        return not self._handles


class Prepped:
    """A descriptor list NIXL prepared (:meth:`NixlAgent.prep`): ``size`` descriptors of
    ``agent`` (``""``: this agent's memory), indexed by a READ until
    :meth:`NixlAgent.release_prep`."""

    __slots__ = ("agent", "handle", "released", "size", "what")

    def __init__(self, handle: Any, size: int, agent: str, what: str) -> None:
        self.handle, self.size, self.agent, self.what = handle, size, agent, what
        self.released = False


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
        b = nixl_bindings()
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
        # peer agent name -> who uses it here: "read" (this rank's loader sessions) and/or "pair"
        # (a loader paired with this rank as exporter); removed from NIXL when the last one goes
        self._remotes: dict[str, set[str]] = {}
        self._remote_lock = threading.Lock()
        self._boxes: dict[str, deque] = {}
        self._cond = threading.Condition(threading.Lock())
        self._pump: threading.Thread | None = None
        self._closed = False
        self._preps: dict[int, Prepped] = {}  # id -> a prepared list not yet released
        self.num_reads = 0
        self.num_descs = 0
        self.num_notifs = 0
        self.num_preps = 0
        self.num_swept = 0  # lists their owner had not released when the agent closed

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
        b = nixl_bindings()
        empty = b.nixlRegDList(b.DRAM_SEG)
        return bytes(
            self._call("get_partial_agent_metadata", self.agent.get_partial_agent_metadata, empty, True, [])
        )

    def add_remote(self, md: bytes, expect: str | None = None, user: str = "read") -> str:
        """Load a peer's metadata for ``user`` (``"read"``: a loader session; ``"pair"``: an
        exporter's pairing); returns its agent name (``NixlError`` when it is not ``expect``:
        then nothing is added). Loading the same agent again refreshes it."""
        with self._remote_lock:
            name = self._call("add_remote_agent", self.agent.add_remote_agent, md)
            if isinstance(name, bytes):
                name = name.decode()
            if expect is not None and name != expect:
                if name not in self._remotes:  # loaded by this call alone
                    self._drop_remote(name)
                raise NixlError(f"NIXL metadata names agent {name!r}, the handshake named {expect!r}")
            self._remotes.setdefault(name, set()).add(user)
            return name

    def remove_remote(self, name: str, user: str = "read") -> None:
        """``user`` no longer needs peer ``name``; once no user does, it is forgotten
        (disconnected). Never raises."""
        with self._remote_lock:
            users = self._remotes.get(name)
            if users is None or self._closed:
                return
            users.discard(user)
            if not users:
                del self._remotes[name]
                self._drop_remote(name)

    def _drop_remote(self, name: str) -> None:
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

    def prep(self, descs: np.ndarray, mem: str, what: str, agent: str = "") -> Prepped:
        """Prepare ``descs`` (``N x 3``) once, in ``agent``'s memory (``""``: this agent's;
        else a loaded peer's), for :meth:`start_prepped`; the caller releases it
        (:meth:`release_prep`), or :meth:`close` does."""
        h = self._call(f"prep_xfer_dlist({what})", self.agent.prep_xfer_dlist, agent, descs, mem)
        p = Prepped(h, int(descs.shape[0]), agent, what)
        with self._lock:
            self._preps[id(p)] = p
        self.num_preps += 1
        return p

    def release_prep(self, p: Prepped | None) -> None:
        """Release a prepared list (idempotent; never raises). Transfers made from it keep
        their own descriptors; a later :meth:`start_prepped` naming it is refused."""
        if p is None:
            return
        with self._lock:
            if p.released:
                return
            p.released = True
            self._preps.pop(id(p), None)
            if self._closed:
                return
            try:
                p.handle.release()
            except Exception as e:  # pragma: no cover - NIXL refused to free a list
                _LOG.debug("kvxfer nixl %s: release of %s: %s", self.name, p.what, e)

    def _post(self, what: str, make, n: int) -> Any:
        """Make a transfer (``make()``, under the lock) and post it; returns its handle."""

        def run():
            h = make()
            try:
                st = self.agent.transfer(h)
            except BaseException:
                with contextlib.suppress(BaseException):
                    h.release()
                raise
            return h, st

        h, st = self._call(what, run)
        self.num_reads += 1
        self.num_descs += n
        if st == "ERR":
            self.release_read(h, quiet=True)
            raise NixlError(f"NIXL {what} failed when posted")
        return h

    def start_prepped(
        self,
        local: Prepped,
        local_idx: np.ndarray,
        remote: Prepped,
        remote_idx: np.ndarray,
        notif: bytes = b"",
    ) -> Any:
        """Post one READ of descriptors ``remote_idx`` of ``remote`` into ``local_idx`` of
        ``local`` (pairwise; NIXL refuses an index out of range or a pair of unequal lengths,
        and merges pairs adjacent on both sides); returns its handle for :meth:`finish`."""
        if local_idx.shape != remote_idx.shape:
            raise ValueError("nixl read: local and remote indices must pair one to one")

        def make():
            if local.released or remote.released:  # checked under the lock the release takes
                raise NixlError(f"NIXL READ from {remote.agent}: its descriptor lists were released")
            return self.agent.make_prepped_xfer(
                "READ", local.handle, local_idx, remote.handle, remote_idx, notif
            )

        return self._post(f"READ from {remote.agent} (prepared)", make, int(local_idx.size))

    def start_read(
        self,
        local: np.ndarray,
        local_mem: str,
        remote_agent: str,
        remote: np.ndarray,
        remote_mem: str,
        notif: bytes = b"",
    ) -> Any:
        """Post one READ of ``remote`` descriptors (``N x 3``, in the peer's memory) into
        ``local`` ones (pairwise, equal lengths) through NIXL's combined call (no list is left
        to release); returns its handle for :meth:`finish` or :meth:`poll_read`."""
        if local.shape != remote.shape or not np.array_equal(local[:, 1], remote[:, 1]):
            raise ValueError("nixl read: local and remote descriptors must pair with equal lengths")
        ag = self.agent

        def make():
            lo, re = ag.get_xfer_descs(local, local_mem), ag.get_xfer_descs(remote, remote_mem)
            return ag.initialize_xfer("READ", lo, re, remote_agent, notif)

        return self._post(f"READ from {remote_agent}", make, int(local.shape[0]))

    def release_read(self, handle, quiet: bool = False) -> bool:
        """Release a transfer handle (cancels an active one); False when NIXL cannot (the
        transfer still runs: keep its memory)."""
        try:
            self._call("release_xfer_handle", handle.release)
        except NixlError as e:
            if not quiet:
                _LOG.warning("kvxfer nixl %s: %s; the transfer is fenced until it ends", self.name, e)
            return False
        return True

    def cancel(self, handles: Sequence) -> list:
        """Release (cancel) ``handles``; returns those NIXL could not cancel (still running)."""
        return [h for h in handles if not self.release_read(h, quiet=True)]

    def poll_read(self, handle) -> str:
        """``"DONE"``, ``"PROC"`` or ``"ERR"`` (progresses the transfer)."""
        return self._state(handle)

    def finish(self, handles: Sequence, deadline: float, what: str) -> None:
        """Wait until every transfer of ``handles`` (one READ) is done (polling,
        :func:`~kvxfer.ordering.poll_pause` between polls), releasing each. Raises
        :class:`NixlError` when one failed or the engine stops (the others cancelled), and
        :class:`XferTimeout` (with a fence) when the deadline passed, or one failed, and some
        cannot be cancelled."""
        pending = list(handles)
        start = time.monotonic()
        first = True
        while pending:
            failed = False
            for h in list(pending):
                st = self._state(h)
                if st == "DONE":
                    self.release_read(h)
                    pending.remove(h)
                elif st == "ERR":
                    failed = True
            if not pending:
                return
            ended = self.stopping() or time.monotonic() >= deadline
            if failed or ended:
                if failed:
                    why = "a transfer failed (peer gone or memory not registered)"
                else:
                    why = "the engine is closing" if self.stopping() else "the deadline passed"
                left = self.cancel(pending)
                if not left:
                    raise NixlError(
                        f"NIXL {what}: {why}" + ("" if failed else "; the transfer was cancelled")
                    )
                raise XferTimeout(
                    f"NIXL {what}: {why} and the transfer cannot be cancelled; fenced until it ends",
                    XferFence(self, left),
                )
            if not first:  # the first re-poll comes at once
                time.sleep(poll_pause(time.monotonic() - start))
            first = False

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
        with self._lock:
            left = list(self._preps.values())
        if left:
            self.num_swept += len(left)
            _LOG.warning(
                "kvxfer nixl %s: %d prepared descriptor list(s) not released by their owner (%s); released at close",
                self.name,
                len(left),
                ", ".join(sorted({p.what for p in left})),
            )
        for p in left:  # before their peers are removed
            self.release_prep(p)
        with self._remote_lock:
            remotes, self._remotes = list(self._remotes), {}
            for name in remotes:
                self._drop_remote(name)
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
            "nixl_dlists": len(self._preps),
            "nixl_dlists_prepared": self.num_preps,
            "nixl_dlists_swept": self.num_swept,
            "nixl_registered_bytes": sum(self._registered.values()),
        }
