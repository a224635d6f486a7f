// kvxfer control-path helpers (kvx_ctl.cpp): the Python types of export_book.h's records and
// book: ExportRecord (members the tracker's Python reads and writes) and ExportBook (its
// methods, the dicts it exposes, construction and the garbage collector's hooks).
//
// Included by kvx_ctl.cpp alone: the module is one translation unit (in its hash).

#pragma once

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>
#include <structmember.h>

#include <new>
#include <vector>

#include "ctl_common.h"
#include "export_book.h"
#include "export_book_export.h"
#include "export_book_msgs.h"

namespace kvx_ctl {

// --------------------------------------------------------------------------- the record

// What the tracker's Python writes (deadline, marked, gates, notified_by) is writable; what the
// book reads back to release (block_ids) or to remember (token, gen) is not.
inline PyMemberDef *record_members() {
  static PyMemberDef m[] = {
      {"block_ids", T_OBJECT_EX, offsetof(ExportRecord, block_ids), READONLY, "int64 [n]: the ids held"},
      {"groups", T_OBJECT, offsetof(ExportRecord, groups), READONLY, "ids per KV cache group, None: one group"},
      {"token", T_OBJECT_EX, offsetof(ExportRecord, token), READONLY, "the export's auth token"},
      {"digest", T_OBJECT_EX, offsetof(ExportRecord, digest), READONLY, "kvxfer.auth.content_digest of the export"},
      {"notified_by", T_OBJECT_EX, offsetof(ExportRecord, notified_by), 0, "expected count -> senders counted"},
      {"marked", T_OBJECT, offsetof(ExportRecord, marked), 0, "layer-wise: layers marked ready (None: all)"},
      {"gates", T_OBJECT_EX, offsetof(ExportRecord, gates), 0, "(layers, events) of marked groups"},
      {"deadline", T_DOUBLE, offsetof(ExportRecord, deadline), 0, "the lease's end (monotonic)"},
      {"num_tokens", T_LONGLONG, offsetof(ExportRecord, num_tokens), READONLY, "the export's token count"},
      {"gen", T_LONGLONG, offsetof(ExportRecord, gen), READONLY, "the export's generation of its request id"},
      {"slot", T_LONGLONG, offsetof(ExportRecord, slot), READONLY, "its lease slot, -1: none"},
      {nullptr, 0, 0, 0, nullptr},
  };
  return m;
}

inline int record_traverse(PyObject *self, visitproc visit, void *arg) {
  ExportRecord *r = reinterpret_cast<ExportRecord *>(self);
  Py_VISIT(Py_TYPE(self));
  PyObject *own[] = {r->block_ids, r->groups, r->token, r->digest, r->notified_by, r->marked, r->gates};
  for (PyObject *o : own) Py_VISIT(o);
  return 0;
}

inline int record_clear(PyObject *self) {
  ExportRecord *r = reinterpret_cast<ExportRecord *>(self);
  Py_CLEAR(r->block_ids);
  Py_CLEAR(r->groups);
  Py_CLEAR(r->token);
  Py_CLEAR(r->digest);
  Py_CLEAR(r->notified_by);
  Py_CLEAR(r->marked);
  Py_CLEAR(r->gates);
  return 0;
}

inline void record_dealloc(PyObject *self) {
  PyTypeObject *tp = Py_TYPE(self);
  PyObject_GC_UnTrack(self);
  record_clear(self);
  tp->tp_free(self);
  Py_DECREF(tp);
}

inline PyObject *export_record_type() {
  static PyType_Slot slots[] = {
      {Py_tp_dealloc, reinterpret_cast<void *>(record_dealloc)},
      {Py_tp_traverse, reinterpret_cast<void *>(record_traverse)},
      {Py_tp_clear, reinterpret_cast<void *>(record_clear)},
      {Py_tp_members, record_members()},
      {Py_tp_doc, const_cast<char *>("One live export of an ExportBook (csrc/ctl/export_book.h).")},
      {0, nullptr},
  };
  static PyType_Spec spec = {"_kvx_ctl.ExportRecord", sizeof(ExportRecord), 0,
                             Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_DISALLOW_INSTANTIATION, slots};
  return PyType_FromSpec(&spec);
}

// --------------------------------------------------------------------------- the type

inline int xbook_traverse(PyObject *self, visitproc visit, void *arg) {
  ExportBook *b = reinterpret_cast<ExportBook *>(self);
  Py_VISIT(Py_TYPE(self));
  PyObject *own[] = {b->live,  b->gone,  b->record_type, b->rc,      b->ep,       b->table,
                     b->gens,  b->used,  b->owner,       b->unready, b->on_full,  b->expected};
  for (PyObject *o : own) Py_VISIT(o);
  return 0;
}

inline int xbook_clear(PyObject *self) {
  ExportBook *b = reinterpret_cast<ExportBook *>(self);
  PyObject **own[] = {&b->live, &b->gone,  &b->record_type, &b->rc,      &b->ep,      &b->table,
                      &b->gens, &b->used,  &b->owner,       &b->unready, &b->on_full, &b->expected};
  for (PyObject **o : own) Py_CLEAR(*o);
  return 0;
}

inline void xbook_dealloc(PyObject *self) {
  PyTypeObject *tp = Py_TYPE(self);
  PyObject_GC_UnTrack(self);
  xbook_clear(self);
  delete reinterpret_cast<ExportBook *>(self)->want;
  tp->tp_free(self);
  Py_DECREF(tp);
}

// ExportBook(refcount int32[B], epochs int64[B], gone_kept, gone_slack); the module's ExportRecord type is
// what add makes (set by the module at import, see kvx_ctl.cpp).
inline PyObject *&record_type_slot() {
  static PyObject *t = nullptr;
  return t;
}

inline PyObject *xbook_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
  PyObject *rc, *ep;
  Py_ssize_t kept, slack;
  if ((kwargs != nullptr && PyDict_GET_SIZE(kwargs)) ||
      !PyArg_ParseTuple(args, "OOnn:ExportBook", &rc, &ep, &kept, &slack)) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "ExportBook takes positional arguments only");
    return nullptr;
  }
  Buf r, e;
  if (!get(rc, r, 4, true, "refcount") || !get(ep, e, 8, true, "epochs")) return nullptr;
  if (r.count() != e.count() || kept < 0 || slack < 1) {
    return PyErr_Format(PyExc_ValueError, "ExportBook: refcount %zd and epochs %zd blocks, gone_kept %zd, gone_slack %zd",
                        r.count(), e.count(), kept, slack);
  }
  if (record_type_slot() == nullptr) return PyErr_Format(PyExc_RuntimeError, "ExportBook: no ExportRecord type");
  ExportBook *b = reinterpret_cast<ExportBook *>(type->tp_alloc(type, 0));
  if (b == nullptr) return nullptr;
  b->want = new (std::nothrow) std::vector<int32_t>();
  b->live = PyDict_New();
  b->gone = PyDict_New();
  if (b->want == nullptr || b->live == nullptr || b->gone == nullptr) {
    Py_DECREF(b);
    return PyErr_Occurred() ? nullptr : PyErr_NoMemory();
  }
  PyObject *given[] = {rc, ep, record_type_slot()};
  for (PyObject *o : given) Py_INCREF(o);
  b->rc = rc, b->ep = ep, b->record_type = record_type_slot();
  b->gone_kept = kept, b->gone_slack = slack;
  return reinterpret_cast<PyObject *>(b);
}

