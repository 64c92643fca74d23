// AVX2+F16C building blocks of the quantized rows (kv_cpu_quant_rows.h): eight groups of 8 elements at a
// time, each group one vector. Same arithmetic as the portable loops, so the same bits: IEEE division (no
// reciprocal), rounding half to even, conversions rounding to nearest even.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

#include "kv_cpu_rows.h"

#if KV_SIMD

#include "kv_cpu_codes.h"
#include "kv_quant.h"

namespace kvcache {
namespace KV_CPU_ISA {

// Lane j of s broadcast to all eight lanes, for j known at compile time: one in-lane shuffle of a half.
struct Lanes {
  __m256 low, high;  // s's low / high 128 bits in both halves
  KV_ALWAYS_INLINE explicit Lanes(__m256 s)
      : low(_mm256_permute2f128_ps(s, s, 0x00)), high(_mm256_permute2f128_ps(s, s, 0x11)) {}
  template <int J>
  KV_ALWAYS_INLINE __m256 Get() const {
    return _mm256_permute_ps(J < 4 ? low : high, (J % 4) * 0x55);
  }
};

// fn(std::integral_constant<int, J>{}) for J = 0..7, unrolled.
template <class Fn, int... J>
KV_ALWAYS_INLINE void Unrolled(Fn&& fn, std::integer_sequence<int, J...>) {
  (fn(std::integral_constant<int, J>{}), ...);
}
template <class Fn>
KV_ALWAYS_INLINE void ForEachOf8(Fn&& fn) {
  Unrolled(fn, std::make_integer_sequence<int, 8>{});
}
template <class Fn>
KV_ALWAYS_INLINE void ForEachOf4(Fn&& fn) {
  Unrolled(fn, std::make_integer_sequence<int, 4>{});
}

// Per lane j, the max of the 8 lanes of v[j] (signed int32 compare): eight horizontal maxima at once.
KV_ALWAYS_INLINE __m256i TransposedMax8(const __m256i* v) {
  __m256i pair[4];
  for (int k = 0; k < 4; ++k)
    pair[k] = _mm256_max_epi32(_mm256_unpacklo_epi32(v[2 * k], v[2 * k + 1]), _mm256_unpackhi_epi32(v[2 * k], v[2 * k + 1]));
  const __m256i low = _mm256_max_epi32(_mm256_unpacklo_epi64(pair[0], pair[1]), _mm256_unpackhi_epi64(pair[0], pair[1]));
  const __m256i high = _mm256_max_epi32(_mm256_unpacklo_epi64(pair[2], pair[3]), _mm256_unpackhi_epi64(pair[2], pair[3]));
  return _mm256_max_epi32(_mm256_permute2x128_si256(low, high, 0x20), _mm256_permute2x128_si256(low, high, 0x31));
}

// Scales of eight groups from their max|x| bits: T3(max(amax / qmax, eps)), NaN kept (GroupScale of the
// canonical NaN, as the portable path). Stores the first count (<= 8) at dst; returns all eight as floats.
template <class T3>
KV_ALWAYS_INLINE __m256 StoreScales8(__m256i amax_bits, float qmax, typename T3::Storage* dst, int count) {
  const __m256i nan = _mm256_cmpgt_epi32(amax_bits, _mm256_set1_epi32(static_cast<int32_t>(kInfBits)));
  const __m256 amax = _mm256_castsi256_ps(_mm256_blendv_epi8(amax_bits, _mm256_set1_epi32(kQuietNanBits), nan));
  __m256 s = _mm256_div_ps(amax, _mm256_set1_ps(qmax));
  const __m256 eps = _mm256_set1_ps(kScaleEps);
  s = _mm256_blendv_ps(eps, s, _mm256_cmp_ps(s, eps, _CMP_NLE_UQ));  // s if s > eps or NaN
  alignas(32) typename T3::Storage stored[8];
  __m256 back;
  if constexpr (T3::kElem == Elem::kFloat32) {
    _mm256_store_ps(stored, s);
    back = s;
  } else {
    const __m128i h = _mm256_cvtps_ph(s, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_store_si128(reinterpret_cast<__m128i*>(stored), h);
    back = _mm256_cvtph_ps(h);
  }
  if (count == 8) {
    std::memcpy(dst, stored, sizeof(stored));
  } else {
    std::memcpy(dst, stored, count * sizeof(stored[0]));
  }
  return back;
}

// Codes of 8 elements: clamp(rint(x / s), -qmax, qmax), 0 where the quotient is NaN (QuantizeValue).
KV_ALWAYS_INLINE __m256i QuantizeCodes8(__m256 x, __m256 s, __m256 lo, __m256 hi) {
  const __m256 q = _mm256_div_ps(x, s);  // IEEE division, as the portable path
  __m256 r = _mm256_round_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  r = _mm256_min_ps(_mm256_max_ps(r, lo), hi);
  r = _mm256_andnot_ps(_mm256_cmp_ps(q, q, _CMP_UNORD_Q), r);
  return _mm256_cvtps_epi32(r);
}

// The same codes for 8 elements of a group quantized by its own scale s = T3(max(amax / qmax, eps)), finite.
// Then |x / s| < qmax + 1/2, so rounding alone gives the clamped code, and no quotient is NaN: |x| <= amax,
// and s lies at most 0.3% below amax / qmax (float16's coarsest relative step among scales is a half step of
// 2^-24 at eps = 1e-5; float32 scales 2^-24), so |x / s| <= 1.003 qmax: 127.4 for int8, 7.03 for int4. The
// conversion rounds by the rounding mode in force, to nearest even by default, as the division does and the
// portable path's rintf.
KV_ALWAYS_INLINE __m256i QuantizeCodes8OwnScale(__m256 x, __m256 s) { return _mm256_cvtps_epi32(_mm256_div_ps(x, s)); }

// Stores 8 codes in [-127, 127] as int8, or as 4 bytes of int4 pairs.
template <int QBits>
KV_ALWAYS_INLINE void StoreCodes8(__m256i c, typename Codes<QBits>::Storage* dst) {
  const __m128i c16 = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));  // 8 x int16
  if constexpr (QBits == 8) {
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm_packs_epi16(c16, c16));
  } else {
    // Each int32 lane holds codes 2i (low half) and 2i+1 (high half): byte = low nibble | high nibble << 4.
    const __m128i lo = _mm_and_si128(c16, _mm_set1_epi32(0x0f));
    const __m128i hi = _mm_and_si128(_mm_srli_epi32(c16, 12), _mm_set1_epi32(0xf0));
    const __m128i bytes = _mm_packus_epi16(_mm_packus_epi32(_mm_or_si128(lo, hi), lo), lo);
    const int32_t packed = _mm_cvtsi128_si32(bytes);
    std::memcpy(dst, &packed, 4);
  }
}

