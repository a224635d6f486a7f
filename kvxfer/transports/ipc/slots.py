"""The lease-slot table: an exporter rank's live exports, in shared memory, for one-sided reads.

A loader on the same host that has mapped an exporter rank's caches (``ipc``) can read a request
without asking the exporter first, when the exporter's table says the request's export is live,
ready and leased long enough (:mod:`kvxfer.transports.ipc.onesided`). The table is an int64
array in POSIX shared memory beside the block epochs (both are host bookkeeping, also for CUDA
caches). The exporter writes every word except these, which loaders write: their own done
marks, and in the header the done ring, its count and ``readers``.

Header (``HEADER`` words): ``MAGIC``, ``VERSION``, the number of slots, the exporter's heartbeat
(``time.monotonic_ns()``, written every side-channel tick, 20 ms, with the exporter's other
header words again), ``open`` (1 until the engine closes), a hash of the exporter's incarnation, ``done``: how many entries loaders have appended
to the done ring (the ``RING`` words after the first eight), and ``readers``: set by the first
loader that maps the table to read one-sided. Until then the exporter gives its exports no slot
(an engine no one reads one-sided pays one load per export for the table).

Slot (``SLOT`` words), one per live export:

* ``gen``: a seqlock generation. Even when stable; the exporter makes it odd while it rewrites
  the slot (open or close) and even again after, so a reader that sees the same even value
  before and after reading the slot read one consistent state. It only grows. The exporter
  keeps it privately (``ExporterSlots.gens``) and publishes it; a loader takes a generation
  outside ``[0, GEN_MAX]`` (its done mark would not fit int64) as no slot.
* ``bind`` (two words): a hash of the export's token, content digest and request id
  (:func:`binding`, :mod:`kvxfer.auth`). A loader finds the slot of its params by this value:
  params of another export, or altered ones (ids, token count, token or request id), find none
  and take the messaged path, where the exporter refuses them by name.
* ``deadline``: the lease's end (``monotonic_ns``), renewed with the lease.
* ``ready``: 1 once the compute that wrote the blocks completed (the exporter's ready gate).
* ``flags``: ``LIVE``, ``LAYERWISE`` (a streaming export: never read one-sided).
* ``done[d]`` for loader rank ``d < MAX_DONE``: ``gen * 512 + loader tp_size`` once loader rank
  ``d`` has landed the request (post-checked). The exporter counts it like a notification from
  loader rank ``d`` when it names the slot's current ``gen``; a mark of an earlier export of the
  slot names an older generation and counts nothing. The loader then appends the slot to the
  header's ring (``RING`` entries, ``done``: how many were ever taken), so the exporter's
  ``poll()`` reads one word when nothing was marked and only the named slots when something was.
  A loader takes the ring's next entry by compare-and-swap on ``done`` and writes it tagged with
  the count it took (:func:`ring_entry`); the exporter reads ``done`` before the entries, and an
  entry not tagged with its count (taken but not written yet) makes it look at every used slot,
  where the mark, written before the count was taken, already is. So no mark is lost, and a
  loader whose every mark was written this way defers its notification and coalesces it with
  others' (:mod:`kvxfer.transports.ipc.onesided`): the marks free the blocks. The
  compare-and-swap is the native module's; without it a loader appends with two plain stores,
  which two loaders at once can collide on, so it notifies at once.

The slot of an export is found by its binding: probing ``PROBES`` slots from ``bind[0] mod
num_slots``; an export finding none free has no slot (its loads take the messaged path). The
params do not name the slot: they are identical on every exporter rank and may be made before
the export (:meth:`kvxfer.engine.TransferEngine.params_for`, a scheduler's token), while each
rank places its exports itself.

Ordering: the exporter closes a slot (``gen`` odd, ``flags`` cleared, ``gen`` even) *before* it
bumps the released blocks' epochs, and a loader snapshots the epochs between two reads of the
same even ``gen``; so a snapshot taken while the slot was live either precedes the release (and
the post-copy epoch check sees it) or is discarded. Single aligned int64 stores and loads, in
program order (x86-64's TSO keeps store-store and load-load order). The loader's read (lookup,
snapshot, generation again), its check after the copy and its done mark are one native call each
(``slot_read``, ``slot_check``, ``slot_mark`` of ``csrc/ctl/lease_slots.h``: acquire loads
and release stores, so the compiler keeps that order too) when the control module is loaded
(:mod:`kvxfer.idops`), else the same steps through the memoryview; so are the exporter's open,
close and look at the done marks (``slot_open``, ``slot_close``, ``slot_done`` of
``csrc/ctl/exporter_slots.h``).

Trust: the table is a file in ``/dev/shm`` (``kvx_ls_*``) that any process of the exporter's
user can find, map and write. So every word either side reads from it is untrusted input. The
exporter keeps what it relies on in private memory (generations, which slots are used and by
whom, the ring entries taken) and only publishes; from the table it reads the loaders' words
alone (done marks, the ring and its count, ``readers``), each checked (a ring entry names a
used slot, a mark names the slot's current generation and a possible loader tp size). A loader
uses no table word as an index or in arithmetic that could overflow before it is checked: a
generation out of range is no slot (the load takes the messaged path), a done count that is
negative or at int64's end is no ring entry (the notification frees the export), each logged
once. What a writer of the table can still do is what it could do by writing the cache: free
unread exports early (forged done marks), have unready data read (a ready flag), or keep
loaders off the one-sided path (``open``, the heartbeat, the bindings).
"""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
import time
from collections.abc import Callable

