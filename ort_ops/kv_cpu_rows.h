// Row kernels of the CPU op: conversions between T1 rows and float32, dequantization and stores.
// Compiled once per instruction set (kv_cpu.cc is built twice: generic and AVX2+F16C); every path
// computes the same bits: F16C's conversion is round-to-nearest-even like FloatToHalf.
#pragma once

#include <cstring>
#include <limits>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define KV_SIMD 1
#else
#define KV_SIMD 0
#endif

#include "kv_quant.h"
#include "kv_types.h"

namespace kvcache {
namespace KV_CPU_ISA {

// dst[i] = float(src[i]) for a T1 row.
template <class T1>
inline void ToFloatRow(const typename T1::Storage* src, float* dst, int64_t n) {
  int64_t i = 0;
#if KV_SIMD
  if constexpr (T1::kElem == Elem::kFloat16) {
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
#endif
  for (; i < n; ++i) dst[i] = T1::ToFloat(src[i]);
}

#if KV_SIMD
// T1(f) for 8 floats, stored at dst (round to nearest even; bfloat16 NaN kept quiet).
template <class T1>
inline void StoreFloat8(__m256 f, typename T1::Storage* dst) {
  if constexpr (T1::kElem == Elem::kFloat32) {
    _mm256_storeu_ps(dst, f);
  } else if constexpr (T1::kElem == Elem::kFloat16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {
    const __m256i u = _mm256_castps_si256(f);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256i bits = _mm256_blendv_epi8(rounded, quiet, _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(packed));
  }
}
#endif

// out[i] = T1(float(codes[i]) * scales[i / group]): float32 product, one rounding to T1.
template <class T1>
inline void DequantizeRow(const int8_t* codes, const float* scales, int64_t group, typename T1::Storage* out,
                          int64_t n) {
#if KV_SIMD
  if (group % 8 == 0) {
    for (int64_t g = 0; g * group < n; ++g) {
      const __m256 s = _mm256_set1_ps(scales[g]);
      for (int64_t i = g * group; i < (g + 1) * group; i += 8) {
        const __m256i wide = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i)));
        StoreFloat8<T1>(_mm256_mul_ps(_mm256_cvtepi32_ps(wide), s), out + i);
      }
    }
    return;
  }
#endif
  for (int64_t g = 0; g * group < n; ++g)
    for (int64_t i = g * group; i < (g + 1) * group; ++i) out[i] = T1::FromFloat(static_cast<float>(codes[i]) * scales[g]);
}

// max|x| over a group; NaN if any element is NaN (the scalar AbsMaxStep's semantics).
inline float GroupAbsMax(const float* x, int64_t n) {
  int64_t i = 0;
  float amax = 0.0f;
#if KV_SIMD
  if (n >= 8) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 vmax = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      vmax = _mm256_max_ps(_mm256_andnot_ps(sign, v), vmax);
    }
    if (_mm256_movemask_ps(nan)) return std::numeric_limits<float>::quiet_NaN();
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmax);
    for (float lane : lanes) amax = lane > amax ? lane : amax;
  }
#endif
  for (; i < n; ++i) amax = AbsMaxStep(amax, x[i]);
  return amax;
}

// codes[i] = QuantizeValue(x[i], stored_scale, qmax) for a group.
inline void QuantizeGroup(const float* x, float stored_scale, float qmax, int32_t* codes, int64_t n) {
  int64_t i = 0;
#if KV_SIMD
  const __m256 s = _mm256_set1_ps(stored_scale), lo = _mm256_set1_ps(-qmax), hi = _mm256_set1_ps(qmax);
  for (; i + 8 <= n; i += 8) {
    const __m256 q = _mm256_div_ps(_mm256_loadu_ps(x + i), s);  // IEEE division, as the scalar path
    const __m256 nan = _mm256_cmp_ps(q, q, _CMP_UNORD_Q);
    __m256 r = _mm256_round_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm256_min_ps(_mm256_max_ps(r, lo), hi);  // NaN lanes are replaced below
    r = _mm256_andnot_ps(nan, r);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + i), _mm256_cvtps_epi32(r));
  }
#endif
  for (; i < n; ++i) codes[i] = QuantizeValue(x[i], stored_scale, qmax);
}

// Copies a finished output row. Large outputs use streaming stores so they do not first read the
// destination into the cache (what a plain copy of the same size does too); small outputs stay cached
// for the attention that reads them next.
inline void StoreRow(void* dst, const void* src, size_t bytes, bool stream) {
#if KV_SIMD
  if (stream && (reinterpret_cast<uintptr_t>(dst) % 32 == 0) && bytes % 32 == 0) {
    auto* d = static_cast<__m256i*>(dst);
    const auto* s = static_cast<const __m256i_u*>(src);
    for (size_t k = 0; k < bytes / 32; ++k) _mm256_stream_si256(d + k, _mm256_loadu_si256(s + k));
    return;
  }
#endif
  (void)stream;
  std::memcpy(dst, src, bytes);
}

// Orders streaming stores before the op returns.
inline void StoreFence() {
#if KV_SIMD
  _mm_sfence();
#endif
}

}  // namespace KV_CPU_ISA
}  // namespace kvcache
