// AVX-512 building blocks of the quantized rows (kv_cpu_quant_rows.h): quantization and dequantization of sixteen
// groups of 8 elements at a time, two groups per 64-byte vector. The same bits as the AVX2 and portable paths:
// the same scales and products, and codes equal to the IEEE division's (by products with the scales' reciprocals
// where that is exact, QuantizeCodes16ByReciprocal).
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kv_cpu_quant_avx2.h"

#if KV_AVX512

namespace kvcache {
namespace KV_CPU_ISA {

// The floats of 16 float16 / bfloat16 values' bits (exact).
template <class T>
KV_ALWAYS_INLINE __m512 FloatsOfBits16(__m256i bits) {
  if constexpr (T::kElem == Elem::kFloat16) return _mm512_cvtph_ps(bits);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// float(src[0..16)) of a T1 / T3 row (exact).
template <class T>
KV_ALWAYS_INLINE __m512 LoadFloat16(const typename T::Storage* src) {
  if constexpr (T::kElem == Elem::kFloat32) {
    return _mm512_loadu_ps(src);
  } else {
    return FloatsOfBits16<T>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
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

// Per group g of 8 lanes (group 2j + h in half h of a[j]), the max of its lanes (signed int32 compare), in lane
// g: sixteen horizontal maxima at once.
KV_ALWAYS_INLINE __m512i TransposedMax16(const __m512i* a) {
  __m512i w[2];
  for (int k = 0; k < 2; ++k) {
    __m512i pair[2];
    for (int i = 0; i < 2; ++i) {
      const __m512i u = a[4 * k + 2 * i], v = a[4 * k + 2 * i + 1];
      pair[i] = _mm512_max_epi32(_mm512_unpacklo_epi32(u, v), _mm512_unpackhi_epi32(u, v));
    }
    // 128-bit chunk c of w[k]: the max of chunk c of a[4k], ..., a[4k + 3] (4 lanes each), in that order.
    w[k] = _mm512_max_epi32(_mm512_unpacklo_epi64(pair[0], pair[1]), _mm512_unpackhi_epi64(pair[0], pair[1]));
  }
  // A group is chunks 2h and 2h + 1 of its vector: chunks (0, 2) against (1, 3) of w[0], then of w[1].
  const __m512i m = _mm512_max_epi32(_mm512_shuffle_i32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_i32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // m holds groups 0 2 4 6 | 1 3 5 7 | 8 10 12 14 | 9 11 13 15.
  return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15), m);
}

// Per group g of 8 words (group 4i + k in 128-bit chunk k of a[i]), the max of its words (signed int16 compare),
// in word g of the result: sixteen horizontal maxima of 16-bit values, four vectors of them where the int32
// lanes of TransposedMax16 take eight.
KV_ALWAYS_INLINE __m256i TransposedMaxWords16(const __m512i* a) {
  // Per chunk, dword j: (a[0], a[1]) and (a[2], a[3]) of max(word j, word j + 4).
  const __m512i m01 = _mm512_max_epi16(_mm512_unpacklo_epi16(a[0], a[1]), _mm512_unpackhi_epi16(a[0], a[1]));
  const __m512i m23 = _mm512_max_epi16(_mm512_unpacklo_epi16(a[2], a[3]), _mm512_unpackhi_epi16(a[2], a[3]));
  // Per chunk, words 0-3: a[0..4) of max(words 0, 2, 4, 6); words 4-7: of words 1, 3, 5, 7.
  __m512i m = _mm512_max_epi16(_mm512_unpacklo_epi32(m01, m23), _mm512_unpackhi_epi32(m01, m23));
  // Per chunk k, words i < 4: group 4i + k's max (the chunk's halves against each other).
  m = _mm512_max_epi16(m, _mm512_shuffle_epi32(m, _MM_PERM_BADC));
  alignas(64) static constexpr int16_t kOrder[32] = {0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27,
                                                     0, 0, 0,  0,  0, 0, 0,  0,  0, 0,  0,  0,  0, 0,  0,  0};
  return _mm512_castsi512_si256(_mm512_permutexvar_epi16(_mm512_load_si512(kOrder), m));
}

// Codes of 16 lanes: clamp(rint(x / s), -qmax, qmax), 0 where the quotient is NaN (QuantizeCodes8).
KV_ALWAYS_INLINE __m512i QuantizeCodes16(__m512 x, __m512 s, float qmax) {
  const __m512 q = _mm512_div_ps(x, s);
  __m512 r = _mm512_roundscale_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  r = _mm512_min_ps(_mm512_max_ps(r, _mm512_set1_ps(-qmax)), _mm512_set1_ps(qmax));
  return _mm512_maskz_cvtps_epi32(_mm512_cmp_ps_mask(q, q, _CMP_ORD_Q), r);
}

// The codes QuantizeCodes8OwnScale gives 16 lanes, rint(x / s), without dividing: x and s are float16 or
// bfloat16 values (at most 11 significant bits each), s the group's own finite scale (so |x / s| < 127.5), and
// r = float32(1 / s).
// - p = float32(x * r) lies within 2^-16 of q = x / s: two roundings of 2^-24 relative each, |q| < 127.5, so
//   |p - q| < 127.5 * (2 * 2^-24 + 2^-48) < 2^-16.
// - q is never within 2^-13 of a half-integer h unless equal to it: within 1/4 of one, |x| >= s / 4, so x - h s
//   is a multiple of 2^(e_s - 12) (e_s the exponent of s: x's last significant bit is worth at least that, and
//   s's half-ulp too), while s < 2^(e_s + 1).
// So p rounded to a multiple of 2^-15 (one rounding instruction) is h itself where q is a half-integer h (h is
// such a multiple, less than half a step from p), and elsewhere lies strictly between the same two
// half-integers as q (within 2^-16 + 2^-16 of it, while they are at least 2^-13 away). Its rint, half to even as
// the conversion rounds, is then rint(q) in both cases: three instructions where comparing h * s with x took
// seven. All of it rounds to nearest, as the kernel's tasks always do (SpecFloatMode). float32 inputs or scales
// keep the division: their quotients come closer to half-integers.
// tests/test_reciprocal_codes.py checks every pair of 16-bit operands this meets against the division.
KV_ALWAYS_INLINE __m512i QuantizeCodes16ByReciprocal(__m512 x, __m512 r) {
  constexpr int kOnGridOf2ToMinus15 = (15 << 4) | _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(x, r), kOnGridOf2ToMinus15));
}

// The bytes of 64 codes in [-127, 127] of c[0..4) (16 each, in order): 64 int8, or 32 bytes of int4 pairs.
template <int QBits>
KV_ALWAYS_INLINE auto PackCodes64(const __m512i* c) {
  // The packs work per 128-bit chunk: dwords come out as c0 c1 c2 c3 of chunk 0, then of chunk 1, ...
  const __m512i bytes = _mm512_packs_epi16(_mm512_packs_epi32(c[0], c[1]), _mm512_packs_epi32(c[2], c[3]));
  const __m512i ordered = _mm512_permutexvar_epi32(
      _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), bytes);
  if constexpr (QBits == 8) {
    return ordered;
  } else {
    // Per int16 lane: code 2i in the low byte, 2i+1 in the high byte -> low nibble | high nibble << 4.
    const __m512i nibbles = _mm512_or_si512(_mm512_and_si512(ordered, _mm512_set1_epi16(0x0f)),
                                            _mm512_and_si512(_mm512_srli_epi16(ordered, 4), _mm512_set1_epi16(0xf0)));
    return _mm512_cvtepi16_epi8(nibbles);
  }
}

// Stores the 128 codes of c[0..8) at dst (two lines of int8, one of int4 pairs); with `stream`, where dst starts
// on a line, with streaming stores (the caller fences them before its task ends).
template <int QBits>
KV_ALWAYS_INLINE void StoreCodes128(const __m512i* c, typename Codes<QBits>::Storage* dst, bool stream) {
  constexpr int kLines = QBits == 8 ? 2 : 1;
  __m512i lines[kLines];
  if constexpr (QBits == 8) {
    lines[0] = PackCodes64<8>(c), lines[1] = PackCodes64<8>(c + 4);
  } else {
    lines[0] = _mm512_inserti64x4(_mm512_castsi256_si512(PackCodes64<4>(c)), PackCodes64<4>(c + 4), 1);
  }
  auto* line = reinterpret_cast<__m512i*>(dst);
  if (stream && OnCacheLine(dst)) {
    for (int i = 0; i < kLines; ++i) _mm512_stream_si512(line + i, lines[i]);
  } else {
    for (int i = 0; i < kLines; ++i) _mm512_storeu_si512(line + i, lines[i]);
  }
}

// Stores block b's 16 scales (the first 32 or 64 bytes of v: float16 or float32) at `at` with ordinary stores
// (QuantizeBlocksOf16Groups' `put`).
struct PlainScaleStores {
  template <class S>
  KV_ALWAYS_INLINE void operator()(int64_t /*b*/, S* at, __m512i v) const {
    if constexpr (sizeof(S) == 2) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(at), _mm512_castsi512_si256(v));
    } else {
      _mm512_storeu_si512(at, v);
    }
  }
};