import numpy as np

from ... import idops
from ...limits import MAX_TP_SIZE

__all__ = [
    "HEADER",
    "MAX_DONE",
    "PROBES",
    "READ_REFUSALS",
    "SLOT",
    "ExporterSlots",
    "SlotView",
    "binder",
    "binding",
]

MAGIC = 0x6B7678736C6F7431  # "kvxslot1"
VERSION = 3  # 3: ring entries tagged with their count; 2: the binding hashes token, digest, request id
RING = 56  # done-mark ring entries (ring_entry: the slot, tagged with the count it was taken at)
HEADER = 8 + RING
H_MAGIC, H_VERSION, H_NUM, H_BEAT, H_OPEN, H_INCARNATION, H_DONE, H_READERS = range(8)
H_RING = 8
MAX_DONE = 16  # loader ranks that mark done in the slot; higher ranks notify by message only
SLOT = 8 + MAX_DONE
S_GEN, S_BIND0, S_BIND1, S_DEADLINE, S_READY, S_FLAGS = range(6)
S_DONE = 8
LIVE, LAYERWISE = 1, 2
PROBES = 8
DONE_TP = 512  # done[d] = gen * DONE_TP + loader tp_size (tp_size <= 256)
SLOT_BITS = 22  # a ring entry's slot bits: a table holds fewer than 2**22 slots
_SLOT_MASK, _TAG_MASK = (1 << SLOT_BITS) - 1, (1 << 40) - 1
DEFAULT_SLOTS = 4096  # twice the exports a rank is expected to hold live at once


_LOG = logging.getLogger(__name__)
_M63 = (1 << 63) - 1
_blake2b = hashlib.blake2b
# The largest generation a loader takes from the table: its done mark gen * DONE_TP + tp must
# fit int64. The exporter's own generations grow by 2 per export of a slot and never get near.
GEN_MAX = (_M63 - (DONE_TP - 1)) // DONE_TP
BAD_WORD = "table word out of range"
_FIELDS = struct.Struct("=5q")  # bind0, bind1, deadline, ready, flags: written between gen steps
_CLEARED = bytes(_FIELDS.size)
# SlotView.read's refusals by the native slot_read's code (csrc/ctl/lease_slots.h), and
# onesided_read's refusal of the params (csrc/ctl/onesided_reads.h)
READ_REFUSALS = {
    1: "exporter closed or silent",
    2: "no live slot",
    3: "layer-wise export",
    4: "not ready",
    5: "lease too short",
    6: BAD_WORD,
    7: "bad params",
}
# SlotView.mark_done's outcomes by the native slot_mark's code: 0 marked and appended to the ring,
# 3 a loader rank past the marks (it notifies)
_MARKED, _MARK_BAD_COUNT, _MARK_BAD_GEN, _MARK_BY_MESSAGE = 0, 1, 2, 3
_logged_layout = False