// Stores the 32 codes of c[0..4) (each 8 codes in [-127, 127]) in order: 32 int8, or 16 bytes of int4 pairs.
template <int QBits>
KV_ALWAYS_INLINE void StoreCodes32(const __m256i* c, typename Codes<QBits>::Storage* dst) {
  // The packs work per 128-bit half: dwords come out as c0 c1 c2 c3 (low halves), then the high halves.
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
  const __m256i ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  if constexpr (QBits == 8) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), ordered);
  } else {
    // Per int16 lane: code 2i in the low byte, 2i+1 in the high byte -> low nibble | high nibble << 4.
    const __m256i nibbles = _mm256_or_si256(_mm256_and_si256(ordered, _mm256_set1_epi16(0x0f)),
                                            _mm256_and_si256(_mm256_srli_epi16(ordered, 4), _mm256_set1_epi16(0xf0)));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi16(nibbles, nibbles), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(packed));
  }
}

// 8 codes as int32 lanes from int8 codes, or from 4 bytes of int4 pairs (sign-extended nibbles).
template <int QBits>
KV_ALWAYS_INLINE __m256i LoadCodes8(const typename Codes<QBits>::Storage* src) {
  if constexpr (QBits == 8) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
  } else {
    int32_t packed;
    std::memcpy(&packed, src, 4);
    // Lane 2k takes byte k's low nibble, lane 2k+1 its high one: shift each to the top, then back with sign.
    const __m256i top = _mm256_sllv_epi32(_mm256_set1_epi32(packed), _mm256_setr_epi32(28, 24, 20, 16, 12, 8, 4, 0));
    return _mm256_srai_epi32(top, 28);
  }
}

