// kvxfer control-path helpers (kvx_ctl.cpp): the loads in flight on a loader rank (LoadBook).
//
// LoadBook is kvxfer.completion.LoadTracker in C, with the same methods and reports (add,
// pending, finish, finish_many, finish_one, fail, drain: each load reported once, finished or
// failed). It also holds the records of the one-sided loads of the native lane
// (kvxfer/transports/ipc/lane.py): their methods are in load_lane.h, the Python type that
// binds both in load_book_type.h.
//
// Every method holds the GIL throughout but complete()'s calls of event_done (an event query
// may let other threads run; the flights it checks are out of the book meanwhile): each call is
// atomic for Python threads, so the Python tracker's lock has no counterpart here.
//
// Included by kvx_ctl.cpp alone (through load_book_type.h): the module is one translation unit
// (in its hash).

#pragma once

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "ctl_common.h"

namespace kvx_ctl {

constexpr Py_ssize_t kLaneSize = 15;

// A lane's fields (borrowed from its tuple).
struct Lane {
  PyObject *target, *tables, *epochs, *marks, *host, *peer;
  bool marks_all;
  PyObject *block_size_o, *num_blocks_o;
  long long port, tp, block_size, num_blocks, local_block_size, local_num_blocks, per_token, calls;
};

inline bool lane_of(PyObject *lane, Lane &l) {
  if (!PyTuple_CheckExact(lane) || PyTuple_GET_SIZE(lane) != kLaneSize) {
    PyErr_Format(PyExc_TypeError, "LoadBook: lane must be a tuple of %zd, got %s", kLaneSize, Py_TYPE(lane)->tp_name);
    return false;
  }
  l.target = PyTuple_GET_ITEM(lane, 0), l.tables = PyTuple_GET_ITEM(lane, 1), l.epochs = PyTuple_GET_ITEM(lane, 2);
  l.marks = PyTuple_GET_ITEM(lane, 3), l.host = PyTuple_GET_ITEM(lane, 4);
  l.block_size_o = PyTuple_GET_ITEM(lane, 7), l.num_blocks_o = PyTuple_GET_ITEM(lane, 8);
  l.marks_all = PyTuple_GET_ITEM(lane, 13) == Py_True, l.peer = PyTuple_GET_ITEM(lane, 14);
  long long *ints[] = {&l.port, &l.tp, &l.block_size, &l.num_blocks, &l.local_block_size, &l.local_num_blocks,
                       &l.per_token, &l.calls};
  const Py_ssize_t at[] = {5, 6, 7, 8, 9, 10, 11, 12};
  for (int i = 0; i < 8; ++i) {
    *ints[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(lane, at[i]));
    if (*ints[i] == -1 && PyErr_Occurred()) return false;
  }
  if (!PyUnicode_CheckExact(l.host) || l.local_block_size < 1 || l.local_num_blocks < 1) {
    PyErr_SetString(PyExc_ValueError, "LoadBook: lane host must be a str, local block size and count >= 1");
    return false;
  }
  return true;
}

// A reference released when it goes out of scope.
struct Held {
  PyObject *o;
  explicit Held(PyObject *obj) : o(obj) {}
  Held(const Held &) = delete;
  Held &operator=(const Held &) = delete;
  ~Held() { Py_XDECREF(o); }
};

// One one-sided load in flight (its references owned: flight_release).
struct Flight {
  PyObject *rid, *key, *lane, *src, *reads, *token, *prid;
  PyObject *event;  // nullptr until launched(); then the event or None
  int64_t b0, b1, num_tokens, calls;  // calls: -1 until launched() says (the lane's then)
  double start, deadline;
  bool late;
};

inline void flight_release(Flight &f) {
  PyObject *held[] = {f.rid, f.key, f.lane, f.src, f.reads, f.token, f.prid, f.event};
  for (PyObject *o : held) Py_XDECREF(o);
  f = Flight{};
}

struct LoadBook {
  PyObject_HEAD
  PyObject *pending;  // request id -> (local ids, start)
  PyObject *done;     // request ids finished since the last drain
  PyObject *failed;   // request id -> local ids (a list), since the last drain
  PyObject *errors;   // request id -> why
  PyObject *active;   // (engine id, params request id) of one-sided loads in flight (shared)
  PyObject *limits;   // params_fields' limits
  PyObject *frombuffer, *dtype;  // numpy.frombuffer and int64: an id buffer as an array
  PyObject *stale_ns;            // an exporter silent this long is not read (int)
  PyObject *targets;             // engine id -> the target whose `lane` its loads read through
  std::vector<Flight> *flights;
  // What complete() reported, once record_into() was given the latencies' deque (load_lane.h):
  // wire bytes, ops calls, loads landed, their latencies summed, and busy time (the union of
  // the reports' [start, end], as kvxfer.metrics.Metrics keeps its own).
  PyObject *latencies;  // a deque the landed loads' latencies are appended to (null: not recorded)
  long long lane_bytes, lane_calls, lane_transfers;
  double lane_latency_sum, lane_busy_closed, span_start, span_end;  // span_end < span_start: none
};

// `ids` (a pending entry's local ids: an array or a sequence) as a new list.
inline PyObject *ids_list(PyObject *ids) {
  if (PyList_Check(ids) || PyTuple_Check(ids)) return PySequence_List(ids);
  return PyObject_CallMethod(ids, "tolist", nullptr);
}

// Pop `rid` from the pending loads: a new reference to its entry, nullptr when not pending (no
// error) or on an error (raised).
inline PyObject *pop_pending(LoadBook *b, PyObject *rid) {
  PyObject *e = PyDict_GetItemWithError(b->pending, rid);
  if (e == nullptr) return nullptr;
  Py_INCREF(e);
  if (PyDict_DelItem(b->pending, rid) != 0) {
    Py_DECREF(e);
    return nullptr;
  }
  return e;
}

// Finish `rid` at `end`: 1 and its latency when it was pending, 0 when not, -1 on an error.
inline int finish_rid(LoadBook *b, PyObject *rid, double end, double &latency) {
  PyObject *e = pop_pending(b, rid);
  if (e == nullptr) return PyErr_Occurred() ? -1 : 0;
  latency = end - PyFloat_AsDouble(PyTuple_GET_ITEM(e, 1));
  Py_DECREF(e);
  if (PyErr_Occurred()) return -1;
  return PySet_Add(b->done, rid) == 0 ? 1 : -1;
}

// Fail `rid` with `why`: 1 when it was pending, 0 when not, -1 on an error.
inline int fail_rid(LoadBook *b, PyObject *rid, PyObject *why) {
  PyObject *e = pop_pending(b, rid);
  if (e == nullptr) return PyErr_Occurred() ? -1 : 0;
  PyObject *ids = ids_list(PyTuple_GET_ITEM(e, 0));
  Py_DECREF(e);
  if (ids == nullptr) return -1;
  const int r = PyDict_SetItem(b->failed, rid, ids) == 0 && PyDict_SetItem(b->errors, rid, why) == 0 ? 1 : -1;
  Py_DECREF(ids);
  return r;
}

// ------------------------------------------------------------------------------ the tracker

inline PyObject *book_add(PyObject *self, PyObject *const *args, Py_ssize_t n) {
  LoadBook *b = reinterpret_cast<LoadBook *>(self);
  if (!nargs(n, 3, "LoadBook.add")) return nullptr;
  const int has = PyDict_Contains(b->pending, args[0]);
  if (has < 0) return nullptr;
  if (has) return PyErr_Format(PyExc_ValueError, "request_id: %R is already being loaded", args[0]);
  PyObject *start = PyNumber_Float(args[2]);
  if (start == nullptr) return nullptr;
  PyObject *e = PyTuple_Pack(2, args[1], start);
  Py_DECREF(start);
  if (e == nullptr) return nullptr;
  const int r = PyDict_SetItem(b->pending, args[0], e);
  Py_DECREF(e);
  if (r != 0) return nullptr;
  Py_RETURN_NONE;
}

inline PyObject *book_pending(PyObject *self, PyObject *) {
  return PyLong_FromSsize_t(PyDict_GET_SIZE(reinterpret_cast<LoadBook *>(self)->pending));
}

inline PyObject *book_finish_many(PyObject *self, PyObject *const *args, Py_ssize_t n) {
  LoadBook *b = reinterpret_cast<LoadBook *>(self);
  if (n != 1 && n != 2) return PyErr_Format(PyExc_TypeError, "LoadBook.finish_many takes 1 or 2 arguments, got %zd", n);
  const double end = n == 2 ? PyFloat_AsDouble(args[1]) : 0.0;
  if (end == -1.0 && PyErr_Occurred()) return nullptr;
  // a tuple of its own: the lookups run each id's __hash__ / __eq__, which may change the caller's list
  PyObject *seq = PySequence_Tuple(args[0]);
  if (seq == nullptr) return nullptr;
  PyObject *out = PyList_New(0);
  for (Py_ssize_t i = 0, k = PyTuple_GET_SIZE(seq); out != nullptr && i < k; ++i) {
    double lat = 0;
    const int got = finish_rid(b, PyTuple_GET_ITEM(seq, i), end, lat);
    PyObject *f = got > 0 ? PyFloat_FromDouble(lat) : nullptr;
    if (got < 0 || (got > 0 && (f == nullptr || PyList_Append(out, f) != 0))) Py_CLEAR(out);
    Py_XDECREF(f);
  }
  Py_DECREF(seq);
  return out;
}

inline PyObject *book_finish(PyObject *self, PyObject *const *args, Py_ssize_t n) {
  if (!nargs(n, 1, "LoadBook.finish")) return nullptr;
  double lat = 0;
  const int got = finish_rid(reinterpret_cast<LoadBook *>(self), args[0], 0.0, lat);
  if (got < 0) return nullptr;
  return PyBool_FromLong(got);
}

inline PyObject *book_finish_one(PyObject *self, PyObject *const *args, Py_ssize_t n) {
  if (!nargs(n, 2, "LoadBook.finish_one")) return nullptr;
  const double end = PyFloat_AsDouble(args[1]);
  if (end == -1.0 && PyErr_Occurred()) return nullptr;
  double lat = 0;
  const int got = finish_rid(reinterpret_cast<LoadBook *>(self), args[0], end, lat);
  if (got < 0) return nullptr;
  if (!got) Py_RETURN_NONE;
  return PyFloat_FromDouble(lat);
}

inline PyObject *book_fail(PyObject *self, PyObject *const *args, Py_ssize_t n) {
  if (!nargs(n, 2, "LoadBook.fail")) return nullptr;
  const int got = fail_rid(reinterpret_cast<LoadBook *>(self), args[0], args[1]);
  if (got < 0) return nullptr;
  return PyBool_FromLong(got);
}

// drain(out): the loads finished or failed since the last drain into the PollResult `out`
// (its finished_recving taken over when empty, else merged; failed and errors updated).
inline PyObject *book_drain(PyObject *self, PyObject *const *args, Py_ssize_t n) {
  LoadBook *b = reinterpret_cast<LoadBook *>(self);
  if (!nargs(n, 1, "LoadBook.drain")) return nullptr;
  if (PySet_GET_SIZE(b->done) == 0 && PyDict_GET_SIZE(b->failed) == 0) Py_RETURN_NONE;
  static PyObject *names[3] = {nullptr};
  if (names[2] == nullptr) {
    const char *s[3] = {"finished_recving", "failed", "errors"};
    for (int i = 0; i < 3; ++i) {
      if (names[i] == nullptr && (names[i] = PyUnicode_InternFromString(s[i])) == nullptr) return nullptr;
    }
  }
  PyObject *out = args[0];
  if (PySet_GET_SIZE(b->done)) {
    PyObject *fr = PyObject_GetAttr(out, names[0]);
    if (fr == nullptr) return nullptr;
    if (PyAnySet_Check(fr) && PySet_GET_SIZE(fr) == 0) {  // taken over: a new set here
      PyObject *fresh = PySet_New(nullptr);
      if (fresh == nullptr || PyObject_SetAttr(out, names[0], b->done) != 0) {
        Py_XDECREF(fresh);
        Py_DECREF(fr);
        return nullptr;
      }
      Py_SETREF(b->done, fresh);
    } else {
      PyObject *r = PyNumber_InPlaceOr(fr, b->done);
      if (r == nullptr) {
        Py_DECREF(fr);
        return nullptr;
      }
      if (r != fr && PyObject_SetAttr(out, names[0], r) != 0) {
        Py_DECREF(r);
        Py_DECREF(fr);
        return nullptr;
      }
      Py_DECREF(r);
      PySet_Clear(b->done);
    }
    Py_DECREF(fr);
  }
  if (PyDict_GET_SIZE(b->failed)) {
    PyObject *of = PyObject_GetAttr(out, names[1]), *oe = PyObject_GetAttr(out, names[2]);
    const bool ok = of != nullptr && oe != nullptr && PyDict_Update(of, b->failed) == 0 &&
                    PyDict_Update(oe, b->errors) == 0;
    Py_XDECREF(of);
    Py_XDECREF(oe);
    if (!ok) return nullptr;
    PyDict_Clear(b->failed);
    PyDict_Clear(b->errors);
  }
  Py_RETURN_NONE;
}

}  // namespace kvx_ctl