def _native():
    """The native control module (:func:`kvxfer.idops.native`) when it is in use and assumes this
    table layout; else None (the same steps in Python, ~3x the time)."""
    global _logged_layout
    mod = idops.native()
    if mod is None:
        return None
    layout = (HEADER, SLOT, PROBES, RING, MAX_DONE, SLOT_BITS)
    if mod.slot_layout() != layout:
        if not _logged_layout:
            _logged_layout = True
            _LOG.warning(
                "kvxfer lease slots: the native module assumes layout %s, this table is %s; the "
                "slot reads run in Python", mod.slot_layout(), layout,
            )  # fmt: skip
        return None
    return mod


def _py_binding(token: str, digest: bytes, request_id: str) -> tuple[int, int]:
    """:func:`binding` through hashlib (the native module not loaded)."""
    h = _blake2b(b"".join((digest, token.encode("ascii"), request_id.encode())), digest_size=16).digest()
    x = int.from_bytes(h, "little")
    return x >> 64 & _M63, x & _M63


def binder() -> Callable[[str, bytes, str], tuple[int, int]]:
    """The :func:`binding` function to call: the native module's (``binding`` of
    ``csrc/ctl/lease_slots.h``) when it is in use, else hashlib's (slower). Both give
    the same words (tests/test_slots.py). Callers on the hot path take it once."""
    mod = idops.native()
    return mod.binding if mod is not None else _py_binding


def binding(token: str, digest: bytes, request_id: str) -> tuple[int, int]:
    """The two words binding a slot to one export: BLAKE2b-128 of the content digest (16 bytes),
    the token (its 48 ASCII characters) and the request id (UTF-8), as two 63-bit ints. A hash
    of the three together, not a combination of them: the token's MAC is the export's
    secret-keyed proof of exactly its request id and digest (kvxfer.auth), so a slot's binding
    is found only by the params that export handed out; params with another token, other ids
    or token count, or another request id find no slot (and take the messaged path, which
    refuses them by name), and none can be solved for from one export's params. ``ValueError``
    when the token is not ASCII or the request id has no UTF-8 (a lone surrogate): such params
    get no slot. (The XOR of MAC and digest it replaced let a holder of one export's params
    reach its slot with other ids or another request id.)"""
    return binder()(token, digest, request_id)


def incarnation_word(incarnation: str) -> int:
    h = hashlib.blake2b(incarnation.encode(), digest_size=8).digest()
    return int.from_bytes(h, "little", signed=True)


def _num_slots(words: int) -> int:
    n = (words - HEADER) // SLOT
    if n >= 1 << SLOT_BITS:
        raise ValueError(f"slots: a table of {words} words holds {n} slots, more than a ring entry names")
    return n


def ring_entry(count: int, slot: int) -> int:
    """The done ring's word for ``slot`` appended at ring count ``count``: the slot in the low
    :data:`SLOT_BITS` bits, above them ``count mod 2**40`` plus one (a zeroed word is no entry)."""
    return ((count & _TAG_MASK) + 1) << SLOT_BITS | slot


