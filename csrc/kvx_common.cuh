// kvxfer CUDA kernels: portability layer shared by nvcc, NVRTC and the g++ host shim.
//
// Everything here is header-only and includes nothing under nvcc/NVRTC, so NVRTC can compile the
// same sources at run time without a CUDA toolkit's host headers.
#pragma once

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define KVX_HD __host__ __device__ __forceinline__
#define KVX_UNROLL _Pragma("unroll")
#else
#include "host/shim.h"  // g++: __global__/threadIdx/uint4/__ldcs/... emulated serially on the CPU
#define KVX_HD inline
#define KVX_UNROLL
#endif

namespace kvx {

typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

KVX_HD u32 umin(u32 a, u32 b) { return a < b ? a : b; }

KVX_HD u32 mulhi(u32 a, u32 b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return static_cast<u32>((static_cast<u64>(a) * b) >> 32);
#endif
}

// n / d for any 32-bit n and 1 <= d < 2^31 by one multiply-high, add and shift
// (round-up reciprocal: with s = ceil(log2 d), m = floor(2^32 * (2^s - d) / d) + 1,
//  n / d == (mulhi(n, m) + n) >> s, the sum taken in 64 bits).
// Integer division is tens of instructions on the GPU; the copy loop divides per 16-byte vector.
struct FastDiv {
  u32 d, m, s;
  KVX_HD FastDiv() : d(1), m(1), s(0) {}
  KVX_HD explicit FastDiv(u32 divisor) : d(divisor), m(1), s(0) {
    while ((1ull << s) < d) ++s;
    m = static_cast<u32>(((1ull << 32) * ((1ull << s) - d)) / d + 1);
  }
  KVX_HD u32 div(u32 n) const { return static_cast<u32>((static_cast<u64>(mulhi(n, m)) + n) >> s); }
};

// The widest integer type of W bytes (W = 16, 8, 4, 2, 1); a copy unit.
template <int W> struct Vec;
template <> struct Vec<16> { typedef uint4 T; };
template <> struct Vec<8> { typedef uint2 T; };
template <> struct Vec<4> { typedef unsigned int T; };
template <> struct Vec<2> { typedef unsigned short T; };
template <> struct Vec<1> { typedef unsigned char T; };

// Streaming (evict-first) load/store: every byte is touched once, so keep it out of the way of
// the engine's working set in L2. Pointers must be W-aligned (checked by UBSan in the host shim).
template <int W> KVX_HD typename Vec<W>::T load_stream(const char* p) {
  return __ldcs(reinterpret_cast<const typename Vec<W>::T*>(p));
}
template <int W> KVX_HD void store_stream(char* p, typename Vec<W>::T v) {
  __stcs(reinterpret_cast<typename Vec<W>::T*>(p), v);
}

KVX_HD char* as_ptr(i64 address) { return reinterpret_cast<char*>(static_cast<u64>(address)); }

}  // namespace kvx
