// kvxfer control-path helpers: the per-request bookkeeping on block-id arrays, one C loop each.
//
// A CPython extension module (_kvx_ctl), built like the CPU backend (kvxfer/backends/cpu_build.py:
// at install time when a C++ compiler is found, else on first use) and wrapped by kvxfer/idops.py,
// which falls back to numpy when it does not load. Why native: a request's bookkeeping is ~15
// small numpy calls (list -> array, range and repeat checks, refcounts, epoch snapshots and
// checks) whose dispatch, paid with a cold cache between scheduler steps, cost more than the work
// (profiling/compare_host_cost.py: these helpers took 23-27 % off a 4K-token request's host cost).
//
// Every function checks its arguments completely (types, item sizes, contiguity, every id in
// range) before it writes anything, and raises TypeError / ValueError / IndexError naming the
// problem. The GIL is held throughout: each call is atomic for Python threads.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kAbiVersion = 6;  // must equal ABI_VERSION in kvxfer/idops.py

// A contiguous buffer of `itemsize`-byte integers ("" item: any bytes-like, itemsize 1).
struct Buf {
  Py_buffer view{};
  bool held = false;
  ~Buf() {
    if (held) PyBuffer_Release(&view);
  }
  Py_ssize_t count() const { return view.len / view.itemsize; }
};

bool int_format(const char *fmt, Py_ssize_t itemsize, Py_ssize_t want) {
  if (itemsize != want || fmt == nullptr) return false;
  if (*fmt == '<' || *fmt == '=' || *fmt == '@') ++fmt;
  if (fmt[0] == '\0' || fmt[1] != '\0') return false;
  return std::strchr(want == 8 ? "qQlL" : "iI", fmt[0]) != nullptr;
}