// The scales of 16 groups of 8 elements (128), two groups per vector: their maxima in one transposed reduction,
// then T3(max(amax / qmax, eps)) in one division, NaN kept (GroupScale of the canonical NaN, as the portable
// path). Writes them to `scales` through store(scales, v), v's first 32 or 64 bytes their T3 bits; returns them
// as floats.
template <class T1, class T3, int QBits, class StoreScales>
KV_ALWAYS_INLINE __m512 SixteenScales(const typename T1::Storage* src, typename T3::Storage* scales,
                                      StoreScales&& store) {
  __m512i amax_bits;
  if constexpr (T1::kElem == Elem::kFloat32) {
    __m512i bits[8];
    for (int j = 0; j < 8; ++j)
      bits[j] = _mm512_and_si512(_mm512_castps_si512(LoadFloat16<T1>(src + 16 * j)),
                                 _mm512_set1_epi32(static_cast<int32_t>(kAbsMask)));
    amax_bits = TransposedMax16(bits);
  } else {
    // float16 and bfloat16 magnitudes order as their bits do, a NaN's above every number's as in float32: the
    // maxima of the 16-bit bits, converted, are the float32 maxima, from half the vectors and no conversions.
    __m512i bits[4];
    for (int j = 0; j < 4; ++j)
      bits[j] = _mm512_and_si512(_mm512_loadu_si512(src + 32 * j), _mm512_set1_epi16(0x7fff));
    amax_bits = _mm512_castps_si512(FloatsOfBits16<T1>(TransposedMaxWords16(bits)));
  }
  const __mmask16 nan = _mm512_cmpgt_epi32_mask(amax_bits, _mm512_set1_epi32(static_cast<int32_t>(kInfBits)));
  const __m512 amax = _mm512_castsi512_ps(_mm512_mask_blend_epi32(nan, amax_bits, _mm512_set1_epi32(kQuietNanBits)));
  const __m512 eps = _mm512_set1_ps(kScaleEps);
  __m512 s = _mm512_div_ps(amax, _mm512_set1_ps(Codes<QBits>::kMax));
  s = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(s, eps, _CMP_NLE_UQ), eps, s);  // s if s > eps or NaN
  if constexpr (T3::kElem == Elem::kFloat16) {
    const __m256i h = _mm512_cvtps_ph(s, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    store(scales, _mm512_castsi256_si512(h));
    return _mm512_cvtph_ps(h);
  } else {
    static_assert(T3::kElem == Elem::kFloat32, "scales are float32 or float16");
    store(scales, _mm512_castps_si512(s));
    return s;
  }
}

