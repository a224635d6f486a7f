// The two hashes of kvxfer/auth.py on the per-request path, one native call each:
//
//   content_digest(num_tokens, ids, groups) -> 16 bytes
//       BLAKE2b-128 of a 14-byte header (num_tokens as 8 bytes, little-endian; 1 when the
//       request has several KV cache groups, else 0; the number of groups as 4 bytes; the ids'
//       width, 4 when every id is below 2**32, else 8), then the ids per group (8 bytes each),
//       then the block ids at that width, little-endian.
//   token(key, request_id, nonce, digest) -> str
//       nonce.hex() + the hex of keyed BLAKE2b-128(key; request_id UTF-8, 0, nonce, digest).
//   export_token(key, request_id, nonce, num_tokens, ids, groups) -> (token, digest)
//       both of an export in one call.
//
// Each equals what auth.py computes with hashlib when this module is not loaded (the tests run
// both on the same inputs). Why native: at export the digest and the token were two Python
// calls into hashlib plus the building of their inputs and a hex conversion, and a one-sided
// load makes the digest again; measured in profiling/results/2026-11-28-cpu-native-hostcost.
//
// Included by kvx_ctl.cpp alone: the module is one translation unit (this header is in its hash).

#pragma once

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>

#include <cstdint>
#include <cstring>

#include "blake2b.h"
#include "ctl_common.h"

