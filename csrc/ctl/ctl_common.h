// kvxfer control-path helpers (kvx_ctl.cpp): what every function of the module shares. A
// buffer of ints got from a Python object with its checks (item size, contiguity, writability),
// the range check of block ids, the fast read of a small int, the argument count check, and the
// snapshot of epochs (snapshot(), ExportBook.grant) and its comparison with them (unchanged() and
// slot_check()).
//
// Included by kvx_ctl.cpp alone: the module is one translation unit (kvxfer/backends/cpu_build.py
// compiles that file; this header is in its hash).

#pragma once

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <new>

namespace kvx_ctl {

// A contiguous buffer of `itemsize`-byte integers ("" item: any bytes-like, itemsize 1).
struct Buf {
  Py_buffer view{};
  bool held = false;
  ~Buf() {
    if (held) PyBuffer_Release(&view);
  }
  Py_ssize_t count() const { return view.len / view.itemsize; }
};

inline bool int_format(const char *fmt, Py_ssize_t itemsize, Py_ssize_t want) {
  if (itemsize != want || fmt == nullptr) return false;
  if (*fmt == '<' || *fmt == '=' || *fmt == '@') ++fmt;
  if (fmt[0] == '\0' || fmt[1] != '\0') return false;
  return std::strchr(want == 8 ? "qQlL" : "iI", fmt[0]) != nullptr;
}

// Get `obj` as a C-contiguous buffer of `itemsize`-byte ints (0: any bytes-like).
inline bool get(PyObject *obj, Buf &b, Py_ssize_t itemsize, bool writable, const char *what) {
  int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
  if (PyObject_GetBuffer(obj, &b.view, flags) != 0) {
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError, "%s: must be a C-contiguous%s buffer, got %s", what,
                 writable ? " writable" : "", Py_TYPE(obj)->tp_name);
    return false;
  }
  b.held = true;
  if (itemsize && !int_format(b.view.format, b.view.itemsize, itemsize)) {
    PyErr_Format(PyExc_TypeError, "%s: must hold %zd-byte ints, got format '%s' of %zd bytes", what,
                 itemsize, b.view.format ? b.view.format : "B", b.view.itemsize);
    return false;
  }
  return true;
}

// Every id of `ids` (int64) in [0, n); IndexError naming the first that is not.
inline bool ids_in_range(const Buf &ids, Py_ssize_t n, const char *what) {
  const int64_t *x = static_cast<const int64_t *>(ids.view.buf);
  const Py_ssize_t k = ids.count();
  // One branch-free pass (each id read as unsigned: a negative one is huge), which the compiler
  // vectorises; the second loop finds the first offender only when there is one.
  uint64_t any_out = 0;
  for (Py_ssize_t i = 0; i < k; ++i) any_out |= static_cast<uint64_t>(x[i]) >= static_cast<uint64_t>(n);
  if (!any_out) return true;
  for (Py_ssize_t i = 0; i < k; ++i) {
    if (x[i] < 0 || x[i] >= n) {
      PyErr_Format(PyExc_IndexError, "%s: block id %lld (item %zd) out of range [0, %zd)", what,
                   static_cast<long long>(x[i]), i, n);
      return false;
    }
  }
  return true;
}

// The value of `o` when it is exactly an int of at most one internal digit (|v| < 2**30: every
// block id of a real cache), read without a call (PyLong_AsLongLongAndOverflow cost ~20
// instructions an id, callgrind); false for anything else, which the caller converts the slow way.
inline bool small_int(PyObject *o, long long &v) {
#if PY_VERSION_HEX >= 0x030C0000
  if (!PyLong_CheckExact(o) || !PyUnstable_Long_IsCompact(reinterpret_cast<PyLongObject *>(o))) return false;
  v = PyUnstable_Long_CompactValue(reinterpret_cast<PyLongObject *>(o));
  return true;
#elif PY_VERSION_HEX >= 0x030B0000
  if (!PyLong_CheckExact(o)) return false;
  const Py_ssize_t size = Py_SIZE(o);  // digits, with the sign; 0 for zero
  if (size < -1 || size > 1) return false;
  v = static_cast<long long>(size) * static_cast<long long>(reinterpret_cast<PyLongObject *>(o)->ob_digit[0]);
  return true;
#else
  (void)o;
  (void)v;
  return false;
#endif
}

inline bool nargs(Py_ssize_t got, Py_ssize_t want, const char *name) {
  if (got == want) return true;
  PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", name, want, got);
  return false;
}

// Whether epochs[ids] (ids checked in range) equal the int64 of the bytes-like `snap` (not when
// its length differs).
inline bool same_epochs(const Buf &ep, const Buf &ids, const Buf &snap) {
  const Py_ssize_t k = ids.count();
  if (snap.view.len != k * 8) return false;
  const int64_t *e = static_cast<const int64_t *>(ep.view.buf);
  const int64_t *x = static_cast<const int64_t *>(ids.view.buf);
  const unsigned char *s = static_cast<const unsigned char *>(snap.view.buf);
  for (Py_ssize_t i = 0; i < k; ++i) {
    int64_t v;
    std::memcpy(&v, s + 8 * i, 8);  // a bytes object's data need not be 8-byte aligned
    if (e[x[i]] != v) return false;
  }
  return true;
}

// epochs[ids] (int64 epochs, ids checked in their range) as a new bytes object of native int64;
// NULL with an error set when it cannot be made (snapshot(), ExportBook.grant).
inline PyObject *epochs_bytes(const Buf &ep, const Buf &ids) {
  const Py_ssize_t k = ids.count();
  PyObject *out = PyBytes_FromStringAndSize(nullptr, k * 8);
  if (out == nullptr) return nullptr;
  int64_t *d = reinterpret_cast<int64_t *>(PyBytes_AS_STRING(out));
  const int64_t *e = static_cast<const int64_t *>(ep.view.buf);
  const int64_t *x = static_cast<const int64_t *>(ids.view.buf);
  for (Py_ssize_t i = 0; i < k; ++i) d[i] = e[x[i]];
  return out;
}

// Whether two buffers share a byte: an array the call writes must not hold the ids it reads
// (the ids were checked before the writes changed them).
inline bool overlap(const Buf &a, const Buf &b) {
  const char *a0 = static_cast<const char *>(a.view.buf), *b0 = static_cast<const char *>(b.view.buf);
  return a.view.len > 0 && b.view.len > 0 && a0 < b0 + b.view.len && b0 < a0 + a.view.len;
}

// A C++ exception (std::bad_alloc from a vector or a set) must not unwind into CPython, which
// terminates the process: every METH_FASTCALL function is registered through guarded<f>, which
// raises it as MemoryError (or RuntimeError) instead.
template <class T>
struct FastSig;
template <class S>
struct FastSig<PyObject *(*)(S *, PyObject *const *, Py_ssize_t)> {
  using Self = S;
};

template <auto F>
PyObject *guarded(typename FastSig<decltype(F)>::Self *self, PyObject *const *args, Py_ssize_t n) noexcept {
  try {
    return F(self, args, n);
  } catch (const std::bad_alloc &) {
    return PyErr_NoMemory();
  } catch (const std::exception &e) {
    PyErr_Format(PyExc_RuntimeError, "kvxfer control module: %s", e.what());
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "kvxfer control module: an unknown C++ exception");
  }
  return nullptr;
}

}  // namespace kvx_ctl
