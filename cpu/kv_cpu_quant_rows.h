// Quantized rows of the CPU op: Q of one (token, head) row into codes and scales, and DQ of one row, exactly
// as spec/KeyValueCache.md "Quantization" (float32, the stored scale used to quantize, IEEE division, round
// half to even). Compiled once per instruction set like kv_cpu_rows.h: the AVX2, AVX-512 and (generic build
// on x86-64) SSE2 paths (kv_cpu_quant_avx2.h, kv_cpu_quant_avx512.h, kv_cpu_quant_sse2.h) and the portable
// loops here compute the same bits, and tests run every build against the reference. The portable loops are
// written branch-free so that compilers vectorize them.
#pragma once

#include <cstdint>
#include <cstring>

#include "kv_cpu_codes.h"
#include "kv_cpu_quant_avx2.h"
#include "kv_cpu_quant_avx512.h"
#include "kv_cpu_quant_sse2.h"
#include "kv_cpu_rows.h"
#include "kv_interleaved_streams.h"
#include "kv_line_streams.h"
#include "kv_quant.h"
#include "kv_types.h"

namespace kvcache {
namespace KV_CPU_ISA {

// A code of the spec's Q: clamp(rint(x / s), -qmax, qmax), 0 for a NaN quotient. Clamping first and
// rounding after give the same integer (rint is monotone and keeps the integer qmax); |q| <= 127 is then
// rounded half to even by adding and subtracting 1.5 * 2^23 (exact below 2^22). Equal to QuantizeValue for
// every input, without its libm call and branches.
inline int32_t QuantizeCode(float x, float stored_scale, float qmax) {
  const float q = x / stored_scale;
  const float clamped = q < -qmax ? -qmax : (q > qmax ? qmax : q);
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23
  const float r = (clamped + kRound) - kRound;
  return static_cast<int32_t>(q == q ? r : 0.0f);  // the select first: only finite values are converted
}

// Per-row scratch of the portable loops (and of the AVX2 paths for uncommon group sizes).
struct RowScratch {
  float* x;        // n floats: the row as float32
  float* scale;    // n floats: each element's scale as float32
  int32_t* codes;  // n ints: the row's codes
  float* sf;       // groups + 8 floats: the row's scales as float32, the last 8 zero
};

// scale[i] = sf[i / group] for i < groups * group. Group 8 (the common size) as a constant: compilers then
// write each group's scale with two vector stores instead of a loop whose length is known only at run time.
inline void SpreadScales(const float* sf, int64_t groups, int64_t group, float* scale) {
  if (group == 8) {
    for (int64_t g = 0; g < groups; ++g)
      for (int j = 0; j < 8; ++j) scale[g * 8 + j] = sf[g];
    return;
  }
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t i = g * group; i < (g + 1) * group; ++i) scale[i] = sf[g];
}

// The bits of max|x[i]| over i < n (see CanonicalAbsMax: a NaN's exceed every number's).
inline uint32_t AbsMaxBits(const float* x, int64_t n) {
  uint32_t bits = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = FloatBits(x[i]) & kAbsMask;
    bits = b > bits ? b : bits;
  }
  return bits;
}

// Portable Q of one row of n elements in `groups` groups of `group`: codes to `codes`, scales to `scales`.
// The per-element work runs in loops over the whole row, and the per-group work (scales and their
// conversions) in loops over all its groups, which compilers vectorize.
template <class T1, class T3, int QBits>
inline void QuantizeRowPortable(const typename T1::Storage* src, int64_t n, int64_t group, int64_t groups,
                                typename Codes<QBits>::Storage* codes, typename T3::Storage* scales,
                                const RowScratch& scratch) {
  constexpr float qmax = Codes<QBits>::kMax;
  float* x = scratch.x;
  float* scale = scratch.scale;
  float* sf = scratch.sf;
  int32_t* q = scratch.codes;
  ToFloatRow<T1>(src, x, n);
  if (group == 8) {  // a constant group, as in SpreadScales
    for (int64_t g = 0; g < groups; ++g) sf[g] = BitsFloat(CanonicalAbsMax(AbsMaxBits(x + g * 8, 8)));
  } else {
    for (int64_t g = 0; g < groups; ++g) sf[g] = BitsFloat(CanonicalAbsMax(AbsMaxBits(x + g * group, group)));
  }
  for (int64_t g = 0; g < groups; ++g) {  // the stored scales, and the float32 values quantization divides by
    const auto stored = T3::FromFloat(GroupScale(sf[g], qmax));
    scales[g] = stored;
    sf[g] = T3::ToFloat(stored);
  }
  SpreadScales(sf, groups, group, scale);
  for (int64_t i = 0; i < n; ++i) q[i] = QuantizeCode(x[i], scale[i], qmax);
  if constexpr (QBits == 8) {
    for (int64_t i = 0; i < n; ++i) codes[i] = static_cast<int8_t>(q[i]);
  } else {
    for (int64_t i = 0; i < n / 2; ++i) codes[i] = Int4Pack(q[2 * i], q[2 * i + 1]);
  }
}

