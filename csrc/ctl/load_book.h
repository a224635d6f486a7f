// kvxfer control-path helpers (kvx_ctl.cpp): the loads in flight on a loader rank (LoadBook), and
// a one-sided load's path through it in one call at load() and one at poll().
//
// LoadBook is kvxfer.completion.LoadTracker in C, with the same methods and reports (add,
// pending, finish, finish_many, finish_one, fail, drain: each load reported once, finished or
// failed), and the records of the one-sided loads of kvxfer/transports/ipc/onesided.py's
// native lane:
//
//   set_target(engine_id, target): loads of that engine read through `target.lane` from now on
//     (the lane below; None: not while it is None, e.g. once its session closed).
//   begin(request_id, params, block_ids, queued, now_ns, need_ns, start, deadline, max_tokens)
//     -> (src ids, dst ids, num_tokens, lane) | None
//     The params dict parsed (params_fields.h's parse_params), the lane of its engine id's
//     target, the peer's address and TP size those of the lane, the local ids checked
//     (block_ids.h), the request not pending and its
//     params' key (engine id, request id) neither in flight (`active`) nor queued for the
//     messaged path (`queued`), every source rank's slot read (onesided_read): only then are the
//     tracker's entry, the key and the flight written. None leaves the load to the Python path,
//     which names what is wrong (or takes the messaged path), nothing written.
//   launched(request_id, event[, calls]): its copy was issued (event: CUDA, recorded after it;
//     None on CPU), in `calls` ops calls (default: the lane's per load; a batch launched together
//     counts its calls once); until then poll() does not look at it. drop(request_id): it was
//     never issued (the Python path takes it). cancel(request_id, why): its copy failed; the
//     load is failed.
//   complete(now_ns, end, loader_rank, loader_tp, event_done, mark_later, due) ->
//     None | (results, events, late, start, nbytes, calls, latencies): every issued flight
//     whose event completed (event_done(event)) landed (onesided_land: checks and done marks).
//     A landed load is finished in the tracker; when every rank it notifies counted its mark,
//     mark_later((due, peer, params request id, token)) defers its notification. results: the
//     others, (code, lane, params request id, token, request id) each as onesided_land coded
//     it (a failed load is left to the caller, which says why); events: (lane, event) of each
//     reported flight with one; late: request ids whose deadline passed, still copying (once
//     each); start: the earliest start of those reported, nbytes their wire bytes, calls their
//     ops calls, latencies the landed ones' (end - start).
//
// The lane is a tuple the Python side makes once per peer: (target, tables, epochs, marks, host,
// port, tp_size, block size, num_blocks, local block size, local num_blocks, wire bytes per
// token, ops calls per load, whether every rank the loads notify has a table to mark, peer);
// tables, epochs and marks as onesided_read/onesided_land take them.
//
// Every method holds the GIL throughout but complete()'s calls of event_done (an event query
// may let other threads run; the flights it checks are out of the book meanwhile): each call is
// atomic for Python threads, so the Python tracker's lock has no counterpart here.
//
// Included by kvx_ctl.cpp alone: the module is one translation unit (in its hash).

