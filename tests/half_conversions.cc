// The element conversions of cpu/kv_types.h over runs of consecutive input bit patterns, for
// tests/test_half_conversions.py. Plain loops like the CPU kernel's portable ones: built with the kernel's
// flags they are vectorized as those are. Built with -DHALF_CONVERSIONS_SSE2 (x86-64), the loops take eight
// elements at a time through cpu/kv_sse2_convert.h instead, as the generic CPU build does.
#include <cstdint>

#include "kv_types.h"
#if defined(HALF_CONVERSIONS_SSE2)
#include "kv_sse2_convert.h"

namespace {

// Eight consecutive float32 bit patterns from first.
kvcache::sse2::Float8 Floats8(uint32_t first) {
  const __m128i base = _mm_set1_epi32(static_cast<int32_t>(first));
  return {_mm_castsi128_ps(_mm_add_epi32(base, _mm_setr_epi32(0, 1, 2, 3))),
          _mm_castsi128_ps(_mm_add_epi32(base, _mm_setr_epi32(4, 5, 6, 7)))};
}

// Eight consecutive 16-bit patterns from first.
__m128i Halves8(uint32_t first) {
  return _mm_add_epi16(_mm_set1_epi16(static_cast<int16_t>(first)), _mm_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7));
}

void Store8(const kvcache::sse2::Float8& v, uint32_t* out) {
  _mm_storeu_ps(reinterpret_cast<float*>(out), v.low);
  _mm_storeu_ps(reinterpret_cast<float*>(out + 4), v.high);
}

}  // namespace
#endif

extern "C" {

// out[i] = FloatToHalf(the float32 with bits first + i), i < n.
void kv_float_to_half(uint32_t first, uint16_t* out, int64_t n) {
  int64_t i = 0;
#if defined(HALF_CONVERSIONS_SSE2)
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     kvcache::sse2::HalvesFromFloats(Floats8(first + static_cast<uint32_t>(i))));
#endif
  for (; i < n; ++i) out[i] = kvcache::FloatToHalf(kvcache::BitsFloat(first + static_cast<uint32_t>(i)));
}

// out[i] = FloatToBFloat16(the float32 with bits first + i), i < n.
void kv_float_to_bfloat16(uint32_t first, uint16_t* out, int64_t n) {
  int64_t i = 0;
#if defined(HALF_CONVERSIONS_SSE2)
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     kvcache::sse2::BFloat16sFromFloats(Floats8(first + static_cast<uint32_t>(i))));
#endif
  for (; i < n; ++i)
    out[i] = kvcache::FloatToBFloat16(kvcache::BitsFloat(first + static_cast<uint32_t>(i)));
}

// out[i] = the bits of HalfToFloat(first + i), i < n <= 65536 - first.
void kv_half_to_float(uint32_t first, uint32_t* out, int64_t n) {
  int64_t i = 0;
#if defined(HALF_CONVERSIONS_SSE2)
  for (; i + 8 <= n; i += 8)
    Store8(kvcache::sse2::FloatsFromHalves(Halves8(first + static_cast<uint32_t>(i))), out + i);
#endif
  for (; i < n; ++i)
    out[i] = kvcache::FloatBits(kvcache::HalfToFloat(static_cast<uint16_t>(first + static_cast<uint32_t>(i))));
}

// out[i] = the bits of BFloat16ToFloat(first + i), i < n <= 65536 - first.
void kv_bfloat16_to_float(uint32_t first, uint32_t* out, int64_t n) {
  int64_t i = 0;
#if defined(HALF_CONVERSIONS_SSE2)
  for (; i + 8 <= n; i += 8)
    Store8(kvcache::sse2::FloatsFromBFloat16s(Halves8(first + static_cast<uint32_t>(i))), out + i);
#endif
  for (; i < n; ++i)
    out[i] = kvcache::FloatBits(kvcache::BFloat16ToFloat(static_cast<uint16_t>(first + static_cast<uint32_t>(i))));
}

#if defined(HALF_CONVERSIONS_SSE2)
// out[i] = sse2::HalvesFromRebiasedNormals of (the float32 with bits first + i) * 2^-112, i < n, n a multiple of 8:
// FloatToHalf of that float where it is 0 or of magnitude in [2^-14, 32768].
void kv_rebiased_float_to_half(uint32_t first, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i + 8 <= n; i += 8) {
    const kvcache::sse2::Float8 v = Floats8(first + static_cast<uint32_t>(i));
    const __m128 r = kvcache::sse2::RebiasFactor();
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     kvcache::sse2::HalvesFromRebiasedNormals({_mm_mul_ps(v.low, r), _mm_mul_ps(v.high, r)}));
  }
}
#endif

}  // extern "C"
