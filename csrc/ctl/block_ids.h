// kvxfer control-path helpers (kvx_ctl.cpp): a caller's block ids as a checked int64 array, and
// the sets the repeat checks use (hold, release, any_repeat and a load's local ids), and the
// refcount and epoch updates of a hold and a release.
//
// Included by kvx_ctl.cpp and load_book.h: the module is one translation unit (in its hash).

#pragma once

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "ctl_common.h"

namespace kvx_ctl {

// A set of up to `n` non-negative ids: open addressing in twice the slots.
class IdSet {
 public:
  explicit IdSet(Py_ssize_t n) {
    size_t cap = 4;
    while (cap < static_cast<size_t>(n) * 2) cap <<= 1;
    slots_.assign(cap, -1);
    mask_ = cap - 1;
  }
  // True when `id` was not in the set (it is now).
  bool insert(int64_t id) {
    size_t j = static_cast<size_t>((static_cast<uint64_t>(id) * 0x9E3779B97F4A7C15ull) >> 32) & mask_;
    while (slots_[j] != -1) {
      if (slots_[j] == id) return false;
      j = (j + 1) & mask_;
    }
    slots_[j] = id;
    return true;
  }

 private:
  std::vector<int64_t> slots_;
  size_t mask_ = 0;
};

// The bitmap Seen keeps between calls: every bit is 0 between calls (each Seen clears what it
// set). The GIL, held by every function here, serialises its users.
inline std::vector<uint64_t> &shared_bits() {
  static std::vector<uint64_t> bits;
  return bits;
}

// Bitmaps up to this many bits (128 KiB, kept) are used for any count of ids; above it, only
// while the bound stays within 64 bits per id, and never above kBitmapMaxBits (16 MiB).
constexpr uint64_t kBitmapBits = uint64_t{1} << 20;
constexpr uint64_t kBitmapMaxBits = uint64_t{1} << 27;

// A set of up to `n` ids in [0, bound): a bit per possible id in the shared bitmap (a test and a
// set per id, nothing to allocate), or an IdSet when the bound is far above the count. The
// bitmap is cleared at the end: the whole range when it is small next to the count, else the
// words of the ids inserted (kept in a list).
class Seen {
 public:
  Seen(Py_ssize_t n, uint64_t bound) {
    const uint64_t count = n > 0 ? static_cast<uint64_t>(n) : 0;
    if (bound <= kBitmapBits || (bound / 64 <= count && bound <= kBitmapMaxBits)) {
      std::vector<uint64_t> &bits = shared_bits();
      words_ = static_cast<size_t>((bound + 63) / 64);
      if (bits.size() < words_) bits.resize(words_, 0);
      bits_ = bits.data();
      track_ = words_ > 4 * count;  // clearing the whole range would cost more than tracking
      if (track_) set_.reserve(static_cast<size_t>(count));
    } else {
      hash_ = new IdSet(n);
    }
  }
  ~Seen() {
    if (hash_ != nullptr) {
      delete hash_;
    } else if (!track_) {
      std::memset(bits_, 0, words_ * sizeof(uint64_t));
    } else {
      for (int64_t id : set_) bits_[id >> 6] = 0;  // whole words: only bits this Seen set were 1
    }
  }
  Seen(const Seen &) = delete;
  Seen &operator=(const Seen &) = delete;
  // True when `id` (in [0, bound)) was not in the set (it is now).
  bool insert(int64_t id) {
    if (hash_ != nullptr) return hash_->insert(id);
    uint64_t &w = bits_[id >> 6];
    const uint64_t bit = uint64_t{1} << (id & 63);
    if (w & bit) return false;
    w |= bit;
    if (track_) set_.push_back(id);
    return true;
  }

 private:
  uint64_t *bits_ = nullptr;
  size_t words_ = 0;
  bool track_ = false;
  IdSet *hash_ = nullptr;
  std::vector<int64_t> set_;
};

// The refcounts of the blocks `x[0..k)` (ids checked in [0, num_blocks)), each distinct id
// once (a block listed twice counts once, as numpy's refcount[ids] += 1 does): hold_ids counts
// one holder more, unhold_ids one less (undoing a hold), release_ids one less and moves the
// epoch of a block no export holds now (numpy: refcount[ids] -= 1; epochs[ids] += refcount[ids]
// == 0). hold / release of kvx_ctl.cpp and the ExportBook's add and release (export_book.h).
inline void hold_ids(int32_t *r, Py_ssize_t num_blocks, const int64_t *x, Py_ssize_t k) {
  Seen seen(k, static_cast<uint64_t>(num_blocks));
  for (Py_ssize_t i = 0; i < k; ++i) {
    if (seen.insert(x[i])) ++r[x[i]];
  }
}

inline void unhold_ids(int32_t *r, Py_ssize_t num_blocks, const int64_t *x, Py_ssize_t k) {
  Seen seen(k, static_cast<uint64_t>(num_blocks));
  for (Py_ssize_t i = 0; i < k; ++i) {
    if (seen.insert(x[i])) --r[x[i]];
  }
}

// release_ids with the set made by the caller (sized for k ids below num_blocks): made before
// the caller's first write, the release cannot throw (it allocates nothing).
inline void release_seen(Seen &seen, int32_t *r, int64_t *e, const int64_t *x, Py_ssize_t k) {
  for (Py_ssize_t i = 0; i < k; ++i) {
    if (seen.insert(x[i]) && --r[x[i]] == 0) ++e[x[i]];
  }
}

inline void release_ids(int32_t *r, int64_t *e, Py_ssize_t num_blocks, const int64_t *x, Py_ssize_t k) {
  Seen seen(k, static_cast<uint64_t>(num_blocks));
  release_seen(seen, r, e, x, k);
}

// Whether `x[0..n)` (ids in [0, bound)) names some value twice.
inline bool has_repeat(const int64_t *x, Py_ssize_t n, uint64_t bound) {
  if (n < 2) return false;
  Seen seen(n, bound);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!seen.insert(x[i])) return true;
  }
  return false;
}

