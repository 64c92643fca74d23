// The per-thread work of the KeyValueCache CUDA kernels, as __host__ __device__ functions.
//
// A __global__ kernel (kv_cache_impl.cu) is a thin wrapper that hands (blockIdx, threadIdx) to these
// functions; the host runner (tests/host_runner) calls the very same functions for every (block,
// thread) of the same grid (StoreGrid / GatherGrid) on host buffers, through a memory policy that
// records every byte each thread reads and writes. Every access goes through the policy `Mem`:
//   Mem::Load<T>(buffer, byte_offset) -> T     Mem::Store<T>(buffer, byte_offset, value)
// where offsets are relative to one of the launch's buffers (Buf), so an access outside its buffer is
// visible to the runner however far it strays. No CUDA header is needed to compile this file.
//
// The launch's buffers, parameters and grids are in kv_cache_launch.h, the element accesses in
// kv_cache_access.h.
#pragma once

#include <cstdint>

#include "kv_cache_access.h"
#include "kv_cache_launch.h"
#include "kv_quant.h"
#include "kv_types.h"

namespace kvcache {
namespace cuda {

// A thread's share of a row: kv half, head and unit u of every row of the block's tokens, with what
// follows from them computed once (the divisions are not repeated per token).
struct RowUnit {
  int64_t head;        // the output head j of a gather, the cache head of a store
  int64_t cache_head;  // the cache head read (j / num_repeat) or written
  int64_t u;           // unit index within the row
  int64_t group, in_group;  // quantization group of the unit's first element, and its place in the group
  int kv;
};

// Row unit r of `heads` heads of `units` units. Consecutive r are consecutive units of one row:
// neighbouring threads touch neighbouring bytes.
KV_HD RowUnit RowUnitOf(const Params& p, int64_t r, int64_t heads, int64_t units, int64_t unit, int64_t repeat) {
  RowUnit it;
  it.u = r % units;
  const int64_t rest = r / units;
  it.head = rest % heads;
  it.kv = static_cast<int>(rest / heads);
  it.cache_head = it.head / repeat;
  it.group = it.u * unit / p.quant_group;
  it.in_group = it.u * unit - it.group * p.quant_group;
  return it;
}

// Stores one unit of the (kv, head) row of input token `token` (an index into current_key/value) into
// cache slot `slot` (and its scales).
template <class T1, class T3, int QBits, class Mem>
KV_HD void StoreItem(const Params& p, Mem& mem, int64_t unit, const RowUnit& it, int64_t token, int64_t slot) {
  using T = typename T1::Storage;
  const int64_t src = ((token * p.heads + it.head) * p.head_dim + it.u * unit) * int64_t(sizeof(T));
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
    const int64_t first_group = srow + it.group;
    if (VectorGroups(p)) {  // the unit is one group of 8k elements: 16-byte reads, 8-code writes
      float v[kVec];
      float amax = 0.0f;
      for (int64_t c = 0; c < n; c += kVec) {
        LoadEight<T1>(mem, src_buf, src + c * int64_t(sizeof(T)), v);
        for (int e = 0; e < kVec; ++e) amax = AbsMaxStep(amax, v[e]);
      }
      const S stored = T3::FromFloat(GroupScale(amax, Codes<QBits>::kMax));
      mem.template Store<S>(kScale, first_group * int64_t(sizeof(S)), stored);
      const float s = T3::ToFloat(stored);
      for (int64_t c = 0; c < n; c += kVec) {
        if (n != kVec) LoadEight<T1>(mem, src_buf, src + c * int64_t(sizeof(T)), v);  // a group of 8 is still in v
        int32_t code[kVec];
        for (int e = 0; e < kVec; ++e) code[e] = QuantizeValue(v[e], s, Codes<QBits>::kMax);
        StoreEightCodes<QBits>(mem, row + it.u * unit + c, code);
      }
      return;
    }
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

// Gathers one unit of the (kv, output head j) row of output token `token` (an index into the outputs)
// from cache slot `slot`.
template <class T1, class T3, int QBits, class Mem>
KV_HD void GatherItem(const Params& p, Mem& mem, int64_t unit, const RowUnit& it, int64_t token, int64_t slot) {
  using T = typename T1::Storage;
  const int64_t h = it.cache_head;
  const int64_t row = p.cache_rows.layer * p.layer_idx + p.cache_rows.kv * it.kv + p.cache_rows.head * h +
                      p.cache_rows.slot * slot;
  const Buf dst_buf = it.kv ? kOutValue : kOutKey;
  const int64_t dst = ((token * p.out_heads + it.head) * p.head_dim + it.u * unit) * int64_t(sizeof(T));
  if constexpr (QBits == 0) {
    CopyUnit<T>(mem, kCache, (row + it.u * unit) * int64_t(sizeof(T)), dst_buf, dst, unit);
  } else {
    using S = typename T3::Storage;
    const int64_t srow = p.scale_rows.layer * p.layer_idx + p.scale_rows.kv * it.kv + p.scale_rows.head * h +
                         p.scale_rows.slot * slot;
    if (unit == kVec) {  // 8 codes in one load, 8 results in 16-byte stores (groups not a multiple of 8)
      int32_t code[kVec];
      UnpackEightCodes<QBits>(LoadEightCodes<QBits>(mem, row + it.u * kVec), code);
      int64_t group = it.group, in_group = it.in_group;
      float s = T3::ToFloat(mem.template Load<S>(kScale, (srow + group) * int64_t(sizeof(S))));
      float v[kVec];
      for (int e = 0; e < kVec; ++e, ++in_group) {
        if (in_group == p.quant_group) {
          in_group = 0;
          s = T3::ToFloat(mem.template Load<S>(kScale, (srow + ++group) * int64_t(sizeof(S))));
        }
        v[e] = static_cast<float>(code[e]) * s;  // the spec's float32 product (no contraction: -fmad=false)
      }
      StoreEight<T1>(mem, dst_buf, dst, v);
      return;
    }
    for (int64_t e = 0; e < unit; ++e) {
      const int64_t d = it.u * unit + e;
      const float s = T3::ToFloat(mem.template Load<S>(kScale, (srow + d / p.quant_group) * int64_t(sizeof(S))));
      // float32 product, one rounding to T1 (the spec's dequantization; no contraction: -fmad=false).
      const float v = static_cast<float>(Codes<QBits>::Get(mem, row + d)) * s;
      mem.template Store<T>(dst_buf, dst + e * int64_t(sizeof(T)), T1::FromFloat(v));
    }
  }
}

// A thread's tokens of one row unit in a block: tokens i0, i0 + step, ... (n <= kTokensPerBlock of them),
// as indices into the block's tokens.
struct Run {
  int64_t i0, step, n;
};

// Gathers one row unit of a run of tokens when its 8 elements share one quantization group (groups of a
// multiple of 8, 16-byte aligned buffers): first every token's codes and scale are read, then every
// output written. The reads of one token could not move above the writes of the one before (nothing
// tells the compiler that the outputs do not overlap the cache), so reading them all first keeps up to
// kTokensPerBlock reads in flight per thread instead of one. `token0`: the output token of the block's
// first token.
template <class T1, class T3, int QBits, class Mem>
KV_HD void GatherGroupedRun(const Params& p, Mem& mem, const RowUnit& it, int64_t token0, const Run& run,
                            SlotCursor<Mem>& slots) {
  using T = typename T1::Storage;
  using S = typename T3::Storage;
  const int64_t h = it.cache_head;
  const int64_t row0 = p.cache_rows.layer * p.layer_idx + p.cache_rows.kv * it.kv + p.cache_rows.head * h + it.u * kVec;
  const int64_t srow0 = p.scale_rows.layer * p.layer_idx + p.scale_rows.kv * it.kv + p.scale_rows.head * h + it.group;
  uint64_t word[kTokensPerBlock];
  S stored[kTokensPerBlock];
  for (int k = 0; k < kTokensPerBlock; ++k) {
    if (k < run.n) {
      const int64_t slot = slots.Next();
      word[k] = LoadEightCodes<QBits>(mem, row0 + p.cache_rows.slot * slot);
      stored[k] = mem.template Load<S>(kScale, (srow0 + p.scale_rows.slot * slot) * int64_t(sizeof(S)));
    }
  }
  const Buf dst_buf = it.kv ? kOutValue : kOutKey;
  for (int k = 0; k < kTokensPerBlock; ++k) {
    if (k < run.n) {
      const int64_t token = token0 + run.i0 + k * run.step;
      const int64_t dst = ((token * p.out_heads + it.head) * p.head_dim + it.u * kVec) * int64_t(sizeof(T));
      int32_t code[kVec];
      UnpackEightCodes<QBits>(word[k], code);
      const float s = T3::ToFloat(stored[k]);
      float v[kVec];
      for (int e = 0; e < kVec; ++e) v[e] = static_cast<float>(code[e]) * s;  // float32 product, no contraction
      // Codes are small integers: with a finite scale no product is NaN.
      if (IsFinite(s))
        StoreEight<T1, true>(mem, dst_buf, dst, v);
      else
        StoreEight<T1>(mem, dst_buf, dst, v);
    }
  }
}

// Calls fn(row_unit, run, slots) for the row units of thread `thread` (of `threads`) in a block covering
// tokens [0, count) of the block (positions first_pos + i of sequence b), `heads` heads each; `slots`
// gives the run's slots in order. A thread keeps its row unit for all of its tokens, so the divisions that
// place it are done once. Rows of fewer units than threads are done threads / units tokens side by side.
template <class Mem, class Fn>
KV_HD void ForEachRun(const Params& p, Mem& mem, int64_t b, uint64_t first_pos, int64_t count, int64_t heads,
                      int64_t unit, int64_t repeat, int64_t thread, int64_t threads, Fn&& fn) {
  const int64_t units = p.head_dim / unit, row_units = 2 * heads * units;
  if (row_units == 0) return;
  if (row_units >= threads) {
    for (int64_t r = thread; r < row_units; r += threads) {
      SlotCursor<Mem> slots(p, mem, b, first_pos, 1);
      fn(RowUnitOf(p, r, heads, units, unit, repeat), Run{0, 1, count}, slots);
    }
    return;
  }
  const int64_t lanes = threads / row_units, lane = thread / row_units;
  if (lane >= lanes || lane >= count) return;
  SlotCursor<Mem> slots(p, mem, b, first_pos + static_cast<uint64_t>(lane), lanes);
  fn(RowUnitOf(p, thread % row_units, heads, units, unit, repeat), Run{lane, lanes, (count - lane + lanes - 1) / lanes},
     slots);
}

// ForEachRun, calling fn(row_unit, i, slot) for each token i of each run.
template <class Mem, class Fn>
KV_HD void ForEachItem(const Params& p, Mem& mem, int64_t b, uint64_t first_pos, int64_t count, int64_t heads,
                       int64_t unit, int64_t repeat, int64_t thread, int64_t threads, Fn&& fn) {
  ForEachRun(p, mem, b, first_pos, count, heads, unit, repeat, thread, threads,
             [&](const RowUnit& it, const Run& run, SlotCursor<Mem>& slots) {
               for (int64_t k = 0; k < run.n; ++k) fn(it, run.i0 + k * run.step, slots.Next());
             });
}

// Tokens [first, first + count) of a sequence of `length` tokens that block_x covers (count may be <= 0).
KV_HD int64_t BlockTokens(int64_t block_x, int64_t length, int64_t* first) {
  *first = block_x * kTokensPerBlock;
  return length - *first < kTokensPerBlock ? length - *first : kTokensPerBlock;
}

// Everything thread `thread` (of `threads`) of block (block_x, block_y) of the store launch does.
template <class T1, class T3, int QBits, class Mem>
KV_HD void StoreThread(const Params& p, Mem& mem, int64_t unit, int64_t block_x, int64_t block_y, int64_t thread,
                       int64_t threads) {
  const int64_t b = block_y;
  const int64_t begin = IndexAt(mem, kSeqstarts, b), seqlen = IndexAt(mem, kSeqstarts, b + 1) - begin;
  int64_t first = 0;
  const int64_t count = BlockTokens(block_x, seqlen, &first);
  if (count <= 0) return;
  const uint64_t first_pos = static_cast<uint64_t>(IndexAt(mem, kStartPos, b)) + static_cast<uint64_t>(first);
  ForEachItem(p, mem, b, first_pos, count, p.heads, unit, 1, thread, threads,
              [&](const RowUnit& it, int64_t i, int64_t slot) {
                StoreItem<T1, T3, QBits>(p, mem, unit, it, begin + first + i, slot);
              });
}

// Everything thread `thread` (of `threads`) of block (block_x, block_y) of the gather launch does.
template <class T1, class T3, int QBits, class Mem>
KV_HD void GatherThread(const Params& p, Mem& mem, int64_t unit, int64_t block_x, int64_t block_y, int64_t thread,
                        int64_t threads) {
  const int64_t b = block_y;
  const int64_t begin = IndexAt(mem, kKvstarts, b), kvlen = IndexAt(mem, kKvstarts, b + 1) - begin;
  int64_t first = 0;
  const int64_t count = BlockTokens(block_x, kvlen, &first);
  if (count <= 0) return;
  if constexpr (QBits != 0) {
    if (VectorGroups(p)) {  // the gather unit is 8 elements of one group
      ForEachRun(p, mem, b, static_cast<uint64_t>(first), count, p.out_heads, unit, p.num_repeat, thread, threads,
                 [&](const RowUnit& it, const Run& run, SlotCursor<Mem>& slots) {
                   GatherGroupedRun<T1, T3, QBits>(p, mem, it, begin + first, run, slots);
                 });
      return;
    }
  }
  ForEachItem(p, mem, b, static_cast<uint64_t>(first), count, p.out_heads, unit, p.num_repeat, thread, threads,
              [&](const RowUnit& it, int64_t i, int64_t slot) {
                GatherItem<T1, T3, QBits>(p, mem, unit, it, begin + first + i, slot);
              });
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
