// kvxfer control-path helpers (kvx_ctl.cpp): the exporter's records of its live exports
// (ExportBook, the core of kvxfer.exports.ExportTracker); their Python types are
// export_book_type.h's.
//
//   ExportRecord   one live export: block_ids, groups, num_tokens, deadline, notified_by, marked,
//                  gates, token, digest, gen (what kvxfer/exports.py's pure-Python record holds)
//                  and slot (its lease slot, -1: none). Attributes, read and written by the
//                  tracker's Python as those of the Python record.
//   ExportBook     live (request id -> record) and gone (released id -> (gen, token), oldest
//                  first) as dicts the tracker reads, the refcount and epoch arrays, and, once
//                  attached, the lease-slot table of kvxfer/transports/ipc/slots.py, which it
//                  writes itself:
//     add(request_id, ids, num_tokens, deadline, token, digest, gen, groups, marked, ready)
//         -> the record: the repeat and reused-token checks, the hold, the record, and its slot
//         opened (binding, probe, write), in one call (export_book_export.h: with the ids'
//         checks and the token before it, what export() makes of a plain whole export);
//     release_many(request_ids) -> the ids released: each slot closed before its blocks'
//         epochs move, the release, the id remembered as gone (the newest gone_kept, and up to
//         gone_slack more);
//     take_marks(expected) -> the ids whose count completed (the caller releases them): the
//         done marks loaders wrote since the last look, counted as those loader ranks'
//         notifications (expected(loader_tp, rank): a count, or a str saying that rank may not
//         notify here, asked once per pair and callable);
//     renew(record, deadline) -> whether its lease now ends later (its slot's deadline too);
//     attach(table, gens, used, owner, unready, on_full): the table to follow.
//
// Why native: in Python an export was a record built by __init__, the tracker's add and three
// listener frames down to the slot write, and a done mark the tick's five frames, a callback and
// a release per request; one call each here (profiling/results/2026-11-29-cpu-export-book).
// The table's rules are exporter_slots.h's (this file calls its helpers): only the words loaders
// write are read from the table, each as untrusted input.
//
// Every argument is checked before anything is written. The GIL is held throughout.
//
// Included by kvx_ctl.cpp alone (through export_book_type.h): one translation unit (in its hash).

#pragma once

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>

#include <climits>
#include <cstdint>
#include <vector>

#include "block_ids.h"
#include "ctl_common.h"
#include "exporter_slots.h"
#include "lease_slots.h"