// The first `need` ids of the list or tuple `seq` as a new bytearray of int64, each in
// [0, num_blocks) and, with `unique`, none repeated; NULL with TypeError / ValueError naming
// the problem otherwise (ids_from_seq's checks; LoadBook.begin's local ids). `exact`, when
// given: set to whether each of those items is exactly an int (exports.py's exact_ints).
// `run_index` false: an item that is not an int (whose __index__ would run Python code) is a
// TypeError instead (ExportBook.export runs no code of the caller's).
inline PyObject *checked_ids(PyObject *seq, Py_ssize_t need, long long num_blocks, bool unique,
                             bool *exact = nullptr, bool run_index = true) {
  if (exact != nullptr) *exact = true;
  if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) {
    return PyErr_Format(PyExc_TypeError, "block_ids: must be a list or tuple, got %s", Py_TYPE(seq)->tp_name);
  }
  const Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
  if (need < 0 || len < need) {
    return PyErr_Format(PyExc_ValueError, "block_ids: %zd needed, got %zd", need, len);
  }
  PyObject **items = PySequence_Fast_ITEMS(seq);
  PyObject *out = PyByteArray_FromStringAndSize(nullptr, need * 8);
  if (out == nullptr) return nullptr;
  int64_t *dst = reinterpret_cast<int64_t *>(PyByteArray_AS_STRING(out));
  for (Py_ssize_t i = 0; i < need; ++i) {
    PyObject *o = items[i];
    long long v;
    if (small_int(o, v)) {
      // the common case: a plain int
    } else if (PyBool_Check(o)) {
      Py_DECREF(out);
      return PyErr_Format(PyExc_TypeError, "block_ids: must hold ints, item %zd is a bool", i);
    } else if (PyLong_Check(o)) {
      if (exact != nullptr && !PyLong_CheckExact(o)) *exact = false;
      int overflow = 0;
      v = PyLong_AsLongLongAndOverflow(o, &overflow);
      if (overflow) v = -1;  // out of range below
    } else if (!PyIndex_Check(o)) {
      Py_DECREF(out);
      Py_INCREF(o);  // its __repr__ is Python code: it may drop the list's reference
      PyObject *r = PyObject_Repr(o);
      if (r != nullptr) {
        PyErr_Format(PyExc_TypeError, "block_ids: must hold ints, item %zd is %s %U", i, Py_TYPE(o)->tp_name, r);
        Py_DECREF(r);
      } else {  // a repr that raised: the type names it
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "block_ids: must hold ints, item %zd is a %s", i, Py_TYPE(o)->tp_name);
      }
      Py_DECREF(o);
      return nullptr;
    } else if (!run_index) {
      Py_DECREF(out);
      return PyErr_Format(PyExc_TypeError, "block_ids: item %zd is a %s, not an int", i, Py_TYPE(o)->tp_name);
    } else {
      if (exact != nullptr) *exact = false;
      // __index__ is Python code: it may change the list under us. Hold the item, and read the
      // list's items again afterwards.
      Py_INCREF(o);
      PyObject *ix = PyNumber_Index(o);
      Py_DECREF(o);
      if (ix == nullptr) {
        Py_DECREF(out);
        return nullptr;
      }
      int overflow = 0;
      v = PyLong_AsLongLongAndOverflow(ix, &overflow);
      Py_DECREF(ix);
      if (overflow) v = -1;
      if (PySequence_Fast_GET_SIZE(seq) < need) {
        Py_DECREF(out);
        return PyErr_Format(PyExc_ValueError, "block_ids: the list changed while it was read");
      }
      items = PySequence_Fast_ITEMS(seq);
    }
    if (v == -1 && PyErr_Occurred()) {
      Py_DECREF(out);
      return nullptr;
    }
    if (v < 0 || v >= num_blocks) {
      Py_DECREF(out);
      return PyErr_Format(PyExc_ValueError, "block_ids: out of range [0, %lld) (item %zd)", num_blocks, i);
    }
    dst[i] = v;
  }
  if (unique && has_repeat(dst, need, static_cast<uint64_t>(num_blocks))) {
    Py_DECREF(out);
    return PyErr_Format(PyExc_ValueError, "block_ids: repeated block id");
  }
  return out;
}

// ids_from_seq(seq, need, num_blocks, unique) -> bytearray of `need` int64 ids.
// `seq`: a list or tuple of ints (anything with __index__: numpy ints; not bools),
// at least `need` long; each in [0, num_blocks); with `unique`, none repeated.
inline PyObject *ids_from_seq(PyObject *, PyObject *const *args, Py_ssize_t n) {
  if (!nargs(n, 4, "ids_from_seq")) return nullptr;
  const Py_ssize_t need = PyLong_AsSsize_t(args[1]);
  const long long num_blocks = PyLong_AsLongLong(args[2]);
  const int unique = PyObject_IsTrue(args[3]);
  if (PyErr_Occurred() || unique < 0) return nullptr;
  return checked_ids(args[0], need, num_blocks, unique != 0);
}

}  // namespace kvx_ctl
