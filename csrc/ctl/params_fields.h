// kvxfer control-path helpers (kvx_ctl.cpp): the params dict of a load, checked in one call.
//
// params_fields(d, limits) -> the fields of a params dict (kvxfer/params.py) when every one is
// plainly good, else None. "Plainly good" is a subset of what KVTransferParams.from_dict accepts,
// for the common case only: exact str / int / list types, no `groups`, `version` absent or the
// current one. Anything else (a subclass, a bad value, a request of several groups) returns None
// and the Python checks take the dict, naming what is wrong, or accepting it: this call never
// refuses what they accept, it only leaves it to them.
//
// limits: (max_id_chars, token_chars, max_tp_size, max_tokens, params_version).
// Returns (fields, ids, digest): `fields` a new dict of the ten KVTransferParams fields
// (block_ids as a tuple, groups None, version as given or the current one), `ids` bytes of the
// block ids as uint64 (immutable: numpy reads them as a read-only array), `digest` their
// content digest (token_hash.h's content_digest of num_tokens and those ids, one group: the
// params need it on every load path, and the ids are in hand here). Block ids are exact ints in
// [0, INT64_MAX).

#pragma once

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>

#include <cstdint>

#include "ctl_common.h"
#include "token_hash.h"

namespace kvx_ctl {

// An exact int in [lo, hi] (no bool, no subclass): its value in v.
inline bool exact_int_in(PyObject *o, long long lo, long long hi, long long &v) {
  if (o == nullptr || !PyLong_CheckExact(o)) return false;
  if (!small_int(o, v)) {
    int overflow = 0;
    v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) {
      PyErr_Clear();
      return false;
    }
  }
  return lo <= v && v <= hi;
}

// An exact str of [lo, hi] code points.
inline bool exact_str_in(PyObject *o, Py_ssize_t lo, Py_ssize_t hi) {
  if (o == nullptr || !PyUnicode_CheckExact(o)) return false;
  const Py_ssize_t n = PyUnicode_GET_LENGTH(o);
  return lo <= n && n <= hi;
}

// The field names, interned once (their hashes kept): a lookup by a new str each call cost more
// than the rest of the call. Kept for the process's life, as the module is. NULL: raised.
inline PyObject *const *field_keys() {
  static const char *const kNames[10] = {"request_id", "engine_id", "host", "port", "tp_size",
                                         "block_ids", "num_tokens", "token", "version", "groups"};
  static PyObject *keys[10] = {nullptr};
  if (keys[9] == nullptr) {
    for (int i = 0; i < 10; ++i) {
      if (keys[i] == nullptr && (keys[i] = PyUnicode_InternFromString(kNames[i])) == nullptr) return nullptr;
    }
  }
  return keys;
}

// A params dict's fields once every one is plainly good (parse_params): the dict's values, held
// (a digest of many ids lets other threads run, which could change the dict), their ints, the
// ids as uint64 bytes and their content digest.
struct ParsedParams {
  PyObject *rid = nullptr, *eid = nullptr, *host = nullptr, *port = nullptr, *tp = nullptr, *ids = nullptr,
           *num = nullptr, *tok = nullptr;
  long long port_v = 0, tp_v = 0, num_v = 0, ver_v = 0;
  PyObject *raw = nullptr, *digest = nullptr;
  PyObject *tup = nullptr;  // the ids as a tuple (params_fields': made before the digest)
  ParsedParams() = default;
  ParsedParams(const ParsedParams &) = delete;
  ParsedParams &operator=(const ParsedParams &) = delete;
  ~ParsedParams() {
    PyObject *held[11] = {rid, eid, host, port, tp, ids, num, tok, raw, digest, tup};
    for (PyObject *o : held) Py_XDECREF(o);
  }
};

