// What one KeyValueCache CUDA launch works on: its buffers, its parameters and its grids (how work is cut
// into blocks, threads and units). Shared by the kernels (kv_cache_work.h), the host that builds the
// parameters (kv_cuda_params.h) and the host runner (tests/host_runner).
#pragma once

#include <cstdint>

#include "kv_types.h"

namespace kvcache {
namespace cuda {

// The buffers of one call. Index arrays are device copies of the host-validated snapshots.
enum Buf : int {
  kSeqstarts,    // int64 [B+1]
  kKvstarts,     // int64 [B+1]
  kStartPos,     // int64 [B]
  kCachestarts,  // int64 [B] (mode 0) or [B, MaxP] (mode 1)
  kKey,          // T1 [seqstarts[B], H, Dh]
  kValue,        // T1 [seqstarts[B], H, Dh]
  kCache,        // rank 5 by layout: T1, int8, or packed int4
  kScale,        // rank 5, last dim Dh / quant_group: T3 (absent without quantization)
  kOutKey,       // T1 [kvstarts[B], H * num_repeat, Dh]
  kOutValue,     // T1 [kvstarts[B], H * num_repeat, Dh]
  // KeyCacheRotaryShift (rotary_work.h) uses kCache and kScale too, and its own tables:
  kSlots,  // int64 [N], device copy of the validated snapshot
  kCos,    // float32 [N, R/2]
  kSin,    // float32 [N, R/2]
  kBufCount
};

struct Rows {  // element offset of (layer, kv, head, slot) rows: l*layer + kv*kv + h*head + s*slot
  int64_t layer, kv, head, slot;
};

struct Params {
  // attributes
  int64_t layer_idx, quant_group, num_repeat, cache_mode, page_size;
  int64_t out_heads;  // H * num_repeat, checked on the host to fit (as are all output offsets)
  // sizes
  int64_t batch, heads, head_dim, max_p;
  int64_t longest_seq, longest_kv;  // longest sequence of this call's seqstarts / kvstarts
  Rows cache_rows, scale_rows;
  bool aligned16;        // every T1 buffer and the cache start on a 16-byte boundary
  void* ptr[kBufCount];  // base of each buffer (device pointers on the GPU)
};

// 16 bytes moved as one access (one 128-bit load/store on the GPU when aligned).
struct alignas(16) Vec16 {
  uint32_t w[4];
};

// A launch: grid (blocks_x, blocks_y) of `threads` threads, each doing `unit` elements per work item.
struct Grid {
  int64_t blocks_x, blocks_y, threads, unit;
  bool Empty() const { return blocks_x == 0 || blocks_y == 0; }
};

constexpr int64_t kThreads = 256;
constexpr int64_t kTokensPerBlock = 8;
constexpr int64_t kVec = 8;  // elements per work item when Dh % 8 == 0 (16-byte fp16 accesses)

// Elements per gather work item: 8 when Dh and the buffers' alignment allow 16-byte accesses, else 1.
KV_HD int64_t GatherUnit(const Params& p) { return (p.head_dim % kVec == 0 && p.aligned16) ? kVec : 1; }

// With groups of a multiple of 8 elements and 16-byte aligned buffers, a quantized store reads a group 16
// bytes at a time and writes its codes 8 at a time.
KV_HD bool VectorGroups(const Params& p) { return p.quant_group % kVec == 0 && GatherUnit(p) == kVec; }

// Elements per store work item. Quantized stores work in whole groups; an odd int4 group ends in half a
// byte, so int4 takes pairs of groups: no two threads ever write the same packed byte.
KV_HD int64_t StoreUnit(const Params& p, int quant_bit) {
  if (quant_bit == 0) return GatherUnit(p);
  return (quant_bit == 4 && p.quant_group % 2) ? 2 * p.quant_group : p.quant_group;
}

// Store launch: x covers the longest sequence in blocks of kTokensPerBlock tokens, y the sequences.
inline Grid StoreGrid(const Params& p, int quant_bit) {
  const int64_t x = p.batch > 0 ? (p.longest_seq + kTokensPerBlock - 1) / kTokensPerBlock : 0;
  return Grid{x, x ? p.batch : 0, kThreads, StoreUnit(p, quant_bit)};
}

// Gather launch: x covers the longest key/value list, y the sequences.
inline Grid GatherGrid(const Params& p) {
  const int64_t x = p.batch > 0 ? (p.longest_kv + kTokensPerBlock - 1) / kTokensPerBlock : 0;
  return Grid{x, x ? p.batch : 0, kThreads, GatherUnit(p)};
}

}  // namespace cuda
}  // namespace kvcache
