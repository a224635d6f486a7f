// kvxfer CUDA kernels: the copy loop shared by gather, scatter and copy (host+device bodies).
//
// Work decomposition (one launch per call, whatever the number of layers and blocks):
//   rows      one head row = row_bytes contiguous bytes of (head h, layer l, K/V kv, token t)
//   items     (h, l, kv, chunk of `chunk` tokens): a flat space of H*L*KV*ceil(T/chunk) items,
//             numbered in wire order so consecutive items are consecutive wire bytes
//   warps     a persistent grid; warp w moves items w, w + num_warps, ...
//   vectors   inside an item, lane i moves W-byte vectors i, i+32, ... with U loads in flight
//             before the matching stores
// A paged side finds token t's row through its block table (block_ids[t / block_size]) and its
// per-layer base address from a device table; the wire side is dense [H, L, KV, T, row_bytes].
// A paged side whose ids are token slots (slot_block > 1, block_size 1) finds token t at slot
// s = block_ids[t]: block s / slot_block, offset s % slot_block (requests that end inside a
// block share one launch, in any layout).
#pragma once

#include "kvx_common.cuh"

namespace kvx {

// Vectors each lane loads before it stores any: independent loads in flight per thread.
constexpr int kLoadsInFlight = 4;

// One rank's paged cache. Byte strides; `layers[l]` already includes head_start * s_head.
struct Paged {
  const i64* layers;     // [L] base address of each selected layer (device memory)
  const i64* block_ids;  // [ceil(T / block_size)] block (or token slot) of each run of tokens
  i64 s_kv, s_blk, s_tok, s_head;
  FastDiv block_size;
  FastDiv slot_block;  // 1: ids are blocks; > 1: ids are slots of blocks of this many tokens

  KVX_HD i64 item_base(u32 h, u32 l, u32 kv) const { return layers[l] + kv * s_kv + h * s_head; }
  KVX_HD char* row(i64 base, u32 t) const {
    const u32 j = block_size.div(t);
    i64 id = block_ids[j];
    u32 o = t - j * block_size.d;
    if (slot_block.d != 1) {  // uniform across the grid: no divergence; slots < 2^31 (host check)
      const u32 s = static_cast<u32>(id);
      const u32 b = slot_block.div(s);
      o += s - b * slot_block.d;
      id = b;
    }
    return as_ptr(base + id * s_blk + static_cast<i64>(o) * s_tok);
  }
};

// The dense wire [H, L, KV, T, row_bytes].
struct Wire {
  i64 base;
  i64 row_bytes;
  u32 L, KV, T;

  KVX_HD i64 item_base(u32 h, u32 l, u32 kv) const {
    return base + ((static_cast<i64>(h) * L + l) * KV + kv) * static_cast<i64>(T) * row_bytes;
  }
  KVX_HD char* row(i64 item, u32 t) const { return as_ptr(item + static_cast<i64>(t) * row_bytes); }
};

// Sizes of a transfer. Host code guarantees H*L*KV*ceil(T/chunk) + num_threads < 2^32.
struct Shape {
  u32 H, L, KV, T, row_bytes, chunk;
};

KVX_HD Paged make_paged(const i64* layers, const i64* block_ids, i64 s_kv, i64 s_blk, i64 s_tok,
                        i64 s_head, i64 block_size, i64 slot_block) {
  Paged p;
  p.layers = layers;
  p.block_ids = block_ids;
  p.s_kv = s_kv;
  p.s_blk = s_blk;
  p.s_tok = s_tok;
  p.s_head = s_head;
  p.block_size = FastDiv(static_cast<u32>(block_size));
  p.slot_block = FastDiv(static_cast<u32>(slot_block));
  return p;
}

KVX_HD Wire make_wire(const Shape& s, i64 base) {
  Wire w;
  w.base = base;
  w.row_bytes = s.row_bytes;
  w.L = s.L;
  w.KV = s.KV;
  w.T = s.T;
  return w;
}

KVX_HD Shape make_shape(i64 H, i64 L, i64 KV, i64 T, i64 row_bytes, i64 chunk) {
  Shape s;
  s.H = static_cast<u32>(H);
  s.L = static_cast<u32>(L);
  s.KV = static_cast<u32>(KV);
  s.T = static_cast<u32>(T);
  s.row_bytes = static_cast<u32>(row_bytes);
  s.chunk = static_cast<u32>(chunk);
  return s;
}

// Move every row of `shape` from `src` to `dst` in W-byte vectors; the body of every entry point.
// Run by each thread of a 1-D grid whose block size is a multiple of 32. Threads never
// communicate, so the host shim may run them one after another.
template <int W, class Src, class Dst>
KVX_HD void move_rows(const Src& src, const Dst& dst, const Shape& shape) {
  typedef typename Vec<W>::T V;
  const u32 vecs_per_row = shape.row_bytes / W;
  const FastDiv per_row(vecs_per_row);
  const u32 num_chunks = (shape.T + shape.chunk - 1) / shape.chunk;
  const FastDiv div_chunks(num_chunks), div_kv(shape.KV), div_l(shape.L);
  const u32 num_items = shape.H * shape.L * shape.KV * num_chunks;
  const u32 lane = threadIdx.x & 31u;
  const u32 num_warps = (gridDim.x * blockDim.x) >> 5;

  for (u32 item = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; item < num_items; item += num_warps) {
    const u32 r1 = div_chunks.div(item);
    const u32 c = item - r1 * num_chunks;
    const u32 r2 = div_kv.div(r1);
    const u32 kv = r1 - r2 * shape.KV;
    const u32 h = div_l.div(r2);
    const u32 l = r2 - h * shape.L;
    const u32 t0 = c * shape.chunk;
    const u32 num_vecs = umin(shape.chunk, shape.T - t0) * vecs_per_row;
    const i64 src_item = src.item_base(h, l, kv);
    const i64 dst_item = dst.item_base(h, l, kv);

    for (u32 e0 = lane; e0 < num_vecs; e0 += 32u * kLoadsInFlight) {
      V v[kLoadsInFlight];
      u32 tok[kLoadsInFlight], off[kLoadsInFlight];
      KVX_UNROLL
      for (int k = 0; k < kLoadsInFlight; ++k) {
        const u32 e = e0 + 32u * k;
        tok[k] = per_row.div(e);
        off[k] = (e - tok[k] * vecs_per_row) * W;
        if (e < num_vecs) v[k] = load_stream<W>(src.row(src_item, t0 + tok[k]) + off[k]);
      }
      KVX_UNROLL
      for (int k = 0; k < kLoadsInFlight; ++k) {
        if (e0 + 32u * k < num_vecs) store_stream<W>(dst.row(dst_item, t0 + tok[k]) + off[k], v[k]);
      }
    }
  }
}

}  // namespace kvx
