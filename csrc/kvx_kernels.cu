// kvxfer CUDA kernels: extern "C" entry points (plain pointer and 64-bit integer arguments).
//
// For every copy width W in {16, 8, 4, 2, 1} bytes (the host picks the widest that divides the
// row size, every base address and every stride):
//   kvx_gather_w<W>(shape, src paged, wire)     paged cache -> dense wire
//   kvx_scatter_w<W>(shape, wire, dst paged)    dense wire  -> paged cache
//   kvx_copy_w<W>(shape, src paged, dst paged)  paged cache -> paged cache
// shape = H, L, KV, T, row_bytes, chunk
// paged = layers (device table of L base addresses, head_start folded in), block_ids (device),
//         byte strides s_kv, s_blk, s_tok, s_head, block_size, slot_block (1: ids are blocks;
//         > 1: ids are token slots of blocks of slot_block tokens, block_size 1)
// The wire may be pinned host memory (its device-mapped address). Launch with a 1-D grid whose
// block size is a multiple of 32; any grid size is correct (the grid is persistent).
#include "kvx_copy.cuh"

#define KVX_SHAPE_ARGS long long H, long long L, long long KV, long long T, long long row_bytes, long long chunk
#define KVX_PAGED_ARGS(p)                                                                              \
  const long long *p##_layers, const long long *p##_ids, long long p##_s_kv, long long p##_s_blk,     \
      long long p##_s_tok, long long p##_s_head, long long p##_block_size, long long p##_slot_block
#define KVX_PAGED(p)                                                                             \
  kvx::make_paged(p##_layers, p##_ids, p##_s_kv, p##_s_blk, p##_s_tok, p##_s_head, p##_block_size, \
                  p##_slot_block)

#define KVX_ENTRIES(W)                                                                                 \
  extern "C" __global__ void kvx_gather_w##W(KVX_SHAPE_ARGS, KVX_PAGED_ARGS(src), char* wire) {      \
    const kvx::Shape s = kvx::make_shape(H, L, KV, T, row_bytes, chunk);                               \
    kvx::move_rows<W>(KVX_PAGED(src), kvx::make_wire(s, reinterpret_cast<long long>(wire)), s);       \
  }                                                                                                    \
  extern "C" __global__ void kvx_scatter_w##W(KVX_SHAPE_ARGS, const char* wire, KVX_PAGED_ARGS(dst)) { \
    const kvx::Shape s = kvx::make_shape(H, L, KV, T, row_bytes, chunk);                               \
    kvx::move_rows<W>(kvx::make_wire(s, reinterpret_cast<long long>(wire)), KVX_PAGED(dst), s);       \
  }                                                                                                    \
  extern "C" __global__ void kvx_copy_w##W(KVX_SHAPE_ARGS, KVX_PAGED_ARGS(src), KVX_PAGED_ARGS(dst)) { \
    const kvx::Shape s = kvx::make_shape(H, L, KV, T, row_bytes, chunk);                               \
    kvx::move_rows<W>(KVX_PAGED(src), KVX_PAGED(dst), s);                                              \
  }

KVX_ENTRIES(16)
KVX_ENTRIES(8)
KVX_ENTRIES(4)
KVX_ENTRIES(2)
KVX_ENTRIES(1)
