// kvxfer control-path helpers (kvx_ctl.cpp): the one-sided native lane's records in LoadBook
// (load_book.h): a one-sided load's path in one call at load() and one at poll().
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
//     None on CPU), in `calls` ops calls (default: the lane's per load); until then poll() does
//     not look at it. A list of request ids: a batch launched together (all or none marked, in
//     one call; `calls` counted once, on the first). drop(request_id): it was
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
//     ops calls, latencies the landed ones' (end - start). After record_into(deque), complete()
//     also keeps those (lane_stats(): wire bytes, ops calls, loads landed, their latency sum,
//     busy seconds) and appends the latencies to the deque: kvxfer.metrics.Metrics.follow, so
//     a poll() records its one-sided loads without a Python call.
//
// The lane is a tuple the Python side makes once per peer: (target, tables, epochs, marks, host,
// port, tp_size, block size, num_blocks, local block size, local num_blocks, wire bytes per
// token, ops calls per load, whether every rank the loads notify has a table to mark, peer);
// tables, epochs and marks as onesided_read/onesided_land take them.
//
// Included by kvx_ctl.cpp alone (through load_book_type.h).

#pragma once

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "block_ids.h"
#include "ctl_common.h"
#include "load_book.h"
#include "onesided_reads.h"
#include "params_fields.h"

