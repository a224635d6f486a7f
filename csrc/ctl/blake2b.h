// BLAKE2b (RFC 7693) with a 16-byte digest, plain or keyed: the slot binding of slots.py (the
// content digest, the token and the request id hashed together), and the content digest and
// token MAC of kvxfer/auth.py (token_hash.h). Each gives hashlib's blake2b of the same bytes,
// which the Python side uses when this module is not loaded; tests compare the two. Here
// because the Python calls to hashlib, with building their input, cost more per export and per
// one-sided load than the hashing.
//
// Plain C++ (no Python). Included by kvx_ctl.cpp alone, through lease_slots.h and token_hash.h:
// the module is one translation unit (this header is in its hash).

#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace kvx_ctl {

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
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  uint64_t v;
  // one load: a byte loop here made the hash 2x hashlib's (profiling/results/2026-11-28-cpu-native-hostcost)
  std::memcpy(&v, p, 8);
  return v;
#else
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
#endif
}

class Blake2b128 {
 public:
  // `key`: up to 64 bytes (none by default): keyed BLAKE2b, a MAC (RFC 7693 section 2.5); the
  // key, padded with zeros to a block, is the first block hashed.
  explicit Blake2b128(const unsigned char *key = nullptr, size_t key_len = 0) {
    for (int i = 0; i < 8; ++i) h_[i] = kBlakeIv[i];
    h_[0] ^= 0x01010000ull ^ (static_cast<uint64_t>(key_len) << 8) ^ 16;  // depth 1, fanout 1, 16-byte digest
    if (key_len > 0) {
      std::memset(buf_, 0, 128);
      std::memcpy(buf_, key, key_len);
      len_ = 128;
    }
  }
  void update(const unsigned char *p, size_t n) {
    while (n > 0) {
      if (len_ == 128) {  // a full block and more to come: it is not the last
        t_ += 128;
        compress(buf_, false);
        len_ = 0;
      }
      while (len_ == 0 && n > 128) {  // whole blocks, not the last, hashed where they are
        t_ += 128;
        compress(p, false);
        p += 128, n -= 128;
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
    compress(buf_, true);
    w0 = h_[0], w1 = h_[1];
  }

 private:
  void compress(const unsigned char *block, bool last) {
    uint64_t m[16], v[16];
    for (int i = 0; i < 16; ++i) m[i] = load_le64(block + 8 * i);
    for (int i = 0; i < 8; ++i) v[i] = h_[i], v[i + 8] = kBlakeIv[i];
    v[12] ^= t_;  // the byte counter's high word stays 0 here (inputs < 2**64 bytes)
    if (last) v[14] = ~v[14];
    // Unrolled: the message schedule's indices become constants and m stays in registers.
#pragma GCC unroll 12
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

}  // namespace kvx_ctl