namespace kvx_ctl {

constexpr Py_ssize_t kHReaders = 7;  // header word a loader sets once it reads one-sided
constexpr int64_t kMaxLoaderTp = 256;  // MAX_TP_SIZE of kvxfer/limits.py: a mark's largest tp
constexpr int32_t kWantUnknown = INT32_MIN, kWantRefused = -1;

// A reference held for a scope (taken: `incref`, else the caller's new reference).
struct Ref {
  PyObject *p;
  explicit Ref(PyObject *o, bool incref = true) : p(o) {
    if (incref) Py_XINCREF(p);
  }
  ~Ref() { Py_XDECREF(p); }
  Ref(const Ref &) = delete;
  Ref &operator=(const Ref &) = delete;
};

struct ExportRecord {
  PyObject_HEAD
  PyObject *block_ids, *groups, *token, *digest, *notified_by, *marked, *gates;
  double deadline;
  long long num_tokens, gen, slot;
};

struct ExportBook {
  PyObject_HEAD
  PyObject *live, *gone, *record_type, *rc, *ep;
  // the lease-slot table, once attached (null before)
  PyObject *table, *gens, *used, *owner, *unready, *on_full;
  PyObject *expected;         // the callable whose answers `want` holds
  std::vector<int32_t> *want;  // tp * kMaxDone + rank -> count, kWantRefused, kWantUnknown
  long long seen;              // the ring count taken so far
  Py_ssize_t gone_kept, gone_slack;  // released ids remembered; forgotten this many at a time
  int readers;  // a loader set the table's readers word (kept: the word is anyone's)
};

// --------------------------------------------------------------------------- helpers

inline bool attached(const ExportBook *b) { return b->table != nullptr; }

// The book's refcount and epoch buffers, checked to agree.
inline bool counts(const ExportBook *b, Buf &rc, Buf &ep) {
  if (!get(b->rc, rc, 4, true, "refcount") || !get(b->ep, ep, 8, true, "epochs")) return false;
  if (rc.count() != ep.count()) {
    PyErr_Format(PyExc_ValueError, "ExportBook: epochs has %zd blocks, refcount %zd", ep.count(), rc.count());
    return false;
  }
  return true;
}

inline bool table_args(const ExportBook *b, ExporterArgs &a, const char *name) {
  PyObject *three[] = {b->table, b->gens, b->used};
  return a.get_all(three, name);
}

// Close slot i of the record whose request id is `rid` (before its blocks' epochs move).
inline void close_slot(ExportBook *b, ExporterArgs &a, ExportRecord *r, PyObject *rid) {
  const Py_ssize_t i = static_cast<Py_ssize_t>(r->slot);
  r->slot = -1;
  if (i < 0 || i >= a.num) return;
  clear_slot(a, i);
  PyObject *key = PyLong_FromSsize_t(i);
  if (key == nullptr || PyDict_DelItem(b->owner, key) != 0) PyErr_Clear();  // not there: nothing to forget
  Py_XDECREF(key);
  if (PyDict_DelItem(b->unready, rid) != 0) PyErr_Clear();
}

// A lease's end (monotonic seconds) as the table's nanoseconds: clamped to [0, INT64_MAX] (an
// infinite or NaN one is no cast: undefined behaviour).
inline int64_t deadline_ns(double deadline) {
  const double ns = deadline * 1e9;
  if (!(ns > 0)) return 0;
  return ns >= 9.2e18 ? kInt64Max : static_cast<int64_t>(ns);
}

// Open a slot for record `r` of `rid`, bound to (b0, b1); -1 when the probed ones are all used.
inline Py_ssize_t open_slot(ExportBook *b, ExporterArgs &a, ExportRecord *r, PyObject *rid, int64_t b0, int64_t b1,
                            bool ready, bool layerwise) {
  const int64_t fields[5] = {b0, b1, deadline_ns(r->deadline), ready ? 1 : 0,
                             layerwise ? (kLive | kLayerwise) : kLive};
  const Py_ssize_t i = free_slot(a, b0);
  if (i < 0) return -1;
  PyObject *key = PyLong_FromSsize_t(i);
  if (key == nullptr || PyDict_SetItem(b->owner, key, rid) != 0 || (!ready && PyDict_SetItem(b->unready, rid, key) != 0)) {
    // no room to remember the owner: no slot (its loads take the messaged path)
    if (key != nullptr && PyDict_DelItem(b->owner, key) != 0) PyErr_Clear();
    Py_XDECREF(key);
    PyErr_Clear();
    return -1;
  }
  Py_DECREF(key);
  fill_slot(a, i, fields);
  r->slot = i;
  return i;
}

// What expected(tp, rank) answered (asked once per pair and callable): a count, kWantRefused,
// or kWantUnknown with an error set.
inline int32_t want_of(ExportBook *b, PyObject *expected, int64_t tp, Py_ssize_t rank) {
  if (expected != b->expected) {  // another callable: its answers may differ
    b->want->assign(static_cast<size_t>((kMaxLoaderTp + 1) * kMaxDone), kWantUnknown);  // may throw: first
    Py_INCREF(expected);
    Py_XSETREF(b->expected, expected);
  }
  const size_t at = static_cast<size_t>(tp * kMaxDone + rank);
  if ((*b->want)[at] != kWantUnknown) return (*b->want)[at];
  PyObject *got = PyObject_CallFunction(expected, "Ln", static_cast<long long>(tp), rank);
  if (got == nullptr) return kWantUnknown;
  int32_t w;
  if (PyUnicode_Check(got)) {
    w = kWantRefused;
  } else if (PyLong_Check(got)) {
    const long v = PyLong_AsLong(got);
    if (v < 0 || v > INT32_MAX) {
      if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "expected: %ld notifications is out of range", v);
      Py_DECREF(got);
      return kWantUnknown;
    }
    w = static_cast<int32_t>(v);
  } else {
    PyErr_Format(PyExc_TypeError, "expected: must return an int or a str, got %s", Py_TYPE(got)->tp_name);
    Py_DECREF(got);
    return kWantUnknown;
  }
  Py_DECREF(got);
  // kept only while that callable is the cached one (the call may have run take_marks with another)
  if (b->expected == expected) (*b->want)[at] = w;
  return w;
}