// The codes of the 16 groups of 8 elements at src whose scales (as SixteenScales returns them) are s, streamed
// where `stream_codes` says so (StoreCodes128). With `values` (not nullptr), also each element's value
// T1(float(code) * scale) there: the bits DequantizeSixteenGroupsOf8 gives from the codes and scales stored (the
// codes lie in [-qmax, qmax], which their packing keeps), without reading them back.
template <class T1, class T3, int QBits>
KV_ALWAYS_INLINE void SixteenCodes(const typename T1::Storage* src, __m512 s, typename Codes<QBits>::Storage* codes,
                                   typename T1::Storage* values, bool stream_codes) {
  auto spread = [&](auto j, __m512 v) { return PairOfLanes<decltype(j)::value>(v); };
  auto x = [&](auto j) { return LoadFloat16<T1>(src + 16 * decltype(j)::value); };
  __m512i c[8];
  if (_mm512_cmp_ps_mask(s, _mm512_set1_ps(INFINITY), _CMP_LT_OQ) == 0xffff) {
    // Each group's own finite scale: |x / s| < qmax + 1/2 and never NaN (QuantizeCodes8OwnScale).
    if constexpr (T1::kElem != Elem::kFloat32 && T3::kElem != Elem::kFloat32) {
      const __m512 r = _mm512_div_ps(_mm512_set1_ps(1.0f), s);
      ForEachOf8([&](auto j) { c[j] = QuantizeCodes16ByReciprocal(x(j), spread(j, r)); });
    } else {
      ForEachOf8([&](auto j) { c[j] = _mm512_cvtps_epi32(_mm512_div_ps(x(j), spread(j, s))); });
    }
  } else {
    ForEachOf8([&](auto j) { c[j] = QuantizeCodes16(x(j), spread(j, s), Codes<QBits>::kMax); });
  }
  StoreCodes128<QBits>(c, codes, stream_codes);
  if (values != nullptr)
    ForEachOf8([&](auto j) {
      StoreFloat16<T1>(_mm512_mul_ps(_mm512_cvtepi32_ps(c[j]), spread(j, s)), values + 16 * decltype(j)::value);
    });
}

