// kvxfer control-path helpers (kvx_ctl.cpp): the exporter's answers to a loader's lease grant
// request and its notification, for the common message, in one call each (ExportBook methods;
// kvxfer/exporter.py's handlers call them through kvxfer/exports.py's ExportTracker):
//
//   grant(request_ids, tokens, digests, deadline) -> [epochs per id] or None
//       every id live, its token and content digest exactly its export's, a whole export (not
//       layer-wise): each lease renewed to `deadline` (its slot's deadline too) and its blocks'
//       epochs snapshot (native int64 bytes), in request order. None when any id is not such
//       a request, before anything is written: the tracker's Python grant then answers every
//       case (unknown, released, forged, altered, another export, layer-wise) with its reason.
//   notify(request_ids, tokens, rank, tp, expected) -> the ids whose count completed, or None
//       every id live and its token exactly its export's, and loader rank `rank` of a `tp`-rank
//       loader allowed to notify here (expected(tp, rank), the callable take_marks asks, its
//       answers cached with the done marks'): each counted as that rank's notification (a
//       sender counts once per expected count, as exports.py's counted). None when any id or
//       the sender is not such, before anything is counted (the Python path says why).
//
// Why native: the Python grant and notification handlers walked each id through a verification
// generator, a renewal call and a snapshot call; here one loop (profiling/results/
// 2026-11-29-cpu-messaged-native).
//
// Token comparison takes time independent of where two tokens of equal length differ (as
// hmac.compare_digest). Included by export_book_type.h alone.

#pragma once

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>

#include "ctl_common.h"
#include "export_book.h"

namespace kvx_ctl {

// Whether the str `given` is ASCII and equal to the record's token (a str), compared without an
// early exit.
inline bool token_matches(PyObject *given, PyObject *own) {
  if (!PyUnicode_IS_ASCII(given) || own == nullptr || !PyUnicode_Check(own) || !PyUnicode_IS_ASCII(own)) {
    return false;
  }
  const Py_ssize_t k = PyUnicode_GET_LENGTH(own);
  if (PyUnicode_GET_LENGTH(given) != k) return false;
  const unsigned char *a = PyUnicode_1BYTE_DATA(given), *b = PyUnicode_1BYTE_DATA(own);
  unsigned char diff = 0;
  for (Py_ssize_t i = 0; i < k; ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

// The live record of `rid` whose token (and digest, unless `digest` is null) are the given ones
// exactly (borrowed), or null (with an error set only when a lookup failed).
inline ExportRecord *verified(ExportBook *b, PyObject *rid, PyObject *token, PyObject *digest) {
  PyObject *rec = PyDict_GetItemWithError(b->live, rid);
  if (rec == nullptr) return nullptr;
  ExportRecord *r = reinterpret_cast<ExportRecord *>(rec);
  if (!token_matches(token, r->token)) return nullptr;
  if (digest == nullptr) return r;
  if (r->digest == nullptr || !PyBytes_Check(r->digest)) return nullptr;
  const Py_ssize_t k = PyBytes_GET_SIZE(digest);
  if (PyBytes_GET_SIZE(r->digest) != k || std::memcmp(PyBytes_AS_STRING(digest), PyBytes_AS_STRING(r->digest), k)) {
    return nullptr;
  }
  return r;
}

// Copies of the lists `given` (each held: a caller's list may change while Python runs) when they
// are lists of one length n >= 1 whose items are exactly str (bytes for `bytes_at`, -1: none),
// as a decoded message's are; false otherwise, or with an error set when a copy failed.
template <size_t N>
inline bool held_lists(PyObject *const (&given)[N], Ref (&out)[N], Py_ssize_t bytes_at, Py_ssize_t &n) {
  for (size_t j = 0; j < N; ++j) {
    if (!PyList_CheckExact(given[j])) return false;
  }
  n = PyList_GET_SIZE(given[0]);
  if (n < 1) return false;
  for (size_t j = 0; j < N; ++j) {
    out[j].p = PyList_GetSlice(given[j], 0, PY_SSIZE_T_MAX);
    if (out[j].p == nullptr) return false;
    if (PyList_GET_SIZE(out[j].p) != n) return false;
    const bool bytes = static_cast<Py_ssize_t>(j) == bytes_at;
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject *o = PyList_GET_ITEM(out[j].p, i);
      if (bytes ? !PyBytes_CheckExact(o) : !PyUnicode_CheckExact(o)) return false;
    }
  }
  return true;
}

// grant(request_ids, tokens, digests, deadline) -> [epochs bytes per id] or None (see above)
inline PyObject *xbook_grant(ExportBook *b, PyObject *const *args, Py_ssize_t n) {
  if (!nargs(n, 4, "ExportBook.grant")) return nullptr;
  const double deadline = PyFloat_AsDouble(args[3]);
  if (deadline == -1.0 && PyErr_Occurred()) return nullptr;
  Py_ssize_t k = 0;
  PyObject *const given[3] = {args[0], args[1], args[2]};
  Ref l[3] = {Ref(nullptr), Ref(nullptr), Ref(nullptr)};
  if (!held_lists(given, l, 2, k)) {
    if (PyErr_Occurred()) return nullptr;
    Py_RETURN_NONE;
  }
  Buf rc, ep;
  if (!counts(b, rc, ep)) return nullptr;
  Ref recs(PyList_New(k), false);  // the records, held: the second pass writes nothing else
  if (recs.p == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < k; ++i) {
    ExportRecord *r = verified(b, PyList_GET_ITEM(l[0].p, i), PyList_GET_ITEM(l[1].p, i), PyList_GET_ITEM(l[2].p, i));
    if (r == nullptr) {
      if (PyErr_Occurred()) return nullptr;
      Py_RETURN_NONE;
    }
    if (r->marked != Py_None) Py_RETURN_NONE;  // layer-wise: the Python grant gives its layers
    Py_INCREF(r);
    PyList_SET_ITEM(recs.p, i, reinterpret_cast<PyObject *>(r));
  }
  Ref out(PyList_New(k), false);
  if (out.p == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < k; ++i) {  // every fallible step before the first renewal
    ExportRecord *r = reinterpret_cast<ExportRecord *>(PyList_GET_ITEM(recs.p, i));
    Buf ids;
    if (r->block_ids == nullptr || !get(r->block_ids, ids, 8, false, "block_ids") ||
        !ids_in_range(ids, ep.count(), "grant")) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "grant: the record has no block_ids");
      return nullptr;
    }
    PyObject *snap = epochs_bytes(ep, ids);
    if (snap == nullptr) return nullptr;
    PyList_SET_ITEM(out.p, i, snap);
  }
  ExporterArgs a;  // the table, got before the first renewal (when any record has a slot)
  bool slots = false;
  for (Py_ssize_t i = 0; i < k && attached(b) && !slots; ++i) {
    slots = reinterpret_cast<ExportRecord *>(PyList_GET_ITEM(recs.p, i))->slot >= 0;
  }
  if (slots && !table_args(b, a, "ExportBook.grant")) return nullptr;
  const int64_t ns = deadline_ns(deadline);
  for (Py_ssize_t i = 0; i < k; ++i) {
    ExportRecord *r = reinterpret_cast<ExportRecord *>(PyList_GET_ITEM(recs.p, i));
    if (!(r->deadline < deadline)) continue;
    r->deadline = deadline;
    if (slots && r->slot >= 0 && r->slot < a.num) st(a.t() + kHeader + r->slot * kSlot + kDeadline, ns);
  }
  Py_INCREF(out.p);
  return out.p;
}

