// The register-blocked halves of a decode step (AttentionKernel::DecodeTask) over a block of keys: the dot
// products of up to kMaxTileHeads query heads of one kv head with a tile of key rows, and the same heads'
// outputs updated by the block's weighted value rows. Every key or value vector loaded serves all heads of the
// tile and every query vector all keys of it; the partial sums and outputs stay in registers across the tile,
// so a decode step runs at the machine's multiply-add rate instead of waiting, key after key, on one chain of
// loads, sums and stores (the per-key form, Dot4 / Axpy4, measured at about 86 ns per key of 4 heads x 128 on one
// core; memory delivers such a key in about 28). Built once per instruction set (KV_CPU_ISA); the portable
// build has no tiles and DecodeTask keeps its per-key form there.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "attention_tiles.h"
#include "kv_cpu_codes.h"
#include "kv_cpu_quant_avx512.h"
#include "kv_cpu_rows.h"
#include "kv_types.h"

namespace kvcache {
namespace KV_CPU_ISA {
namespace attention_detail {

#if KV_AVX512 && defined(__FMA__)
#define KV_DECODE_TILES 1
// The prefill tiles' 16-float vector (zero, load, splat, multiply-add, store), with 16 accumulators of the 32
// registers (the rest hold query vectors, weights, a row).
struct DecodeVector : TileVector {
  static constexpr int kAccs = 16;
  // float(src[0..16)) of a row of E (exact).
  template <class E>
  static V LoadRow(const typename E::Storage* src) {
    return LoadFloat16<E>(src);
  }
  // out[i] = the sum of x[i]'s lanes, i < 16, by one transposing tree (45 instructions for 16 sums): pairs of
  // vectors interleaved and added within 128-bit lanes, then pairs of those by 64-bit halves, then 128-bit blocks.
  static void Sums(const V* x, float* out) {
    auto lo_hi = [](V a, V b) { return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b)); };
    auto halves = [](V a, V b) {
      const __m512d u = _mm512_castps_pd(a), v = _mm512_castps_pd(b);
      return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(u, v)), _mm512_castpd_ps(_mm512_unpackhi_pd(u, v)));
    };
    auto blocks = [](V a, V b) {  // [a0+a1, a2+a3, b0+b1, b2+b3] of 128-bit blocks
      return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
    };
    V s[4];
    for (int i = 0; i < 4; ++i)  // s[i]'s 128-bit block L, lane m: block L of x[4i + m], summed
      s[i] = halves(lo_hi(x[4 * i], x[4 * i + 1]), lo_hi(x[4 * i + 2], x[4 * i + 3]));
    _mm512_storeu_ps(out, blocks(blocks(s[0], s[1]), blocks(s[2], s[3])));
  }
};
#elif KV_SIMD && defined(__FMA__)
#define KV_DECODE_TILES 1
// The prefill tiles' 8-float vector, with 8 accumulators of the 16 registers.
struct DecodeVector : TileVector {
  static constexpr int kAccs = 8;
  template <class E>
  static V LoadRow(const typename E::Storage* src) {
    return LoadFloat8<E>(src);
  }
  // out[i] = the sum of x[i]'s lanes, i < 8: the same tree as the 16-wide one, its last level across the two
  // 128-bit halves.
  static void Sums(const V* x, float* out) {
    auto lo_hi = [](V a, V b) { return _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b)); };
    auto halves = [](V a, V b) {
      const __m256d u = _mm256_castps_pd(a), v = _mm256_castps_pd(b);
      return _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(u, v)), _mm256_castpd_ps(_mm256_unpackhi_pd(u, v)));
    };
    const V s0 = halves(lo_hi(x[0], x[1]), lo_hi(x[2], x[3])), s1 = halves(lo_hi(x[4], x[5]), lo_hi(x[6], x[7]));
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31)));
  }
};
#else
#define KV_DECODE_TILES 0
#endif

#if KV_DECODE_TILES
// float32 values of one DecodeVector of a quantized row in groups of 8: codes from `codes`, the group scales
// from `scales` on. float32 code x scale rounded to T1 (to nearest even), as DequantizeRow gives them.
template <class T1, class T3, int QBits>
KV_ALWAYS_INLINE DecodeVector::V DequantizedVector(const typename Codes<QBits>::Storage* codes, const typename T3::Storage* scales) {
  static_assert(T3::kElem == Elem::kFloat32 || T3::kElem == Elem::kFloat16, "scales are float32 or float16 (spec)");
#if KV_AVX512
  // Two groups: lanes 0-7 take scales[0], lanes 8-15 scales[1].
  __m128 two;
  if constexpr (T3::kElem == Elem::kFloat32) {
    two = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(scales)));
  } else {
    int32_t bits;
    std::memcpy(&bits, scales, sizeof(bits));
    two = _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
  }
  const __m512 s = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                         _mm512_castps128_ps512(two));
  const __m512 x = _mm512_mul_ps(_mm512_cvtepi32_ps(LoadCodes16<QBits>(codes)), s);
  if constexpr (T1::kElem == Elem::kFloat32) return x;
  else if constexpr (T1::kElem == Elem::kFloat16)
    return _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  else return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(HalfBits16<T1>(x)), 16));
