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
// problem. The GIL is held throughout (but while content_digest hashes 8192 ids or more, its
// buffers held): each call is atomic for Python threads.
//
// One translation unit: this file holds the block-id bookkeeping and the method table, and
// includes the rest (each header is in the library's hash, kvxfer/backends/cpu_build.py):
// ctl_common.h (the argument checks every function shares), lease_slots.h (the lease-slot
// table of kvxfer/transports/ipc/slots.py: the loader's reads and marks, the binding),
// onesided_reads.h (a one-sided load's reads and marks over all its source ranks in one call),
// load_book.h (the loads in flight on a loader rank), load_lane.h (the one-sided native lane's
// records in them), load_book_type.h (their Python type), export_book.h (the exporter's records
// of its live exports, and its writes to its lease-slot table), export_book_msgs.h (its answers
// to a lease grant request and a notification), export_book_type.h (their Python types), block_ids.h (a caller's ids checked, the repeat sets, refcounts), exporter_slots.h (the
// exporter's writes to that table), token_hash.h (the content digest and token of
// kvxfer/auth.py), blake2b.h (the hash of those three) and params_fields.h (a load's params dict
// checked in one call, kvxfer/params.py).

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "block_ids.h"
#include "ctl_common.h"
#include "export_book_type.h"
#include "exporter_slots.h"
#include "lease_slots.h"
#include "load_book_type.h"
#include "onesided_reads.h"
#include "params_fields.h"
#include "token_hash.h"

