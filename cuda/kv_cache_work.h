// The per-thread work of the KeyValueCache CUDA kernels, as __host__ __device__ functions.
//
// A __global__ kernel (kv_cache_impl.cu) is a thin wrapper that hands (blockIdx, threadIdx) to these
// functions; the host runner (tests/host_runner) calls the very same functions for every (block,
// thread) of the same grid (StoreGrid / GatherGrid) on host buffers, through a memory policy that
// records every byte each thread reads and writes. Every access goes through the policy `Mem`:
//   Mem::Load<T>(buffer, byte_offset) -> T     Mem::Store<T>(buffer, byte_offset, value)
// where offsets are relative to one of the launch's buffers (Buf), so an access outside its buffer is
// visible to the runner however far it strays. No CUDA header is needed to compile this file.
#pragma once

#include <cstdint>

#include "kv_quant.h"
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

// Slot of position `pos` of sequence b. pos is unsigned: start_pos[b] + i may exceed INT64_MAX; the page
// index and the slot fit (validated on the host).
template <class Mem>
KV_HD int64_t SlotOf(const Params& p, Mem& mem, int64_t b, uint64_t pos) {
  if (p.cache_mode == 0) return mem.template Load<int64_t>(kCachestarts, 8 * b) + static_cast<int64_t>(pos);
  const uint64_t page_size = static_cast<uint64_t>(p.page_size);
  const int64_t page = b * p.max_p + static_cast<int64_t>(pos / page_size);
  return mem.template Load<int64_t>(kCachestarts, 8 * page) + static_cast<int64_t>(pos % page_size);
}

template <class Mem>
KV_HD int64_t IndexAt(Mem& mem, Buf buf, int64_t i) {
  return mem.template Load<int64_t>(buf, 8 * i);
}

// Code storage per quant_bit: code `elem` of the cache (element offset) is read and written here.
template <int QBits>
struct Codes;
template <>
struct Codes<8> {
  static constexpr float kMax = 127.0f;
  template <class Mem>
  KV_HD static int32_t Get(Mem& mem, int64_t elem) {
    return mem.template Load<int8_t>(kCache, elem);
  }
  // Writes the code(s) of elements elem (and elem + 1 when `pair`).
  template <class Mem>
  KV_HD static void Put(Mem& mem, int64_t elem, int32_t first, int32_t second, bool pair) {
    mem.template Store<int8_t>(kCache, elem, static_cast<int8_t>(first));
    if (pair) mem.template Store<int8_t>(kCache, elem + 1, static_cast<int8_t>(second));
  }
};
template <>
struct Codes<4> {
  static constexpr float kMax = 7.0f;
  template <class Mem>
  KV_HD static int32_t Get(Mem& mem, int64_t elem) {
    const uint8_t byte = mem.template Load<uint8_t>(kCache, elem / 2);
    return (elem & 1) ? Int4High(byte) : Int4Low(byte);
  }
  // elem is even and a pair is always written: one whole byte.
  template <class Mem>
  KV_HD static void Put(Mem& mem, int64_t elem, int32_t first, int32_t second, bool) {
    mem.template Store<uint8_t>(kCache, elem / 2, Int4Pack(first, second));
  }
};

// Copies n elements of T from (src_buf, src byte offset) to (dst_buf, dst byte offset): 16 bytes per
// access when n is kVec elements of a 2- or 4-byte type (offsets are then 16-byte multiples).
template <class T, class Mem>
KV_HD void CopyUnit(Mem& mem, Buf src_buf, int64_t src, Buf dst_buf, int64_t dst, int64_t n) {
  if (n == kVec && (kVec * sizeof(T)) % 16 == 0) {
    for (int64_t k = 0; k < int64_t(kVec * sizeof(T) / 16); ++k)
      mem.template Store<Vec16>(dst_buf, dst + 16 * k, mem.template Load<Vec16>(src_buf, src + 16 * k));
    return;
  }
  for (int64_t i = 0; i < n; ++i)
    mem.template Store<T>(dst_buf, dst + i * int64_t(sizeof(T)), mem.template Load<T>(src_buf, src + i * int64_t(sizeof(T))));
}

