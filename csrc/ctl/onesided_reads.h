// kvxfer control-path helpers (kvx_ctl.cpp): a one-sided load's lookup and its landing, each one
// call over every source rank of the load (kvxfer/transports/ipc/onesided.py).
//
// What the loader did per source rank through slots.py's SlotView (the binding, slot_read, then
// after the copy slot_check and slot_mark per exporter rank it notifies) in one call each, with
// the load's own checks of the params' ids: a 4K-token load made ~8 calls and as many Python
// frames around them on its way from load() to its done marks. The protocol and every check are
// lease_slots.h's (read_slot, check_slot, mark_slot, bind_words); the Python steps stay the
// fallback when this module is not in use.
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

// onesided_read's refusal of the params themselves (the other codes are read_slot's Refusals):
// ids not ceil(num_tokens / block_size) of them, an id at or past the exporter's block count, a
// token not ASCII or a request id without UTF-8. The messaged path names the problem.
constexpr int kBadParams = 7;
// A refusal's source rank index is in the bits above the code (codes < 16); a landing's first
// mark with a word out of range above its two flags (16, 32).
constexpr int kSourceShift = 4, kMarkShift = 6;

// Every table of the tuple `tables` (of `count` sources) as a buffer; the epochs likewise.
inline bool source_bufs(PyObject *tables, PyObject *epochs, std::vector<Buf> &tb, std::vector<Buf> &ep,
                        bool writable, const char *what) {
  if (!PyTuple_Check(tables) || !PyTuple_Check(epochs) || PyTuple_GET_SIZE(tables) != PyTuple_GET_SIZE(epochs) ||
      PyTuple_GET_SIZE(tables) < 1 || PyTuple_GET_SIZE(tables) >= (1 << 20)) {
    PyErr_Format(PyExc_TypeError, "%s: tables and epochs must be tuples of one length (>= 1)", what);
    return false;
  }
  const Py_ssize_t k = PyTuple_GET_SIZE(tables);
  tb.resize(k);
  ep.resize(k);
  for (Py_ssize_t i = 0; i < k; ++i) {
    if (!get(PyTuple_GET_ITEM(tables, i), tb[i], 8, writable, "table") ||
        !get(PyTuple_GET_ITEM(epochs, i), ep[i], 8, false, "epochs") || table_slots(tb[i]) < 0) {
      return false;
    }
  }
  return true;
}