// 1: the params dict `d` is plainly good under `lim` (params_fields' limits tuple), `p` filled
// (with `tuple`, the ids' tuple too); 0: it is not (the Python checks take it); -1: an error was
// raised (a bad limits tuple, memory).
inline int parse_params(PyObject *d, PyObject *lim, ParsedParams &p, bool tuple = false) {
  if (!PyTuple_CheckExact(lim) || PyTuple_GET_SIZE(lim) != 5) {
    PyErr_Format(PyExc_TypeError, "params_fields: limits must be a tuple of 5 ints");
    return -1;
  }
  long long l[5];
  for (Py_ssize_t i = 0; i < 5; ++i) {
    l[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(lim, i));
    if (l[i] == -1 && PyErr_Occurred()) return -1;
  }
  const long long max_id = l[0], token_chars = l[1], max_tp = l[2], max_tokens = l[3], version = l[4];
  if (!PyDict_CheckExact(d)) return 0;
  // Keys other than exact str could run Python code while compared (and change the dict under
  // the borrowed values below): such a dict is left to the Python checks.
  Py_ssize_t pos = 0;
  PyObject *key, *value;
  while (PyDict_Next(d, &pos, &key, &value)) {
    if (!PyUnicode_CheckExact(key)) return 0;
  }
  PyObject *const *keys = field_keys();
  if (keys == nullptr) return -1;
  // borrowed references; a missing key is NULL (exact str keys only: no error, no Python code)
  PyObject *rid = PyDict_GetItem(d, keys[0]), *eid = PyDict_GetItem(d, keys[1]);
  PyObject *host = PyDict_GetItem(d, keys[2]), *port = PyDict_GetItem(d, keys[3]);
  PyObject *tp = PyDict_GetItem(d, keys[4]), *ids = PyDict_GetItem(d, keys[5]);
  PyObject *num = PyDict_GetItem(d, keys[6]), *tok = PyDict_GetItem(d, keys[7]);
  PyObject *ver = PyDict_GetItem(d, keys[8]), *groups = PyDict_GetItem(d, keys[9]);
  long long port_v, tp_v, num_v, ver_v = version;
  if (!exact_str_in(rid, 1, max_id) || !exact_str_in(eid, 1, max_id) || !exact_str_in(host, 1, max_id) ||
      !exact_int_in(port, 1, 65535, port_v) || !exact_int_in(tp, 1, max_tp, tp_v) || port_v + tp_v - 1 > 65535 ||
      !exact_int_in(num, 1, max_tokens, num_v) || !exact_str_in(tok, token_chars, token_chars) ||
      (ver != nullptr && !exact_int_in(ver, version, version, ver_v)) || (groups != nullptr && groups != Py_None) ||
      ids == nullptr || !PyList_CheckExact(ids) || PyList_GET_SIZE(ids) == 0) {
    return 0;
  }
  const Py_ssize_t k = PyList_GET_SIZE(ids);
  PyObject *raw = PyBytes_FromStringAndSize(nullptr, k * 8);  // filled before anyone sees it
  if (raw == nullptr) return -1;
  uint64_t *out = reinterpret_cast<uint64_t *>(PyBytes_AS_STRING(raw));
  PyObject **items = PySequence_Fast_ITEMS(ids);
  for (Py_ssize_t i = 0; i < k; ++i) {  // exact ints only: no __index__ runs, the list cannot change
    long long v;
    if (!exact_int_in(items[i], 0, INT64_MAX - 1, v)) {
      Py_DECREF(raw);
      return 0;
    }
    out[i] = static_cast<uint64_t>(v);
  }
  // Held before the digest below may let other threads run (they could change `d` and drop
  // what it held).
  PyObject *held[8] = {rid, eid, host, port, tp, ids, num, tok};
  for (PyObject *o : held) Py_INCREF(o);
  p.rid = rid, p.eid = eid, p.host = host, p.port = port, p.tp = tp, p.ids = ids, p.num = num, p.tok = tok;
  p.port_v = port_v, p.tp_v = tp_v, p.num_v = num_v, p.ver_v = ver_v;
  p.raw = raw;
  if (tuple && (p.tup = PyList_AsTuple(ids)) == nullptr) return -1;  // before the list may change
  Blake2b128 h;  // content_digest(num_v, the ids, None); `raw` is this call's own: no other thread sees it
  hash_ids(h, num_v, nullptr, 0, out, static_cast<size_t>(k));
  p.digest = digest_bytes(h);
  return p.digest == nullptr ? -1 : 1;
}

inline PyObject *params_fields(PyObject *, PyObject *const *args, Py_ssize_t n) {
  if (!nargs(n, 2, "params_fields")) return nullptr;
  ParsedParams p;
  const int got = parse_params(args[0], args[1], p, true);
  if (got < 0) return nullptr;
  if (got == 0) Py_RETURN_NONE;
  PyObject *const *keys = field_keys();
  PyObject *fields = PyDict_New();
  PyObject *ver_o = PyLong_FromLongLong(p.ver_v);
  PyObject *values[10] = {p.rid, p.eid, p.host, p.port, p.tp, p.tup, p.num, p.tok, ver_o, Py_None};
  bool ok = fields != nullptr && ver_o != nullptr;
  for (int i = 0; i < 10 && ok; ++i) ok = PyDict_SetItem(fields, keys[i], values[i]) == 0;
  Py_XDECREF(ver_o);
  if (!ok) {
    Py_XDECREF(fields);
    return nullptr;
  }
  Py_INCREF(p.raw);
  Py_INCREF(p.digest);
  return Py_BuildValue("(NNN)", fields, p.raw, p.digest);
}

}  // namespace kvx_ctl