// A work item of a launch: token i (of the block's tokens), kv half, head, and unit index u.
struct Item {
  int64_t token, head, u;
  int kv;
};

// Work item w of a block covering kTokensPerBlock tokens of `heads` heads, `units` units per row.
// Consecutive w are consecutive units of one row: neighbouring threads touch neighbouring bytes.
KV_HD Item ItemOf(int64_t w, int64_t block_x, int64_t heads, int64_t units) {
  Item it;
  it.u = w % units;
  int64_t rest = w / units;
  it.head = rest % heads;
  rest /= heads;
  it.kv = static_cast<int>(rest % 2);
  it.token = block_x * kTokensPerBlock + rest / 2;
  return it;
}

// Stores one unit of one (token, kv, head) row of sequence b into the cache (and its scales).
template <class T1, class T3, int QBits, class Mem>
KV_HD void StoreItem(const Params& p, Mem& mem, int64_t unit, int64_t b, int64_t begin, const Item& it) {
  using T = typename T1::Storage;
  const int64_t slot = SlotOf(p, mem, b, static_cast<uint64_t>(IndexAt(mem, kStartPos, b)) + static_cast<uint64_t>(it.token));
  const int64_t src = (((begin + it.token) * p.heads + it.head) * p.head_dim + it.u * unit) * int64_t(sizeof(T));
  const Buf src_buf = it.kv ? kValue : kKey;
  const int64_t row = p.cache_rows.layer * p.layer_idx + p.cache_rows.kv * it.kv + p.cache_rows.head * it.head +
                      p.cache_rows.slot * slot;
  if constexpr (QBits == 0) {
    CopyUnit<T>(mem, src_buf, src, kCache, (row + it.u * unit) * int64_t(sizeof(T)), unit);
  } else {
    using S = typename T3::Storage;
    const int64_t n = p.quant_group;
    const int64_t srow = p.scale_rows.layer * p.layer_idx + p.scale_rows.kv * it.kv + p.scale_rows.head * it.head +
                         p.scale_rows.slot * slot;
    const int64_t first_group = srow + (it.u * unit) / n;
    int32_t held = 0;  // a code waiting for its partner (codes are written two at a time)
    bool holding = false;
    for (int64_t g = 0; g < unit / n; ++g) {
      float amax = 0.0f;
      for (int64_t e = 0; e < n; ++e)
        amax = AbsMaxStep(amax, T1::ToFloat(mem.template Load<T>(src_buf, src + (g * n + e) * int64_t(sizeof(T)))));
      const S stored = T3::FromFloat(GroupScale(amax, Codes<QBits>::kMax));
      mem.template Store<S>(kScale, (first_group + g) * int64_t(sizeof(S)), stored);
      const float s = T3::ToFloat(stored);
      for (int64_t e = 0; e < n; ++e) {
        const float v = T1::ToFloat(mem.template Load<T>(src_buf, src + (g * n + e) * int64_t(sizeof(T))));
        const int32_t code = QuantizeValue(v, s, Codes<QBits>::kMax);
        if (holding) {
          Codes<QBits>::Put(mem, row + it.u * unit + g * n + e - 1, held, code, true);
          holding = false;
        } else {
          held = code;
          holding = true;
        }
      }
    }
    if (holding) Codes<QBits>::Put(mem, row + it.u * unit + unit - 1, held, 0, false);  // int8, odd unit
  }
}