// Portable DQ of one row: out[i] = T1(float(code_i) * float(scale[i / group])), in loops over the whole row.
template <class T1, class T3, int QBits>
inline void DequantizeRowPortable(const typename Codes<QBits>::Storage* codes, const typename T3::Storage* scales,
                                  int64_t n, int64_t group, int64_t groups, typename T1::Storage* out,
                                  const RowScratch& scratch) {
  float* scale = scratch.scale;
  ToFloatRow<T3>(scales, scratch.sf, groups);
  SpreadScales(scratch.sf, groups, group, scale);
  if constexpr (QBits == 8) {
    for (int64_t i = 0; i < n; ++i) out[i] = T1::FromFloat(static_cast<float>(codes[i]) * scale[i]);
  } else {
    int32_t* c = scratch.codes;
    for (int64_t i = 0; i < n / 2; ++i) {
      c[2 * i] = Int4Low(codes[i]);
      c[2 * i + 1] = Int4High(codes[i]);
    }
    for (int64_t i = 0; i < n; ++i) out[i] = T1::FromFloat(static_cast<float>(c[i]) * scale[i]);
  }
}

#if KV_AVX512
// No values wanted from QuantizeBlocksOf16Groups (a ValuesAt).
template <class T1>
constexpr auto NoValues = [](int64_t) -> typename T1::Storage* { return nullptr; };
#endif

// Q of `rows` rows as QuantizeRows, in the AVX-512 build's blocks of 16 groups of 8 only: returns false, having
// done nothing, where those do not cover the rows (another build, group != 8, groups not a multiple of 16).
// With `values` (not nullptr), each row's elements' values after DQ go to values + k * n as well: the bits
// DequantizeRow gives from the codes and scales stored, written without reading those back (a stored token's
// output rows, from its store). With `stream_codes`, codes that start on a line are written with streaming
// stores (StoreCodes128), to be fenced before the task ends. With `scale_streams`, row k's scales are the next
// row of its stream first_stream + k (InterleavedStreams::Write, to be flushed and fenced before the task ends).
template <class T1, class T3, int QBits>
inline bool QuantizeRowsWithValues(const typename T1::Storage* src, int64_t rows, int64_t n, int64_t group,
                                   int64_t groups, typename Codes<QBits>::Storage* codes, int64_t code_step,
                                   typename T3::Storage* scales, int64_t scale_step, typename T1::Storage* values,
                                   bool stream_codes, InterleavedStreams* scale_streams = nullptr,
                                   int64_t first_stream = 0) {
#if KV_AVX512
  if (group == 8 && groups % 16 == 0) {
    const int64_t per_row = groups / 16;
    auto blocks = [&](auto&& put) __attribute__((always_inline)) {
      QuantizeBlocksOf16Groups<T1, T3, QBits>(
          rows * per_row, [&](int64_t b) { return src + b / per_row * n + b % per_row * 128; },
          [&](int64_t b) { return codes + b / per_row * code_step + b % per_row * 16 * CodeBytes8(QBits); },
          [&](int64_t b) { return scales + b / per_row * scale_step + b % per_row * 16; },
          [&](int64_t b) { return values == nullptr ? nullptr : values + b / per_row * n + b % per_row * 128; },
          stream_codes, put);
    };
    if (scale_streams != nullptr) {
      blocks([&](int64_t b, auto* at, __m512i v) __attribute__((always_inline)) {
        scale_streams->Write(first_stream + b / per_row, at, v, static_cast<int>(16 * sizeof(*at)));
      });
    } else {
      blocks(PlainScaleStores{});
    }
    return true;
  }
#endif
  (void)src, (void)rows, (void)n, (void)group, (void)groups, (void)codes, (void)code_step, (void)scales,
      (void)scale_step, (void)values, (void)stream_codes, (void)scale_streams, (void)first_stream;
  return false;
}