// Count loader rank `rank`'s notification of record `r` against `want` (a sender counts once
// per expected count: exports.py's _counted); 1 when this one completed the count, 0 when not,
// -1 with an error set.
inline int counted(ExportRecord *r, Py_ssize_t rank, int32_t want) {
  if (r->notified_by == nullptr || !PyDict_Check(r->notified_by)) {
    PyErr_SetString(PyExc_TypeError, "ExportRecord.notified_by: must be a dict");
    return -1;
  }
  PyObject *key = PyLong_FromLong(want);
  if (key == nullptr) return -1;
  PyObject *seen = PyDict_GetItemWithError(r->notified_by, key);  // borrowed
  if (seen == nullptr) {
    if (PyErr_Occurred()) {
      Py_DECREF(key);
      return -1;
    }
    seen = PySet_New(nullptr);
    const bool ok = seen != nullptr && PyDict_SetItem(r->notified_by, key, seen) == 0;
    Py_XDECREF(seen);  // the dict holds it
    if (!ok) {
      Py_DECREF(key);
      return -1;
    }
  }
  Py_DECREF(key);
  if (!PyAnySet_Check(seen)) {
    PyErr_SetString(PyExc_TypeError, "ExportRecord.notified_by: its values must be sets");
    return -1;
  }
  PyObject *sender = PyLong_FromSsize_t(rank);
  if (sender == nullptr) return -1;
  const int has = PySet_Contains(seen, sender);
  if (has != 0) {
    Py_DECREF(sender);
    return has < 0 ? -1 : 0;
  }
  const int added = PySet_Add(seen, sender);
  Py_DECREF(sender);
  if (added != 0) return -1;
  return PySet_GET_SIZE(seen) >= want ? 1 : 0;
}

// Remember `rid` released with generation `gen` and `token`, newest last; forget the oldest
// beyond gone_kept.
inline bool remember_gone(ExportBook *b, PyObject *rid, long long gen, PyObject *token) {
  if (PyDict_DelItem(b->gone, rid) != 0) PyErr_Clear();  // re-inserted last: forgotten last
  PyObject *was = Py_BuildValue("(LO)", gen, token != nullptr ? token : Py_None);
  if (was == nullptr) return false;
  const bool ok = PyDict_SetItem(b->gone, rid, was) == 0;
  Py_DECREF(was);
  return ok;
}

// Forget the oldest released ids beyond gone_kept, in batches once gone_slack more were released
// (exports.py's GONE_SLACK): a dict finds its oldest key by scanning past those deleted before
// it, so one forgotten per release cost every release that scan.
inline bool trim_gone(ExportBook *b) {
  const Py_ssize_t size = PyDict_GET_SIZE(b->gone);
  if (size <= b->gone_kept + b->gone_slack) return true;
  Ref old(PyList_New(0), false);
  if (old.p == nullptr) return false;
  Py_ssize_t pos = 0;
  PyObject *k, *v;
  for (Py_ssize_t j = size - b->gone_kept; j > 0 && PyDict_Next(b->gone, &pos, &k, &v); --j) {
    if (PyList_Append(old.p, k) != 0) return false;
  }
  for (Py_ssize_t j = 0, m = PyList_GET_SIZE(old.p); j < m; ++j) {
    if (PyDict_DelItem(b->gone, PyList_GET_ITEM(old.p, j)) != 0) return false;
  }
  return true;
}