// Q of blocks of 16 groups of 8 elements: block b from src(b) to codes(b) (streamed where `stream_codes` says so)
// and scales(b) (through put(b, at, v), PlainScaleStores' contract), and its values to values(b) where that is not
// nullptr (SixteenCodes). Up to 8 blocks' scales first, then their codes: each block's codes wait on one long
// chain of dependent steps (maxima, a division, the rounding to T3 and back), and written block by block the
// chains overlapped too little to keep the vector units busy (measured on an Intel Xeon: 128 elements took about
// as long as one chain).
template <class T1, class T3, int QBits, class Src, class CodesAt, class ScalesAt, class ValuesAt,
          class PutScales = PlainScaleStores>
KV_ALWAYS_INLINE void QuantizeBlocksOf16Groups(int64_t blocks, Src&& src, CodesAt&& codes, ScalesAt&& scales,
                                               ValuesAt&& values, bool stream_codes, PutScales&& put = {}) {
  constexpr int kBatch = 8;
  for (int64_t b0 = 0; b0 < blocks; b0 += kBatch) {
    const int n = static_cast<int>(blocks - b0 < kBatch ? blocks - b0 : kBatch);
    __m512 s[kBatch];
    for (int k = 0; k < n; ++k) {
      auto store = [&](auto* at, __m512i v) __attribute__((always_inline)) { put(b0 + k, at, v); };
      s[k] = SixteenScales<T1, T3, QBits>(src(b0 + k), scales(b0 + k), store);
    }
    for (int k = 0; k < n; ++k)
      SixteenCodes<T1, T3, QBits>(src(b0 + k), s[k], codes(b0 + k), values(b0 + k), stream_codes);
  }
}

// DQ of 16 groups of 8 codes (128) with their 16 scales: each vector of two groups takes its scales from
// one in-register permute of the scales loaded once. Without `emit` the values are stored at out; with it,
// each 64 bytes of them go to emit(__m512i) in order (a streamed output's writer, ShiftedRow::Put), from the
// vector of groups 2 * kFromPair on (the earlier ones not computed; even for 16-bit T1, whose 64 bytes are two
// pairs).
template <class T1, class T3, int QBits, int kFromPair = 0, class Emit = std::nullptr_t>
KV_ALWAYS_INLINE void DequantizeSixteenGroupsOf8(const typename Codes<QBits>::Storage* codes,
                                                 const typename T3::Storage* scales, typename T1::Storage* out,
                                                 Emit&& emit = nullptr) {
  constexpr bool kEmit = !std::is_same_v<std::decay_t<Emit>, std::nullptr_t>;
  static_assert(T1::kElem == Elem::kFloat32 || kFromPair % 2 == 0, "a 16-bit vector is two pairs");
  const __m512 s = LoadFloat16<T3>(scales);
  __m512 v[8];
  ForEachOf8([&](auto j) __attribute__((always_inline)) {  // one body with the emitted stores
    constexpr int J = decltype(j)::value;
    if constexpr (J < kFromPair) return;
    const __m512 sj = PairOfLanes<J>(s);
    v[J] = _mm512_mul_ps(_mm512_cvtepi32_ps(LoadCodes16<QBits>(codes + 2 * J * CodeBytes8(QBits))), sj);
    if constexpr (!kEmit) {
      StoreFloat16<T1>(v[J], out + 16 * J);
    } else if constexpr (T1::kElem == Elem::kFloat32) {
      emit(_mm512_castps_si512(v[J]));
    } else if constexpr (J % 2 == 1) {
      emit(_mm512_inserti64x4(_mm512_castsi256_si512(HalfBits16<T1>(v[J - 1])), HalfBits16<T1>(v[J]), 1));
    }
  });
}

// The last 64 bytes of T1 values that DequantizeSixteenGroupsOf8 emits for these 16 groups (the last two
// groups' 16 floats, or the last four groups' 32 16-bit values), computed alone.
template <class T1, class T3, int QBits>
KV_ALWAYS_INLINE __m512i LastVectorOfSixteenGroupsOf8(const typename Codes<QBits>::Storage* codes,
                                                      const typename T3::Storage* scales) {
  constexpr int kFrom = T1::kElem == Elem::kFloat32 ? 7 : 6;
  __m512i last = _mm512_setzero_si512();
  DequantizeSixteenGroupsOf8<T1, T3, QBits, kFrom>(codes, scales, nullptr,
                                                   [&](__m512i v) __attribute__((always_inline)) { last = v; });
  return last;
}

}  // namespace KV_CPU_ISA
}  // namespace kvcache

#endif  // KV_AVX512
