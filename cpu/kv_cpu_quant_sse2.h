// SSE2 building blocks of the quantized rows (kv_cpu_quant_rows.h) for the generic build on x86-64, where
// F16C and AVX2 may be missing but SSE2 never is: four groups of 8 elements at a time. Same arithmetic as the
// portable loops, so the same bits: IEEE division (no reciprocal), rounding half to even, the exact
// conversions of kv_sse2_convert.h.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kv_cpu_codes.h"
#include "kv_cpu_rows.h"

#define KV_SSE2_ONLY (KV_SSE2 && !KV_SIMD)

#if KV_SSE2_ONLY

#include "kv_quant.h"
#include "kv_sse2_convert.h"

namespace kvcache {
namespace KV_CPU_ISA {

using sse2::Float8;

// float(src[0..8)) of a T1 row (exact).
template <class T1>
KV_SSE2_INLINE Float8 LoadFloat8Sse2(const typename T1::Storage* src) {
  if constexpr (T1::kElem == Elem::kFloat32) {
    return {_mm_loadu_ps(src), _mm_loadu_ps(src + 4)};
  } else {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    if constexpr (T1::kElem == Elem::kFloat16) return sse2::FloatsFromHalves(bits);
    return sse2::FloatsFromBFloat16s(bits);
  }
}

// 16 bytes to dst (16-byte aligned where Stream: then with a streaming store).
template <bool Stream>
KV_SSE2_INLINE void Store16(void* dst, __m128i v) {
  if constexpr (Stream) {
    _mm_stream_si128(static_cast<__m128i*>(dst), v);
  } else {
    _mm_storeu_si128(static_cast<__m128i*>(dst), v);
  }
}

// T1(f) for 8 floats, stored at dst (Stream: see Store16).
template <class T1, bool Stream = false>
KV_SSE2_INLINE void StoreFloat8Sse2(Float8 f, typename T1::Storage* dst) {
  if constexpr (T1::kElem == Elem::kFloat32) {
    Store16<Stream>(dst, _mm_castps_si128(f.low));
    Store16<Stream>(dst + 4, _mm_castps_si128(f.high));
  } else if constexpr (T1::kElem == Elem::kFloat16) {
    Store16<Stream>(dst, sse2::HalvesFromFloats(f));
  } else {
    Store16<Stream>(dst, sse2::BFloat16sFromFloats(f));
  }
}

// float(scales[0..4)) of four T3 scales (exact).
template <class T3>
KV_SSE2_INLINE __m128 LoadScales4(const typename T3::Storage* scales) {
  if constexpr (T3::kElem == Elem::kFloat32) {
    return _mm_loadu_ps(scales);
  } else {
    const __m128i bits = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales));
    return sse2::FloatsFromHalves4(_mm_unpacklo_epi16(bits, _mm_setzero_si128()));
  }
}

// The codes of 8 elements as floats: from 8 int8 codes, or from 4 bytes of int4 pairs.
template <int QBits>
KV_SSE2_INLINE Float8 LoadCodes8Sse2(const typename Codes<QBits>::Storage* src) {
  __m128i c16;  // the 8 codes as int16
  if constexpr (QBits == 8) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src));
    c16 = _mm_srai_epi16(_mm_unpacklo_epi8(bytes, bytes), 8);
  } else {
    int32_t packed;
    std::memcpy(&packed, src, 4);
    // Lane i holds byte i/2 twice; lane 2k moves its low nibble to the top (x 2^12), lane 2k+1 its high one
    // (x 2^8), and the arithmetic shift brings each back with its sign.
    const __m128i bytes = _mm_cvtsi32_si128(packed);
    const __m128i twice = _mm_unpacklo_epi8(_mm_unpacklo_epi8(bytes, bytes), _mm_unpacklo_epi8(bytes, bytes));
    c16 = _mm_srai_epi16(_mm_mullo_epi16(twice, _mm_setr_epi16(4096, 256, 4096, 256, 4096, 256, 4096, 256)), 12);
  }
  return {_mm_cvtepi32_ps(_mm_srai_epi32(_mm_unpacklo_epi16(c16, c16), 16)),
          _mm_cvtepi32_ps(_mm_srai_epi32(_mm_unpackhi_epi16(c16, c16), 16))};
}

KV_SSE2_INLINE Float8 Scaled(Float8 v, __m128 s) { return {_mm_mul_ps(v.low, s), _mm_mul_ps(v.high, s)}; }

// Lane J of v in all four lanes.
template <int J>
KV_SSE2_INLINE __m128 Broadcast(__m128 v) {
  return _mm_shuffle_ps(v, v, J * 0x55);
}

