// kvxfer control-path helpers (kvx_ctl.cpp): LoadBook's Python type, binding the tracker's
// methods (load_book.h) and the native lane's (load_lane.h).
//
// Included by kvx_ctl.cpp alone: the module is one translation unit (in its hash).

#pragma once

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>

#include "ctl_common.h"
#include "load_book.h"
#include "load_lane.h"

namespace kvx_ctl {

// --------------------------------------------------------------------------- the type

inline int book_traverse(PyObject *self, visitproc visit, void *arg) {
  LoadBook *b = reinterpret_cast<LoadBook *>(self);
  Py_VISIT(Py_TYPE(self));
  PyObject *own[] = {b->pending, b->done,  b->failed,  b->errors,   b->active,
                     b->limits,  b->frombuffer, b->dtype, b->stale_ns, b->targets, b->latencies};
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
  Py_CLEAR(b->latencies);
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
  b->flights = new (std::nothrow) std::vector<Flight>();
  if (b->flights == nullptr) {
    Py_DECREF(b);
    return PyErr_NoMemory();
  }
  b->pending = PyDict_New();
  b->done = PySet_New(nullptr);
  b->failed = PyDict_New();
  b->errors = PyDict_New();
  b->targets = PyDict_New();
  PyObject *given[] = {active, limits, frombuffer, dtype, stale};
  for (PyObject *o : given) Py_INCREF(o);
  b->active = active, b->limits = limits, b->frombuffer = frombuffer, b->dtype = dtype, b->stale_ns = stale;
  b->span_start = 0.0, b->span_end = -1.0;  // no span yet
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
      {"add", book_method(guarded<book_add>), METH_FASTCALL, "add(request_id, block_ids, start): a load starts (ValueError: one of that id is pending)"},
      {"pending", book_pending, METH_NOARGS, "the loads not reported yet"},
      {"finish", book_method(guarded<book_finish>), METH_FASTCALL, "finish(request_id) -> whether it was pending"},
      {"finish_many", book_method(guarded<book_finish_many>), METH_FASTCALL,
       "finish_many(request_ids, end=0.0) -> end minus the start of each that was pending"},
      {"finish_one", book_method(guarded<book_finish_one>), METH_FASTCALL, "finish_one(request_id, end) -> its latency or None"},
      {"fail", book_method(guarded<book_fail>), METH_FASTCALL, "fail(request_id, reason) -> whether it was pending"},
      {"drain", book_method(guarded<book_drain>), METH_FASTCALL, "drain(out): the reports since the last drain into a PollResult"},
      {"set_target", book_method(guarded<book_set_target>), METH_FASTCALL, "set_target(engine_id, target): its lane (see load_book.h)"},
      {"begin", book_method(guarded<book_begin>), METH_FASTCALL, "a one-sided load's lookup and record (see load_book.h)"},
      {"launched", book_method(guarded<book_launched>), METH_FASTCALL,
     "launched(request_id | [request ids], event[, calls]): its copy (a batch's) was issued"},
      {"drop", book_method(guarded<book_drop>), METH_FASTCALL, "drop(request_id): its copy was not issued; forgotten"},
      {"cancel", book_method(guarded<book_cancel>), METH_FASTCALL, "cancel(request_id, why): its copy failed; failed"},
      {"complete", book_method(guarded<book_complete>), METH_FASTCALL, "the flights whose copy completed, landed and reported"},
      {"in_flight", book_in_flight, METH_NOARGS, "one-sided loads launched and not reported yet"},
      {"record_into", book_method(guarded<book_record_into>), METH_FASTCALL,
       "record_into(deque): complete() keeps the lane's metrics, latencies appended to the deque"},
      {"lane_stats", book_lane_stats, METH_NOARGS,
       "(wire bytes, ops calls, loads landed, latency sum, busy s) complete() recorded"},
      {"events_of", book_method(guarded<book_events_of>), METH_FASTCALL, "events_of(request_ids) -> their flights' events"},
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