// onesided_read(tables, epochs, ids, num_tokens, block_size, num_blocks, token, digest,
// request_id, now_ns, stale_ns, need_ns) -> (b0, b1, ((slot, gen, snapshot), ...)): the binding
// of (token, digest, request_id) and read_slot of it in each source rank's table (tables[k],
// its blocks' epochs epochs[k]) for the int64 ids `ids`; or an int refusal, its code | source <<
// kSourceShift: kBadParams (source 0) when the ids are not ceil(num_tokens / block_size) ids in
// [0, num_blocks) or the binding has no bytes, else the first source's read_slot refusal. The
// ids are checked against every source's epochs too (IndexError: a caller's bug, nothing read).
inline PyObject *onesided_read(PyObject *, PyObject *const *args, Py_ssize_t n) {
  if (!nargs(n, 12, "onesided_read")) return nullptr;
  std::vector<Buf> tb, ep;
  Buf ids, dg;
  int64_t v[3], w[3];
  if (!source_bufs(args[0], args[1], tb, ep, false, "onesided_read") || !get(args[2], ids, 8, false, "ids") ||
      !int64_args(args, 3, 3, v) || !get(args[7], dg, 0, false, "digest") || !int64_args(args, 9, 3, w)) {
    return nullptr;
  }
  const int64_t num_tokens = v[0], block_size = v[1], num_blocks = v[2];
  if (block_size < 1 || num_tokens < 1) {
    return PyErr_Format(PyExc_ValueError, "onesided_read: num_tokens %lld, block_size %lld", (long long)num_tokens,
                        (long long)block_size);
  }
  const Py_ssize_t k = ids.count();
  const int64_t *x = static_cast<const int64_t *>(ids.view.buf);
  if (k != (num_tokens + block_size - 1) / block_size) return PyLong_FromLong(kBadParams);
  uint64_t top = 0;
  for (Py_ssize_t i = 0; i < k; ++i) top |= static_cast<uint64_t>(x[i]) >= static_cast<uint64_t>(num_blocks);
  if (top) return PyLong_FromLong(kBadParams);
  for (const Buf &e : ep) {
    if (!ids_in_range(ids, e.count(), "onesided_read")) return nullptr;
  }
  int64_t b0, b1;
  if (!bind_words(args[6], dg, args[8], b0, b1)) {
    if (!PyErr_ExceptionMatches(PyExc_ValueError)) return nullptr;
    PyErr_Clear();  // no bytes to bind: the messaged path refuses those params by name
    return PyLong_FromLong(kBadParams);
  }
  const Py_ssize_t count = static_cast<Py_ssize_t>(tb.size());
  PyObject *reads = PyTuple_New(count);
  if (reads == nullptr) return nullptr;
  for (Py_ssize_t s = 0; s < count; ++s) {
    Py_ssize_t slot = -1;
    int64_t gen = 0;
    PyObject *snap = nullptr;
    const int got = read_slot(static_cast<const int64_t *>(tb[s].view.buf), table_slots(tb[s]), ep[s], ids, b0, b1,
                              w[0], w[1], w[2], slot, gen, snap);
    if (got) {
      Py_DECREF(reads);
      return got < 0 ? nullptr : PyLong_FromLong(got | (s << kSourceShift));
    }
    PyObject *one = Py_BuildValue("(nLN)", slot, static_cast<long long>(gen), snap);
    if (one == nullptr) {
      Py_DECREF(reads);
      return nullptr;
    }
    PyTuple_SET_ITEM(reads, s, one);
  }
  return Py_BuildValue("(LLN)", static_cast<long long>(b0), static_cast<long long>(b1), reads);
}