// Whether all four scales lie in [2^-14, 256]. Then every product of a code (|c| <= 128) and a scale, rounded
// to float32, is 0 or a normal float16 of at most 32768 (|c * s| >= s >= 2^-14 for c != 0), and scaling scale
// and product by 2^-112 commutes with their rounding (every value stays a normal float32): the float16 bits
// come from sse2::HalvesFromRebiasedNormals. Any other scale (subnormal, huge, negative, NaN) takes the full
// conversion.
KV_SSE2_INLINE bool RebiasedScalesFit(__m128 s) {
  const __m128 fit = _mm_and_ps(_mm_cmpge_ps(s, _mm_set1_ps(0x1p-14f)), _mm_cmple_ps(s, _mm_set1_ps(256.0f)));
  return _mm_movemask_ps(fit) == 0xf;
}

// DQ of `groups` groups of `group` codes (a multiple of 8) into out: four groups of 8 per step where group is
// 8, one group per step otherwise. Stream: out is 16-byte aligned and written with streaming stores.
template <class T1, class T3, int QBits, bool Stream = false>
inline void DequantizeGroupsSse2(const typename Codes<QBits>::Storage* codes, const typename T3::Storage* scales,
                                 int64_t group, int64_t groups, typename T1::Storage* out) {
  int64_t g = 0;
  if (group == 8) {
    for (; g + 4 <= groups; g += 4) {
      const auto* c = codes + g * CodeBytes8(QBits);
      typename T1::Storage* o = out + g * 8;
      // The four groups with their scales in the lanes of sv (rebiased: the scales * 2^-112, float16 out).
      auto four_groups = [&](__m128 sv, auto rebiased) __attribute__((always_inline)) {
        auto one_group = [&](int j, __m128 sj) __attribute__((always_inline)) {
          const Float8 v = Scaled(LoadCodes8Sse2<QBits>(c + j * CodeBytes8(QBits)), sj);
          if constexpr (decltype(rebiased)::value) {
            Store16<Stream>(o + 8 * j, sse2::HalvesFromRebiasedNormals(v));
          } else {
            StoreFloat8Sse2<T1, Stream>(v, o + 8 * j);
          }
        };
        one_group(0, Broadcast<0>(sv)), one_group(1, Broadcast<1>(sv));
        one_group(2, Broadcast<2>(sv)), one_group(3, Broadcast<3>(sv));
      };
      const __m128 s = LoadScales4<T3>(scales + g);
      if constexpr (T1::kElem == Elem::kFloat16) {
        if (RebiasedScalesFit(s)) {  // exact: s is normal, and so is s * 2^-112
          four_groups(_mm_mul_ps(s, sse2::RebiasFactor()), std::true_type{});
          continue;
        }
      }
      four_groups(s, std::false_type{});
    }
  }
  for (; g < groups; ++g) {
    const __m128 s = _mm_set1_ps(T3::ToFloat(scales[g]));
    for (int64_t i = g * group; i < (g + 1) * group; i += 8)
      StoreFloat8Sse2<T1, Stream>(Scaled(LoadCodes8Sse2<QBits>(codes + i / 8 * CodeBytes8(QBits)), s), out + i);
  }
}

// Lane-wise max of two int32 vectors (signed compare; SSE2 has no pmaxsd).
KV_SSE2_INLINE __m128i MaxInt32(__m128i a, __m128i b) {
  const __m128i a_greater = _mm_cmpgt_epi32(a, b);
  return _mm_or_si128(_mm_and_si128(a_greater, a), _mm_andnot_si128(a_greater, b));
}

// Codes of 4 elements: clamp(rint(x / s), -qmax, qmax) as QuantizeCode, 0 where the quotient is NaN.
// OwnScale: s is the finite scale the elements' group got from its own max|x|, so the quotient needs no clamp
// and is never NaN (QuantizeCodes8OwnScale says why), and the conversion rounds it to nearest even.
template <bool OwnScale>
KV_SSE2_INLINE __m128i QuantizeCodes4(__m128 x, __m128 s, float qmax) {
  const __m128 q = _mm_div_ps(x, s);  // IEEE division, as the portable path
  if constexpr (OwnScale) return _mm_cvtps_epi32(q);
  const __m128 round = _mm_set1_ps(12582912.0f);  // 1.5 * 2^23: adding and subtracting it rounds half to even
  __m128 r = _mm_min_ps(_mm_max_ps(q, _mm_set1_ps(-qmax)), _mm_set1_ps(qmax));
  r = _mm_sub_ps(_mm_add_ps(r, round), round);
  r = _mm_andnot_ps(_mm_cmpunord_ps(q, q), r);
  return _mm_cvttps_epi32(r);
}

// The 16 codes of two groups of 8 (int32 lanes, in [-127, 127]) as 16 int8 bytes.
KV_SSE2_INLINE __m128i CodeBytes16(const __m128i* c) {
  return _mm_packs_epi16(_mm_packs_epi32(c[0], c[1]), _mm_packs_epi32(c[2], c[3]));
}