namespace kvx_ctl {

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "token_hash.h hashes int64 ids as their bytes: a little-endian host is assumed"
#endif

// Ids from which the digest lets other threads run while it hashes: 8192 ids (a 128K-token
// request at block 16) hash for ~30 times as long as 256 ids do, long next to taking the GIL
// back, which cost a 256-id digest several times its hash when hashlib let it go at 2 KiB
// (profiling/results/2026-11-26-cpu-onesided-hostcost).
constexpr size_t kDigestFreeGilIds = 8192;
// Ids packed to 4 bytes per hash update (on the stack).
constexpr size_t kPackIds = 256;

inline void store_le64(unsigned char *p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}

inline PyObject *digest_bytes(Blake2b128 &h) {
  uint64_t w0, w1;
  h.final(w0, w1);
  unsigned char out[16];
  store_le64(out, w0);
  store_le64(out + 8, w1);
  return PyBytes_FromStringAndSize(reinterpret_cast<const char *>(out), 16);
}

// The content digest's hash (see the file's head) of num_tokens, the ids per group (`groups`,
// `num_groups` of them; null: one group) and the ids (`k` non-negative 8-byte ints). The ids'
// width is their own: 4 bytes each when all are below 2**32 (every real cache), which halves
// what is hashed.
inline void hash_ids(Blake2b128 &h, long long num_tokens, const int64_t *groups, Py_ssize_t num_groups,
                     const uint64_t *ids, size_t k) {
  uint64_t top = 0;
  for (size_t i = 0; i < k; ++i) top |= ids[i];
  const bool narrow = top >> 32 == 0;
  unsigned char head[14];
  store_le64(head, static_cast<uint64_t>(num_tokens));
  head[8] = groups != nullptr ? 1 : 0;
  const uint32_t ng = groups != nullptr ? static_cast<uint32_t>(num_groups) : 0;
  for (int i = 0; i < 4; ++i) head[9 + i] = static_cast<unsigned char>(ng >> (8 * i));
  head[13] = narrow ? 4 : 8;
  h.update(head, 14);
  if (groups != nullptr) {
    h.update(reinterpret_cast<const unsigned char *>(groups), static_cast<size_t>(num_groups) * 8);
  }
  auto all = [&] {
    if (!narrow) {
      h.update(reinterpret_cast<const unsigned char *>(ids), k * 8);
      return;
    }
    uint32_t packed[kPackIds];
    for (size_t at = 0; at < k; at += kPackIds) {
      const size_t m = k - at < kPackIds ? k - at : kPackIds;
      for (size_t i = 0; i < m; ++i) packed[i] = static_cast<uint32_t>(ids[at + i]);
      h.update(reinterpret_cast<const unsigned char *>(packed), m * 4);
    }
  };
  if (k >= kDigestFreeGilIds) {  // the caller holds the ids' memory: it stays valid
    Py_BEGIN_ALLOW_THREADS all();
    Py_END_ALLOW_THREADS
  } else {
    all();
  }
}

inline void hash_content(Blake2b128 &h, long long num_tokens, const Buf *groups, const Buf &ids) {
  hash_ids(h, num_tokens, groups != nullptr ? static_cast<const int64_t *>(groups->view.buf) : nullptr,
           groups != nullptr ? groups->count() : 0, static_cast<const uint64_t *>(ids.view.buf),
           static_cast<size_t>(ids.count()));
}

// num_tokens, ids and groups (None: one group) of a content digest's call, checked.
inline bool content_args(PyObject *const *args, long long &num_tokens, Buf &ids, Buf &groups, const char *fn) {
  num_tokens = PyLong_AsLongLong(args[0]);
  if (num_tokens == -1 && PyErr_Occurred()) return false;
  if (num_tokens < 0) {
    PyErr_Format(PyExc_ValueError, "%s: num_tokens %lld < 0", fn, num_tokens);
    return false;
  }
  return get(args[1], ids, 8, false, "ids") && (args[2] == Py_None || get(args[2], groups, 8, false, "groups"));
}

// content_digest(num_tokens, ids, groups): ids and groups (None: one group) 8-byte ints.
inline PyObject *content_digest(PyObject *, PyObject *const *args, Py_ssize_t n) {
  if (!nargs(n, 3, "content_digest")) return nullptr;
  long long num_tokens;
  Buf ids, groups;
  if (!content_args(args, num_tokens, ids, groups, "content_digest")) return nullptr;
  Blake2b128 h;
  hash_content(h, num_tokens, groups.held ? &groups : nullptr, ids);
  return digest_bytes(h);
}

// The token of request_id (str) under key with nonce (8 bytes) and digest, as a new str.
inline PyObject *make_token(PyObject *key_o, PyObject *rid_o, PyObject *nonce_o, const unsigned char *digest,
                            size_t digest_len) {
  if (!PyUnicode_Check(rid_o)) {
    return PyErr_Format(PyExc_TypeError, "token: request_id must be str, got %s", Py_TYPE(rid_o)->tp_name);
  }
  Buf key, nonce;
  if (!get(key_o, key, 0, false, "key") || !get(nonce_o, nonce, 0, false, "nonce")) return nullptr;
  if (key.view.len < 1 || key.view.len > 64) {
    return PyErr_Format(PyExc_ValueError, "token: the key must be 1 to 64 bytes, got %zd", key.view.len);
  }
  if (nonce.view.len != 8) return PyErr_Format(PyExc_ValueError, "token: the nonce must be 8 bytes, got %zd", nonce.view.len);
  Py_ssize_t rid_len = 0;
  const char *rid = PyUnicode_AsUTF8AndSize(rid_o, &rid_len);
  if (rid == nullptr) return nullptr;  // UnicodeEncodeError, a ValueError
  Blake2b128 h(static_cast<const unsigned char *>(key.view.buf), static_cast<size_t>(key.view.len));
  const unsigned char zero = 0;
  h.update(reinterpret_cast<const unsigned char *>(rid), static_cast<size_t>(rid_len));
  h.update(&zero, 1);
  h.update(static_cast<const unsigned char *>(nonce.view.buf), 8);
  h.update(digest, digest_len);
  uint64_t w0, w1;
  h.final(w0, w1);
  unsigned char raw[24];
  std::memcpy(raw, nonce.view.buf, 8);
  store_le64(raw + 8, w0);
  store_le64(raw + 16, w1);
  static const char kHex[] = "0123456789abcdef";
  char out[48];
  for (int i = 0; i < 24; ++i) out[2 * i] = kHex[raw[i] >> 4], out[2 * i + 1] = kHex[raw[i] & 15];
  return PyUnicode_FromStringAndSize(out, 48);
}

// token(key, request_id, nonce, digest) -> the 48-character token (see the file's head).
inline PyObject *token(PyObject *, PyObject *const *args, Py_ssize_t n) {
  if (!nargs(n, 4, "token")) return nullptr;
  Buf dg;  // the request id's type named first, as make_token would
  if (!PyUnicode_Check(args[1])) return make_token(args[0], args[1], args[2], nullptr, 0);
  if (!get(args[3], dg, 0, false, "digest")) return nullptr;
  return make_token(args[0], args[1], args[2], static_cast<const unsigned char *>(dg.view.buf),
                    static_cast<size_t>(dg.view.len));
}

// export_token(key, request_id, nonce, num_tokens, ids, groups) -> (token, digest): an export's
// content digest and its token in one call (what export() makes per request).
inline PyObject *export_token(PyObject *, PyObject *const *args, Py_ssize_t n) {
  if (!nargs(n, 6, "export_token")) return nullptr;
  long long num_tokens;
  Buf ids, groups;
  if (!content_args(args + 3, num_tokens, ids, groups, "export_token")) return nullptr;
  Blake2b128 h;
  hash_content(h, num_tokens, groups.held ? &groups : nullptr, ids);
  uint64_t w0, w1;
  h.final(w0, w1);
  unsigned char dg[16];
  store_le64(dg, w0);
  store_le64(dg + 8, w1);
  PyObject *tok = make_token(args[0], args[1], args[2], dg, 16);
  if (tok == nullptr) return nullptr;
  return Py_BuildValue("(Ny#)", tok, reinterpret_cast<const char *>(dg), static_cast<Py_ssize_t>(16));
}

}  // namespace kvx_ctl