// Q of one row of n elements in `groups` groups of `group` (spec "Quantization"): codes and scales written to
// the cache.
template <class T1, class T3, int QBits>
inline void QuantizeRow(const typename T1::Storage* src, int64_t n, int64_t group, int64_t groups,
                        typename Codes<QBits>::Storage* codes, typename T3::Storage* scales, const RowScratch& scratch) {
#if KV_SIMD
  if (group % 8 == 0) {
    int64_t g = 0;
#if KV_AVX512
    if (group == 8 && groups >= 32) {  // a single block goes faster through the eight-group path below
      QuantizeBlocksOf16Groups<T1, T3, QBits>(
          groups / 16, [&](int64_t b) { return src + b * 128; },
          [&](int64_t b) { return codes + b * 16 * CodeBytes8(QBits); }, [&](int64_t b) { return scales + b * 16; },
          NoValues<T1>, false);
      g = groups / 16 * 16;
    }
#endif
    if (group == 8)
      for (; g + 8 <= groups; g += 8) QuantizeEightGroupsOf8<T1, T3, QBits>(src + g * 8, codes + g * CodeBytes8(QBits), scales + g);
    for (; g < groups; g += 8) {
      const int count = static_cast<int>(groups - g < 8 ? groups - g : 8);
      QuantizeGroups<T1, T3, QBits>(src + g * group, group, count, codes + g * group / 8 * CodeBytes8(QBits), scales + g);
    }
    return;
  }
#elif KV_SSE2_ONLY
  if (group == 8) {
    const int64_t whole = groups / 4 * 4;  // the last groups (fewer than 4) take the portable loops
    for (int64_t g = 0; g < whole; g += 4)
      QuantizeFourGroupsOf8<T1, T3, QBits>(src + g * 8, codes + g * CodeBytes8(QBits), scales + g);
    if (whole < groups)
      QuantizeRowPortable<T1, T3, QBits>(src + whole * 8, n - whole * 8, group, groups - whole,
                                         codes + whole * CodeBytes8(QBits), scales + whole, scratch);
    return;
  }
#endif
  QuantizeRowPortable<T1, T3, QBits>(src, n, group, groups, codes, scales, scratch);
}

// Q of `rows` rows of n elements each: row k from src + k * n, its codes to codes + k * code_step and its scales to
// scales + k * scale_step (a token's head rows, far apart in layout 3's cache). In the AVX-512 build the rows'
// blocks of 16 groups go through one QuantizeBlocksOf16Groups, so that one row's chain of dependent steps
// overlaps the next rows', their codes streamed where `stream_codes` says so and their scales through
// `scale_streams` where given (QuantizeRowsWithValues); elsewhere,
// and for a single block, row by row with plain stores.
template <class T1, class T3, int QBits>
inline void QuantizeRows(const typename T1::Storage* src, int64_t rows, int64_t n, int64_t group, int64_t groups,
                         typename Codes<QBits>::Storage* codes, int64_t code_step, typename T3::Storage* scales,
                         int64_t scale_step, const RowScratch& scratch, bool stream_codes,
                         InterleavedStreams* scale_streams = nullptr, int64_t first_stream = 0) {
  if (rows * groups >= 32 && QuantizeRowsWithValues<T1, T3, QBits>(src, rows, n, group, groups, codes, code_step, scales,
                                                                   scale_step, nullptr, stream_codes, scale_streams,
                                                                   first_stream))
    return;
  for (int64_t k = 0; k < rows; ++k)
    QuantizeRow<T1, T3, QBits>(src + k * n, n, group, groups, codes + k * code_step, scales + k * scale_step, scratch);
}

// DQ of one row of n elements in `groups` groups of `group` into out (spec "Quantization").
template <class T1, class T3, int QBits>
inline void DequantizeRow(const typename Codes<QBits>::Storage* codes, const typename T3::Storage* scales, int64_t n,
                          int64_t group, int64_t groups, typename T1::Storage* out, const RowScratch& scratch) {
#if KV_SIMD
  if (group == 8) {
    int64_t g = 0;
#if KV_AVX512
    for (; g + 16 <= groups; g += 16)
      DequantizeSixteenGroupsOf8<T1, T3, QBits>(codes + g * CodeBytes8(QBits), scales + g, out + g * 8);
#endif
    for (; g < groups; g += 8) {
      const int count = static_cast<int>(groups - g < 8 ? groups - g : 8);
      __m256 s;
      if (count == 8) {
        s = LoadFloat8<T3>(scales + g);
      } else {  // a row's last groups: their scales copied first, so nothing past the row is read
        typename T3::Storage tail[8] = {};
        std::memcpy(tail, scales + g, count * sizeof(tail[0]));
        s = LoadFloat8<T3>(tail);
      }
      DequantizeGroupsOf8<T1, QBits>(codes + g * CodeBytes8(QBits), s, count, out + g * 8);
    }
    return;
  }
  if (group % 8 == 0 || (n % 8 == 0 && 8 % group == 0)) {
    ToFloatRow<T3>(scales, scratch.sf, groups);
    DequantizeSpread<T1, QBits>(codes, scratch.sf, n, group, groups, out);
    return;
  }
#elif KV_SSE2_ONLY
  if (group % 8 == 0) {
    DequantizeGroupsSse2<T1, T3, QBits>(codes, scales, group, groups, out);
    return;
  }
#endif
  DequantizeRowPortable<T1, T3, QBits>(codes, scales, n, group, groups, out, scratch);
}