// Get `obj` as a C-contiguous buffer of `itemsize`-byte ints (0: any bytes-like).
bool get(PyObject *obj, Buf &b, Py_ssize_t itemsize, bool writable, const char *what) {
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
bool ids_in_range(const Buf &ids, Py_ssize_t n, const char *what) {
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

bool nargs(Py_ssize_t got, Py_ssize_t want, const char *name) {
  if (got == want) return true;
  PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", name, want, got);
  return false;
}

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
std::vector<uint64_t> &shared_bits() {
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

// Whether `x[0..n)` (ids in [0, bound)) names some value twice.
bool has_repeat(const int64_t *x, Py_ssize_t n, uint64_t bound) {
  if (n < 2) return false;
  Seen seen(n, bound);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!seen.insert(x[i])) return true;
  }
  return false;
}

// ids_from_seq(seq, need, num_blocks, unique) -> bytearray of `need` int64 ids.
// `seq`: a list or tuple of ints (anything with __index__: numpy ints; not bools),
// at least `need` long; each in [0, num_blocks); with `unique`, none repeated.
PyObject *ids_from_seq(PyObject *, PyObject *const *args, Py_ssize_t n) {
  if (!nargs(n, 4, "ids_from_seq")) return nullptr;
  PyObject *seq = args[0];
  if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) {
    return PyErr_Format(PyExc_TypeError, "block_ids: must be a list or tuple, got %s", Py_TYPE(seq)->tp_name);
  }
  const Py_ssize_t need = PyLong_AsSsize_t(args[1]);
  const long long num_blocks = PyLong_AsLongLong(args[2]);
  const int unique = PyObject_IsTrue(args[3]);
  if (PyErr_Occurred() || unique < 0) return nullptr;
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
      int overflow = 0;
      v = PyLong_AsLongLongAndOverflow(o, &overflow);
      if (overflow) v = -1;  // out of range below
    } else if (!PyIndex_Check(o)) {
      Py_DECREF(out);
      PyObject *r = PyObject_Repr(o);
      PyErr_Format(PyExc_TypeError, "block_ids: must hold ints, item %zd is %s %U", i, Py_TYPE(o)->tp_name,
                   r ? r : Py_None);
      Py_XDECREF(r);
      return nullptr;
    } else {
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

// hold(refcount int32[B], ids int64[n]): refcount[id] += 1 for each distinct id (a block listed
// twice counts once, as numpy's refcount[ids] += 1 does).
PyObject *hold(PyObject *, PyObject *const *args, Py_ssize_t n) {
  if (!nargs(n, 2, "hold")) return nullptr;
  Buf rc, ids;
  if (!get(args[0], rc, 4, true, "refcount") || !get(args[1], ids, 8, false, "ids")) return nullptr;
  if (!ids_in_range(ids, rc.count(), "hold")) return nullptr;
  int32_t *r = static_cast<int32_t *>(rc.view.buf);
  const int64_t *x = static_cast<const int64_t *>(ids.view.buf);
  const Py_ssize_t k = ids.count();
  Seen seen(k, static_cast<uint64_t>(rc.count()));
  for (Py_ssize_t i = 0; i < k; ++i) {
    if (seen.insert(x[i])) ++r[x[i]];
  }
  Py_RETURN_NONE;
}

// release(refcount int32[B], epochs int64[B], ids int64[n]): refcount[id] -= 1 for each distinct
// id, and the epoch of a block whose count reaches 0 goes up by one (numpy: refcount[ids] -= 1;
// epochs[ids] += refcount[ids] == 0).
PyObject *release(PyObject *, PyObject *const *args, Py_ssize_t n) {
  if (!nargs(n, 3, "release")) return nullptr;
  Buf rc, ep, ids;
  if (!get(args[0], rc, 4, true, "refcount") || !get(args[1], ep, 8, true, "epochs") ||
      !get(args[2], ids, 8, false, "ids")) {
    return nullptr;
  }
  if (ep.count() != rc.count()) {
    return PyErr_Format(PyExc_ValueError, "release: epochs has %zd blocks, refcount %zd", ep.count(), rc.count());
  }
  if (!ids_in_range(ids, rc.count(), "release")) return nullptr;
  int32_t *r = static_cast<int32_t *>(rc.view.buf);
  int64_t *e = static_cast<int64_t *>(ep.view.buf);
  const int64_t *x = static_cast<const int64_t *>(ids.view.buf);
  const Py_ssize_t k = ids.count();
  Seen seen(k, static_cast<uint64_t>(rc.count()));
  for (Py_ssize_t i = 0; i < k; ++i) {
    if (seen.insert(x[i]) && --r[x[i]] == 0) ++e[x[i]];
  }
  Py_RETURN_NONE;
}

// snapshot(epochs int64[B], ids int64[n]) -> bytes: epochs[ids] as n native int64.
PyObject *snapshot(PyObject *, PyObject *const *args, Py_ssize_t n) {
  if (!nargs(n, 2, "snapshot")) return nullptr;
  Buf ep, ids;
  if (!get(args[0], ep, 8, false, "epochs") || !get(args[1], ids, 8, false, "ids")) return nullptr;
  if (!ids_in_range(ids, ep.count(), "snapshot")) return nullptr;
  const Py_ssize_t k = ids.count();
  PyObject *out = PyBytes_FromStringAndSize(nullptr, k * 8);
  if (out == nullptr) return nullptr;
  int64_t *d = reinterpret_cast<int64_t *>(PyBytes_AS_STRING(out));
  const int64_t *e = static_cast<const int64_t *>(ep.view.buf);
  const int64_t *x = static_cast<const int64_t *>(ids.view.buf);
  for (Py_ssize_t i = 0; i < k; ++i) d[i] = e[x[i]];
  return out;
}

// Whether epochs[ids] (ids checked in range) equal the int64 of the bytes-like `snap` (not when
// its length differs).
bool same_epochs(const Buf &ep, const Buf &ids, const Buf &snap) {
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

// unchanged(epochs int64[B], ids int64[n], snap) -> bool: epochs[ids] equals the n int64 of the
// bytes-like `snap` (False when its length differs).
PyObject *unchanged(PyObject *, PyObject *const *args, Py_ssize_t n) {
  if (!nargs(n, 3, "unchanged")) return nullptr;
  Buf ep, ids, snap;
  if (!get(args[0], ep, 8, false, "epochs") || !get(args[1], ids, 8, false, "ids") ||
      !get(args[2], snap, 0, false, "snapshot")) {
    return nullptr;
  }
  if (!ids_in_range(ids, ep.count(), "unchanged")) return nullptr;
  return PyBool_FromLong(same_epochs(ep, ids, snap));
}

// moved(epochs int64[B], ids_list, snaps) -> list of the indices i whose epochs[ids_list[i]] no
// longer equal snaps[i] (bytes-like, as many int64 as ids). One call for a batch's loads.
PyObject *moved(PyObject *, PyObject *const *args, Py_ssize_t n) {
  if (!nargs(n, 3, "moved")) return nullptr;
  PyObject *ids_list = args[1], *snaps = args[2];
  if (!PyList_CheckExact(ids_list) || !PyList_CheckExact(snaps)) {
    return PyErr_Format(PyExc_TypeError, "moved: ids_list and snaps must be lists, got %s and %s",
                        Py_TYPE(ids_list)->tp_name, Py_TYPE(snaps)->tp_name);
  }
  const Py_ssize_t m = PyList_GET_SIZE(ids_list);
  if (PyList_GET_SIZE(snaps) != m) {
    return PyErr_Format(PyExc_ValueError, "moved: %zd id arrays, %zd snapshots", m, PyList_GET_SIZE(snaps));
  }
  Buf ep;
  if (!get(args[0], ep, 8, false, "epochs")) return nullptr;
  // Every argument is checked before anything is compared (a bad one raises, never half a list).
  std::vector<Buf> ids(m), snap(m);
  for (Py_ssize_t i = 0; i < m; ++i) {
    if (!get(PyList_GET_ITEM(ids_list, i), ids[i], 8, false, "ids") ||
        !get(PyList_GET_ITEM(snaps, i), snap[i], 0, false, "snapshot") ||
        !ids_in_range(ids[i], ep.count(), "moved")) {
      return nullptr;
    }
  }
  PyObject *out = PyList_New(0);
  if (out == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < m; ++i) {
    if (!same_epochs(ep, ids[i], snap[i])) {
      PyObject *ix = PyLong_FromSsize_t(i);
      if (ix == nullptr || PyList_Append(out, ix) != 0) {
        Py_XDECREF(ix);
        Py_DECREF(out);
        return nullptr;
      }
      Py_DECREF(ix);
    }
  }
  return out;
}

// any_repeat(arrays) -> bool: whether the int64 arrays of the list or tuple `arrays`, read as
// one list, name some id twice (ids must be >= 0: ValueError otherwise).
PyObject *any_repeat(PyObject *, PyObject *const *args, Py_ssize_t n) {
  if (!nargs(n, 1, "any_repeat")) return nullptr;
  PyObject *seq = args[0];
  if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) {
    return PyErr_Format(PyExc_TypeError, "any_repeat: arrays must be a list or tuple, got %s",
                        Py_TYPE(seq)->tp_name);
  }
  const Py_ssize_t m = PySequence_Fast_GET_SIZE(seq);
  PyObject **items = PySequence_Fast_ITEMS(seq);
  std::vector<Buf> bufs(m);
  Py_ssize_t total = 0;
  int64_t top = 0;
  for (Py_ssize_t i = 0; i < m; ++i) {
    if (!get(items[i], bufs[i], 8, false, "ids")) return nullptr;
    const int64_t *x = static_cast<const int64_t *>(bufs[i].view.buf);
    for (Py_ssize_t j = 0, k = bufs[i].count(); j < k; ++j) {
      if (x[j] < 0) {
        return PyErr_Format(PyExc_ValueError, "any_repeat: negative block id %lld (array %zd, item %zd)",
                            static_cast<long long>(x[j]), i, j);
      }
      top = x[j] > top ? x[j] : top;
    }
    total += bufs[i].count();
  }
  if (total < 2) Py_RETURN_FALSE;
  Seen seen(total, static_cast<uint64_t>(top) + 1);
  for (Py_ssize_t i = 0; i < m; ++i) {
    const int64_t *x = static_cast<const int64_t *>(bufs[i].view.buf);
    for (Py_ssize_t j = 0, k = bufs[i].count(); j < k; ++j) {
      if (!seen.insert(x[j])) Py_RETURN_TRUE;
    }
  }
  Py_RETURN_FALSE;
}

// max_id(ids 8-byte ints[n]) -> int: the largest id read as unsigned (a negative one is huge),
// 0 for no ids.
PyObject *max_id(PyObject *, PyObject *const *args, Py_ssize_t n) {
  if (!nargs(n, 1, "max_id")) return nullptr;
  Buf ids;
  if (!get(args[0], ids, 8, false, "ids")) return nullptr;
  const uint64_t *x = static_cast<const uint64_t *>(ids.view.buf);
  uint64_t m = 0;
  for (Py_ssize_t i = 0, k = ids.count(); i < k; ++i) m = x[i] > m ? x[i] : m;
  return PyLong_FromUnsignedLongLong(m);
}

// exact_ints(seq) -> bool: whether every item of the list or tuple `seq` is exactly an int (not a
// bool, a numpy int or another subclass): then the list itself is JSON-safe as the ids it holds.
PyObject *exact_ints(PyObject *, PyObject *const *args, Py_ssize_t n) {
  if (!nargs(n, 1, "exact_ints")) return nullptr;
  PyObject *seq = args[0];
  if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) {
    return PyErr_Format(PyExc_TypeError, "exact_ints: must be a list or tuple, got %s", Py_TYPE(seq)->tp_name);
  }
  PyObject **items = PySequence_Fast_ITEMS(seq);
  for (Py_ssize_t i = 0, k = PySequence_Fast_GET_SIZE(seq); i < k; ++i) {
    if (!PyLong_CheckExact(items[i])) Py_RETURN_FALSE;
  }
  Py_RETURN_TRUE;
}