template <class F>
PyCFunction xbook_method(F f) {
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(f));
}

inline PyMethodDef *xbook_methods() {
  static PyMethodDef m[] = {
      {"add", xbook_method(guarded<xbook_add>), METH_FASTCALL,
       "add(request_id, ids, num_tokens, deadline, token, digest, gen, groups, marked, ready) -> the record"},
      {"export", xbook_method(guarded<xbook_export>), METH_FASTCALL,
       "export(request_id, block_ids, need, num_tokens, deadline, key, token, ready, frombuffer, dtype) -> "
       "(token, ids, exact); None: the Python path takes it (nothing written)"},
      {"release_many", xbook_method(guarded<xbook_release_many>), METH_FASTCALL,
       "release_many(request_ids) -> the ids released"},
      {"take_marks", xbook_method(guarded<xbook_take_marks>), METH_FASTCALL,
       "take_marks(expected) -> the ids whose count the done marks since the last look completed"},
      {"renew", xbook_method(guarded<xbook_renew>), METH_FASTCALL,
       "renew(record, deadline) -> whether its lease now ends later"},
      {"grant", xbook_method(guarded<xbook_grant>), METH_FASTCALL,
       "grant(request_ids, tokens, digests, deadline) -> each id's epochs, renewed; None: not every id a "
       "verified whole export"},
      {"notify", xbook_method(guarded<xbook_notify>), METH_FASTCALL,
       "notify(request_ids, tokens, rank, tp, expected) -> the ids whose count completed; None: not every id "
       "verified, or the sender may not notify"},
      {"attach", xbook_method(guarded<xbook_attach>), METH_FASTCALL,
       "attach(table, gens, used, owner, unready, on_full): follow this lease-slot table"},
      {nullptr, nullptr, 0, nullptr},
  };
  return m;
}

inline PyMemberDef *xbook_members() {
  static PyMemberDef m[] = {
      {"live", T_OBJECT, offsetof(ExportBook, live), READONLY, "request id -> its record"},
      {"gone", T_OBJECT, offsetof(ExportBook, gone), READONLY, "released request id -> (gen, token), oldest first"},
      {"seen", T_LONGLONG, offsetof(ExportBook, seen), READONLY, "the ring count taken so far"},
      {nullptr, 0, 0, 0, nullptr},
  };
  return m;
}

inline PyObject *export_book_type() {
  static PyType_Slot slots[] = {
      {Py_tp_new, reinterpret_cast<void *>(xbook_new)},
      {Py_tp_dealloc, reinterpret_cast<void *>(xbook_dealloc)},
      {Py_tp_traverse, reinterpret_cast<void *>(xbook_traverse)},
      {Py_tp_clear, reinterpret_cast<void *>(xbook_clear)},
      {Py_tp_methods, xbook_methods()},
      {Py_tp_members, xbook_members()},
      {Py_tp_doc, const_cast<char *>("The records of an exporter rank's live exports "
                                     "(the core of kvxfer.exports.ExportTracker): see csrc/ctl/export_book.h.")},
      {0, nullptr},
  };
  static PyType_Spec spec = {"_kvx_ctl.ExportBook", sizeof(ExportBook), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
                             slots};
  return PyType_FromSpec(&spec);
}

}  // namespace kvx_ctl