// Release the live exports of `rids` (a list): their slots closed, one holder less of each
// block (epochs moved where none is left), remembered as gone. An id not live is skipped. The
// ids released, or NULL with an error set; every fallible step of an id comes before its first
// write, so an error leaves that id live (and those before it released and lost to the report:
// only an allocation failure or a record whose ids are no longer its own gets there). What goes
// wrong remembering ids as gone is reported unraisable: the releases stand.
inline PyObject *release_list(ExportBook *b, PyObject *rids) {
  Buf rc, ep;
  if (!counts(b, rc, ep)) return nullptr;
  ExporterArgs a;
  const bool slots = attached(b);
  if (slots && !table_args(b, a, "ExportBook.release_many")) return nullptr;
  Ref out(PyList_New(0), false);
  if (out.p == nullptr) return nullptr;
  for (Py_ssize_t j = 0, m = PyList_GET_SIZE(rids); j < m; ++j) {
    Ref rid(PyList_GET_ITEM(rids, j));  // the list may lose it while the dicts change
    Ref rec(PyDict_GetItemWithError(b->live, rid.p));
    if (rec.p == nullptr) {
      if (PyErr_Occurred()) return nullptr;
      continue;
    }
    ExportRecord *r = reinterpret_cast<ExportRecord *>(rec.p);
    Buf ids;
    if (r->block_ids == nullptr || !get(r->block_ids, ids, 8, false, "block_ids") ||
        !ids_in_range(ids, rc.count(), "release")) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "release: the record has no block_ids");
      return nullptr;
    }
    if (overlap(rc, ids) || overlap(ep, ids)) {
      return PyErr_Format(PyExc_ValueError, "release: block_ids share memory with refcount or epochs");
    }
    const int64_t *x = static_cast<const int64_t *>(ids.view.buf);
    const Py_ssize_t k = ids.count();
    Seen seen(k, static_cast<uint64_t>(rc.count()));  // allocated before any write: the loop below cannot throw
    if (PyList_Append(out.p, rid.p) != 0 || PyDict_DelItem(b->live, rid.p) != 0) return nullptr;
    if (slots) close_slot(b, a, r, rid.p);  // before the epochs move (kvxfer.transports.ipc.slots)
    release_seen(seen, static_cast<int32_t *>(rc.view.buf), static_cast<int64_t *>(ep.view.buf), x, k);
    if (!remember_gone(b, rid.p, r->gen, r->token)) PyErr_WriteUnraisable(rid.p);
  }
  if (!trim_gone(b)) PyErr_WriteUnraisable(b->gone);
  Py_INCREF(out.p);
  return out.p;
}

// --------------------------------------------------------------------------- the methods

// Whether `rid` may be added with `token`: 1; 0 when it is live, or `token` (non-empty) is that
// of its last release (ValueError set naming which, as exports.py's add raises it); -1 on error.
inline int may_add(ExportBook *b, PyObject *rid, PyObject *token) {
  const int dup = PyDict_Contains(b->live, rid);
  if (dup < 0) return -1;
  if (dup) {
    PyErr_Format(PyExc_ValueError, "request_id: %R is already exported and not yet released", rid);
    return 0;
  }
  if (PyUnicode_GET_LENGTH(token) > 0) {
    PyObject *was = PyDict_GetItemWithError(b->gone, rid);
    if (was == nullptr && PyErr_Occurred()) return -1;
    if (was != nullptr && PyTuple_Check(was) && PyTuple_GET_SIZE(was) == 2) {
      const int same = PyObject_RichCompareBool(PyTuple_GET_ITEM(was, 1), token, Py_EQ);
      if (same < 0) return -1;
      if (same) {
        PyErr_Format(PyExc_ValueError,
                     "token: already used by an earlier export of %R (released); each export needs a token of "
                     "its own",
                     rid);
        return 0;
      }
    }
  }
  return 1;
}