// ----------------------------------------------------------------------------- lease slots
// The lease-slot table of kvxfer/transports/ipc/slots.py (its docstring is the protocol): an
// int64 array in shared memory that another process writes while these read it. Every word is
// read with an acquire load and written with a release store, so neither the compiler nor the
// CPU reorders the seqlock's reads (gen, fields, gen) or the done mark before its ring entry.
// slot_layout() returns the constants below; slots.py uses these functions only when they
// equal its own.
//
// Every word read from the table is untrusted input: any process of the same user can write
// it. None is used as an index or in arithmetic that could overflow before it is checked; a
// word out of range is "no slot" (slot_read) or "no ring entry" (slot_mark), never a crash.
constexpr Py_ssize_t kHeader = 8 + 56, kSlot = 8 + 16, kProbes = 8, kRing = 56, kMaxDone = 16;
constexpr Py_ssize_t kHOpen = 4, kHBeat = 3, kHDone = 6, kHRing = 8;
constexpr Py_ssize_t kGen = 0, kBind0 = 1, kBind1 = 2, kDeadline = 3, kReady = 4, kFlags = 5, kDone = 8;
constexpr int64_t kLive = 1, kLayerwise = 2, kDoneTp = 512;
constexpr int64_t kInt64Max = INT64_MAX;
// The largest generation a done mark can name: gen * kDoneTp + tp must fit int64 (GEN_MAX).
constexpr int64_t kGenMax = (kInt64Max - (kDoneTp - 1)) / kDoneTp;
// slot_read's refusals (slots.py names them)
enum Refusal { kSilent = 1, kNoSlot = 2, kLayerwiseRefused = 3, kNotReady = 4, kShortLease = 5, kBadWord = 6 };
// slot_mark's outcomes (slots.py logs the last two once)
enum Mark { kMarked = 0, kMarkBadCount = 1, kMarkBadGen = 2 };

