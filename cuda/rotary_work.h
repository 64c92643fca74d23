// The per-thread work of the KeyCacheRotaryShift CUDA kernel, as __host__ __device__ functions: one
// thread rotates the key row of one (slot, head), exactly as spec/KeyCacheRotaryShift.md and the CPU
// kernel do (float32, each product rounded, no contraction; a quantized row dequantized, rotated and
// quantized again with KeyValueCache's Q). Slots are distinct (validated), so threads own disjoint rows
// (an int4 row is whole bytes: Dh is even). The host runner runs these functions for every thread of
// RotaryGrid through its tracing memory policy, as for KeyValueCache (kv_cache_work.h).
#pragma once

#include <cstdint>

#include "kv_cache_work.h"

namespace kvcache {
namespace cuda {

// A quantized row is rotated in a per-thread buffer of this many floats (head dims of current models are
// at most 256); unquantized rows are rotated pair by pair in place and have no limit.
constexpr int64_t kMaxQuantizedShiftHeadDim = 256;

struct RotaryParams {
  int64_t layer_idx, quant_group, heads, head_dim, rotary, slots;  // slots: N
  bool interleaved;
  Rows cache_rows, scale_rows;
  void* ptr[kBufCount];  // kCache, kScale (null without quantization), kSlots, kCos, kSin
};

// One thread per (slot, head) row.
inline Grid RotaryGrid(const RotaryParams& p) {
  const int64_t rows = p.slots * p.heads;
  return Grid{(rows + kThreads - 1) / kThreads, 1, kThreads, 1};
}

// The j-th rotated pair: (2j, 2j+1) interleaved (GPT-J), else (j, j + R/2) (GPT-NeoX / Llama).
KV_HD void PairOf(const RotaryParams& p, int64_t j, int64_t* a, int64_t* b) {
  *a = p.interleaved ? 2 * j : j;
  *b = p.interleaved ? 2 * j + 1 : j + p.rotary / 2;
}

// (y_a, y_b) = (x_a c - x_b s, x_a s + x_b c) of row i's pair j, each product rounded to float32.
template <class Mem>
KV_HD void Rotate(const RotaryParams& p, Mem& mem, int64_t i, int64_t j, float xa, float xb, float* ya, float* yb) {
  const int64_t at = (i * (p.rotary / 2) + j) * int64_t(sizeof(float));
  const float c = mem.template Load<float>(kCos, at), s = mem.template Load<float>(kSin, at);
  const float ac = xa * c, bs = xb * s, as = xa * s, bc = xb * c;  // -fmad=false: no fused multiply-add
  *ya = ac - bs;
  *yb = as + bc;
}

// Everything thread `thread` of block `block` does. T2: the cache's float type without quantization;
// T3: the scale's type with it (the other is unused).
template <class T2, class T3, int QBits, class Mem>
KV_HD void RotaryThread(const RotaryParams& p, Mem& mem, int64_t block, int64_t thread, int64_t threads) {
  const int64_t r = block * threads + thread;
  if (r >= p.slots * p.heads) return;
  const int64_t i = r / p.heads, h = r % p.heads;
  const int64_t slot = mem.template Load<int64_t>(kSlots, 8 * i);
  const int64_t row = p.cache_rows.layer * p.layer_idx + p.cache_rows.head * h + p.cache_rows.slot * slot;  // K half
  if constexpr (QBits == 0) {
    using T = typename T2::Storage;
    auto load = [&](int64_t d) { return T2::ToFloat(mem.template Load<T>(kCache, (row + d) * int64_t(sizeof(T)))); };
    auto store = [&](int64_t d, float v) { mem.template Store<T>(kCache, (row + d) * int64_t(sizeof(T)), T2::FromFloat(v)); };
    for (int64_t j = 0; j < p.rotary / 2; ++j) {
      int64_t a = 0, b = 0;
      PairOf(p, j, &a, &b);
      float ya = 0.0f, yb = 0.0f;
      Rotate(p, mem, i, j, load(a), load(b), &ya, &yb);
      store(a, ya);
      store(b, yb);
    }
    for (int64_t d = p.rotary; d < p.head_dim; ++d) store(d, load(d));  // T2(y), y = x beyond R (as the spec)
  } else {
    using S = typename T3::Storage;
    const int64_t srow = p.scale_rows.layer * p.layer_idx + p.scale_rows.head * h + p.scale_rows.slot * slot;
    float y[kMaxQuantizedShiftHeadDim];  // every value read before any is written: codes and scales are shared
    for (int64_t d = 0; d < p.head_dim; ++d) {
      const float s = T3::ToFloat(mem.template Load<S>(kScale, (srow + d / p.quant_group) * int64_t(sizeof(S))));
      y[d] = static_cast<float>(Codes<QBits>::Get(mem, row + d)) * s;
    }
    for (int64_t j = 0; j < p.rotary / 2; ++j) {
      int64_t a = 0, b = 0;
      PairOf(p, j, &a, &b);
      Rotate(p, mem, i, j, y[a], y[b], &y[a], &y[b]);
    }
    for (int64_t g = 0; g < p.head_dim / p.quant_group; ++g) {  // Q: a fresh scale per group, then the codes
      const int64_t first = g * p.quant_group;
      float amax = 0.0f;
      for (int64_t e = 0; e < p.quant_group; ++e) amax = AbsMaxStep(amax, y[first + e]);
      const S stored = T3::FromFloat(GroupScale(amax, Codes<QBits>::kMax));
      mem.template Store<S>(kScale, (srow + g) * int64_t(sizeof(S)), stored);
      const float s = T3::ToFloat(stored);
      for (int64_t e = 0; e < p.quant_group; ++e)
        y[first + e] = static_cast<float>(QuantizeValue(y[first + e], s, Codes<QBits>::kMax));  // a code, exact
    }
    for (int64_t d = 0; d < p.head_dim; d += 2) {
      const bool pair = d + 1 < p.head_dim;  // int8 with an odd Dh ends in a single code
      Codes<QBits>::Put(mem, row + d, static_cast<int32_t>(y[d]), pair ? static_cast<int32_t>(y[d + 1]) : 0, pair);
    }
  }
}

// Calls f.template Run<T2, T3, QBits>() for the cache type (unquantized), scale type and quant_bit.
template <class F>
auto DispatchRotaryTypes(int32_t cache_type, int32_t scale_type, int quant_bit, F&& f) {
  const bool f16_scale = scale_type == int32_t(Elem::kFloat16);
  switch (quant_bit) {
    case 8: return f16_scale ? f.template Run<F32, F16, 8>() : f.template Run<F32, F32, 8>();
    case 4: return f16_scale ? f.template Run<F32, F16, 4>() : f.template Run<F32, F32, 4>();
    default:
      switch (static_cast<Elem>(cache_type)) {
        case Elem::kFloat32: return f.template Run<F32, F32, 0>();
        case Elem::kFloat16: return f.template Run<F16, F32, 0>();
        default: return f.template Run<BF16, F32, 0>();
      }
  }
}

}  // namespace cuda
}  // namespace kvcache
