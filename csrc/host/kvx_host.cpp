// g++ build of kvxfer's CUDA entry points, run serially on the CPU through the host shim.
//
// Exposes a C ABI for ctypes:
//   int kvx_host_launch(const char* name, unsigned grid, unsigned block, const long long* args, int n)
//     runs entry `name` (e.g. "kvx_gather_w16") over the grid with the 64-bit arguments `args`
//     in the entry's order (pointers as integers); returns 0, or -1 for an unknown name / arity.
//   unsigned kvx_host_fastdiv(unsigned d, unsigned n)   n / d through kvx::FastDiv.
#include <cstring>

#include "../kvx_kernels.cu"

namespace {

typedef long long ll;
typedef const long long* cp;


// gather / scatter / copy take 15 / 15 / 22 arguments; unpack them into the entry's types.
#define KVX_HOST_CASES(W)                                                                               \
  if (!std::strcmp(name, "kvx_gather_w" #W)) {                                                         \
    if (n != 15) return -1;                                                                            \
    kvx_shim::run_grid(grid, block, kvx_gather_w##W, a[0], a[1], a[2], a[3], a[4], a[5], (cp)a[6],     \
                       (cp)a[7], a[8], a[9], a[10], a[11], a[12], a[13], (char*)a[14]);                \
    return 0;                                                                                          \
  }                                                                                                    \
  if (!std::strcmp(name, "kvx_scatter_w" #W)) {                                                        \
    if (n != 15) return -1;                                                                            \
    kvx_shim::run_grid(grid, block, kvx_scatter_w##W, a[0], a[1], a[2], a[3], a[4], a[5],             \
                       (const char*)a[6], (cp)a[7], (cp)a[8], a[9], a[10], a[11], a[12], a[13], a[14]); \
    return 0;                                                                                          \
  }                                                                                                    \
  if (!std::strcmp(name, "kvx_copy_w" #W)) {                                                           \
    if (n != 22) return -1;                                                                            \
    kvx_shim::run_grid(grid, block, kvx_copy_w##W, a[0], a[1], a[2], a[3], a[4], a[5], (cp)a[6],       \
                       (cp)a[7], a[8], a[9], a[10], a[11], a[12], a[13], (cp)a[14], (cp)a[15], a[16],  \
                       a[17], a[18], a[19], a[20], a[21]);                                             \
    return 0;                                                                                          \
  }

}  // namespace

extern "C" int kvx_host_launch(const char* name, unsigned grid, unsigned block, const ll* a, int n) {
  if (grid == 0 || block == 0 || block % 32 != 0) return -1;
  KVX_HOST_CASES(16)
  KVX_HOST_CASES(8)
  KVX_HOST_CASES(4)
  KVX_HOST_CASES(2)
  KVX_HOST_CASES(1)
  return -1;
}

extern "C" unsigned kvx_host_fastdiv(unsigned d, unsigned n) { return kvx::FastDiv(d).div(n); }