// The codes and scales of a row's last 16 groups (DequantizeRowsStreamed's `lead`); null codes: none. For
// values (Code void: WriteRows' lead), codes points at the row's last 64 bytes and scales is unused.
template <class Code, class Scale>
struct StreamedLead {
  const Code* codes = nullptr;
  const Scale* scales = nullptr;
};

// DQ of `rows` rows (codes[r] and scales[r], `groups` groups each), one after another, straight into out with
// streaming stores of whole lines, where this build can: AVX-512, groups of 8, a multiple of 16 groups, out at any
// element alignment (each line cut from the rows' vectors in registers, the part lines at the edges of the whole
// held in `lines` until their neighbours complete them: a line two of the rows share is streamed at once); AVX2,
// groups of 8, a multiple of 8 groups, and the generic build on x86-64, groups of a multiple of 8, each row whole
// lines from a line on. Returns false, having written nothing, elsewhere (the caller streams a scratch row through
// `lines`). Saves the round trip through a scratch row, whose burst of stores at the end of each row measured up
// to 20% slower (int8 decode, one core, on an Intel Xeon). Never inlined in the AVX-512 build: inside the gathers'
// large loops the compiler kept ShiftedRow's carried vector in memory, each Put waiting on its reload; in a
// function of its own it stays in a register (AMD EPYC of Zen 4, int8 layout-3 decode into outputs 16 bytes past a
// line: 35.1 -> 30.5 ms, one core, medians side by side; a call a row costs nothing measurable).
//
// `lead` (AVX-512 only): where its codes are not null, the last 16 groups of the row just before out in the
// output, which the same writer writes with tail_follows; the first line is then streamed whole, with that row's
// last values (ShiftedRow's `led`). `tail_follows`: the row just after these is written by the same writer, led.
// Either way the same bytes.
#if KV_AVX512
#define KV_STREAMED_ROWS_INLINE __attribute__((noinline))
#else
#define KV_STREAMED_ROWS_INLINE KV_ALWAYS_INLINE
#endif
template <class T1, class T3, int QBits>
KV_STREAMED_ROWS_INLINE bool DequantizeRowsStreamed(const typename Codes<QBits>::Storage* const* codes,
                                                      const typename T3::Storage* const* scales, int64_t rows,
                                                      int64_t group, int64_t groups, typename T1::Storage* out,
                                                      LineStreams& lines,
                                                      StreamedLead<typename Codes<QBits>::Storage,
                                                                   typename T3::Storage> lead = {},
                                                      bool tail_follows = false) {
#if KV_AVX512
  if (group == 8 && groups % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 2 == 0) {
    const bool led = lead.codes != nullptr && reinterpret_cast<uintptr_t>(out) % 64 != 0;
    ShiftedRow row(lines, out, led, tail_follows);
    // A local: kept in a register from one Put to the next.
    __m512i previous = led ? LastVectorOfSixteenGroupsOf8<T1, T3, QBits>(lead.codes, lead.scales)
                           : _mm512_setzero_si512();
    auto put = [&](__m512i v) __attribute__((always_inline)) { row.Put(v, previous); };
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t g = 0; g < groups; g += 16)
        DequantizeSixteenGroupsOf8<T1, T3, QBits>(codes[r] + g * CodeBytes8(QBits), scales[r] + g, out, put);
    row.End(previous);
    return true;
  }
#else
  (void)lines, (void)lead, (void)tail_follows;
  const int64_t n = group * groups;  // a row's elements; rows of whole lines keep every row on a line
  const bool whole_lines = OnCacheLine(out) && (n * int64_t(sizeof(*out))) % 64 == 0;
#if KV_SIMD
  if (whole_lines && group == 8 && groups % 8 == 0) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t g = 0; g < groups; g += 8)
        DequantizeGroupsOf8<T1, QBits, true>(codes[r] + g * CodeBytes8(QBits), LoadFloat8<T3>(scales[r] + g), 8,
                                             out + r * n + g * 8);
    return true;
  }
#elif KV_SSE2_ONLY
  if (whole_lines && group % 8 == 0) {
    for (int64_t r = 0; r < rows; ++r) DequantizeGroupsSse2<T1, T3, QBits, true>(codes[r], scales[r], group, groups, out + r * n);
    return true;
  }
#else
  (void)codes, (void)scales, (void)rows, (void)whole_lines;
#endif
#endif
  return false;
}

}  // namespace KV_CPU_ISA
}  // namespace kvcache