#if KV_AVX512
// Lanes 2J and 2J + 1 of v over the low and the high 8 lanes of a 64-byte vector: the scales of the two groups of
// 8 that one vector holds.
template <int J>
KV_ALWAYS_INLINE __m512 PairOfLanes(__m512 v) {
  constexpr int a = 2 * J, b = 2 * J + 1;
  return _mm512_permutexvar_ps(_mm512_setr_epi32(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b), v);
}
#endif

// Q of 8 groups of 8 elements (64): their maxima in one transposed reduction, their 8 scales in one division,
// each group's codes from the vector it was loaded in.
template <class T1, class T3, int QBits>
KV_ALWAYS_INLINE void QuantizeEightGroupsOf8(const typename T1::Storage* src, typename Codes<QBits>::Storage* codes,
                                             typename T3::Storage* scales) {
  const __m256i abs_mask = _mm256_set1_epi32(static_cast<int32_t>(kAbsMask));
  __m256 x[8];
  __m256i bits[8];
  for (int j = 0; j < 8; ++j) {
    x[j] = LoadFloat8<T1>(src + 8 * j);
    bits[j] = _mm256_and_si256(_mm256_castps_si256(x[j]), abs_mask);
  }
  const __m256 s = StoreScales8<T3>(TransposedMax8(bits), Codes<QBits>::kMax, scales, 8);
  const __m256 lo = _mm256_set1_ps(-Codes<QBits>::kMax), hi = _mm256_set1_ps(Codes<QBits>::kMax);
  const Lanes lanes(s);
  __m256i c[8];
  if (_mm256_movemask_ps(_mm256_cmp_ps(s, _mm256_set1_ps(INFINITY), _CMP_LT_OQ)) == 0xff) {
#if KV_AVX512
    // Two groups per 64-byte division: the divisions bound a prefill's stores, and a 64-byte one costs about
    // what a 32-byte one does (measured on an AMD EPYC Zen 5: 1.8 ns per 16 quotients against 2.0 per 8). The
    // same IEEE quotients lane by lane, so the same codes.
    const __m512 s16 = _mm512_castps256_ps512(s);
    ForEachOf4([&](auto k) {
      constexpr int j = 2 * decltype(k)::value;
      const __m512 pair = _mm512_castpd_ps(
          _mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(x[j])), _mm256_castps_pd(x[j + 1]), 1));
      const __m512i codes = _mm512_cvtps_epi32(_mm512_div_ps(pair, PairOfLanes<decltype(k)::value>(s16)));
      c[j] = _mm512_castsi512_si256(codes);
      c[j + 1] = _mm512_extracti64x4_epi64(codes, 1);
    });
#else
    ForEachOf8([&](auto j) { c[j] = QuantizeCodes8OwnScale(x[j], lanes.template Get<decltype(j)::value>()); });
#endif
  } else {
    ForEachOf8([&](auto j) { c[j] = QuantizeCodes8(x[j], lanes.template Get<decltype(j)::value>(), lo, hi); });
  }
  StoreCodes32<QBits>(c, codes);
  StoreCodes32<QBits>(c + 4, codes + 4 * CodeBytes8(QBits));
}

