// kvxfer control-path helpers (kvx_ctl.cpp): the exporter's writes to its lease-slot table
// (ExporterSlots of kvxfer/transports/ipc/slots.py, whose docstring is the protocol), one native
// call each: a slot opened for an export, a slot closed at its release, and the done marks
// loaders wrote since the last look.
//
// The exporter's own state stays private to it: `gens` (int64, a slot's generation, published
// to the table, never read back from it) and `used` (one byte per slot) are arrays in the
// exporter's memory that these functions keep; slots.py keeps which request owns a slot. From
// the table only the words loaders write are read (the ring, its count, the done marks), each
// checked as untrusted input, as slots.py's Python does. Why native: in Python the three were
// a large part of a one-sided request's cost on the exporter's side, mostly memoryview and
// list work around a few words (profiling/results/2026-11-28-cpu-native-hostcost).
//
// Included by kvx_ctl.cpp alone: the module is one translation unit (in its hash).

#pragma once

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>

#include <cstdint>
#include <vector>

#include "ctl_common.h"
#include "lease_slots.h"

namespace kvx_ctl {

// The table, gens and used of one exporter, checked to agree (their slot counts).
struct ExporterArgs {
  Buf table, gens, used;
  Py_ssize_t num = 0;
  bool get_all(PyObject *const *args, const char *name) {
    if (!get(args[0], table, 8, true, "table") || !get(args[1], gens, 8, true, "gens") ||
        !get(args[2], used, 0, true, "used")) {
      return false;
    }
    num = table_slots(table);
    if (num < 0) return false;
    if (gens.count() != num || used.view.len != num) {
      PyErr_Format(PyExc_ValueError, "%s: %zd slots, but gens holds %zd and used %zd", name, num, gens.count(),
                   used.view.len);
      return false;
    }
    return true;
  }
  int64_t *t() const { return static_cast<int64_t *>(table.view.buf); }
  int64_t *g() const { return static_cast<int64_t *>(gens.view.buf); }
  unsigned char *u() const { return static_cast<unsigned char *>(used.view.buf); }
};

// Rewrite slot i between an odd and the next even generation: bind0, bind1, deadline, ready, flags.
inline void rewrite_slot(ExporterArgs &a, Py_ssize_t i, const int64_t fields[5]) {
  int64_t *s = a.t() + kHeader + i * kSlot;
  const int64_t g = a.g()[i] + 1;
  st(s + kGen, g);  // odd: being written
  for (int k = 0; k < 5; ++k) st(s + kBind0 + k, fields[k]);
  st(s + kGen, g + 1);  // even: stable
  a.g()[i] = g + 1;
}

// The first free slot of the kProbes probed from binding word b0 (>= 0), or -1.
inline Py_ssize_t free_slot(const ExporterArgs &a, int64_t b0) {
  for (Py_ssize_t k = 0; k < kProbes; ++k) {
    const Py_ssize_t i = static_cast<Py_ssize_t>((static_cast<uint64_t>(b0) + k) % static_cast<uint64_t>(a.num));
    if (!a.u()[i]) return i;
  }
  return -1;
}

// Slot i given an export (bind0, bind1, deadline, ready, flags), or cleared: its export ended.
inline void fill_slot(ExporterArgs &a, Py_ssize_t i, const int64_t fields[5]) {
  rewrite_slot(a, i, fields);
  a.u()[i] = 1;
}

inline void clear_slot(ExporterArgs &a, Py_ssize_t i) {
  const int64_t cleared[5] = {0, 0, 0, 0, 0};
  rewrite_slot(a, i, cleared);
  a.u()[i] = 0;
}

// Whether done mark `v`, written by loader rank `d` in a slot of generation `g`, counts: it names
// that generation and a loader tp size a plan can have (above the rank, at most max_tp), `tp`.
inline bool counting_mark(int64_t v, int64_t g, Py_ssize_t d, int64_t max_tp, int64_t &tp) {
  if (v <= 0 || v / kDoneTp != g) return false;
  tp = v % kDoneTp;
  return d < tp && tp <= max_tp;
}

// slot_open(table, gens, used, b0, b1, deadline_ns, ready, flags) -> the slot given the export
// bound to (b0, b1) (the first free one of the kProbes probed from b0), or -1 when all are used.
inline PyObject *slot_open(PyObject *, PyObject *const *args, Py_ssize_t n) {
  if (!nargs(n, 8, "slot_open")) return nullptr;
  ExporterArgs a;
  int64_t v[5];
  if (!a.get_all(args, "slot_open") || !int64_args(args, 3, 5, v)) return nullptr;
  if (v[0] < 0) return PyErr_Format(PyExc_ValueError, "slot_open: binding word %lld is negative", (long long)v[0]);
  const Py_ssize_t i = free_slot(a, v[0]);
  if (i >= 0) fill_slot(a, i, v);
  return PyLong_FromSsize_t(i);
}

// slot_close(table, gens, used, slot): the export of `slot` ended (its fields cleared between
// two generation steps, the slot free again).
inline PyObject *slot_close(PyObject *, PyObject *const *args, Py_ssize_t n) {
  if (!nargs(n, 4, "slot_close")) return nullptr;
  ExporterArgs a;
  int64_t i;
  if (!a.get_all(args, "slot_close") || !int64_args(args, 3, 1, &i)) return nullptr;
  if (i < 0 || i >= a.num) return PyErr_Format(PyExc_IndexError, "slot_close: slot %lld of %zd", (long long)i, a.num);
  clear_slot(a, static_cast<Py_ssize_t>(i));
  Py_RETURN_NONE;
}

// The done marks of used slot i that name its generation and a loader tp size a plan can have
// (above the marking rank, at most max_tp): a list of (loader rank, loader tp size), or NULL
// with an error set.
inline PyObject *slot_marks_of(const ExporterArgs &a, Py_ssize_t i, int64_t max_tp) {
  const int64_t *s = a.t() + kHeader + i * kSlot + kDone;
  const int64_t g = a.g()[i];
  PyObject *out = PyList_New(0);
  if (out == nullptr) return nullptr;
  for (Py_ssize_t d = 0; d < kMaxDone; ++d) {
    int64_t tp;
    if (!counting_mark(ld(s + d), g, d, max_tp, tp)) continue;
    PyObject *pair = Py_BuildValue("(nL)", d, static_cast<long long>(tp));
    if (pair == nullptr || PyList_Append(out, pair) != 0) {
      Py_XDECREF(pair);
      Py_DECREF(out);
      return nullptr;
    }
    Py_DECREF(pair);
  }
  return out;
}

// The used slots whose done marks to look at when the ring's count moved from `seen` to `w`:
// those the ring named since `seen`, each once, in ring order. Every used slot instead when more
// were written than the ring holds, the count moved in a way no loader moves it, or an entry is
// not tagged with its count (a loader took the count and has not stored the entry yet, or a
// later one overwrote it: its mark, stored before it took the count, is in its slot).
inline void done_slots(const ExporterArgs &a, int64_t seen, int64_t w, std::vector<Py_ssize_t> &out) {
  out.clear();
  if (w == seen) return;
  bool every = false;
  // w - seen computed unsigned: a count a confused peer set anywhere never overflows here
  const uint64_t moved = static_cast<uint64_t>(w) - static_cast<uint64_t>(seen);
  if (moved <= static_cast<uint64_t>(kRing) && seen >= 0) {
    for (int64_t k = seen; k < w; ++k) {
      const int64_t slot = ring_slot(ld(a.t() + kHRing + k % kRing), k);
      if (slot < 0) {  // not written yet (or overwritten)
        every = true;
        break;
      }
      if (slot >= a.num || !a.u()[slot]) continue;  // not a used slot: nothing to count
      bool dup = false;
      for (Py_ssize_t j : out) dup = dup || j == slot;
      if (!dup) out.push_back(static_cast<Py_ssize_t>(slot));
    }
  } else {  // the ring overflowed (or was written by a confused peer)
    every = true;
  }
  if (every) {  // what the ring named so far is looked at again with the rest
    out.clear();
    for (Py_ssize_t i = 0; i < a.num; ++i) {
      if (a.u()[i]) out.push_back(i);
    }
  }
}

// slot_done(table, gens, used, seen, max_tp) -> (count, [(slot, [(loader rank, tp), ...]), ...]):
// the ring's count now, and among the slots done_slots names those with a counting mark.
inline PyObject *slot_done(PyObject *, PyObject *const *args, Py_ssize_t n) {
  if (!nargs(n, 5, "slot_done")) return nullptr;
  ExporterArgs a;
  int64_t v[2];
  if (!a.get_all(args, "slot_done") || !int64_args(args, 3, 2, v)) return nullptr;
  const int64_t seen = v[0], max_tp = v[1];
  const int64_t w = ld(a.t() + kHDone);
  std::vector<Py_ssize_t> slots;
  done_slots(a, seen, w, slots);
  PyObject *out = PyList_New(0);
  if (out == nullptr) return nullptr;
  for (Py_ssize_t i : slots) {
    PyObject *marks = slot_marks_of(a, i, max_tp);
    if (marks == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    if (PyList_GET_SIZE(marks) == 0) {
      Py_DECREF(marks);
      continue;
    }
    PyObject *item = Py_BuildValue("(nN)", i, marks);
    if (item == nullptr || PyList_Append(out, item) != 0) {
      Py_XDECREF(item);
      Py_DECREF(out);
      return nullptr;
    }
    Py_DECREF(item);
  }
  return Py_BuildValue("(LN)", static_cast<long long>(w), out);
}

}  // namespace kvx_ctl