// notify(request_ids, tokens, rank, tp, expected) -> the ids whose count completed, or None
inline PyObject *xbook_notify(ExportBook *b, PyObject *const *args, Py_ssize_t n) {
  if (!nargs(n, 5, "ExportBook.notify")) return nullptr;
  const Py_ssize_t rank = PyLong_AsSsize_t(args[2]);
  if (rank == -1 && PyErr_Occurred()) return nullptr;
  const long long tp = PyLong_AsLongLong(args[3]);
  if (tp == -1 && PyErr_Occurred()) return nullptr;
  PyObject *expected = args[4];
  if (!PyCallable_Check(expected)) return PyErr_Format(PyExc_TypeError, "notify: expected must be callable");
  if (tp < 1 || tp > kMaxLoaderTp || rank < 0 || rank >= kMaxDone || rank >= tp) Py_RETURN_NONE;
  Py_ssize_t k = 0;
  PyObject *const given[2] = {args[0], args[1]};
  Ref l[2] = {Ref(nullptr), Ref(nullptr)};  // the ids, held: expected() runs Python below
  if (!held_lists(given, l, -1, k)) {
    if (PyErr_Occurred()) return nullptr;
    Py_RETURN_NONE;
  }
  Ref recs(PyList_New(k), false);
  if (recs.p == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < k; ++i) {
    ExportRecord *r = verified(b, PyList_GET_ITEM(l[0].p, i), PyList_GET_ITEM(l[1].p, i), nullptr);
    if (r == nullptr) {
      if (PyErr_Occurred()) return nullptr;
      Py_RETURN_NONE;
    }
    Py_INCREF(r);
    PyList_SET_ITEM(recs.p, i, reinterpret_cast<PyObject *>(r));
  }
  const int32_t want = want_of(b, expected, tp, rank);  // may run Python: the records are held
  if (want == kWantUnknown) return nullptr;
  if (want == kWantRefused) Py_RETURN_NONE;
  Ref done(PyList_New(0), false);
  if (done.p == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < k; ++i) {
    const int c = counted(reinterpret_cast<ExportRecord *>(PyList_GET_ITEM(recs.p, i)), rank, want);
    if (c < 0) return nullptr;
    if (c == 1 && PyList_Append(done.p, PyList_GET_ITEM(l[0].p, i)) != 0) return nullptr;
  }
  Py_INCREF(done.p);
  return done.p;
}

}  // namespace kvx_ctl
