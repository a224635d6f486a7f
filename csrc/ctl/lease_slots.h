// kvxfer control-path helpers (kvx_ctl.cpp): the lease-slot table's reads, checks and marks,
// and the binding that names a slot's export.
//
// The lease-slot table of kvxfer/transports/ipc/slots.py (its docstring is the protocol): an
// int64 array in shared memory that another process writes while these read it. Every word is
// read with an acquire load and written with a release store, so neither the compiler nor the
// CPU reorders the seqlock's reads (gen, fields, gen) or the done mark before its ring entry.
// slot_layout() returns the constants below; slots.py uses these functions only when they
// equal its own.
//
// Every word read from the table is untrusted input: any process of the same user can write
// it. None is used as an index or in arithmetic that could overflow before it is checked; a
// word out of range is "no slot" (slot_read) or "no ring entry" (slot_mark), never a crash.
//
// Included by kvx_ctl.cpp alone: the module is one translation unit (in its hash).

#pragma once

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>

#include <cstddef>
#include <cstdint>

#include "blake2b.h"
#include "ctl_common.h"

namespace kvx_ctl {

constexpr Py_ssize_t kHeader = 8 + 56, kSlot = 8 + 16, kProbes = 8, kRing = 56, kMaxDone = 16;
constexpr Py_ssize_t kHOpen = 4, kHBeat = 3, kHDone = 6, kHRing = 8;
constexpr Py_ssize_t kGen = 0, kBind0 = 1, kBind1 = 2, kDeadline = 3, kReady = 4, kFlags = 5, kDone = 8;
constexpr int64_t kLive = 1, kLayerwise = 2, kDoneTp = 512;
constexpr int64_t kInt64Max = INT64_MAX;
// A done-ring entry: ((count mod 2**40) + 1) << kSlotBits | slot, the count it was appended at
// as its tag (never 0: a zeroed word names no entry), so the exporter tells a written entry from
// one whose writer has taken the count but not stored it yet. A table holds < 2**kSlotBits slots.
constexpr int kSlotBits = 22;
constexpr int64_t kSlotMask = (int64_t{1} << kSlotBits) - 1, kTagMask = (int64_t{1} << 40) - 1;
inline int64_t ring_entry(int64_t count, int64_t slot) { return (((count & kTagMask) + 1) << kSlotBits) | slot; }
// The slot ring word `e` names when it is the entry appended at `count`; -1 when it is not (not
// written yet, overwritten by a later one, or a stranger's word).
inline int64_t ring_slot(int64_t e, int64_t count) {
  return e > 0 && (e >> kSlotBits) == (count & kTagMask) + 1 ? (e & kSlotMask) : -1;
}
// The largest generation a done mark can name: gen * kDoneTp + tp must fit int64 (GEN_MAX).
constexpr int64_t kGenMax = (kInt64Max - (kDoneTp - 1)) / kDoneTp;
// slot_read's refusals (slots.py names them)
enum Refusal { kSilent = 1, kNoSlot = 2, kLayerwiseRefused = 3, kNotReady = 4, kShortLease = 5, kBadWord = 6 };
// slot_mark's outcomes (slots.py logs the two bad ones once; kMarkByMessage: a loader rank past
// the marks, which notifies by message only)
enum Mark { kMarked = 0, kMarkBadCount = 1, kMarkBadGen = 2, kMarkByMessage = 3 };

inline int64_t ld(const int64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline void st(int64_t *p, int64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

// The number of slots of a table buffer; -1 (ValueError set) when it holds none.
inline Py_ssize_t table_slots(const Buf &t) {
  const Py_ssize_t n = (t.count() - kHeader) / kSlot;
  if (t.count() < kHeader || n < kProbes) {
    PyErr_Format(PyExc_ValueError, "slots: a table of %zd words holds fewer than %zd slots", t.count(), kProbes);
    return -1;
  }
  return n;
}

// Open, and beat within stale_ns of now_ns. The heartbeat word is compared, not subtracted from:
// a word near int64's ends must not overflow (now_ns and stale_ns are the caller's, sane).
inline bool alive(const int64_t *t, int64_t now_ns, int64_t stale_ns) {
  return ld(t + kHOpen) != 0 && ld(t + kHBeat) >= now_ns - stale_ns;
}

inline bool int64_args(PyObject *const *args, Py_ssize_t first, Py_ssize_t count, int64_t *out) {
  for (Py_ssize_t k = 0; k < count; ++k) {
    out[k] = PyLong_AsLongLong(args[first + k]);
    if (out[k] == -1 && PyErr_Occurred()) return false;
  }
  return true;
}

// The slot of the live export bound to (b0, b1) (b0 >= 0) among the probed slots of table `t` of
// `num` slots, `gen` its even generation; -1 when none is (not exported, released, being
// rewritten). A slot bound to (b0, b1) whose generation is out of [0, kGenMax] is skipped and
// sets `bad`.
inline Py_ssize_t find_slot(const int64_t *t, Py_ssize_t num, int64_t b0, int64_t b1, int64_t &gen, bool &bad) {
  for (Py_ssize_t k = 0; k < kProbes; ++k) {
    const Py_ssize_t i = static_cast<Py_ssize_t>((static_cast<uint64_t>(b0) + k) % static_cast<uint64_t>(num));
    const int64_t *s = t + kHeader + i * kSlot;
    const int64_t g = ld(s + kGen);
    if ((g & 1) || ld(s + kBind0) != b0 || ld(s + kBind1) != b1 || !(ld(s + kFlags) & kLive)) continue;
    if (g < 0 || g > kGenMax) {
      bad = true;
      continue;
    }
    if (ld(s + kGen) == g) {
      gen = g;
      return i;
    }
  }
  return -1;
}

// The slot of the live export bound to (b0, b1) in table `t` of `num` slots when it may be read
// one-sided now (the exporter open and beating within stale_ns, the export ready, not
// layer-wise, leased past need_ns), with epochs[ids] (ids checked in range) taken into `snap`
// (a new bytes object) between two reads of the same even generation: 0, `slot`, `gen` and
// `snap` set; else a Refusal code (nothing set), or -1 with a Python error (out of memory). A
// slot bound to (b0, b1) whose generation is out of [0, kGenMax] is skipped (kBadWord when no
// other probed slot is the export's).
inline int read_slot(const int64_t *t, Py_ssize_t num, const Buf &ep, const Buf &ids, int64_t b0, int64_t b1,
                     int64_t now_ns, int64_t stale_ns, int64_t need_ns, Py_ssize_t &slot, int64_t &gen,
                     PyObject *&snap) {
  if (!alive(t, now_ns, stale_ns)) return kSilent;
  bool bad = false;
  slot = find_slot(t, num, b0, b1, gen, bad);
  if (slot < 0) return bad ? kBadWord : kNoSlot;
  const int64_t *s = t + kHeader + slot * kSlot;
  if (ld(s + kFlags) & kLayerwise) return kLayerwiseRefused;
  if (!ld(s + kReady)) return kNotReady;
  if (ld(s + kDeadline) < need_ns) return kShortLease;
  const Py_ssize_t k = ids.count();
  snap = PyBytes_FromStringAndSize(nullptr, k * 8);
  if (snap == nullptr) return -1;
  int64_t *d = reinterpret_cast<int64_t *>(PyBytes_AS_STRING(snap));
  const int64_t *e = static_cast<const int64_t *>(ep.view.buf);
  const int64_t *x = static_cast<const int64_t *>(ids.view.buf);
  for (Py_ssize_t i = 0; i < k; ++i) d[i] = ld(e + x[i]);
  if (ld(s + kGen) != gen) {  // rewritten meanwhile: the snapshot may postdate a release
    Py_CLEAR(snap);
    return kNoSlot;
  }
  return 0;
}

// slot_read(table, epochs, ids, b0, b1, now_ns, stale_ns, need_ns) -> (slot, gen, snapshot) of
// read_slot, or its Refusal code (int).
inline PyObject *slot_read(PyObject *, PyObject *const *args, Py_ssize_t n) {
  if (!nargs(n, 8, "slot_read")) return nullptr;
  Buf tb, ep, ids;
  int64_t v[5];
  if (!get(args[0], tb, 8, false, "table") || !get(args[1], ep, 8, false, "epochs") ||
      !get(args[2], ids, 8, false, "ids") || !int64_args(args, 3, 5, v)) {
    return nullptr;
  }
  const Py_ssize_t num = table_slots(tb);
  if (num < 0 || !ids_in_range(ids, ep.count(), "slot_read")) return nullptr;
  if (v[0] < 0) return PyErr_Format(PyExc_ValueError, "slot_read: binding word %lld is negative", (long long)v[0]);
  Py_ssize_t slot = -1;
  int64_t gen = 0;
  PyObject *snap = nullptr;
  const int got = read_slot(static_cast<const int64_t *>(tb.view.buf), num, ep, ids, v[0], v[1], v[2], v[3], v[4],
                            slot, gen, snap);
  if (got < 0) return nullptr;
  if (got) return PyLong_FromLong(got);
  return Py_BuildValue("(nLN)", slot, static_cast<long long>(gen), snap);
}

// After a copy of what read_slot found: 0 when slot `slot` (in range) of table `t` is still at
// generation `gen`, epochs[ids] (in range) equal the snapshot and the exporter is alive; 1 when
// the slot or the epochs moved (released), 2 when only the exporter stopped (closed, silent).
inline int check_slot(const int64_t *t, const Buf &ep, const Buf &ids, const Buf &snap, int64_t slot, int64_t gen,
                      int64_t now_ns, int64_t stale_ns) {
  if (ld(t + kHeader + slot * kSlot + kGen) != gen) return 1;
  __atomic_thread_fence(__ATOMIC_ACQUIRE);
  if (!same_epochs(ep, ids, snap)) return 1;
  return alive(t, now_ns, stale_ns) ? 0 : 2;
}

// slot_check(table, epochs, ids, snapshot, slot, gen, now_ns, stale_ns) -> check_slot's answer.
inline PyObject *slot_check(PyObject *, PyObject *const *args, Py_ssize_t n) {
  if (!nargs(n, 8, "slot_check")) return nullptr;
  Buf tb, ep, ids, snap;
  int64_t v[4];
  if (!get(args[0], tb, 8, false, "table") || !get(args[1], ep, 8, false, "epochs") ||
      !get(args[2], ids, 8, false, "ids") || !get(args[3], snap, 0, false, "snapshot") ||
      !int64_args(args, 4, 4, v)) {
    return nullptr;
  }
  const Py_ssize_t num = table_slots(tb);
  if (num < 0 || !ids_in_range(ids, ep.count(), "slot_check")) return nullptr;
  if (v[0] < 0 || v[0] >= num) return PyErr_Format(PyExc_IndexError, "slot_check: slot %lld of %zd", (long long)v[0], num);
  return PyLong_FromLong(check_slot(static_cast<const int64_t *>(tb.view.buf), ep, ids, snap, v[0], v[1], v[2], v[3]));
}

// Loader rank `rank` (in [0, tp), tp < kDoneTp) of a `tp`-rank engine landed slot `slot`'s (in
// range) export of generation `gen`: its done mark (a release store), then the ring's count taken
// by compare-and-swap (so loaders appending at once never take the same entry), then the tagged
// entry at that count (ring_entry). The exporter reads the count before the entries it covers;
// an entry it finds untagged (taken, not written yet) makes it look at every used slot, where the
// mark already is: no mark is lost. `gen` was read from the table: out of [0, kGenMax] nothing is
// written (kMarkBadGen). A ring count out of [0, INT64_MAX) leaves the ring and the count alone
// after the mark (kMarkBadCount): it is no index, and its increment would overflow. A rank past
// the marks writes nothing (kMarkByMessage).
inline int mark_slot(int64_t *t, int64_t slot, int64_t gen, int64_t rank, int64_t tp) {
  if (rank >= kMaxDone) return kMarkByMessage;
  if (gen < 0 || gen > kGenMax) return kMarkBadGen;
  st(t + kHeader + slot * kSlot + kDone + rank, gen * kDoneTp + tp);
  int64_t w = ld(t + kHDone);
  do {
    if (w < 0 || w == kInt64Max) return kMarkBadCount;
  } while (!__atomic_compare_exchange_n(t + kHDone, &w, w + 1, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE));
  st(t + kHRing + w % kRing, ring_entry(w, slot));
  return kMarked;
}

inline bool loader_rank_ok(int64_t rank, int64_t tp, const char *what) {
  if (rank < 0 || tp < 1 || tp >= kDoneTp || rank >= tp) {
    PyErr_Format(PyExc_ValueError, "%s: loader rank %lld of %lld", what, (long long)rank, (long long)tp);
    return false;
  }
  return true;
}

// slot_mark(table, slot, gen, loader_rank, loader_tp) -> mark_slot's Mark.
inline PyObject *slot_mark(PyObject *, PyObject *const *args, Py_ssize_t n) {
  if (!nargs(n, 5, "slot_mark")) return nullptr;
  Buf tb;
  int64_t v[4];
  if (!get(args[0], tb, 8, true, "table") || !int64_args(args, 1, 4, v)) return nullptr;
  const Py_ssize_t num = table_slots(tb);
  if (num < 0) return nullptr;
  const int64_t slot = v[0];
  if (slot < 0 || slot >= num) return PyErr_Format(PyExc_IndexError, "slot_mark: slot %lld of %zd", (long long)slot, num);
  if (!loader_rank_ok(v[2], v[3], "slot_mark")) return nullptr;
  return PyLong_FromLong(mark_slot(static_cast<int64_t *>(tb.view.buf), slot, v[1], v[2], v[3]));
}

// ------------------------------------------------------------------------------ binding
// The binding of (token, digest, request_id): BLAKE2b-128 of the bytes of `dg`, the str `token`
// (ASCII: ValueError otherwise) and the str `request_id` (UTF-8: ValueError for one that has
// none, e.g. a lone surrogate), in that order, as two 63-bit words; false with a Python error.
inline bool bind_words(PyObject *token, const Buf &dg, PyObject *request_id, int64_t &b0, int64_t &b1) {
  if (!PyUnicode_Check(token) || !PyUnicode_Check(request_id)) {
    PyErr_Format(PyExc_TypeError, "binding: token and request_id must be str, got %s and %s", Py_TYPE(token)->tp_name,
                 Py_TYPE(request_id)->tp_name);
    return false;
  }
  if (!PyUnicode_IS_ASCII(token)) {
    PyErr_SetString(PyExc_ValueError, "binding: the token is not ASCII");
    return false;
  }
  Py_ssize_t rid_len = 0;
  const char *rid = PyUnicode_AsUTF8AndSize(request_id, &rid_len);
  if (rid == nullptr) return false;  // UnicodeEncodeError, a ValueError
  Blake2b128 h;
  h.update(static_cast<const unsigned char *>(dg.view.buf), static_cast<size_t>(dg.view.len));
  h.update(static_cast<const unsigned char *>(PyUnicode_DATA(token)), static_cast<size_t>(PyUnicode_GET_LENGTH(token)));
  h.update(reinterpret_cast<const unsigned char *>(rid), static_cast<size_t>(rid_len));
  uint64_t w0, w1;
  h.final(w0, w1);
  constexpr uint64_t kM63 = (uint64_t{1} << 63) - 1;
  b0 = static_cast<int64_t>(w1 & kM63);
  b1 = static_cast<int64_t>(w0 & kM63);
  return true;
}

// binding(token, digest, request_id) -> (b0, b1): bind_words of a bytes-like `digest` (the
// words slots.binding returns).
inline PyObject *binding(PyObject *, PyObject *const *args, Py_ssize_t n) {
  if (!nargs(n, 3, "binding")) return nullptr;
  if (!PyUnicode_Check(args[0]) || !PyUnicode_Check(args[2])) {
    return PyErr_Format(PyExc_TypeError, "binding: token and request_id must be str, got %s and %s",
                        Py_TYPE(args[0])->tp_name, Py_TYPE(args[2])->tp_name);
  }
  Buf dg;
  if (!get(args[1], dg, 0, false, "digest")) return nullptr;
  int64_t b0, b1;
  if (!bind_words(args[0], dg, args[2], b0, b1)) return nullptr;
  return Py_BuildValue("(LL)", static_cast<long long>(b0), static_cast<long long>(b1));
}

// slot_layout() -> the table layout these functions assume (slots.py compares it with its own).
inline PyObject *slot_layout(PyObject *, PyObject *) {
  return Py_BuildValue("(nnnnni)", kHeader, kSlot, kProbes, kRing, kMaxDone, kSlotBits);
}

}  // namespace kvx_ctl
