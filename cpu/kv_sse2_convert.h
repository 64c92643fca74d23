// The float16 / bfloat16 conversions of kv_types.h, eight elements at a time with SSE2 alone (part of x86-64
// itself): what the generic CPU build uses on processors without F16C. Every function gives exactly the bits of
// its scalar counterpart (round to nearest even, overflow to inf, subnormals kept, the same NaN rules);
// tests/test_half_conversions.py checks them over every input. They rely on IEEE float arithmetic (no flush to
// zero, no -ffast-math), as the scalar ones do.
#pragma once

#if defined(__SSE2__)
#include <emmintrin.h>

#include <cstdint>

// Always inlined: called per vector from the kernels' loops, whose constants and registers they share.
#define KV_SSE2_INLINE inline __attribute__((always_inline))

namespace kvcache {
namespace sse2 {

// Two vectors of four floats: elements 0-3 and 4-7.
struct Float8 {
  __m128 low, high;
};

// The four int32 lanes sign-extended from bits 16..31 of each: packs of them keep every value (the top halves).
KV_SSE2_INLINE __m128i TopHalves(__m128i a, __m128i b) { return _mm_packs_epi32(_mm_srai_epi32(a, 16), _mm_srai_epi32(b, 16)); }

// Magnitude bits of a float32 (sign cleared) -> float16 magnitude bits, in int32 lanes: exact below 65520 (as
// FloatToHalf), a value above 0x7c00 for anything larger (the caller saturates it to inf and marks NaN).
KV_SSE2_INLINE __m128i HalfMagnitude(__m128i f) {
  // Normal halves: rebias the exponent and round the 13 dropped bits to nearest even.
  const __m128i odd = _mm_and_si128(_mm_srli_epi32(f, 13), _mm_set1_epi32(1));
  const __m128i normal = _mm_srli_epi32(
      _mm_add_epi32(_mm_add_epi32(f, _mm_set1_epi32(static_cast<int32_t>((static_cast<uint32_t>(15 - 127) << 23) + 0xfffu))), odd),
      13);
  // Below the smallest normal half: adding 0.5f rounds to the half subnormal ulp (as FloatToHalf).
  const __m128i subnormal =
      _mm_sub_epi32(_mm_castps_si128(_mm_add_ps(_mm_castsi128_ps(f), _mm_set1_ps(0.5f))), _mm_set1_epi32(126 << 23));
  const __m128i small = _mm_cmplt_epi32(f, _mm_set1_epi32(0x38800000));
  return _mm_or_si128(_mm_and_si128(small, subnormal), _mm_andnot_si128(small, normal));
}

// FloatToHalf of eight floats, as eight uint16 lanes.
KV_SSE2_INLINE __m128i HalvesFromFloats(Float8 v) {
  const __m128i abs_mask = _mm_set1_epi32(0x7fffffff), inf = _mm_set1_epi32(0x7f800000);
  const __m128i a = _mm_castps_si128(v.low), b = _mm_castps_si128(v.high);
  const __m128i fa = _mm_and_si128(a, abs_mask), fb = _mm_and_si128(b, abs_mask);
  // Every magnitude from 65520 on comes out above 0x7bff: the signed pack saturates the largest to 0x7fff, and
  // the minimum with 0x7c00 makes them all inf; NaNs then get the quiet bit (0x7e00).
  __m128i h = _mm_min_epi16(_mm_packs_epi32(HalfMagnitude(fa), HalfMagnitude(fb)), _mm_set1_epi16(0x7c00));
  const __m128i nan = _mm_packs_epi32(_mm_cmpgt_epi32(fa, inf), _mm_cmpgt_epi32(fb, inf));
  h = _mm_or_si128(h, _mm_and_si128(nan, _mm_set1_epi16(0x0200)));
  return _mm_or_si128(h, _mm_and_si128(TopHalves(a, b), _mm_set1_epi16(static_cast<int16_t>(0x8000))));
}

// FloatToHalf(v) of eight values v given as v * 2^-112 (exact), where each v is 0 or has |v| in [2^-14, 32768]:
// a normal float16 or zero, far from overflow. Scaled so, a value's exponent field is already its float16
// exponent, and dropping 13 bits rounded to nearest even gives its float16 bits: half the work of
// HalvesFromFloats, for dequantization with scales known in range.
KV_SSE2_INLINE __m128i HalvesFromRebiasedNormals(Float8 v) {
  const __m128i abs_mask = _mm_set1_epi32(0x7fffffff);
  const __m128i a = _mm_castps_si128(v.low), b = _mm_castps_si128(v.high);
  auto magnitude = [&](__m128i u) __attribute__((always_inline)) {
    const __m128i f = _mm_and_si128(u, abs_mask);
    const __m128i odd = _mm_and_si128(_mm_srli_epi32(f, 13), _mm_set1_epi32(1));
    return _mm_srli_epi32(_mm_add_epi32(_mm_add_epi32(f, _mm_set1_epi32(0xfff)), odd), 13);
  };
  const __m128i h = _mm_packs_epi32(magnitude(a), magnitude(b));  // at most 0x7800: kept by the signed pack
  return _mm_or_si128(h, _mm_and_si128(TopHalves(a, b), _mm_set1_epi16(static_cast<int16_t>(0x8000))));
}

// 2^-112 as a float: the factor HalvesFromRebiasedNormals expects its values scaled by.
KV_SSE2_INLINE __m128 RebiasFactor() { return _mm_castsi128_ps(_mm_set1_epi32(0x07800000)); }

// HalfToFloat of four float16 values in the low 16 bits of each int32 lane (upper bits zero).
KV_SSE2_INLINE __m128 FloatsFromHalves4(__m128i h) {
  const __m128i magnitude = _mm_and_si128(h, _mm_set1_epi32(0x7fff));
  // The magnitude's bits moved to a float32's place stand for the value times 2^-112, normal or subnormal:
  // multiplying by 2^112 is exact. inf and NaN (0x7c00 and up) get the all-ones exponent, payload kept.
  __m128 f = _mm_mul_ps(_mm_castsi128_ps(_mm_slli_epi32(magnitude, 13)), _mm_castsi128_ps(_mm_set1_epi32(0x77800000)));
  const __m128i special = _mm_cmpgt_epi32(magnitude, _mm_set1_epi32(0x7bff));
  f = _mm_or_ps(f, _mm_castsi128_ps(_mm_and_si128(special, _mm_set1_epi32(0x7f800000))));
  const __m128i sign = _mm_slli_epi32(_mm_and_si128(h, _mm_set1_epi32(0x8000)), 16);
  return _mm_or_ps(f, _mm_castsi128_ps(sign));
}

// HalfToFloat of eight float16 values (uint16 lanes).
KV_SSE2_INLINE Float8 FloatsFromHalves(__m128i h) {
  const __m128i zero = _mm_setzero_si128();
  return {FloatsFromHalves4(_mm_unpacklo_epi16(h, zero)), FloatsFromHalves4(_mm_unpackhi_epi16(h, zero))};
}

// FloatToBFloat16 of four floats, in int32 lanes (the bfloat16 in the top 16 bits).
KV_SSE2_INLINE __m128i BFloat16Words(__m128 v) {
  const __m128i u = _mm_castps_si128(v);
  const __m128i nan = _mm_cmpgt_epi32(_mm_and_si128(u, _mm_set1_epi32(0x7fffffff)), _mm_set1_epi32(0x7f800000));
  const __m128i rounded =
      _mm_add_epi32(_mm_add_epi32(u, _mm_set1_epi32(0x7fff)), _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1)));
  const __m128i quiet = _mm_or_si128(u, _mm_set1_epi32(0x00400000));
  return _mm_or_si128(_mm_and_si128(nan, quiet), _mm_andnot_si128(nan, rounded));
}

// FloatToBFloat16 of eight floats, as eight uint16 lanes.
KV_SSE2_INLINE __m128i BFloat16sFromFloats(Float8 v) { return TopHalves(BFloat16Words(v.low), BFloat16Words(v.high)); }

// BFloat16ToFloat of eight bfloat16 values (uint16 lanes): each is a float32's top half.
KV_SSE2_INLINE Float8 FloatsFromBFloat16s(__m128i b) {
  const __m128i zero = _mm_setzero_si128();
  return {_mm_castsi128_ps(_mm_unpacklo_epi16(zero, b)), _mm_castsi128_ps(_mm_unpackhi_epi16(zero, b))};
}

}  // namespace sse2
}  // namespace kvcache

#endif  // __SSE2__