// The add of a record that may_add allowed: the hold of `ids_obj` (8-byte ids), the record
// (holding every object given), its slot opened (a table followed, a token, a loader reading
// one-sided, a binding). The record (new reference), or NULL with an error set and nothing
// written.
inline PyObject *add_record(ExportBook *b, PyObject *rid, PyObject *ids_obj, long long num_tokens, double deadline,
                            PyObject *token, PyObject *digest, long long gen, PyObject *groups, PyObject *marked,
                            bool ready) {
  Buf rc, ep, ids;
  if (!counts(b, rc, ep) || !get(ids_obj, ids, 8, false, "ids")) return nullptr;
  if (overlap(rc, ids)) return PyErr_Format(PyExc_ValueError, "hold: ids share memory with refcount");
  if (!ids_in_range(ids, rc.count(), "hold")) return nullptr;
  // the slot: a table followed, a token, a loader reading one-sided, a binding (a request id
  // with no UTF-8 has none: no loader finds it either)
  ExporterArgs a;
  bool slot = attached(b) && PyUnicode_GET_LENGTH(token) > 0 && PyUnicode_Check(rid);
  if (slot && !table_args(b, a, "ExportBook.add")) return nullptr;
  if (slot && !b->readers) b->readers = ld(a.t() + kHReaders) != 0;
  slot = slot && b->readers;
  int64_t b0 = 0, b1 = 0;
  if (slot) {
    Buf dg;
    if (!get(digest, dg, 0, false, "digest")) return nullptr;
    if (!bind_words(token, dg, rid, b0, b1)) {
      if (!PyErr_ExceptionMatches(PyExc_ValueError)) return nullptr;
      PyErr_Clear();
      slot = false;
    }
  }
  PyTypeObject *rt = reinterpret_cast<PyTypeObject *>(b->record_type);
  ExportRecord *r = reinterpret_cast<ExportRecord *>(rt->tp_alloc(rt, 0));
  if (r == nullptr) return nullptr;
  r->notified_by = PyDict_New();
  r->gates = PyList_New(0);
  if (r->notified_by == nullptr || r->gates == nullptr) {
    Py_DECREF(r);
    return nullptr;
  }
  PyObject *given[] = {ids_obj, groups, token, digest, marked};
  for (PyObject *o : given) Py_INCREF(o);
  r->block_ids = ids_obj, r->groups = groups, r->token = token, r->digest = digest, r->marked = marked;
  r->deadline = deadline, r->num_tokens = num_tokens, r->gen = gen, r->slot = -1;
  int32_t *counts_of = static_cast<int32_t *>(rc.view.buf);
  const int64_t *x = static_cast<const int64_t *>(ids.view.buf);
  hold_ids(counts_of, rc.count(), x, ids.count());
  if (PyDict_SetItem(b->live, rid, reinterpret_cast<PyObject *>(r)) != 0) {
    unhold_ids(counts_of, rc.count(), x, ids.count());
    Py_DECREF(r);
    return nullptr;
  }
  if (slot && open_slot(b, a, r, rid, b0, b1, ready, marked != Py_None) < 0 && b->on_full != Py_None) {
    PyObject *said = PyObject_CallOneArg(b->on_full, rid);  // logged there, once
    if (said == nullptr) PyErr_WriteUnraisable(b->on_full);
    Py_XDECREF(said);
  }
  return reinterpret_cast<PyObject *>(r);
}

// add(request_id, ids, num_tokens, deadline, token, digest, gen, groups, marked, ready) -> record
inline PyObject *xbook_add(ExportBook *b, PyObject *const *args, Py_ssize_t n) {
  if (!nargs(n, 10, "ExportBook.add")) return nullptr;
  PyObject *rid = args[0], *token = args[4], *digest = args[5];
  const long long num_tokens = PyLong_AsLongLong(args[2]);
  const double deadline = PyFloat_AsDouble(args[3]);
  const long long gen = PyLong_AsLongLong(args[6]);
  const int ready = PyObject_IsTrue(args[9]);
  if (PyErr_Occurred() || ready < 0) return nullptr;
  if (!PyUnicode_Check(token) || !PyBytes_Check(digest)) {
    return PyErr_Format(PyExc_TypeError, "ExportBook.add: token must be str and digest bytes, got %s and %s",
                        Py_TYPE(token)->tp_name, Py_TYPE(digest)->tp_name);
  }
  if (may_add(b, rid, token) <= 0) return nullptr;
  return add_record(b, rid, args[1], num_tokens, deadline, token, digest, gen, args[7], args[8], ready != 0);
}

// release_many(request_ids) -> the ids released (see release_list)
inline PyObject *xbook_release_many(ExportBook *b, PyObject *const *args, Py_ssize_t n) {
  if (!nargs(n, 1, "ExportBook.release_many")) return nullptr;
  PyObject *rids = PySequence_List(args[0]);  // a copy: a caller's list may change meanwhile
  if (rids == nullptr) return nullptr;
  PyObject *out = release_list(b, rids);
  Py_DECREF(rids);
  return out;
}