// Q of count (< 8) groups of group elements (a multiple of 8): a row's last groups, or every group of a
// quant_group larger than 8.
template <class T1, class T3, int QBits>
inline void QuantizeGroups(const typename T1::Storage* src, int64_t group, int count,
                           typename Codes<QBits>::Storage* codes, typename T3::Storage* scales) {
  const __m256i abs_mask = _mm256_set1_epi32(static_cast<int32_t>(kAbsMask));
  __m256i amax[8];
  for (int j = 0; j < 8; ++j) {
    amax[j] = _mm256_setzero_si256();
    for (int64_t i = 0; j < count && i < group; i += 8)
      amax[j] = _mm256_max_epi32(amax[j], _mm256_and_si256(_mm256_castps_si256(LoadFloat8<T1>(src + j * group + i)), abs_mask));
  }
  const __m256 s = StoreScales8<T3>(TransposedMax8(amax), Codes<QBits>::kMax, scales, count);
  const __m256 lo = _mm256_set1_ps(-Codes<QBits>::kMax), hi = _mm256_set1_ps(Codes<QBits>::kMax);
  for (int j = 0; j < count; ++j) {
    const __m256 sj = _mm256_permutevar8x32_ps(s, _mm256_set1_epi32(j));
    for (int64_t i = j * group; i < (j + 1) * group; i += 8)
      StoreCodes8<QBits>(QuantizeCodes8(LoadFloat8<T1>(src + i), sj, lo, hi), codes + i / 8 * CodeBytes8(QBits));
  }
}

// DQ of count (<= 8) groups of 8 codes whose scales are the lanes of s, into out[0, 8 * count). Each group's
// scale is broadcast from memory, a load rather than another shuffle on the port the code widening and the
// float16 conversion already share. Stream: count is 8, out is 32-byte aligned and written with 32-byte
// streaming stores, two groups per store for 16-bit T1.
template <class T1, int QBits, bool Stream = false>
KV_ALWAYS_INLINE void DequantizeGroupsOf8(const typename Codes<QBits>::Storage* codes, __m256 s, int count,
                                          typename T1::Storage* out) {
  alignas(32) float sf[8];
  _mm256_store_ps(sf, s);
  auto value = [&](int j) {
    return _mm256_mul_ps(_mm256_cvtepi32_ps(LoadCodes8<QBits>(codes + j * CodeBytes8(QBits))), _mm256_broadcast_ss(sf + j));
  };
  if constexpr (Stream) {
    ForEachOf8([&](auto j) {
      constexpr int J = decltype(j)::value;
      if constexpr (T1::kElem == Elem::kFloat32) {
        _mm256_stream_ps(out + 8 * J, value(J));
      } else if constexpr (J % 2 == 1) {
        const __m256i pair = _mm256_set_m128i(HalfBits8<T1>(value(J)), HalfBits8<T1>(value(J - 1)));
        _mm256_stream_si256(reinterpret_cast<__m256i*>(out + 8 * (J - 1)), pair);
      }
    });
  } else if (count == 8) {
    ForEachOf8([&](auto j) { StoreFloat8<T1>(value(decltype(j)::value), out + 8 * decltype(j)::value); });
  } else {
    for (int j = 0; j < count; ++j) StoreFloat8<T1>(value(j), out + 8 * j);
  }
}

// DQ of a row's `groups` groups of `group` codes (a multiple of 8; or 1, 2 or 4 with n a multiple of 8) with
// their scales already float32 in sf; groups of 1, 2 or 4 take 8 / group scales per 8 codes.
template <class T1, int QBits>
inline void DequantizeSpread(const typename Codes<QBits>::Storage* codes, const float* sf, int64_t n, int64_t group,
                             int64_t groups, typename T1::Storage* out) {
  auto codes8 = [&](int64_t i) { return _mm256_cvtepi32_ps(LoadCodes8<QBits>(codes + i / 8 * CodeBytes8(QBits))); };
  if (group % 8 == 0) {
    for (int64_t g = 0, i = 0; g < groups; ++g) {
      const __m256 s = _mm256_broadcast_ss(sf + g);
      for (const int64_t end = i + group; i < end; i += 8) StoreFloat8<T1>(_mm256_mul_ps(codes8(i), s), out + i);
    }
    return;
  }
  const __m256i spread = _mm256_srlv_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                           _mm256_set1_epi32(group == 1 ? 0 : group == 2 ? 1 : 2));
  for (int64_t i = 0, g = 0; i < n; i += 8, g += 8 / group)
    StoreFloat8<T1>(_mm256_mul_ps(codes8(i), _mm256_permutevar8x32_ps(_mm256_loadu_ps(sf + g), spread)), out + i);
}

}  // namespace KV_CPU_ISA
}  // namespace kvcache

#endif  // KV_SIMD