namespace kvx_ctl {
namespace {

constexpr int kAbiVersion = 17;  // must equal ABI_VERSION in kvxfer/idops.py

// hold(refcount int32[B], ids int64[n]): refcount[id] += 1 for each distinct id (a block listed
// twice counts once, as numpy's refcount[ids] += 1 does).
PyObject *hold(PyObject *, PyObject *const *args, Py_ssize_t n) {
  if (!nargs(n, 2, "hold")) return nullptr;
  Buf rc, ids;
  if (!get(args[0], rc, 4, true, "refcount") || !get(args[1], ids, 8, false, "ids")) return nullptr;
  if (overlap(rc, ids)) return PyErr_Format(PyExc_ValueError, "hold: ids share memory with refcount");
  if (!ids_in_range(ids, rc.count(), "hold")) return nullptr;
  hold_ids(static_cast<int32_t *>(rc.view.buf), rc.count(), static_cast<const int64_t *>(ids.view.buf), ids.count());
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
  if (overlap(rc, ids) || overlap(ep, ids)) {
    return PyErr_Format(PyExc_ValueError, "release: ids share memory with refcount or epochs");
  }
  if (!ids_in_range(ids, rc.count(), "release")) return nullptr;
  release_ids(static_cast<int32_t *>(rc.view.buf), static_cast<int64_t *>(ep.view.buf), rc.count(),
              static_cast<const int64_t *>(ids.view.buf), ids.count());
  Py_RETURN_NONE;
}

// snapshot(epochs int64[B], ids int64[n]) -> bytes: epochs[ids] as n native int64.
PyObject *snapshot(PyObject *, PyObject *const *args, Py_ssize_t n) {
  if (!nargs(n, 2, "snapshot")) return nullptr;
  Buf ep, ids;
  if (!get(args[0], ep, 8, false, "epochs") || !get(args[1], ids, 8, false, "ids")) return nullptr;
  if (!ids_in_range(ids, ep.count(), "snapshot")) return nullptr;
  return epochs_bytes(ep, ids);
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

PyObject *abi_version(PyObject *, PyObject *) { return PyLong_FromLong(kAbiVersion); }

// METH_FASTCALL functions have another signature than PyCFunction: cast through void (*)().
template <class F>
PyCFunction as_method(F f) {
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(f));
}

PyMethodDef kMethods[] = {
    {"ids_from_seq", as_method(guarded<ids_from_seq>),
     METH_FASTCALL, "seq, need, num_blocks, unique -> bytearray of int64 block ids"},
    {"hold", as_method(guarded<hold>), METH_FASTCALL,
     "refcount, ids: count one more holder of each block"},
    {"release", as_method(guarded<release>),
     METH_FASTCALL, "refcount, epochs, ids: one holder less; bump the epoch of blocks no longer held"},
    {"snapshot", as_method(guarded<snapshot>),
     METH_FASTCALL, "epochs, ids -> bytes of epochs[ids]"},
    {"unchanged", as_method(guarded<unchanged>),
     METH_FASTCALL, "epochs, ids, snapshot -> whether epochs[ids] still equals the snapshot"},
    {"moved", as_method(guarded<moved>), METH_FASTCALL,
     "epochs, ids_list, snaps -> indices of the loads whose epochs moved since their snapshot"},
    {"any_repeat", as_method(guarded<any_repeat>), METH_FASTCALL,
     "arrays -> whether the int64 arrays, read as one list, name some id twice"},
    {"max_id", as_method(guarded<max_id>),
     METH_FASTCALL, "ids -> the largest id as unsigned"},
    {"exact_ints", as_method(guarded<exact_ints>),
     METH_FASTCALL, "seq -> whether every item is exactly an int (no bool, no subclass)"},
    {"slot_read", as_method(guarded<slot_read>), METH_FASTCALL,
     "table, epochs, ids, b0, b1, now_ns, stale_ns, need_ns -> (slot, gen, snapshot) or a refusal code"},
    {"slot_check", as_method(guarded<slot_check>), METH_FASTCALL,
     "table, epochs, ids, snapshot, slot, gen, now_ns, stale_ns -> 0 landed, 1 released, 2 exporter stopped"},
    {"slot_mark", as_method(guarded<slot_mark>), METH_FASTCALL,
     "table, slot, gen, loader_rank, loader_tp -> 0 marked, 1 ring count out of range, 2 gen out of range"},
    {"onesided_read", as_method(guarded<onesided_read>), METH_FASTCALL,
     "tables, epochs, ids, num_tokens, block_size, num_blocks, token, digest, request_id, now_ns, stale_ns, "
     "need_ns -> (b0, b1, reads) of a one-sided load, or a refusal code | source << 4"},
    {"onesided_land", as_method(guarded<onesided_land>), METH_FASTCALL,
     "tables, epochs, ids, reads, marks, b0, b1, loader_rank, loader_tp, now_ns, stale_ns -> 0 landed and "
     "marked, 3 landed (notify), else 1 released / 2 stopped | source << 4"},
    {"slot_open", as_method(guarded<slot_open>), METH_FASTCALL,
     "table, gens, used, b0, b1, deadline_ns, ready, flags -> the slot given the export, or -1"},
    {"slot_close", as_method(guarded<slot_close>), METH_FASTCALL, "table, gens, used, slot: the slot's export ended"},
    {"slot_done", as_method(guarded<slot_done>), METH_FASTCALL,
     "table, gens, used, seen, max_tp -> (ring count, [(slot, [(loader rank, tp), ...]), ...])"},
    {"binding", as_method(guarded<binding>), METH_FASTCALL,
     "token, digest, request_id -> the two 63-bit words of their BLAKE2b-128 (a lease slot's binding)"},
    {"content_digest", as_method(guarded<content_digest>), METH_FASTCALL,
     "num_tokens, ids, groups -> BLAKE2b-128 of them (kvxfer.auth.content_digest)"},
    {"token", as_method(guarded<token>), METH_FASTCALL,
     "key, request_id, nonce, digest -> the 48-character token (kvxfer.auth.request_token)"},
    {"export_token", as_method(guarded<export_token>), METH_FASTCALL,
     "key, request_id, nonce, num_tokens, ids, groups -> (token, digest) of an export (kvxfer.auth)"},
    {"params_fields", as_method(guarded<params_fields>), METH_FASTCALL,
     "d, limits -> (fields, ids, digest) of a plainly good params dict (kvxfer.params), else None"},
    {"slot_layout", slot_layout, METH_NOARGS, "the lease-slot table layout these functions assume"},
    {"abi_version", abi_version, METH_NOARGS, "the source's ABI version"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_kvx_ctl", "kvxfer control-path helpers (see kvxfer/idops.py)",
                       -1, kMethods, nullptr, nullptr, nullptr, nullptr};

}  // namespace
}  // namespace kvx_ctl

extern "C" PyMODINIT_FUNC PyInit__kvx_ctl() {
  PyObject *m = PyModule_Create(&kvx_ctl::kModule);
  if (m == nullptr) return nullptr;
  PyObject *types[] = {kvx_ctl::load_book_type(), kvx_ctl::export_record_type(), kvx_ctl::export_book_type()};
  const char *names[] = {"LoadBook", "ExportRecord", "ExportBook"};
  bool ok = true;
  for (int i = 0; i < 3; ++i) {
    if (types[i] == nullptr || !ok) {
      ok = false;
      Py_XDECREF(types[i]);
      continue;
    }
    if (i == 1) {  // what ExportBook.add makes
      Py_INCREF(types[i]);
      Py_XSETREF(kvx_ctl::record_type_slot(), types[i]);
    }
    if (PyModule_AddObject(m, names[i], types[i]) != 0) {
      Py_DECREF(types[i]);
      ok = false;
    }
  }
  if (!ok) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
