// AVX-512 building blocks of the quantized rows (kv_cpu_quant_rows.h): dequantization of sixteen groups of 8
// codes at a time, two groups per 64-byte vector. Same arithmetic as the AVX2 and portable paths (float32
// product of code and scale, rounded to T1 to nearest even), so the same bits.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kv_cpu_quant_avx2.h"

#if KV_AVX512

namespace kvcache {
namespace KV_CPU_ISA {

// float(src[0..16)) of a T1 / T3 row (exact).
template <class T>
KV_ALWAYS_INLINE __m512 LoadFloat16(const typename T::Storage* src) {
  if constexpr (T::kElem == Elem::kFloat32) {
    return _mm512_loadu_ps(src);
  } else {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    if constexpr (T::kElem == Elem::kFloat16) return _mm512_cvtph_ps(bits);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
}

// The float16 / bfloat16 bits of 16 floats (round to nearest even; bfloat16 NaN kept quiet, as StoreFloat8).
template <class T1>
KV_ALWAYS_INLINE __m256i HalfBits16(__m512 f) {
  if constexpr (T1::kElem == Elem::kFloat16) {
    return _mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  } else {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    const __m512i bits = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), rounded, quiet);
    return _mm512_cvtepi32_epi16(bits);
  }
}

// T1(f) for 16 floats, stored at dst.
template <class T1>
KV_ALWAYS_INLINE void StoreFloat16(__m512 f, typename T1::Storage* dst) {
  if constexpr (T1::kElem == Elem::kFloat32) {
    _mm512_storeu_ps(dst, f);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), HalfBits16<T1>(f));
  }
}

// 16 codes as int32 lanes from int8 codes, or from 8 bytes of int4 pairs.
template <int QBits>
KV_ALWAYS_INLINE __m512i LoadCodes16(const typename Codes<QBits>::Storage* src) {
  if constexpr (QBits == 8) {
    return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  } else {
    return _mm512_inserti64x4(_mm512_zextsi256_si512(LoadCodes8<4>(src)), LoadCodes8<4>(src + 4), 1);
  }
}

// DQ of 16 groups of 8 codes (128) with their 16 scales: each vector of two groups takes its scales from
// one in-register permute of the scales loaded once. Without a sink the values are stored at out; with one,
// each 64 bytes of them go to sink->Put(__m512i) in order (a streamed output's writer, ShiftedRow).
template <class T1, class T3, int QBits, class Sink = void>
KV_ALWAYS_INLINE void DequantizeSixteenGroupsOf8(const typename Codes<QBits>::Storage* codes,
                                                 const typename T3::Storage* scales, typename T1::Storage* out,
                                                 Sink* sink = nullptr) {
  constexpr bool kEmit = !std::is_void_v<Sink>;
  const __m512 s = LoadFloat16<T3>(scales);
  const __m512i pair = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  __m512 v[8];
  ForEachOf8([&](auto j) __attribute__((always_inline)) {  // one body with the sink's stores
    constexpr int J = decltype(j)::value;
    const __m512 sj = _mm512_permutexvar_ps(_mm512_add_epi32(pair, _mm512_set1_epi32(2 * J)), s);
    v[J] = _mm512_mul_ps(_mm512_cvtepi32_ps(LoadCodes16<QBits>(codes + 2 * J * CodeBytes8(QBits))), sj);
    if constexpr (!kEmit) {
      StoreFloat16<T1>(v[J], out + 16 * J);
    } else if constexpr (T1::kElem == Elem::kFloat32) {
      sink->Put(_mm512_castps_si512(v[J]));
    } else if constexpr (J % 2 == 1) {
      sink->Put(_mm512_inserti64x4(_mm512_castsi256_si512(HalfBits16<T1>(v[J - 1])), HalfBits16<T1>(v[J]), 1));
    }
  });
}

}  // namespace KV_CPU_ISA
}  // namespace kvcache

#endif  // KV_AVX512