// The codes of 4 groups of 8 elements x whose scales are the lanes of s (OwnScale: each group's own finite
// scale): 32 int8, or 16 bytes of int4 pairs.
template <int QBits, bool OwnScale>
KV_SSE2_INLINE void QuantizeCodesOf4Groups(const Float8* x, __m128 s, typename Codes<QBits>::Storage* codes) {
  constexpr float qmax = Codes<QBits>::kMax;
  __m128i c[8];
  const __m128 sj[4] = {Broadcast<0>(s), Broadcast<1>(s), Broadcast<2>(s), Broadcast<3>(s)};
  for (int j = 0; j < 4; ++j) {
    c[2 * j] = QuantizeCodes4<OwnScale>(x[j].low, sj[j], qmax);
    c[2 * j + 1] = QuantizeCodes4<OwnScale>(x[j].high, sj[j], qmax);
  }
  const __m128i first = CodeBytes16(c), second = CodeBytes16(c + 4);
  if constexpr (QBits == 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes), first);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + 16), second);
  } else {
    // Per int16 lane: code 2i in the low byte, 2i+1 in the high byte -> low nibble | high nibble << 4.
    auto nibbles = [](__m128i v) __attribute__((always_inline)) {
      return _mm_or_si128(_mm_and_si128(v, _mm_set1_epi16(0x0f)), _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi16(0xf0)));
    };
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes), _mm_packus_epi16(nibbles(first), nibbles(second)));
  }
}

// Q of 4 groups of 8 elements (32): codes to `codes`, the 4 scales to `scales`. Their maxima come from one
// transposed reduction, their scales from one division.
template <class T1, class T3, int QBits>
KV_SSE2_INLINE void QuantizeFourGroupsOf8(const typename T1::Storage* src, typename Codes<QBits>::Storage* codes,
                                          typename T3::Storage* scales) {
  const __m128i abs_mask = _mm_set1_epi32(static_cast<int32_t>(kAbsMask));
  Float8 x[4];
  __m128 m[4];  // per group, lane-wise max|x| bits of its two vectors
  for (int j = 0; j < 4; ++j) {
    x[j] = LoadFloat8Sse2<T1>(src + 8 * j);
    m[j] = _mm_castsi128_ps(MaxInt32(_mm_and_si128(_mm_castps_si128(x[j].low), abs_mask),
                                     _mm_and_si128(_mm_castps_si128(x[j].high), abs_mask)));
  }
  _MM_TRANSPOSE4_PS(m[0], m[1], m[2], m[3]);  // lane j of m[k]: group j's k-th partial max
  const __m128i amax_bits = MaxInt32(MaxInt32(_mm_castps_si128(m[0]), _mm_castps_si128(m[1])),
                                     MaxInt32(_mm_castps_si128(m[2]), _mm_castps_si128(m[3])));
  // GroupScale of CanonicalAbsMax: the canonical NaN for any NaN, max(amax / qmax, eps) otherwise.
  const __m128i nan = _mm_cmpgt_epi32(amax_bits, _mm_set1_epi32(static_cast<int32_t>(kInfBits)));
  const __m128 amax = _mm_castsi128_ps(_mm_or_si128(_mm_and_si128(nan, _mm_set1_epi32(static_cast<int32_t>(kQuietNanBits))),
                                                    _mm_andnot_si128(nan, amax_bits)));
  __m128 s = _mm_div_ps(amax, _mm_set1_ps(Codes<QBits>::kMax));
  const __m128 eps = _mm_set1_ps(kScaleEps);
  const __m128 keep = _mm_cmpnle_ps(s, eps);  // s > eps, or NaN
  s = _mm_or_ps(_mm_and_ps(keep, s), _mm_andnot_ps(keep, eps));
  if constexpr (T3::kElem == Elem::kFloat32) {
    _mm_storeu_ps(scales, s);
  } else {  // the stored float16 scales, and the float32 values quantization divides by
    const __m128i h = sse2::HalvesFromFloats({s, s});
    _mm_storel_epi64(reinterpret_cast<__m128i*>(scales), h);
    s = sse2::FloatsFromHalves4(_mm_unpacklo_epi16(h, _mm_setzero_si128()));
  }
  // Own finite scales take the unclamped path. They are > 0 too (the tasks run with denormals read as they are,
  // SpecFloatMode); a scale that read back as 0 would take the clamped path, its codes still within +-qmax.
  const __m128 own = _mm_and_ps(_mm_cmplt_ps(s, _mm_set1_ps(INFINITY)), _mm_cmpgt_ps(s, _mm_setzero_ps()));
  if (_mm_movemask_ps(own) == 0xf) {
    QuantizeCodesOf4Groups<QBits, true>(x, s, codes);
  } else {
    QuantizeCodesOf4Groups<QBits, false>(x, s, codes);
  }
}

}  // namespace KV_CPU_ISA
}  // namespace kvcache

#endif  // KV_SSE2_ONLY