class ExporterSlots:
    """The exporter rank's side of its table (``table``: the int64 array in shared memory,
    ``HEADER + num_slots * SLOT`` words). Its methods are called under the export tracker's
    lock (``open``, ``close``, ``renew``, ``set_ready``, ``take_done``), or from any thread
    (``beat``, ``shut``). ``open``, ``close`` and ``take_done`` are one native call each when
    the control module is loaded; single words are read and written through a memoryview
    (a numpy scalar access costs ~3x as much).

    What the exporter relies on is private (``gens``: each slot's generation, ``used``,
    ``owner``, the ring entries taken, its header words and whether it is open): it only
    *publishes* it to the table (the header again with every beat), and never reads a word back
    but those loaders write (the done marks, the ring and its count, ``readers``), each taken as
    untrusted input. So a process that writes the table cannot make the exporter raise, leak an
    export or count a mark of anything but a live slot's current generation, and what it
    overwrote of the header holds until the next beat."""

    def __init__(self, table: np.ndarray, incarnation: str) -> None:
        n = _num_slots(table.size)
        if n < PROBES:
            raise ValueError(f"slots: a table of {table.size} words holds {n} slots, fewer than {PROBES}")
        self.t = table
        self.mv = memoryview(table)
        self.raw = self.mv.cast("B")
        self.num_slots = n
        self.rows = table[HEADER:].reshape(n, SLOT)
        table[:HEADER] = 0
        # the header words the exporter owns, republished with every beat (a process that
        # overwrote one keeps loaders off the one-sided path for a tick, not for good)
        self._header = (MAGIC, VERSION, n, incarnation_word(incarnation))
        self._open = True
        self._readers = False  # a loader set ``readers`` once (kept here: the word is anyone's)
        self._lock = threading.Lock()  # beat() and shut() run on different threads
        self.beat()
        self._binding = binder()
        self._ctl = _native()  # open, close and take_done in one native call each when set
        self.used = bytearray(n)
        # the slots' generations (published to the table, never read back)
        self.gens = np.zeros(n, dtype=np.int64)
        self.owner: dict[int, str] = {}  # slot -> request id
        self._seen = 0  # ring entries taken so far
        self._full_logged = False

    def beat(self) -> None:
        """The heartbeat: this rank is alive now; the header words it owns are published again."""
        mv = self.mv
        if not self._readers and mv[H_READERS]:
            self._readers = True
        with self._lock:
            mv[H_MAGIC], mv[H_VERSION], mv[H_NUM], mv[H_INCARNATION] = self._header
            mv[H_OPEN] = 1 if self._open else 0
            mv[H_BEAT] = time.monotonic_ns()

    def shut(self) -> None:
        """The engine is closing: no loader reads one-sided from here any more."""
        with self._lock:
            self._open = False
            self.mv[H_OPEN] = 0

    def open(
        self, request_id: str, token: str, digest: bytes, deadline: float, ready: bool, layerwise: bool
    ) -> int:
        """Give a live export a slot; its index, or -1 when no loader reads one-sided from here
        yet or the probed slots are all taken."""
        if not self._readers:
            if not self.mv[H_READERS]:
                return -1
            self._readers = True
        try:
            b0, b1 = self._binding(token, digest, request_id)
        except ValueError:  # a request id with no UTF-8: no loader finds it either
            return -1
        flags = LIVE | LAYERWISE if layerwise else LIVE
        ctl = self._ctl
        if ctl is not None:
            i = ctl.slot_open(
                self.t, self.gens, self.used, b0, b1, int(deadline * 1e9), 1 if ready else 0, flags
            )
            if i >= 0:
                self.owner[i] = request_id
                return i
            return self._full(request_id)
        n, used = self.num_slots, self.used
        for k in range(PROBES):
            i = (b0 + k) % n
            if not used[i]:
                break
        else:
            return self._full(request_id)
        mv, base = self.mv, HEADER + i * SLOT
        g = int(self.gens[i]) + 1
        mv[base + S_GEN] = g  # odd: being written
        _FIELDS.pack_into(
            self.raw, 8 * (base + S_BIND0), b0, b1, int(deadline * 1e9), 1 if ready else 0, flags
        )
        mv[base + S_GEN] = g + 1  # even: stable
        self.gens[i] = g + 1
        used[i] = 1
        self.owner[i] = request_id
        return i

    def native_state(self) -> tuple | None:
        """``(table, gens, used, owner, on_full)``: what the export tracker's native book needs
        to write this table itself (:meth:`kvxfer.exports.ExportTracker.follow_slots`; it keeps
        ``gens``, ``used`` and ``owner`` as :meth:`open` and :meth:`close` do, and calls
        ``on_full(request_id)`` when the probed slots are all taken); None when the control
        module is not in use for this table. :meth:`marked` and :meth:`take_done` are not to be
        called once it follows the table (it takes the done marks)."""
        if self._ctl is None:
            return None
        return self.t, self.gens, self.used, self.owner, self._full

    def _full(self, request_id: str) -> int:
        """No free slot among those probed for ``request_id``: -1, logged once."""
        if not self._full_logged:
            self._full_logged = True
            _LOG.warning(
                "kvxfer lease slots: %d slots, the %d probed for export %r all taken; exports "
                "without a slot are loaded through the messaged path (logged once)",
                self.num_slots, PROBES, request_id,
            )  # fmt: skip
        return -1

    def close(self, i: int) -> None:
        """End slot ``i``'s export (before the released blocks' epochs move)."""
        self.owner.pop(i, None)
        ctl = self._ctl
        if ctl is not None:
            ctl.slot_close(self.t, self.gens, self.used, i)
            return
        mv, base = self.mv, HEADER + i * SLOT
        g = int(self.gens[i]) + 1
        self.gens[i] = g + 1
        self.used[i] = 0
        mv[base + S_GEN] = g
        self.raw[8 * (base + S_BIND0) : 8 * (base + S_BIND0) + _FIELDS.size] = _CLEARED
        mv[base + S_GEN] = g + 1

    def renew(self, i: int, deadline: float) -> None:
        self.mv[HEADER + i * SLOT + S_DEADLINE] = int(deadline * 1e9)

    def set_ready(self, i: int) -> None:
        self.mv[HEADER + i * SLOT + S_READY] = 1

    def marked(self) -> bool:
        """Whether a loader wrote a done mark since the last :meth:`take_done` (one load)."""
        return self.mv[H_DONE] != self._seen

    def take_done(self) -> list[tuple[str, list[tuple[int, int]]]]:
        """The done marks loaders wrote since the last call, of live exports:
        ``[(request id, [(loader rank, loader tp_size), ...])]``. One read when none was written;
        else the slots the ring names (every live slot if more were written than it holds, or the
        count moved in a way no loader moves it). A mark counts only when it names the slot's
        current generation (the exporter's own) and a loader tp size a plan can have
        (``1..MAX_TP_SIZE``, above its rank)."""
        ctl = self._ctl
        if ctl is not None:
            self._seen, got = ctl.slot_done(self.t, self.gens, self.used, self._seen, MAX_TP_SIZE)
            owner = self.owner
            return [(owner[i], marks) for i, marks in got]
        mv = self.mv
        w = mv[H_DONE]
        seen = self._seen
        if w == seen:
            return []
        self._seen = w
        slots = self.owner.keys()  # the ring overflowed, was written by a confused peer, or an
        if 0 < w - seen <= RING:  # entry is not written yet: look at every live slot
            entries = [mv[H_RING + k % RING] for k in range(seen, w)]
            if all((e >> SLOT_BITS) == (k & _TAG_MASK) + 1 for k, e in zip(range(seen, w), entries)):
                slots = {e & _SLOT_MASK for e in entries}
        out = []
        gens, owner, n = self.gens, self.owner, self.num_slots
        for i in list(slots):
            rid = owner.get(i) if type(i) is int and 0 <= i < n else None
            if rid is None:
                continue
            base = HEADER + i * SLOT
            g = int(gens[i])
            marks = [
                (d, v % DONE_TP)
                for d, v in enumerate(mv[base + S_DONE : base + S_DONE + MAX_DONE].tolist())
                if v and v // DONE_TP == g and d < v % DONE_TP <= MAX_TP_SIZE
            ]
            if marks:
                out.append((rid, marks))
        return out


