// kvxfer control-path helpers (kvx_ctl.cpp): a plain whole export in one call of the exporter's
// book (ExportBook, export_book.h).
//
//   ExportBook.export(request_id, block_ids, need, num_tokens, deadline, key, token, ready,
//                     frombuffer, dtype) -> (token, ids, exact), or None with nothing written
//
// What TransferEngine.export makes of an export of one KV cache group, not layer-wise, whose
// block ids are a list: the first `need` ids checked (ints in the book's range, none repeated),
// the generation (one more than the last release remembered of the request id, else 0), the
// content digest and the token (auth.py: made with the generation as nonce under `key`, or
// `token`, made by a process without an engine, verified to be this key's for that content), then
// add's repeat check, hold, record and slot (export_book.h's may_add and add_record). `ids` is
// `frombuffer(<the checked ids>, dtype)`: the record's block_ids; `exact`: whether each of those
// `need` items is exactly an int (then the params may carry them as they are). No code of the
// caller's runs here: an item that is not an int (a numpy int: its __index__) takes the Python
// path, so such code runs once, there, as it did before this call existed.
//
// Any export the Python path would refuse or convert (ids that are not ints, out of range or
// repeated, too few; a request id live, or not a str; a given token that is not this key's for
// the content, or is that of the id's last release) gets None before anything is written:
// kvxfer/exports.py then has export() take the Python path, which raises naming the problem. So
// the two paths agree by construction on every refusal, and tests/test_export_book_export.py
// compares what each writes for the exports both take.
//
// Why native: the Python path was five calls into this module and numpy (the ids, the
// generation, the token, the record) with their frames and argument checks, the largest share of
// export() (profiling/results/2026-11-29-cpu-export-native).
//
// Included by kvx_ctl.cpp alone (through export_book_type.h): one translation unit (in its hash).

#pragma once

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>

#include <climits>
#include <cstdint>
#include <cstring>

#include "block_ids.h"
#include "ctl_common.h"
#include "export_book.h"
#include "token_hash.h"