#else
  float scale;
  if constexpr (T3::kElem == Elem::kFloat16) scale = _cvtsh_ss(scales[0]);  // F16C, not the portable conversion
  else scale = scales[0];
  const __m256 s = _mm256_set1_ps(scale);
  const __m256 x = _mm256_mul_ps(_mm256_cvtepi32_ps(LoadCodes8<QBits>(codes)), s);
  if constexpr (T1::kElem == Elem::kFloat32) return x;
  else if constexpr (T1::kElem == Elem::kFloat16)
    return _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  else return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(HalfBits8<T1>(x)), 16));
#endif
}

// Heads a tile computes at most (half the accumulators: a tile of keys holds at least two).
constexpr int kMaxTileHeads = DecodeVector::kAccs / 2;

// The rows a tile reads (Load(i, d): float32 values [d, d + kWidth) of row i), and Pick<K>(i0, n): the K rows from
// i0 on, the last of the n repeated past n (the padded tile of DotsBlockOf).
//
// StoredRows: T1 rows as stored (in the cache, or converted into a block buffer).
template <class E, int N>
struct StoredRows {
  const typename E::Storage* rows[N];
  KV_ALWAYS_INLINE DecodeVector::V Load(int64_t i, int64_t d) const { return DecodeVector::template LoadRow<E>(rows[i] + d); }
  template <int K>
  KV_ALWAYS_INLINE StoredRows<E, K> Pick(int64_t i0, int64_t n) const {
    StoredRows<E, K> tile;
    for (int i = 0; i < K; ++i) tile.rows[i] = rows[i0 + i < n ? i0 + i : n - 1];
    return tile;
  }
};

// CodeRows: quantized rows in groups of 8 (codes and their scales, in the cache), dequantized in registers exactly
// as KeyValueCache's gather gives them: float32 code x scale, rounded to T1, read back as float32.
template <class T1, class T3, int QBits, int N>
struct CodeRows {
  const typename Codes<QBits>::Storage* codes[N];
  const typename T3::Storage* scales[N];  // a row's first group scale
  KV_ALWAYS_INLINE DecodeVector::V Load(int64_t i, int64_t d) const {
    return DequantizedVector<T1, T3, QBits>(codes[i] + d * QBits / 8, scales[i] + d / 8);
  }
  template <int K>
  KV_ALWAYS_INLINE CodeRows<T1, T3, QBits, K> Pick(int64_t i0, int64_t n) const {
    CodeRows<T1, T3, QBits, K> tile;
    for (int i = 0; i < K; ++i) {
      const int64_t r = i0 + i < n ? i0 + i : n - 1;
      tile.codes[i] = codes[r];
      tile.scales[i] = scales[r];
    }
    return tile;
  }
};

// The largest power of two <= n (n >= 1), at most `cap`.
inline int FloorPow2(int64_t n, int cap) {
  int p = 1;
  while (p * 2 <= cap && p * 2 <= n) p *= 2;
  return p;
}

// out[h * stride + i] = sum_d q[h][d] * k[i][d] in float32 for heads h < GS and keys i < kAccs / GS, D a multiple of
// the vector width: one accumulator per (head, key), summed across lanes at the end.
template <int GS, class Tile>
KV_ALWAYS_INLINE void DotsTile(const float* const* q, const Tile& k, int64_t D, float* out, int64_t stride) {
  using X = DecodeVector;
  constexpr int KG = X::kAccs / GS;
  typename X::V acc[X::kAccs];
#pragma GCC unroll 16
  for (int i = 0; i < X::kAccs; ++i) acc[i] = X::Zero();
  for (int64_t d = 0; d < D; d += X::kWidth) {
    typename X::V qv[GS];
#pragma GCC unroll 8
    for (int h = 0; h < GS; ++h) qv[h] = X::Load(q[h] + d);
#pragma GCC unroll 16
    for (int i = 0; i < KG; ++i) {
      const typename X::V kv = k.Load(i, d);
#pragma GCC unroll 8
      for (int h = 0; h < GS; ++h) acc[h * KG + i] = X::MulAdd(qv[h], kv, acc[h * KG + i]);
    }
  }
  alignas(64) float sums[X::kAccs];
  X::Sums(acc, sums);
  for (int h = 0; h < GS; ++h)
    for (int i = 0; i < KG; ++i) out[h * stride + i] = sums[h * KG + i];
}