inline int64_t ld(const int64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline void st(int64_t *p, int64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

// The number of slots of a table buffer; -1 (ValueError set) when it holds none.
Py_ssize_t table_slots(const Buf &t) {
  const Py_ssize_t n = (t.count() - kHeader) / kSlot;
  if (t.count() < kHeader || n < kProbes) {
    PyErr_Format(PyExc_ValueError, "slots: a table of %zd words holds fewer than %zd slots", t.count(), kProbes);
    return -1;
  }
  return n;
}

// Open, and beat within stale_ns of now_ns. The heartbeat word is compared, not subtracted from:
// a word near int64's ends must not overflow (now_ns and stale_ns are the caller's, sane).
bool alive(const int64_t *t, int64_t now_ns, int64_t stale_ns) {
  return ld(t + kHOpen) != 0 && ld(t + kHBeat) >= now_ns - stale_ns;
}

bool int64_args(PyObject *const *args, Py_ssize_t first, Py_ssize_t count, int64_t *out) {
  for (Py_ssize_t k = 0; k < count; ++k) {
    out[k] = PyLong_AsLongLong(args[first + k]);
    if (out[k] == -1 && PyErr_Occurred()) return false;
  }
  return true;
}

// slot_read(table, epochs, ids, b0, b1, now_ns, stale_ns, need_ns) -> (slot, gen, snapshot) of
// the live export bound to (b0, b1) when it may be read one-sided now (the exporter open and
// beating within stale_ns, the export ready, not layer-wise, leased past need_ns), with
// epochs[ids] taken between two reads of the same even generation; else a Refusal code (int).
// A slot bound to (b0, b1) whose generation is out of [0, kGenMax] is skipped (kBadWord when no
// other probed slot is the export's).
PyObject *slot_read(PyObject *, PyObject *const *args, Py_ssize_t n) {
  if (!nargs(n, 8, "slot_read")) return nullptr;
  Buf tb, ep, ids;
  int64_t v[5];
  if (!get(args[0], tb, 8, false, "table") || !get(args[1], ep, 8, false, "epochs") ||
      !get(args[2], ids, 8, false, "ids") || !int64_args(args, 3, 5, v)) {
    return nullptr;
  }
  const Py_ssize_t num = table_slots(tb);
  if (num < 0 || !ids_in_range(ids, ep.count(), "slot_read")) return nullptr;
  const int64_t b0 = v[0], b1 = v[1], now_ns = v[2], stale_ns = v[3], need_ns = v[4];
  if (b0 < 0) return PyErr_Format(PyExc_ValueError, "slot_read: binding word %lld is negative", (long long)b0);
  const int64_t *t = static_cast<const int64_t *>(tb.view.buf);
  if (!alive(t, now_ns, stale_ns)) return PyLong_FromLong(kSilent);
  Py_ssize_t slot = -1;
  int64_t gen = 0;
  bool bad = false;
  const int64_t *s = nullptr;
  for (Py_ssize_t k = 0; k < kProbes && slot < 0; ++k) {
    const Py_ssize_t i = static_cast<Py_ssize_t>((static_cast<uint64_t>(b0) + k) % static_cast<uint64_t>(num));
    s = t + kHeader + i * kSlot;
    const int64_t g = ld(s + kGen);
    if ((g & 1) || ld(s + kBind0) != b0 || ld(s + kBind1) != b1 || !(ld(s + kFlags) & kLive)) continue;
    if (g < 0 || g > kGenMax) {
      bad = true;
      continue;
    }
    if (ld(s + kGen) == g) slot = i, gen = g;
  }
  if (slot < 0) return PyLong_FromLong(bad ? kBadWord : kNoSlot);
  if (ld(s + kFlags) & kLayerwise) return PyLong_FromLong(kLayerwiseRefused);
  if (!ld(s + kReady)) return PyLong_FromLong(kNotReady);
  if (ld(s + kDeadline) < need_ns) return PyLong_FromLong(kShortLease);
  const Py_ssize_t k = ids.count();
  PyObject *snap = PyBytes_FromStringAndSize(nullptr, k * 8);
  if (snap == nullptr) return nullptr;
  int64_t *d = reinterpret_cast<int64_t *>(PyBytes_AS_STRING(snap));
  const int64_t *e = static_cast<const int64_t *>(ep.view.buf);
  const int64_t *x = static_cast<const int64_t *>(ids.view.buf);
  for (Py_ssize_t i = 0; i < k; ++i) d[i] = ld(e + x[i]);
  if (ld(s + kGen) != gen) {  // rewritten meanwhile: the snapshot may postdate a release
    Py_DECREF(snap);
    return PyLong_FromLong(kNoSlot);
  }
  return Py_BuildValue("(nLN)", slot, static_cast<long long>(gen), snap);
}

// slot_check(table, epochs, ids, snapshot, slot, gen, now_ns, stale_ns) -> 0 when slot `slot`
// is still at generation `gen`, epochs[ids] equal the snapshot and the exporter is alive; 1 when
// the slot or the epochs moved (released), 2 when only the exporter stopped (closed, silent).
PyObject *slot_check(PyObject *, PyObject *const *args, Py_ssize_t n) {
  if (!nargs(n, 8, "slot_check")) return nullptr;
  Buf tb, ep, ids, snap;
  int64_t v[4];
  if (!get(args[0], tb, 8, false, "table") || !get(args[1], ep, 8, false, "epochs") ||
      !get(args[2], ids, 8, false, "ids") || !get(args[3], snap, 0, false, "snapshot") ||
      !int64_args(args, 4, 4, v)) {
    return nullptr;
  }
  const Py_ssize_t num = table_slots(tb);
  if (num < 0 || !ids_in_range(ids, ep.count(), "slot_check")) return nullptr;
  if (v[0] < 0 || v[0] >= num) return PyErr_Format(PyExc_IndexError, "slot_check: slot %lld of %zd", (long long)v[0], num);
  const int64_t *t = static_cast<const int64_t *>(tb.view.buf);
  if (ld(t + kHeader + v[0] * kSlot + kGen) != v[1]) return PyLong_FromLong(1);
  __atomic_thread_fence(__ATOMIC_ACQUIRE);
  if (!same_epochs(ep, ids, snap)) return PyLong_FromLong(1);
  return PyLong_FromLong(alive(t, v[2], v[3]) ? 0 : 2);
}

// slot_mark(table, slot, gen, loader_rank, loader_tp) -> Mark: loader rank `loader_rank` (< 16)
// of a `loader_tp`-rank engine landed slot `slot`'s export of generation `gen`: its done mark,
// then the slot into the done ring, then the ring's count (each a release store, in that
// order). `gen` was read from the table: out of [0, kGenMax] nothing is written (kMarkBadGen).
// A ring count out of [0, INT64_MAX) leaves the ring and the count alone after the mark
// (kMarkBadCount): it is no index, and its increment would overflow.
PyObject *slot_mark(PyObject *, PyObject *const *args, Py_ssize_t n) {
  if (!nargs(n, 5, "slot_mark")) return nullptr;
  Buf tb;
  int64_t v[4];
  if (!get(args[0], tb, 8, true, "table") || !int64_args(args, 1, 4, v)) return nullptr;
  const Py_ssize_t num = table_slots(tb);
  if (num < 0) return nullptr;
  const int64_t slot = v[0], gen = v[1], rank = v[2], tp = v[3];
  if (slot < 0 || slot >= num) return PyErr_Format(PyExc_IndexError, "slot_mark: slot %lld of %zd", (long long)slot, num);
  if (rank < 0 || tp < 1 || tp >= kDoneTp || rank >= tp) {
    return PyErr_Format(PyExc_ValueError, "slot_mark: loader rank %lld of %lld", (long long)rank, (long long)tp);
  }
  if (rank >= kMaxDone) return PyLong_FromLong(kMarked);  // higher ranks notify by message only
  if (gen < 0 || gen > kGenMax) return PyLong_FromLong(kMarkBadGen);
  int64_t *t = static_cast<int64_t *>(tb.view.buf);
  st(t + kHeader + slot * kSlot + kDone + rank, gen * kDoneTp + tp);
  const int64_t w = ld(t + kHDone);
  if (w < 0 || w == kInt64Max) return PyLong_FromLong(kMarkBadCount);
  st(t + kHRing + w % kRing, slot);
  st(t + kHDone, w + 1);
  return PyLong_FromLong(kMarked);
}

// ------------------------------------------------------------------------------ binding
// BLAKE2b (RFC 7693) with a 16-byte digest and no key: the slot binding of slots.py, which
// hashes the content digest, the token and the request id together (hashlib's blake2b of the
// same bytes, which slots.py uses when this module is not loaded; tests compare the two). Here
// because the Python call to hashlib, with building its input, cost ~1 us per export and per
// one-sided load, more than the rest of the lookup.
constexpr uint64_t kBlakeIv[8] = {
    0x6a09e667f3bcc908ull, 0xbb67ae8584caa73bull, 0x3c6ef372fe94f82bull, 0xa54ff53a5f1d36f1ull,
    0x510e527fade682d1ull, 0x9b05688c2b3e6c1full, 0x1f83d9abfb41bd6bull, 0x5be0cd19137e2179ull,
};
constexpr uint8_t kBlakeSigma[10][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4}, {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13}, {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11}, {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5}, {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
};

inline uint64_t rotr64(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

inline uint64_t load_le64(const unsigned char *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

class Blake2b128 {
 public:
  Blake2b128() {
    for (int i = 0; i < 8; ++i) h_[i] = kBlakeIv[i];
    h_[0] ^= 0x01010000ull ^ 16;  // depth 1, fanout 1, no key, 16-byte digest
  }
  void update(const unsigned char *p, size_t n) {
    while (n > 0) {
      if (len_ == 128) {  // a full block and more to come: it is not the last
        t_ += 128;
        compress(false);
        len_ = 0;
      }
      const size_t k = n < 128 - len_ ? n : 128 - len_;
      std::memcpy(buf_ + len_, p, k);
      len_ += k, p += k, n -= k;
    }
  }
  // The digest's two little-endian words.
  void final(uint64_t &w0, uint64_t &w1) {
    t_ += len_;
    std::memset(buf_ + len_, 0, 128 - len_);
    compress(true);
    w0 = h_[0], w1 = h_[1];
  }

 private:
  void compress(bool last) {
    uint64_t m[16], v[16];
    for (int i = 0; i < 16; ++i) m[i] = load_le64(buf_ + 8 * i);
    for (int i = 0; i < 8; ++i) v[i] = h_[i], v[i + 8] = kBlakeIv[i];
    v[12] ^= t_;  // the byte counter's high word stays 0 here (inputs < 2**64 bytes)
    if (last) v[14] = ~v[14];
    for (int r = 0; r < 12; ++r) {
      const uint8_t *s = kBlakeSigma[r % 10];
      mix(v, 0, 4, 8, 12, m[s[0]], m[s[1]]);
      mix(v, 1, 5, 9, 13, m[s[2]], m[s[3]]);
      mix(v, 2, 6, 10, 14, m[s[4]], m[s[5]]);
      mix(v, 3, 7, 11, 15, m[s[6]], m[s[7]]);
      mix(v, 0, 5, 10, 15, m[s[8]], m[s[9]]);
      mix(v, 1, 6, 11, 12, m[s[10]], m[s[11]]);
      mix(v, 2, 7, 8, 13, m[s[12]], m[s[13]]);
      mix(v, 3, 4, 9, 14, m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; ++i) h_[i] ^= v[i] ^ v[i + 8];
  }
  static void mix(uint64_t *v, int a, int b, int c, int d, uint64_t x, uint64_t y) {
    v[a] = v[a] + v[b] + x;
    v[d] = rotr64(v[d] ^ v[a], 32);
    v[c] = v[c] + v[d];
    v[b] = rotr64(v[b] ^ v[c], 24);
    v[a] = v[a] + v[b] + y;
    v[d] = rotr64(v[d] ^ v[a], 16);
    v[c] = v[c] + v[d];
    v[b] = rotr64(v[b] ^ v[c], 63);
  }
  uint64_t h_[8];
  unsigned char buf_[128];
  size_t len_ = 0;
  uint64_t t_ = 0;
};

// binding(token, digest, request_id) -> (b0, b1): BLAKE2b-128 of the bytes-like `digest`, the
// str `token` (ASCII: ValueError otherwise) and the str `request_id` (UTF-8: ValueError for one
// that has none, e.g. a lone surrogate), in that order, as the two 63-bit words slots.binding
// returns.
PyObject *binding(PyObject *, PyObject *const *args, Py_ssize_t n) {
  if (!nargs(n, 3, "binding")) return nullptr;
  PyObject *token = args[0], *request_id = args[2];
  if (!PyUnicode_Check(token) || !PyUnicode_Check(request_id)) {
    return PyErr_Format(PyExc_TypeError, "binding: token and request_id must be str, got %s and %s",
                        Py_TYPE(token)->tp_name, Py_TYPE(request_id)->tp_name);
  }
  if (!PyUnicode_IS_ASCII(token)) return PyErr_Format(PyExc_ValueError, "binding: the token is not ASCII");
  Buf dg;
  if (!get(args[1], dg, 0, false, "digest")) return nullptr;
  Py_ssize_t rid_len = 0;
  const char *rid = PyUnicode_AsUTF8AndSize(request_id, &rid_len);
  if (rid == nullptr) return nullptr;  // UnicodeEncodeError, a ValueError
  Blake2b128 h;
  h.update(static_cast<const unsigned char *>(dg.view.buf), static_cast<size_t>(dg.view.len));
  h.update(static_cast<const unsigned char *>(PyUnicode_DATA(token)), static_cast<size_t>(PyUnicode_GET_LENGTH(token)));
  h.update(reinterpret_cast<const unsigned char *>(rid), static_cast<size_t>(rid_len));
  uint64_t w0, w1;
  h.final(w0, w1);
  constexpr uint64_t kM63 = (uint64_t{1} << 63) - 1;
  return Py_BuildValue("(LL)", static_cast<long long>(w1 & kM63), static_cast<long long>(w0 & kM63));
}

// slot_layout() -> the table layout these functions assume (slots.py compares it with its own).
PyObject *slot_layout(PyObject *, PyObject *) {
  return Py_BuildValue("(nnnnn)", kHeader, kSlot, kProbes, kRing, kMaxDone);
}

PyObject *abi_version(PyObject *, PyObject *) { return PyLong_FromLong(kAbiVersion); }

// METH_FASTCALL functions have another signature than PyCFunction: cast through void (*)().
template <class F>
PyCFunction as_method(F f) {
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(f));
}

PyMethodDef kMethods[] = {
    {"ids_from_seq", as_method(ids_from_seq),
     METH_FASTCALL, "seq, need, num_blocks, unique -> bytearray of int64 block ids"},
    {"hold", as_method(hold), METH_FASTCALL,
     "refcount, ids: count one more holder of each block"},
    {"release", as_method(release),
     METH_FASTCALL, "refcount, epochs, ids: one holder less; bump the epoch of blocks no longer held"},
    {"snapshot", as_method(snapshot),
     METH_FASTCALL, "epochs, ids -> bytes of epochs[ids]"},
    {"unchanged", as_method(unchanged),
     METH_FASTCALL, "epochs, ids, snapshot -> whether epochs[ids] still equals the snapshot"},
    {"moved", as_method(moved), METH_FASTCALL,
     "epochs, ids_list, snaps -> indices of the loads whose epochs moved since their snapshot"},
    {"any_repeat", as_method(any_repeat), METH_FASTCALL,
     "arrays -> whether the int64 arrays, read as one list, name some id twice"},
    {"max_id", as_method(max_id),
     METH_FASTCALL, "ids -> the largest id as unsigned"},
    {"exact_ints", as_method(exact_ints),
     METH_FASTCALL, "seq -> whether every item is exactly an int (no bool, no subclass)"},
    {"slot_read", as_method(slot_read), METH_FASTCALL,
     "table, epochs, ids, b0, b1, now_ns, stale_ns, need_ns -> (slot, gen, snapshot) or a refusal code"},
    {"slot_check", as_method(slot_check), METH_FASTCALL,
     "table, epochs, ids, snapshot, slot, gen, now_ns, stale_ns -> 0 landed, 1 released, 2 exporter stopped"},
    {"slot_mark", as_method(slot_mark), METH_FASTCALL,
     "table, slot, gen, loader_rank, loader_tp -> 0 marked, 1 ring count out of range, 2 gen out of range"},
    {"binding", as_method(binding), METH_FASTCALL,
     "token, digest, request_id -> the two 63-bit words of their BLAKE2b-128 (a lease slot's binding)"},
    {"slot_layout", slot_layout, METH_NOARGS, "the lease-slot table layout these functions assume"},
    {"abi_version", abi_version, METH_NOARGS, "the source's ABI version"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_kvx_ctl", "kvxfer control-path helpers (see kvxfer/idops.py)",
                       -1, kMethods, nullptr, nullptr, nullptr, nullptr};

}  // namespace

extern "C" PyMODINIT_FUNC PyInit__kvx_ctl() { return PyModule_Create(&kModule); }
