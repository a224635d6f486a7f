// g++ host shim for kvxfer's CUDA kernel bodies: the CUDA names they use, emulated on the CPU.
//
// A "launch" (run_grid) runs every thread of a 1-D grid one after another, so kernels must not
// synchronise or communicate between threads (kvxfer's copy kernels never do). Vector types keep
// CUDA's alignment so that UBSan (-fsanitize=alignment) flags any load the host code would
// misalign on the GPU.
#pragma once

#include <cstring>

#define __global__
#define __host__
#define __device__
#define __forceinline__ inline

struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned int x, y;
};
static_assert(sizeof(uint4) == 16 && sizeof(uint2) == 8, "CUDA vector type sizes");
struct dim3 {
  unsigned int x = 1, y = 1, z = 1;
};

namespace kvx_shim {
// The running thread's coordinates (one emulated thread at a time per OS thread). thread_local:
// the engine launches from several threads at once (an exporter's gather while a loader
// scatters), and shared coordinates made those launches write each other's rows.
inline thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;
}  // namespace kvx_shim
using kvx_shim::blockDim;
using kvx_shim::blockIdx;
using kvx_shim::gridDim;
using kvx_shim::threadIdx;

// Typed dereference (not memcpy): UBSan checks the pointer's alignment for T.
template <class T> inline T __ldcs(const T* p) { return *p; }
template <class T> inline void __stcs(T* p, T v) { *p = v; }

namespace kvx_shim {
// Run `kernel(args...)` for every thread of a 1-D grid of `grid` blocks of `block` threads.
template <class Kernel, class... Args>
void run_grid(unsigned int grid, unsigned int block, Kernel kernel, Args... args) {
  gridDim.x = grid;
  blockDim.x = block;
  for (unsigned int b = 0; b < grid; ++b) {
    blockIdx.x = b;
    for (unsigned int t = 0; t < block; ++t) {
      threadIdx.x = t;
      kernel(args...);
    }
  }
}
}  // namespace kvx_shim