// acc[h][d0 + d] += sum_{i < n} w[h * stride + i] * v[i][d0 + d] for heads h < GS and d < NV vector widths: the
// outputs stay in registers over the n value rows.
template <int GS, int NV, class Rows>
KV_ALWAYS_INLINE void AxpyTile(float* const* acc, const float* w, int64_t stride, const Rows& v, int64_t n, int64_t d0) {
  using X = DecodeVector;
  constexpr int W = X::kWidth;
  typename X::V out[GS][NV];
#pragma GCC unroll 8
  for (int h = 0; h < GS; ++h)
#pragma GCC unroll 16
    for (int c = 0; c < NV; ++c) out[h][c] = X::Load(acc[h] + d0 + c * W);
  for (int64_t i = 0; i < n; ++i) {
    typename X::V wi[GS];
#pragma GCC unroll 8
    for (int h = 0; h < GS; ++h) wi[h] = X::Splat(&w[h * stride + i]);
#pragma GCC unroll 16
    for (int c = 0; c < NV; ++c) {
      const typename X::V x = v.Load(i, d0 + c * W);
#pragma GCC unroll 8
      for (int h = 0; h < GS; ++h) out[h][c] = X::MulAdd(wi[h], x, out[h][c]);
    }
  }
#pragma GCC unroll 8
  for (int h = 0; h < GS; ++h)
#pragma GCC unroll 16
    for (int c = 0; c < NV; ++c) X::Store(acc[h] + d0 + c * W, out[h][c]);
}

// DotsTile for the first n rows of k (n <= kDecodeBlock, D a multiple of the vector width) and GS heads
// (a power of two <= kMaxTileHeads): tiles of kAccs / GS keys, the last one padded with its last key (computed,
// written to out past n, never read).
template <int GS, class Rows>
KV_ALWAYS_INLINE void DotsBlockOf(const float* const* q, const Rows& k, int64_t n, int64_t D, float* out, int64_t stride) {
  constexpr int KG = DecodeVector::kAccs / GS;
  for (int64_t i0 = 0; i0 < n; i0 += KG) DotsTile<GS>(q, k.template Pick<KG>(i0, n), D, out + i0, stride);
}

// AxpyTile over all D (a multiple of the vector width) for GS heads: spans of the most vectors the accumulators
// hold, a power of two each.
template <int GS, class Rows>
KV_ALWAYS_INLINE void AxpyBlockOf(float* const* acc, const float* w, int64_t stride, const Rows& v, int64_t n, int64_t D) {
  constexpr int W = DecodeVector::kWidth, kMost = DecodeVector::kAccs / GS;
  for (int64_t d0 = 0; d0 < D;) {
    switch (FloorPow2((D - d0) / W, kMost)) {
      case 16: if constexpr (kMost >= 16) { AxpyTile<GS, 16>(acc, w, stride, v, n, d0); d0 += 16 * W; } break;
      case 8: if constexpr (kMost >= 8) { AxpyTile<GS, 8>(acc, w, stride, v, n, d0); d0 += 8 * W; } break;
      case 4: if constexpr (kMost >= 4) { AxpyTile<GS, 4>(acc, w, stride, v, n, d0); d0 += 4 * W; } break;
      case 2: AxpyTile<GS, 2>(acc, w, stride, v, n, d0); d0 += 2 * W; break;
      default: AxpyTile<GS, 1>(acc, w, stride, v, n, d0); d0 += W; break;
    }
  }
}

// Runs fn.template operator()<GS>() for the power of two gs (<= kMaxTileHeads).
template <class Fn>
inline void WithTileHeads(int gs, Fn&& fn) {
  switch (gs) {
    case 8: if constexpr (kMaxTileHeads >= 8) { fn(std::integral_constant<int, 8>{}); return; } break;
    case 4: fn(std::integral_constant<int, 4>{}); return;
    case 2: fn(std::integral_constant<int, 2>{}); return;
    default: break;
  }
  fn(std::integral_constant<int, 1>{});
}
#endif

}  // namespace attention_detail
}  // namespace KV_CPU_ISA
}  // namespace kvcache