// onesided_land(tables, epochs, ids, reads, marks, b0, b1, loader_rank, loader_tp, now_ns,
// stale_ns) -> the landing of a one-sided load whose copy completed: check_slot of each source
// rank's read (reads as onesided_read returned them), and when none moved, the done mark of
// loader rank `loader_rank` of a `loader_tp`-rank engine into the table of each exporter rank it
// notifies (`marks`: (table, source index or -1) per such rank; -1: the slot found there by the
// binding (b0, b1), as read_slot finds it but whatever its flags). Returns an int: 0 landed and
// every mark written with its ring entry taken; 3 landed, some rank not marked (a slot not
// found, a rank past the marks, a word out of range: the loader notifies by message), with
// kMarkBadGen / kMarkBadCount seen as bits 16 / 32 and the index of the first mark that saw one
// << kMarkShift; else 1 (released) or 2 (an exporter stopped), | source << kSourceShift, and no
// mark written. A table of `marks` is written; the sources' only read.
inline PyObject *onesided_land(PyObject *, PyObject *const *args, Py_ssize_t n) {
  if (!nargs(n, 11, "onesided_land")) return nullptr;
  std::vector<Buf> tb, ep;
  Buf ids;
  int64_t v[6];
  if (!source_bufs(args[0], args[1], tb, ep, false, "onesided_land") || !get(args[2], ids, 8, false, "ids") ||
      !int64_args(args, 5, 6, v)) {
    return nullptr;
  }
  const int64_t b0 = v[0], b1 = v[1], rank = v[2], tp = v[3], now_ns = v[4], stale_ns = v[5];
  if (!loader_rank_ok(rank, tp, "onesided_land")) return nullptr;
  PyObject *reads = args[3], *marks = args[4];
  const Py_ssize_t count = static_cast<Py_ssize_t>(tb.size());
  if (!PyTuple_Check(reads) || PyTuple_GET_SIZE(reads) != count || !PyTuple_Check(marks)) {
    return PyErr_Format(PyExc_TypeError, "onesided_land: reads must be a tuple of one read per source, marks a tuple");
  }
  // each read's slot and generation converted once: the values checked are the values used
  std::vector<int64_t> rslot(static_cast<size_t>(count)), rgen(static_cast<size_t>(count));
  for (Py_ssize_t s = 0; s < count; ++s) {
    PyObject *r = PyTuple_GET_ITEM(reads, s);
    if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 3) {
      return PyErr_Format(PyExc_TypeError, "onesided_land: read %zd is not (slot, gen, snapshot)", s);
    }
    const Py_ssize_t num = table_slots(tb[s]);
    const int64_t slot = PyLong_AsLongLong(PyTuple_GET_ITEM(r, 0)), gen = PyLong_AsLongLong(PyTuple_GET_ITEM(r, 1));
    if (PyErr_Occurred()) return nullptr;
    if (slot < 0 || slot >= num) return PyErr_Format(PyExc_IndexError, "onesided_land: slot %lld of %zd", (long long)slot, num);
    rslot[static_cast<size_t>(s)] = slot;
    rgen[static_cast<size_t>(s)] = gen;
    Buf snap;
    if (!get(PyTuple_GET_ITEM(r, 2), snap, 0, false, "snapshot") || !ids_in_range(ids, ep[s].count(), "onesided_land")) {
      return nullptr;
    }
    const int got = check_slot(static_cast<const int64_t *>(tb[s].view.buf), ep[s], ids, snap, slot, gen, now_ns, stale_ns);
    if (got) return PyLong_FromLong(got | (s << kSourceShift));
  }
  // every mark's table and source checked before the first is written
  const Py_ssize_t num_marks = PyTuple_GET_SIZE(marks);
  std::vector<Buf> mt(static_cast<size_t>(num_marks));
  std::vector<long long> msrc(static_cast<size_t>(num_marks));
  for (Py_ssize_t m = 0; m < num_marks; ++m) {
    PyObject *mk = PyTuple_GET_ITEM(marks, m);
    if (!PyTuple_Check(mk) || PyTuple_GET_SIZE(mk) != 2) {
      return PyErr_Format(PyExc_TypeError, "onesided_land: mark %zd is not (table, source index)", m);
    }
    const long long src = PyLong_AsLongLong(PyTuple_GET_ITEM(mk, 1));
    if ((src == -1 && PyErr_Occurred()) || !get(PyTuple_GET_ITEM(mk, 0), mt[m], 8, true, "table") ||
        table_slots(mt[m]) < 0) {
      return nullptr;
    }
    if (src >= count || src < -1) return PyErr_Format(PyExc_IndexError, "onesided_land: source %lld of %zd", src, count);
    msrc[m] = src;
  }
  int out = 0;
  Py_ssize_t bad_at = -1;  // the first mark whose table had a word out of range
  for (Py_ssize_t m = 0; m < num_marks; ++m) {
    const Py_ssize_t num = table_slots(mt[m]);
    int64_t *t = static_cast<int64_t *>(mt[m].view.buf);
    int64_t slot = -1, gen = 0;
    if (msrc[m] >= 0) {  // checked above: in range of its source's table
      slot = rslot[static_cast<size_t>(msrc[m])];
      gen = rgen[static_cast<size_t>(msrc[m])];
    } else {
      bool bad = false;
      slot = b0 < 0 ? -1 : find_slot(t, num, b0, b1, gen, bad);
      if (slot < 0) {
        out |= 3 | (bad ? 16 : 0);
        if (bad && bad_at < 0) bad_at = m;
        continue;
      }
    }
    if (slot >= num) {  // a source's slot in another rank's table of fewer slots: no mark there
      out |= 3;
      continue;
    }
    const int got = mark_slot(t, slot, gen, rank, tp);
    if (got == kMarkBadGen || got == kMarkBadCount) {
      out |= 3 | (got == kMarkBadGen ? 16 : 32);
      if (bad_at < 0) bad_at = m;
    } else if (got != kMarked) {
      out |= 3;
    }
  }
  return PyLong_FromSsize_t(out | (bad_at >= 0 ? bad_at << kMarkShift : 0));
}

}  // namespace kvx_ctl