// Gathers one unit of one (row t, kv, output head j) of sequence b into the outputs.
template <class T1, class T3, int QBits, class Mem>
KV_HD void GatherItem(const Params& p, Mem& mem, int64_t unit, int64_t b, int64_t begin, const Item& it) {
  using T = typename T1::Storage;
  const int64_t j = it.head, h = j / p.num_repeat;
  const int64_t slot = SlotOf(p, mem, b, static_cast<uint64_t>(it.token));
  const int64_t row = p.cache_rows.layer * p.layer_idx + p.cache_rows.kv * it.kv + p.cache_rows.head * h +
                      p.cache_rows.slot * slot;
  const Buf dst_buf = it.kv ? kOutValue : kOutKey;
  const int64_t dst = (((begin + it.token) * p.out_heads + j) * p.head_dim + it.u * unit) * int64_t(sizeof(T));
  if constexpr (QBits == 0) {
    CopyUnit<T>(mem, kCache, (row + it.u * unit) * int64_t(sizeof(T)), dst_buf, dst, unit);
  } else {
    using S = typename T3::Storage;
    const int64_t srow = p.scale_rows.layer * p.layer_idx + p.scale_rows.kv * it.kv + p.scale_rows.head * h +
                         p.scale_rows.slot * slot;
    for (int64_t e = 0; e < unit; ++e) {
      const int64_t d = it.u * unit + e;
      const float s = T3::ToFloat(mem.template Load<S>(kScale, (srow + d / p.quant_group) * int64_t(sizeof(S))));
      // float32 product, one rounding to T1 (the spec's dequantization; no contraction: -fmad=false).
      const float v = static_cast<float>(Codes<QBits>::Get(mem, row + d)) * s;
      mem.template Store<T>(dst_buf, dst + e * int64_t(sizeof(T)), T1::FromFloat(v));
    }
  }
}

// Calls fn(item) for the work items of thread `thread` (of `threads`) in a block covering tokens
// [block_x * kTokensPerBlock, +kTokensPerBlock) of a sequence of `length` tokens, `heads` heads each.
template <class Fn>
KV_HD void ForEachItem(int64_t length, int64_t heads, int64_t units, int64_t block_x, int64_t thread, int64_t threads,
                       Fn&& fn) {
  const int64_t work = kTokensPerBlock * 2 * heads * units;
  for (int64_t w = thread; w < work; w += threads) {
    const Item it = ItemOf(w, block_x, heads, units);
    if (it.token < length) fn(it);
  }
}

// Everything thread `thread` (of `threads`) of block (block_x, block_y) of the store launch does.
template <class T1, class T3, int QBits, class Mem>
KV_HD void StoreThread(const Params& p, Mem& mem, int64_t unit, int64_t block_x, int64_t block_y, int64_t thread,
                       int64_t threads) {
  const int64_t b = block_y;
  const int64_t begin = IndexAt(mem, kSeqstarts, b), seqlen = IndexAt(mem, kSeqstarts, b + 1) - begin;
  ForEachItem(seqlen, p.heads, p.head_dim / unit, block_x, thread, threads,
              [&](const Item& it) { StoreItem<T1, T3, QBits>(p, mem, unit, b, begin, it); });
}

// Everything thread `thread` (of `threads`) of block (block_x, block_y) of the gather launch does.
template <class T1, class T3, int QBits, class Mem>
KV_HD void GatherThread(const Params& p, Mem& mem, int64_t unit, int64_t block_x, int64_t block_y, int64_t thread,
                        int64_t threads) {
  const int64_t b = block_y;
  const int64_t begin = IndexAt(mem, kKvstarts, b), kvlen = IndexAt(mem, kKvstarts, b + 1) - begin;
  ForEachItem(kvlen, p.out_heads, p.head_dim / unit, block_x, thread, threads,
              [&](const Item& it) { GatherItem<T1, T3, QBits>(p, mem, unit, b, begin, it); });
}

// Calls f.template Run<T1, T3, QBits>() for the call's element types (ONNX types) and quant_bit.
template <class F>
auto DispatchTypes(int32_t t1, int32_t scale_type, int quant_bit, F&& f) {
  const bool f16_scale = scale_type == int32_t(Elem::kFloat16);
  auto by_quant = [&](auto t1_tag) {
    using T1 = decltype(t1_tag);
    switch (quant_bit) {
      case 0: return f.template Run<T1, F32, 0>();
      case 8: return f16_scale ? f.template Run<T1, F16, 8>() : f.template Run<T1, F32, 8>();
      default: return f16_scale ? f.template Run<T1, F16, 4>() : f.template Run<T1, F32, 4>();
    }
  };
  switch (static_cast<Elem>(t1)) {
    case Elem::kFloat32: return by_quant(F32{});
    case Elem::kFloat16: return by_quant(F16{});
    default: return by_quant(BF16{});
  }
}

}  // namespace cuda
}  // namespace kvcache