#pragma once

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "block_ids.h"
#include "ctl_common.h"
#include "onesided_reads.h"
#include "params_fields.h"

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
  PyObject *seq = PySequence_Fast(args[0], "LoadBook.finish_many: request_ids must be a sequence");
  if (seq == nullptr) return nullptr;
  PyObject *out = PyList_New(0);
  for (Py_ssize_t i = 0, k = PySequence_Fast_GET_SIZE(seq); out != nullptr && i < k; ++i) {
    double lat = 0;
    const int got = finish_rid(b, PySequence_Fast_GET_ITEM(seq, i), end, lat);
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

// ------------------------------------------------------------------- the one-sided lane

inline PyObject *book_set_target(PyObject *self, PyObject *const *args, Py_ssize_t n) {
  LoadBook *b = reinterpret_cast<LoadBook *>(self);
  if (!nargs(n, 2, "LoadBook.set_target")) return nullptr;
  if (!PyUnicode_CheckExact(args[0])) return PyErr_Format(PyExc_TypeError, "LoadBook.set_target: engine_id must be a str");
  if (PyDict_SetItem(b->targets, args[0], args[1]) != 0) return nullptr;
  Py_RETURN_NONE;
}

inline PyObject *book_begin(PyObject *self, PyObject *const *args, Py_ssize_t n) {
  LoadBook *b = reinterpret_cast<LoadBook *>(self);
  if (!nargs(n, 9, "LoadBook.begin")) return nullptr;
  PyObject *rid = args[0], *params = args[1], *block_ids = args[2], *queued = args[3];
  if (!PyUnicode_CheckExact(rid) || !PyAnySet_Check(queued)) {
    return PyErr_Format(PyExc_TypeError, "LoadBook.begin: request_id must be a str, queued a set");
  }
  const long long now_ns = PyLong_AsLongLong(args[4]), need_ns = PyLong_AsLongLong(args[5]);
  const double start = PyFloat_AsDouble(args[6]), deadline = PyFloat_AsDouble(args[7]);
  const long long max_tokens = PyLong_AsLongLong(args[8]);
  if (PyErr_Occurred()) return nullptr;
  ParsedParams p;
  const int parsed = parse_params(params, b->limits, p);
  if (parsed <= 0) {
    if (parsed < 0) return nullptr;
    Py_RETURN_NONE;
  }
  // the lane of the params' engine: none (not handshaken, not mapped, its session closed) leaves
  // the load to the Python path
  static PyObject *lane_name = nullptr;
  if (lane_name == nullptr && (lane_name = PyUnicode_InternFromString("lane")) == nullptr) return nullptr;
  PyObject *target = PyDict_GetItemWithError(b->targets, p.eid);
  if (target == nullptr) {
    if (PyErr_Occurred()) return nullptr;
    Py_RETURN_NONE;
  }
  Held lane_held(PyObject_GetAttr(target, lane_name));  // held to the end (the flight takes its own)
  PyObject *lane = lane_held.o;
  if (lane == nullptr) return nullptr;
  if (lane == Py_None) Py_RETURN_NONE;
  Lane l;
  if (!lane_of(lane, l)) return nullptr;
  // params of another address or TP size name another start of that engine: the Python path
  if (PyUnicode_Compare(p.host, l.host) != 0 || p.port_v != l.port || p.tp_v != l.tp ||
      (max_tokens >= 0 && p.num_v > max_tokens)) {
    if (PyErr_Occurred()) return nullptr;
    Py_RETURN_NONE;
  }
  const int loading = PyDict_Contains(b->pending, rid);
  if (loading) {
    if (loading < 0) return nullptr;
    Py_RETURN_NONE;  // the Python path raises, naming it
  }
  PyObject *key = PyTuple_Pack(2, p.eid, p.rid);
  if (key == nullptr) return nullptr;
  const int twice = PySet_Contains(b->active, key), queued_too = twice ? 0 : PySet_Contains(queued, key);
  if (twice || queued_too) {
    Py_DECREF(key);
    if (twice < 0 || queued_too < 0) return nullptr;
    Py_RETURN_NONE;  // the Python path refuses it as loaded twice in one batch
  }
  const Py_ssize_t need = static_cast<Py_ssize_t>((p.num_v + l.local_block_size - 1) / l.local_block_size);
  PyObject *dst_raw = checked_ids(block_ids, need, l.local_num_blocks, true);
  if (dst_raw == nullptr) {  // the Python path raises the same error, naming the problem
    Py_DECREF(key);
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  PyObject *src = PyObject_CallFunctionObjArgs(b->frombuffer, p.raw, b->dtype, nullptr);
  PyObject *dst = src ? PyObject_CallFunctionObjArgs(b->frombuffer, dst_raw, b->dtype, nullptr) : nullptr;
  Py_DECREF(dst_raw);
  PyObject *now_o = PyLong_FromLongLong(now_ns), *need_o = PyLong_FromLongLong(need_ns);
  PyObject *got = nullptr;
  if (dst != nullptr && now_o != nullptr && need_o != nullptr) {
    PyObject *a[12] = {l.tables, l.epochs, src, p.num, l.block_size_o, l.num_blocks_o,
                       p.tok, p.digest, p.rid, now_o, b->stale_ns, need_o};
    got = onesided_read(nullptr, a, 12);
  }
  Py_XDECREF(now_o);
  Py_XDECREF(need_o);
  if (got == nullptr || !PyTuple_Check(got)) {  // an error, or a refusal: the Python path names it
    Py_DECREF(key);
    Py_XDECREF(src);
    Py_XDECREF(dst);
    if (got == nullptr) return nullptr;
    Py_DECREF(got);
    Py_RETURN_NONE;
  }
  const int64_t b0 = PyLong_AsLongLong(PyTuple_GET_ITEM(got, 0)), b1 = PyLong_AsLongLong(PyTuple_GET_ITEM(got, 1));
  PyObject *reads = PyTuple_GET_ITEM(got, 2);
  // Everything checked: the tracker's entry, the key and the flight.
  PyObject *start_o = PyFloat_FromDouble(start);
  PyObject *entry = start_o ? PyTuple_Pack(2, dst, start_o) : nullptr;
  Py_XDECREF(start_o);
  PyObject *out = entry ? PyTuple_Pack(4, src, dst, p.num, lane) : nullptr;
  bool ok = out != nullptr && PyDict_SetItem(b->pending, rid, entry) == 0;
  if (ok && PySet_Add(b->active, key) != 0) {
    PyDict_DelItem(b->pending, rid);
    ok = false;
  }
  Py_XDECREF(entry);
  if (!ok) {
    Py_XDECREF(out);
    Py_DECREF(key);
    Py_DECREF(src);
    Py_DECREF(dst);
    Py_DECREF(got);
    return nullptr;
  }
  Py_INCREF(rid);
  Py_INCREF(lane);
  Py_INCREF(reads);
  Py_INCREF(p.tok);
  Py_INCREF(p.rid);
  b->flights->push_back(Flight{rid, key, lane, src, reads, p.tok, p.rid, nullptr, b0, b1,
                               static_cast<int64_t>(p.num_v), -1, start, deadline, false});
  Py_DECREF(dst);
  Py_DECREF(got);
  return out;
}

// The index of request `rid`'s flight not launched yet, or -1 (-2: `rid` is not a str, raised).
inline Py_ssize_t unlaunched(LoadBook *b, PyObject *rid) {
  if (!PyUnicode_Check(rid)) {
    PyErr_Format(PyExc_TypeError, "LoadBook: request_id must be a str, got %s", Py_TYPE(rid)->tp_name);
    return -2;
  }
  std::vector<Flight> &fl = *b->flights;
  for (Py_ssize_t i = static_cast<Py_ssize_t>(fl.size()) - 1; i >= 0; --i) {
    if (fl[i].event == nullptr && (fl[i].rid == rid || PyUnicode_Compare(fl[i].rid, rid) == 0)) return i;
  }
  return -1;
}

inline PyObject *book_launched(PyObject *self, PyObject *const *args, Py_ssize_t n) {
  LoadBook *b = reinterpret_cast<LoadBook *>(self);
  if (n != 2 && n != 3) {
    return PyErr_Format(PyExc_TypeError, "LoadBook.launched takes 2 or 3 arguments (%zd given)", n);
  }
  long long calls = -1;
  if (n == 3) {
    calls = PyLong_AsLongLong(args[2]);
    if (calls == -1 && PyErr_Occurred()) return nullptr;
    if (calls < 0) return PyErr_Format(PyExc_ValueError, "LoadBook.launched: calls must be >= 0, got %lld", calls);
  }
  const Py_ssize_t i = unlaunched(b, args[0]);
  if (i == -2) return nullptr;
  if (i < 0) return PyErr_Format(PyExc_KeyError, "LoadBook.launched: no flight of %R waits for its launch", args[0]);
  Py_INCREF(args[1]);
  (*b->flights)[i].event = args[1];
  (*b->flights)[i].calls = calls;
  Py_RETURN_NONE;
}

// drop(request_id) / cancel(request_id, why): the flight not launched is gone; its tracker entry
// too (drop: the Python path loads it) or failed with `why` (cancel). True when there was one.
inline PyObject *book_unlaunch(LoadBook *b, PyObject *rid, PyObject *why) {
  const Py_ssize_t i = unlaunched(b, rid);
  if (i == -2) return nullptr;
  if (i < 0) Py_RETURN_FALSE;
  Flight f = (*b->flights)[i];
  b->flights->erase(b->flights->begin() + i);
  int r = PySet_Discard(b->active, f.key) < 0 ? -1 : 0;
  if (r == 0 && why == nullptr) {
    PyObject *e = pop_pending(b, rid);
    r = e == nullptr && PyErr_Occurred() ? -1 : 0;
    Py_XDECREF(e);
  } else if (r == 0) {
    r = fail_rid(b, rid, why) < 0 ? -1 : 0;
  }
  flight_release(f);
  if (r < 0) return nullptr;
  Py_RETURN_TRUE;
}

inline PyObject *book_drop(PyObject *self, PyObject *const *args, Py_ssize_t n) {
  if (!nargs(n, 1, "LoadBook.drop")) return nullptr;
  return book_unlaunch(reinterpret_cast<LoadBook *>(self), args[0], nullptr);
}

inline PyObject *book_cancel(PyObject *self, PyObject *const *args, Py_ssize_t n) {
  if (!nargs(n, 2, "LoadBook.cancel")) return nullptr;
  return book_unlaunch(reinterpret_cast<LoadBook *>(self), args[0], args[1]);
}

inline PyObject *book_complete(PyObject *self, PyObject *const *args, Py_ssize_t n) {
  LoadBook *b = reinterpret_cast<LoadBook *>(self);
  if (!nargs(n, 7, "LoadBook.complete")) return nullptr;
  PyObject *rank_o = args[2], *tp_o = args[3], *stale_o = b->stale_ns, *event_done = args[4], *mark_later = args[5];
  PyObject *due = args[6];
  if (!PyCallable_Check(event_done) || !PyCallable_Check(mark_later) || !PyFloat_Check(due)) {
    return PyErr_Format(PyExc_TypeError, "LoadBook.complete: event_done and mark_later must be callable, due a float");
  }
  const long long now_ns = PyLong_AsLongLong(args[0]);
  const double end = PyFloat_AsDouble(args[1]);
  if (PyErr_Occurred()) return nullptr;
  std::vector<Flight> &fl = *b->flights;
  if (fl.empty()) Py_RETURN_NONE;
  // The launched flights are this call's while it runs (an event query may let other threads
  // run, whose begin() and launched() then see only the others).
  std::vector<Flight> mine, keep;
  for (Flight &f : fl) (f.event != nullptr ? mine : keep).push_back(f);
  if (mine.empty()) Py_RETURN_NONE;
  fl.swap(keep);
  PyObject *results = PyList_New(0), *events = PyList_New(0), *late = PyList_New(0), *lats = PyList_New(0);
  PyObject *now_o = PyLong_FromLongLong(now_ns);
  double first = std::numeric_limits<double>::infinity();
  long long nbytes = 0, calls = 0;
  std::vector<Flight> still;
  size_t i = 0;
  bool ok = results != nullptr && events != nullptr && late != nullptr && lats != nullptr && now_o != nullptr;
  for (; ok && i < mine.size(); ++i) {
    Flight &f = mine[i];
    if (f.event != Py_None) {
      PyObject *r = PyObject_CallOneArg(event_done, f.event);
      const int done = r == nullptr ? -1 : PyObject_IsTrue(r);
      Py_XDECREF(r);
      if (done < 0) {
        ok = false;
        break;
      }
      if (!done) {
        if (!f.late && now_ns * 1e-9 > f.deadline) {
          f.late = true;
          ok = PyList_Append(late, f.rid) == 0;
        }
        still.push_back(f);
        continue;
      }
    }
    Lane l;
    PyObject *b0 = PyLong_FromLongLong(f.b0), *b1 = PyLong_FromLongLong(f.b1);
    PyObject *got = nullptr;
    if (b0 != nullptr && b1 != nullptr && lane_of(f.lane, l)) {
      PyObject *a[11] = {l.tables, l.epochs, f.src, f.reads, l.marks, b0, b1, rank_o, tp_o, now_o, stale_o};
      got = onesided_land(nullptr, a, 11);
    }
    Py_XDECREF(b0);
    Py_XDECREF(b1);
    if (got == nullptr) {
      ok = false;
      break;
    }
    const long code = PyLong_AsLong(got);
    const bool landed = code == 0 || (code & 15) == 3;
    calls += f.calls >= 0 ? f.calls : l.calls;
    first = f.start < first ? f.start : first;
    double lat = 0;
    const int finished = landed ? finish_rid(b, f.rid, end, lat) : 0;
    PyObject *lat_o = finished > 0 ? PyFloat_FromDouble(lat) : nullptr;
    if (finished > 0) nbytes += f.num_tokens * l.per_token;
    // every rank it notifies counted its mark: its notification waits (mark_later); else now
    PyObject *row = code == 0 && l.marks_all ? PyTuple_Pack(4, due, l.peer, f.prid, f.token)
                                             : PyTuple_Pack(5, got, f.lane, f.prid, f.token, f.rid);
    PyObject *later = row != nullptr && PyTuple_GET_SIZE(row) == 4 ? PyObject_CallOneArg(mark_later, row) : nullptr;
    PyObject *ev_row = f.event != Py_None ? PyTuple_Pack(2, f.lane, f.event) : nullptr;
    ok = finished >= 0 && (finished == 0 || (lat_o != nullptr && PyList_Append(lats, lat_o) == 0)) && row != nullptr &&
         (PyTuple_GET_SIZE(row) == 4 ? later != nullptr : PyList_Append(results, row) == 0) &&
         (f.event == Py_None || (ev_row != nullptr && PyList_Append(events, ev_row) == 0)) &&
         PySet_Discard(b->active, f.key) >= 0;
    Py_XDECREF(lat_o);
    Py_XDECREF(row);
    Py_XDECREF(later);
    Py_XDECREF(ev_row);
    Py_DECREF(got);
    flight_release(f);  // reported (or, on an error, its report is lost with this call's)
  }
  // unchecked flights go back first, in order, before those launched meanwhile
  for (; i < mine.size(); ++i) still.push_back(mine[i]);
  fl.insert(fl.begin(), still.begin(), still.end());
  Py_XDECREF(now_o);
  if (!ok) {
    Py_XDECREF(results);
    Py_XDECREF(events);
    Py_XDECREF(late);
    Py_XDECREF(lats);
    return nullptr;
  }
  if (first == std::numeric_limits<double>::infinity()) first = end;
  return Py_BuildValue("(NNNdLLN)", results, events, late, first, nbytes, calls, lats);
}

inline PyObject *book_in_flight(PyObject *self, PyObject *) {
  size_t k = 0;  // launched: a flight held for its batch's launch is not in flight yet
  for (const Flight &f : *reinterpret_cast<LoadBook *>(self)->flights) k += f.event != nullptr;
  return PyLong_FromSize_t(k);
}

// events_of(request_ids) -> the events of the launched flights of those request ids (any
// container: a set is what wait() has).
inline PyObject *book_events_of(PyObject *self, PyObject *const *args, Py_ssize_t n) {
  LoadBook *b = reinterpret_cast<LoadBook *>(self);
  if (!nargs(n, 1, "LoadBook.events_of")) return nullptr;
  // (request id, event) of the launched flights, held first: a container's test may run Python
  // code, and with it other threads that change the flights
  PyObject *pairs = PyList_New(0);
  for (const Flight &f : *b->flights) {
    if (pairs == nullptr || f.event == nullptr || f.event == Py_None) continue;
    PyObject *pair = PyTuple_Pack(2, f.rid, f.event);
    if (pair == nullptr || PyList_Append(pairs, pair) != 0) Py_CLEAR(pairs);
    Py_XDECREF(pair);
  }
  if (pairs == nullptr) return nullptr;
  PyObject *out = PyList_New(0);
  for (Py_ssize_t i = 0, k = PyList_GET_SIZE(pairs); out != nullptr && i < k; ++i) {
    PyObject *pair = PyList_GET_ITEM(pairs, i);
    const int in = PySequence_Contains(args[0], PyTuple_GET_ITEM(pair, 0));
    if (in < 0 || (in && PyList_Append(out, PyTuple_GET_ITEM(pair, 1)) != 0)) Py_CLEAR(out);
  }
  Py_DECREF(pairs);
  return out;
}

// --------------------------------------------------------------------------- the type

inline int book_traverse(PyObject *self, visitproc visit, void *arg) {
  LoadBook *b = reinterpret_cast<LoadBook *>(self);
  Py_VISIT(Py_TYPE(self));
  PyObject *own[] = {b->pending, b->done,  b->failed,  b->errors,   b->active,
                     b->limits,  b->frombuffer, b->dtype, b->stale_ns, b->targets};
  for (PyObject *o : own) Py_VISIT(o);
  if (b->flights != nullptr) {
    for (const Flight &f : *b->flights) {
      PyObject *held[] = {f.rid, f.key, f.lane, f.src, f.reads, f.token, f.prid, f.event};
      for (PyObject *o : held) Py_VISIT(o);
    }
  }
  return 0;
}

inline int book_clear(PyObject *self) {
  LoadBook *b = reinterpret_cast<LoadBook *>(self);
  Py_CLEAR(b->pending);
  Py_CLEAR(b->done);
  Py_CLEAR(b->failed);
  Py_CLEAR(b->errors);
  Py_CLEAR(b->active);
  Py_CLEAR(b->limits);
  Py_CLEAR(b->frombuffer);
  Py_CLEAR(b->dtype);
  Py_CLEAR(b->stale_ns);
  Py_CLEAR(b->targets);
  if (b->flights != nullptr) {
    std::vector<Flight> fl;
    fl.swap(*b->flights);
    for (Flight &f : fl) flight_release(f);
  }
  return 0;
}

inline void book_dealloc(PyObject *self) {
  PyTypeObject *tp = Py_TYPE(self);
  PyObject_GC_UnTrack(self);
  book_clear(self);
  delete reinterpret_cast<LoadBook *>(self)->flights;
  tp->tp_free(self);
  Py_DECREF(tp);
}

// LoadBook(limits, active, frombuffer, dtype, stale_ns)
inline PyObject *book_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
  PyObject *limits, *active, *frombuffer, *dtype, *stale;
  if ((kwargs != nullptr && PyDict_GET_SIZE(kwargs)) ||
      !PyArg_ParseTuple(args, "OOOOO:LoadBook", &limits, &active, &frombuffer, &dtype, &stale)) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "LoadBook takes positional arguments only");
    return nullptr;
  }
  if (!PyTuple_CheckExact(limits) || PyTuple_GET_SIZE(limits) != 5 || !PyAnySet_CheckExact(active) ||
      !PyCallable_Check(frombuffer) || !PyLong_CheckExact(stale)) {
    return PyErr_Format(PyExc_TypeError,
                        "LoadBook(limits: 5-tuple, active: set, frombuffer: callable, dtype, stale_ns: int)");
  }
  LoadBook *b = reinterpret_cast<LoadBook *>(type->tp_alloc(type, 0));
  if (b == nullptr) return nullptr;
  b->flights = new std::vector<Flight>();
  b->pending = PyDict_New();
  b->done = PySet_New(nullptr);
  b->failed = PyDict_New();
  b->errors = PyDict_New();
  b->targets = PyDict_New();
  PyObject *given[] = {active, limits, frombuffer, dtype, stale};
  for (PyObject *o : given) Py_INCREF(o);
  b->active = active, b->limits = limits, b->frombuffer = frombuffer, b->dtype = dtype, b->stale_ns = stale;
  if (b->pending == nullptr || b->done == nullptr || b->failed == nullptr || b->errors == nullptr ||
      b->targets == nullptr) {
    Py_DECREF(b);
    return nullptr;
  }
  return reinterpret_cast<PyObject *>(b);
}