// Whether the done marks in slot i complete the count of the export that owns it (appended to
// `done` then); false when none does, or with an error set (then `err`).
inline bool slot_landed(ExportBook *b, const ExporterArgs &a, Py_ssize_t i, PyObject *expected, PyObject *done,
                        bool &err) {
  PyObject *key = PyLong_FromSsize_t(i);
  if (key == nullptr) return err = true, false;
  PyObject *rid = PyDict_GetItemWithError(b->owner, key);
  Py_DECREF(key);
  PyObject *rec = rid != nullptr ? PyDict_GetItemWithError(b->live, rid) : nullptr;
  if (rec == nullptr) return err = PyErr_Occurred() != nullptr, false;
  // held while expected() runs: what it does cannot free them under this loop
  Ref hold_rid(rid), hold_rec(rec);
  ExportRecord *r = reinterpret_cast<ExportRecord *>(rec);
  const int64_t *s = a.t() + kHeader + i * kSlot + kDone;
  const int64_t g = a.g()[i];
  bool landed = false;
  for (Py_ssize_t d = 0; d < kMaxDone; ++d) {
    int64_t tp;
    if (!counting_mark(ld(s + d), g, d, kMaxLoaderTp, tp)) continue;
    const int32_t want = want_of(b, expected, tp, d);
    if (want == kWantUnknown) return err = true, false;
    if (want == kWantRefused) continue;
    // a lone loader rank's mark: nothing to count
    if (want == 1 && PyDict_Check(r->notified_by) && PyDict_GET_SIZE(r->notified_by) == 0) {
      landed = true;
      continue;
    }
    const int c = counted(r, d, want);
    if (c < 0) return err = true, false;
    landed = landed || c == 1;
  }
  if (landed && PyList_Append(done, rid) != 0) return err = true, false;
  return landed;
}

// take_marks(expected) -> the ids whose count the done marks since the last look completed
inline PyObject *xbook_take_marks(ExportBook *b, PyObject *const *args, Py_ssize_t n) {
  if (!nargs(n, 1, "ExportBook.take_marks")) return nullptr;
  PyObject *expected = args[0];
  if (!PyCallable_Check(expected)) return PyErr_Format(PyExc_TypeError, "take_marks: expected must be callable");
  if (!attached(b)) return PyList_New(0);
  ExporterArgs a;
  if (!table_args(b, a, "ExportBook.take_marks")) return nullptr;
  const int64_t w = ld(a.t() + kHDone);
  if (w == b->seen) return PyList_New(0);
  std::vector<Py_ssize_t> slots;
  done_slots(a, b->seen, w, slots);
  b->seen = w;
  Ref done(PyList_New(0), false);
  if (done.p == nullptr) return nullptr;
  bool err = false;
  for (Py_ssize_t i : slots) {
    slot_landed(b, a, i, expected, done.p, err);
    if (err) return nullptr;
  }
  Py_INCREF(done.p);
  return done.p;
}

// renew(record, deadline) -> whether the lease now ends at `deadline` (it ended earlier)
inline PyObject *xbook_renew(ExportBook *b, PyObject *const *args, Py_ssize_t n) {
  if (!nargs(n, 2, "ExportBook.renew")) return nullptr;
  if (!PyObject_TypeCheck(args[0], reinterpret_cast<PyTypeObject *>(b->record_type))) {
    return PyErr_Format(PyExc_TypeError, "renew: an ExportRecord, got %s", Py_TYPE(args[0])->tp_name);
  }
  const double deadline = PyFloat_AsDouble(args[1]);
  if (deadline == -1.0 && PyErr_Occurred()) return nullptr;
  ExportRecord *r = reinterpret_cast<ExportRecord *>(args[0]);
  if (!(r->deadline < deadline)) Py_RETURN_FALSE;
  r->deadline = deadline;
  if (r->slot >= 0 && attached(b)) {
    ExporterArgs a;
    if (!table_args(b, a, "ExportBook.renew")) return nullptr;
    if (r->slot < a.num) st(a.t() + kHeader + r->slot * kSlot + kDeadline, deadline_ns(deadline));
  }
  Py_RETURN_TRUE;
}

// attach(table, gens, used, owner, unready, on_full): follow this lease-slot table
inline PyObject *xbook_attach(ExportBook *b, PyObject *const *args, Py_ssize_t n) {
  if (!nargs(n, 6, "ExportBook.attach")) return nullptr;
  ExporterArgs a;
  if (!a.get_all(args, "ExportBook.attach")) return nullptr;
  if (!PyDict_CheckExact(args[3]) || !PyDict_CheckExact(args[4]) ||
      (args[5] != Py_None && !PyCallable_Check(args[5]))) {
    return PyErr_Format(PyExc_TypeError, "attach: owner and unready must be dicts, on_full callable or None");
  }
  if (attached(b)) return PyErr_Format(PyExc_ValueError, "attach: a lease-slot table is already followed");
  for (Py_ssize_t i = 0; i < 6; ++i) Py_INCREF(args[i]);
  b->table = args[0], b->gens = args[1], b->used = args[2], b->owner = args[3], b->unready = args[4];
  b->on_full = args[5];
  b->seen = 0;
  b->readers = 0;
  Py_RETURN_NONE;
}

}  // namespace kvx_ctl