namespace kvx_ctl {

constexpr Py_ssize_t kTokenChars = 48;  // auth.py's TOKEN_CHARS: a 16-hex nonce and a 32-hex MAC

// The value of hex digit `c`, or -1.
inline int hex_digit(unsigned char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// The nonce of `given` (an exact str of kTokenChars ASCII characters whose first 16 are hex) in
// `nonce`; false when it has none (the Python path's verify refuses such a token).
inline bool token_nonce(PyObject *given, unsigned char nonce[8]) {
  if (!PyUnicode_CheckExact(given) || PyUnicode_GET_LENGTH(given) != kTokenChars || !PyUnicode_IS_ASCII(given)) {
    return false;
  }
  const unsigned char *c = PyUnicode_1BYTE_DATA(given);
  for (int i = 0; i < 8; ++i) {
    const int hi = hex_digit(c[2 * i]), lo = hex_digit(c[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    nonce[i] = static_cast<unsigned char>(hi << 4 | lo);
  }
  return true;
}

// Whether the ASCII strs `a` and `b` (kTokenChars each) are equal, in time independent of where
// they differ (auth.py's hmac.compare_digest).
inline bool same_token(PyObject *a, PyObject *b) {
  const unsigned char *x = PyUnicode_1BYTE_DATA(a), *y = PyUnicode_1BYTE_DATA(b);
  unsigned char diff = 0;
  for (Py_ssize_t i = 0; i < kTokenChars; ++i) diff |= static_cast<unsigned char>(x[i] ^ y[i]);
  return diff == 0;
}

// The generation the next export of `rid` gets (exports.py's generation): one more than the
// last release remembered, else 0; -1 with an error set.
inline long long next_gen(ExportBook *b, PyObject *rid) {
  PyObject *was = PyDict_GetItemWithError(b->gone, rid);
  if (was == nullptr) return PyErr_Occurred() ? -1 : 0;
  if (!PyTuple_Check(was) || PyTuple_GET_SIZE(was) != 2) {
    PyErr_SetString(PyExc_TypeError, "ExportBook.gone: its values must be (gen, token) tuples");
    return -1;
  }
  const long long gen = PyLong_AsLongLong(PyTuple_GET_ITEM(was, 0));
  if (gen == -1 && PyErr_Occurred()) return -1;
  if (gen < 0 || gen == LLONG_MAX) {
    PyErr_SetString(PyExc_ValueError, "ExportBook.gone: a generation out of range");
    return -1;
  }
  return gen + 1;
}

// None, for an export the Python path takes (see the file's head): the error a check set is
// dropped, unless it is not one of a check's (memory).
inline PyObject *python_path() {
  if (PyErr_Occurred()) {
    if (!PyErr_ExceptionMatches(PyExc_ValueError) && !PyErr_ExceptionMatches(PyExc_TypeError) &&
        !PyErr_ExceptionMatches(PyExc_OverflowError)) {
      return nullptr;
    }
    PyErr_Clear();
  }
  Py_RETURN_NONE;
}

// export(request_id, block_ids, need, num_tokens, deadline, key, token, ready, frombuffer, dtype)
inline PyObject *xbook_export(ExportBook *b, PyObject *const *args, Py_ssize_t n) {
  if (!nargs(n, 10, "ExportBook.export")) return nullptr;
  PyObject *rid = args[0], *seq = args[1], *key = args[5], *given = args[6];
  const Py_ssize_t need = PyLong_AsSsize_t(args[2]);
  const long long num_tokens = PyLong_AsLongLong(args[3]);
  const double deadline = PyFloat_AsDouble(args[4]);
  const int ready = PyObject_IsTrue(args[7]);
  if (PyErr_Occurred() || ready < 0) return nullptr;
  if (need < 1 || num_tokens < 1) {
    return PyErr_Format(PyExc_ValueError, "ExportBook.export: need %zd and num_tokens %lld must be >= 1", need,
                        num_tokens);
  }
  if (!PyUnicode_CheckExact(rid) || PyUnicode_GET_LENGTH(rid) == 0 || !PyList_CheckExact(seq)) return python_path();
  const int live = PyDict_Contains(b->live, rid);
  if (live < 0) return nullptr;
  if (live) return python_path();  // "already exported", named there
  Buf rc, ep;
  if (!counts(b, rc, ep)) return nullptr;
  bool exact = false;
  Ref raw(checked_ids(seq, need, static_cast<long long>(rc.count()), true, &exact, false), false);
  if (raw.p == nullptr) return python_path();  // too few, not ints, out of range, repeated: named there
  const long long gen = next_gen(b, rid);
  if (gen < 0) return nullptr;
  Ref arr(PyObject_CallFunctionObjArgs(args[8], raw.p, args[9], nullptr), false);  // the record's ids
  if (arr.p == nullptr) return nullptr;
  Buf ids;
  if (!get(arr.p, ids, 8, false, "ids")) return nullptr;
  Blake2b128 h;
  hash_content(h, num_tokens, nullptr, ids);
  uint64_t w0, w1;
  h.final(w0, w1);
  unsigned char dg[16];
  store_le64(dg, w0);
  store_le64(dg + 8, w1);
  unsigned char nonce[8];
  if (given == Py_None) {
    for (int i = 0; i < 8; ++i) nonce[i] = static_cast<unsigned char>(static_cast<unsigned long long>(gen) >> (56 - 8 * i));
  } else if (!token_nonce(given, nonce)) {
    return python_path();  // not a token: refused there
  }
  Ref nonce_b(PyBytes_FromStringAndSize(reinterpret_cast<const char *>(nonce), 8), false);
  if (nonce_b.p == nullptr) return nullptr;
  Ref made(make_token(key, rid, nonce_b.p, dg, 16), false);
  if (made.p == nullptr) return python_path();  // a key or request id make_token refuses
  PyObject *token = made.p;
  if (given != Py_None) {
    if (!same_token(made.p, given)) return python_path();  // not this key's for this content
    token = given;
    const int ok = may_add(b, rid, token);  // the token of the id's last release: refused there
    if (ok < 0) return nullptr;
    if (ok == 0) return python_path();
  }
  Ref digest(PyBytes_FromStringAndSize(reinterpret_cast<const char *>(dg), 16), false);
  if (digest.p == nullptr) return nullptr;
  Ref out(Py_BuildValue("(OOO)", token, arr.p, exact ? Py_True : Py_False), false);  // before any write
  if (out.p == nullptr) return nullptr;
  Ref rec(add_record(b, rid, arr.p, num_tokens, deadline, token, digest.p, gen, Py_None, Py_None, ready != 0),
          false);
  if (rec.p == nullptr) return nullptr;
  Py_INCREF(out.p);
  return out.p;
}

}  // namespace kvx_ctl