template <class F>
PyCFunction book_method(F f) {
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(f));
}

inline PyMethodDef *book_methods() {
  static PyMethodDef m[] = {
      {"add", book_method(book_add), METH_FASTCALL, "add(request_id, block_ids, start): a load starts (ValueError: one of that id is pending)"},
      {"pending", book_pending, METH_NOARGS, "the loads not reported yet"},
      {"finish", book_method(book_finish), METH_FASTCALL, "finish(request_id) -> whether it was pending"},
      {"finish_many", book_method(book_finish_many), METH_FASTCALL,
       "finish_many(request_ids, end=0.0) -> end minus the start of each that was pending"},
      {"finish_one", book_method(book_finish_one), METH_FASTCALL, "finish_one(request_id, end) -> its latency or None"},
      {"fail", book_method(book_fail), METH_FASTCALL, "fail(request_id, reason) -> whether it was pending"},
      {"drain", book_method(book_drain), METH_FASTCALL, "drain(out): the reports since the last drain into a PollResult"},
      {"set_target", book_method(book_set_target), METH_FASTCALL, "set_target(engine_id, target): its lane (see load_book.h)"},
      {"begin", book_method(book_begin), METH_FASTCALL, "a one-sided load's lookup and record (see load_book.h)"},
      {"launched", book_method(book_launched), METH_FASTCALL,
     "launched(request_id, event[, calls]): its copy was issued (in calls ops calls)"},
      {"drop", book_method(book_drop), METH_FASTCALL, "drop(request_id): its copy was not issued; forgotten"},
      {"cancel", book_method(book_cancel), METH_FASTCALL, "cancel(request_id, why): its copy failed; failed"},
      {"complete", book_method(book_complete), METH_FASTCALL, "the flights whose copy completed, landed and reported"},
      {"in_flight", book_in_flight, METH_NOARGS, "one-sided loads launched and not reported yet"},
      {"events_of", book_method(book_events_of), METH_FASTCALL, "events_of(request_ids) -> their flights' events"},
      {nullptr, nullptr, 0, nullptr},
  };
  return m;
}

// The LoadBook type (a heap type), for the module to add.
inline PyObject *load_book_type() {
  static PyType_Slot slots[] = {
      {Py_tp_new, reinterpret_cast<void *>(book_new)},
      {Py_tp_dealloc, reinterpret_cast<void *>(book_dealloc)},
      {Py_tp_traverse, reinterpret_cast<void *>(book_traverse)},
      {Py_tp_clear, reinterpret_cast<void *>(book_clear)},
      {Py_tp_methods, book_methods()},
      {Py_tp_doc, const_cast<char *>("The loads in flight on a loader rank (kvxfer.completion.LoadTracker in C), "
                                     "with the one-sided lane's records: see csrc/ctl/load_book.h.")},
      {0, nullptr},
  };
  static PyType_Spec spec = {"_kvx_ctl.LoadBook", sizeof(LoadBook), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, slots};
  return PyType_FromSpec(&spec);
}

}  // namespace kvx_ctl