class SlotView:
    """A loader's view of an exporter rank's table (mapped read-write: the loader writes its
    done marks and the ring). Every word it reads is untrusted input (any process of the same
    user can write the table): a generation or a done count out of range is no slot, or no ring
    entry, logged once per view; never an index, never a value that overflows."""

    def __init__(self, table: np.ndarray, wait_s: float = 0.1) -> None:
        n = _num_slots(table.size)
        end = time.monotonic() + wait_s
        while table[H_MAGIC] != MAGIC or table[H_VERSION] != VERSION or table[H_NUM] != n:
            if time.monotonic() >= end:
                raise ValueError("slots: not a lease-slot table of this kvxfer version")
            # a word another process overwrote comes back with the exporter's next beat (20 ms)
            time.sleep(0.005)
        self.t = table
        self.mv = memoryview(table)
        self.num_slots = n
        self.mv[H_READERS] = 1  # the exporter gives its exports slots from now on
        self.ctl = _native()  # read, check and mark_done in one native call each when set
        self._logged: set[str] = set()

    def bad(self, what: str) -> None:
        """Log once per view that a word of the table was out of range (and not used)."""
        if what not in self._logged:
            self._logged.add(what)
            _LOG.warning(
                "kvxfer lease slots: %s in the exporter's table (written by another process?); "
                "not used: that load takes the messaged path, or its done mark is left to the "
                "notification (logged once)",
                what,
            )

    def of(self, incarnation: str) -> bool:
        """Whether the table is that of the exporter's start ``incarnation`` (its handshake's)."""
        return self.mv[H_INCARNATION] == incarnation_word(incarnation)

    def alive(self, stale_ns: int, now_ns: int) -> str:
        """Why the exporter may not be read now; empty when it is open and beat within
        ``stale_ns``."""
        mv = self.mv
        if not mv[H_OPEN]:
            return "the exporting engine closed"
        age = now_ns - mv[H_BEAT]
        if age > stale_ns:
            return f"no heartbeat from the exporter for {age / 1e9:.2f} s (stopped or hung)"
        return ""

    def _find(self, b0: int, b1: int) -> tuple[int, int, bool]:
        """:meth:`find`, and whether a probed slot bound to ``(b0, b1)`` had a generation out of
        range."""
        n, mv = self.num_slots, self.mv
        bad = False
        for k in range(PROBES):
            base = HEADER + (b0 + k) % n * SLOT
            g = mv[base + S_GEN]
            if g & 1 or mv[base + S_BIND0] != b0 or mv[base + S_BIND1] != b1 or not mv[base + S_FLAGS] & LIVE:
                continue
            if not 0 <= g <= GEN_MAX:
                bad = True
                continue
            if mv[base + S_GEN] == g:
                return (b0 + k) % n, g, bad
        return -1, 0, bad

    def find(self, b0: int, b1: int) -> tuple[int, int]:
        """(slot, its even generation) of the live export bound to ``(b0, b1)``; (-1, 0) when none
        is (not exported yet, released, the slot was being rewritten, or its generation is out of
        range)."""
        i, g, bad = self._find(b0, b1)
        if bad and i < 0:
            self.bad("a slot's generation out of range")
        return i, g

    def lookup(self, b0: int, b1: int, now_ns: int, stale_ns: int, need_ns: int) -> tuple[int, int, str]:
        """(slot, its even generation, "") of the live export bound to ``(b0, b1)`` when it may be
        read one-sided now: the exporter open and beating within ``stale_ns``, the export ready,
        not layer-wise, leased past ``need_ns``; else (-1, 0, why not)."""
        if self.alive(stale_ns, now_ns):
            return -1, 0, "exporter closed or silent"
        i, g, bad = self._find(b0, b1)
        if i < 0:
            return -1, 0, BAD_WORD if bad else "no live slot"
        mv, base = self.mv, HEADER + i * SLOT
        if mv[base + S_FLAGS] & LAYERWISE:
            return -1, 0, "layer-wise export"
        if not mv[base + S_READY]:
            return -1, 0, "not ready"
        if mv[base + S_DEADLINE] < need_ns:
            return -1, 0, "lease too short"
        return i, g, ""

    def same(self, i: int, g: int) -> bool:
        return self.mv[HEADER + i * SLOT + S_GEN] == g

    def read(
        self, b0: int, b1: int, now_ns: int, stale_ns: int, need_ns: int, epochs: np.ndarray, ids: np.ndarray
    ) -> tuple[int, int, bytes] | str:
        """:meth:`lookup`, then ``epochs[ids]`` (:func:`kvxfer.idops.snapshot`) taken while the
        slot stays at the generation found: ``(slot, generation, snapshot)``, or why the export
        may not be read one-sided now. One native call when the module is in use, where the
        Python fallback takes three steps."""
        ctl = self.ctl
        if ctl is not None:
            got = ctl.slot_read(self.t, epochs, ids, b0, b1, now_ns, stale_ns, need_ns)
            if type(got) is int:
                why = READ_REFUSALS[got]
                if why is BAD_WORD:
                    self.bad("a slot's generation out of range")
                return why
            return got
        i, g, why = self.lookup(b0, b1, now_ns, stale_ns, need_ns)
        if why:
            if why is BAD_WORD:
                self.bad("a slot's generation out of range")
            return why
        snap = idops.snapshot(epochs, ids)
        return (i, g, snap) if self.same(i, g) else "no live slot"

    def check(
        self, i: int, g: int, epochs: np.ndarray, ids: np.ndarray, snap: bytes, now_ns: int, stale_ns: int
    ) -> int:
        """After a copy of what :meth:`read` returned: 0 when slot ``i`` is still at generation
        ``g`` and ``epochs[ids]`` equal ``snap`` (nothing released) and the exporter is alive,
        1 when something was released, 2 when only the exporter stopped (:meth:`alive` says
        why)."""
        ctl = self.ctl
        if ctl is not None:
            return ctl.slot_check(self.t, epochs, ids, snap, i, g, now_ns, stale_ns)
        if not self.same(i, g) or not idops.unchanged(epochs, ids, snap):
            return 1
        return 2 if self.alive(stale_ns, now_ns) else 0

    def mark_done(self, i: int, g: int, loader_rank: int, loader_tp: int) -> bool:
        """Loader rank ``loader_rank`` of a ``loader_tp``-rank engine landed slot ``i``'s export
        (generation ``g``, as read from the table); the slot goes into the ring for the exporter
        to look at. True when the exporter will count the mark without waiting for a
        notification: written, and the ring entry taken by the native compare-and-swap (the
        Python stores can collide with another loader's). A rank past the marks writes nothing; nor does a generation out of
        range; a ring count out of range (negative, or at int64's end) leaves the ring alone
        after the mark. False for those: the loader notifies."""
        if loader_rank >= MAX_DONE:
            return False
        if self.ctl is not None:  # the same stores, in this order
            got = self.ctl.slot_mark(self.t, i, g, loader_rank, loader_tp)
            if got == _MARKED:
                return True
        else:
            got = self._mark(i, g, loader_rank, loader_tp)
        if got == _MARK_BAD_GEN:
            self.bad("a slot's generation out of range")
        elif got == _MARK_BAD_COUNT:
            self.bad("a done count out of range")
        return False

    def _mark(self, i: int, g: int, loader_rank: int, loader_tp: int) -> int:
        """:meth:`mark_done` through the memoryview (what the native ``slot_mark`` does)."""
        if not 0 <= g <= GEN_MAX:
            return _MARK_BAD_GEN
        mv = self.mv
        mv[HEADER + i * SLOT + S_DONE + loader_rank] = g * DONE_TP + loader_tp
        w = mv[H_DONE]
        if not 0 <= w < _M63:
            return _MARK_BAD_COUNT
        mv[H_RING + w % RING] = ring_entry(w, i)
        mv[H_DONE] = w + 1
        return _MARKED