namespace kvx_ctl {

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
  // the local ids first: their conversion may run an item's __index__ (Python code, which could
  // begin a load itself); what is pending or active is looked at after it
  const Py_ssize_t need = static_cast<Py_ssize_t>((p.num_v + l.local_block_size - 1) / l.local_block_size);
  PyObject *dst_raw = checked_ids(block_ids, need, l.local_num_blocks, true);
  if (dst_raw == nullptr) {  // the Python path raises the same error, naming the problem
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  const int loading = PyDict_Contains(b->pending, rid);
  if (loading) {
    Py_DECREF(dst_raw);
    if (loading < 0) return nullptr;
    Py_RETURN_NONE;  // the Python path raises, naming it
  }
  PyObject *key = PyTuple_Pack(2, p.eid, p.rid);
  if (key == nullptr) {
    Py_DECREF(dst_raw);
    return nullptr;
  }
  const int twice = PySet_Contains(b->active, key), queued_too = twice ? 0 : PySet_Contains(queued, key);
  if (twice || queued_too) {
    Py_DECREF(key);
    Py_DECREF(dst_raw);
    if (twice < 0 || queued_too < 0) return nullptr;
    Py_RETURN_NONE;  // the Python path refuses it as loaded twice in one batch
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
  // room for the flight before anything is written: push_back below cannot throw then
  b->flights->reserve(b->flights->size() + 1);
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

// Whether flight `f` is not launched yet and of request `rid` (a str).
inline bool waits_for(const Flight &f, PyObject *rid) {
  return f.event == nullptr && (f.rid == rid || PyUnicode_Compare(f.rid, rid) == 0);
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
  std::vector<Flight> &fl = *b->flights;
  if (!PyList_CheckExact(args[0])) {
    const Py_ssize_t i = unlaunched(b, args[0]);
    if (i == -2) return nullptr;
    if (i < 0) return PyErr_Format(PyExc_KeyError, "LoadBook.launched: no flight of %R waits for its launch", args[0]);
    Py_INCREF(args[1]);
    fl[i].event = args[1];
    fl[i].calls = calls;
    Py_RETURN_NONE;
  }
  // A batch: every flight found first (nothing marked unless all are), then all marked in this
  // one call, so a poll() on another thread never sees part of a batch launched. Its flights were
  // begun in the list's order: each is looked for below the one after it, then anywhere.
  PyObject *rids = args[0];
  const Py_ssize_t k = PyList_GET_SIZE(rids);
  std::vector<Py_ssize_t> at(static_cast<size_t>(k), -1);
  std::vector<char> taken(fl.size(), 0);  // the flights this call took so far
  Py_ssize_t below = static_cast<Py_ssize_t>(fl.size());
  for (Py_ssize_t j = k - 1; j >= 0; --j) {
    PyObject *rid = PyList_GET_ITEM(rids, j);
    if (!PyUnicode_Check(rid)) {
      return PyErr_Format(PyExc_TypeError, "LoadBook: request_id must be a str, got %s", Py_TYPE(rid)->tp_name);
    }
    // a flight is taken once per call (a request id listed twice needs two flights of it)
    auto free_for = [&](Py_ssize_t x) { return !taken[static_cast<size_t>(x)] && waits_for(fl[x], rid); };
    Py_ssize_t i = below - 1;
    while (i >= 0 && !free_for(i)) --i;
    if (i < 0) {  // begun out of order: any flight of it not launched and not taken by this call
      for (i = static_cast<Py_ssize_t>(fl.size()) - 1; i >= 0 && !free_for(i); --i) {
      }
    }
    if (PyErr_Occurred()) return nullptr;  // a str subclass's comparison failed
    if (i < 0) return PyErr_Format(PyExc_KeyError, "LoadBook.launched: no flight of %R waits for its launch", rid);
    at[static_cast<size_t>(j)] = i;
    taken[static_cast<size_t>(i)] = 1;
    below = i;
  }
  for (Py_ssize_t j = 0; j < k; ++j) {
    Flight &f = fl[static_cast<size_t>(at[static_cast<size_t>(j)])];
    Py_INCREF(args[1]);
    f.event = args[1];
    f.calls = j == 0 && calls >= 0 ? calls : (calls >= 0 ? 0 : -1);
  }
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

inline bool record_lane(LoadBook *b, double first, double end, long long nbytes, long long calls, PyObject *lats);

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
  std::vector<Flight> still;
  still.reserve(mine.size());  // before the flights leave the book: their return cannot throw
  keep.reserve(keep.size() + mine.size());  // the book's vector after the swap: room to return them
  fl.swap(keep);
  PyObject *results = PyList_New(0), *events = PyList_New(0), *late = PyList_New(0), *lats = PyList_New(0);
  PyObject *now_o = PyLong_FromLongLong(now_ns);
  double first = std::numeric_limits<double>::infinity();
  long long nbytes = 0, calls = 0;
  std::vector<std::pair<PyObject *, int>> asked;  // (event, done) queried in this call
  size_t i = 0;
  bool ok = results != nullptr && events != nullptr && late != nullptr && lats != nullptr && now_o != nullptr;
  for (; ok && i < mine.size(); ++i) {
    Flight &f = mine[i];
    if (f.event != Py_None) {
      // Asked once per event in a call: the flights of a batch share one, and all of them are
      // then reported in the same call (its event goes back to the pool once, after the last).
      int done = -1;
      for (const auto &q : asked) {
        if (q.first == f.event) done = q.second;
      }
      if (done < 0) {
        PyObject *r = PyObject_CallOneArg(event_done, f.event);
        done = r == nullptr ? -1 : PyObject_IsTrue(r);
        Py_XDECREF(r);
        if (done < 0) {
          ok = false;
          break;
        }
        asked.emplace_back(f.event, done);
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
    // The flights taken so far are released; those whose report is the caller's (results:
    // released or stopped) would stay pending, never reported: they fail here, then the error
    // goes on.
    if (results != nullptr && PyList_GET_SIZE(results) > 0) {
      PyObject *et, *ev, *tb;
      PyErr_Fetch(&et, &ev, &tb);
      PyObject *why = PyUnicode_FromString("one-sided load: its report was lost to an error in the same poll()");
      for (Py_ssize_t r = 0; why != nullptr && r < PyList_GET_SIZE(results); ++r) {
        PyObject *row = PyList_GET_ITEM(results, r);
        const long code = PyLong_AsLong(PyTuple_GET_ITEM(row, 0));
        if (code == 0 || (code & 15) == 3) continue;  // landed: finished already
        if (fail_rid(b, PyTuple_GET_ITEM(row, 4), why) < 0) PyErr_Clear();
      }
      if (why == nullptr) PyErr_Clear();
      Py_XDECREF(why);
      PyErr_Restore(et, ev, tb);
    }
    Py_XDECREF(results);
    Py_XDECREF(events);
    Py_XDECREF(late);
    Py_XDECREF(lats);
    return nullptr;
  }
  if (first == std::numeric_limits<double>::infinity()) first = end;
  if (b->latencies != nullptr && !record_lane(b, first, end, nbytes, calls, lats)) {
    // the reports stand (the loads are finished in the book); only the metrics lost them
    PyErr_WriteUnraisable(b->latencies);
  }
  return Py_BuildValue("(NNNdLLN)", results, events, late, first, nbytes, calls, lats);
}

// The lane's metrics of one complete(): its reports' [first, end], wire bytes, ops calls and the
// landed loads' latencies (Metrics.record_loads's arithmetic); false with an error set when the
// deque would not take the latencies (then nothing was counted).
inline bool record_lane(LoadBook *b, double first, double end, long long nbytes, long long calls, PyObject *lats) {
  const Py_ssize_t k = PyList_GET_SIZE(lats);
  if (k > 0) {
    double sum = 0;  // before extend(), which is any Python (it could change the list)
    for (Py_ssize_t i = 0; i < k; ++i) sum += PyFloat_AS_DOUBLE(PyList_GET_ITEM(lats, i));
    static PyObject *extend = nullptr;  // interned once: a lookup by a new str each call cost more
    if (extend == nullptr && (extend = PyUnicode_InternFromString("extend")) == nullptr) return false;
    PyObject *r = PyObject_CallMethodOneArg(b->latencies, extend, lats);
    if (r == nullptr) return false;
    Py_DECREF(r);
    b->lane_transfers += k;
    b->lane_latency_sum += sum;
  }
  b->lane_bytes += nbytes;
  b->lane_calls += calls;
  if (b->span_end < b->span_start || first > b->span_end) {  // none open, or this one starts after it
    if (b->span_end >= b->span_start) b->lane_busy_closed += b->span_end - b->span_start;
    b->span_start = first, b->span_end = end;
  } else {  // overlaps the open span
    b->span_start = first < b->span_start ? first : b->span_start;
    b->span_end = end > b->span_end ? end : b->span_end;
  }
  return true;
}

// record_into(deque): complete() keeps the lane's metrics from now on (lane_stats()), the landed
// loads' latencies appended to `deque` (anything with extend()).
inline PyObject *book_record_into(PyObject *self, PyObject *const *args, Py_ssize_t n) {
  LoadBook *b = reinterpret_cast<LoadBook *>(self);
  if (!nargs(n, 1, "LoadBook.record_into")) return nullptr;
  if (!PyObject_HasAttrString(args[0], "extend")) {
    return PyErr_Format(PyExc_TypeError, "record_into: a deque (with extend), got %s", Py_TYPE(args[0])->tp_name);
  }
  Py_INCREF(args[0]);
  Py_XSETREF(b->latencies, args[0]);
  Py_RETURN_NONE;
}

// lane_stats() -> (wire bytes, ops calls, loads landed, their latency sum, busy seconds)
inline PyObject *book_lane_stats(PyObject *self, PyObject *) {
  LoadBook *b = reinterpret_cast<LoadBook *>(self);
  const double open = b->span_end >= b->span_start ? b->span_end - b->span_start : 0.0;
  return Py_BuildValue("(LLLdd)", b->lane_bytes, b->lane_calls, b->lane_transfers, b->lane_latency_sum,
                       b->lane_busy_closed + open);
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

}  // namespace kvx_ctl
