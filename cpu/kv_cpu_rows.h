// Row kernels of the CPU op: conversions between T1 rows and float32, prefetches, and the streamed stores' fence.
// Compiled once per instruction set (kv_cpu.cc is built generic, AVX2+F16C and AVX-512); every path
// computes the same bits: F16C's conversion is round-to-nearest-even like FloatToHalf.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define KV_SIMD 1
#else
#define KV_SIMD 0
#endif
// The AVX-512 build (KeyValueCache only) adds 64-byte vectors to the AVX2 paths.
#if KV_SIMD && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KV_AVX512 1
#else
#define KV_AVX512 0
#endif
// SSE2 is part of x86-64 itself: the generic build there still has streaming stores.
#if defined(__SSE2__)
#include <emmintrin.h>
#define KV_SSE2 1
#else
#define KV_SSE2 0
#endif

#include "kv_types.h"

// For the short helpers of inner loops, which GCC stops inlining once their callers grow.
#define KV_ALWAYS_INLINE inline __attribute__((always_inline))

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
// float(src[0..8)) of a T1 row (exact).
template <class T1>
inline __m256 LoadFloat8(const typename T1::Storage* src) {
  if constexpr (T1::kElem == Elem::kFloat32) {
    return _mm256_loadu_ps(src);
  } else {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    if constexpr (T1::kElem == Elem::kFloat16) return _mm256_cvtph_ps(bits);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  }
}

// The float16 / bfloat16 bits of 8 floats (round to nearest even; bfloat16 NaN kept quiet).
template <class T1>
inline __m128i HalfBits8(__m256 f) {
  if constexpr (T1::kElem == Elem::kFloat16) {
    return _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  } else {
    const __m256i u = _mm256_castps_si256(f);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256i bits = _mm256_blendv_epi8(rounded, quiet, _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08));
  }
}

// T1(f) for 8 floats, stored at dst.
template <class T1>
inline void StoreFloat8(__m256 f, typename T1::Storage* dst) {
  if constexpr (T1::kElem == Elem::kFloat32) {
    _mm256_storeu_ps(dst, f);
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), HalfBits8<T1>(f));
  }
}
#endif

// Asks for the bytes [p, p + bytes) ahead of their use, one prefetch per 64-byte line. The empty volatile asm is
// what keeps the prefetches: GCC counts __builtin_prefetch as free of side effects, so a reader function whose
// only work is prefetching is found pure by its interprocedural analysis and every call of it is deleted as dead
// (GCC 12 left no prefetch instruction at all in the library's cache readers; with them, a decode step of
// float16 8/2 heads head_dim 128 went from 7.4 to 3.9 ms). Into every cache level (prefetcht0), or with
// kSecondLevel into the second and not the first (prefetcht1): for rows whose addresses share their low bits, which
// the first level's few ways of a set cannot all hold until their use (kv_cpu.cc, PrefetchHeads).
constexpr int kEveryLevel = 3, kSecondLevel = 2;  // __builtin_prefetch's locality
template <int Locality = kEveryLevel>
inline void PrefetchBytes(const void* p, int64_t bytes) {
  const auto* line = static_cast<const char*>(p);
  for (int64_t k = 0; k < bytes; k += 64) __builtin_prefetch(line + k, 0, Locality);
  asm volatile("" : : "r"(line));
}

// Whether address p starts a 64-byte cache line (the unit a 64-byte streaming store writes whole).
inline bool OnCacheLine(const void* p) { return reinterpret_cast<uintptr_t>(p) % 64 == 0; }

#if KV_AVX512
// The bytes of v that `bits` selects, merged into a held part line: `held` (64-byte aligned) its bytes so far,
// `filled` which of them are written. Once every byte is, the line is streamed to `line` from the register (a load
// of `held` would wait on the store before it) and true returned, the holder to free `held`; else `held` keeps it.
KV_ALWAYS_INLINE bool MergeHeldLine(unsigned char* held, uint64_t& filled, void* line, __m512i v, uint64_t bits) {
  const __m512i merged = _mm512_mask_mov_epi8(_mm512_load_si512(held), bits, v);
  if ((filled |= bits) == ~uint64_t{0}) {
    _mm512_stream_si512(static_cast<__m512i*>(line), merged);
    return true;
  }
  _mm512_store_si512(held, merged);
  return false;
}
#endif

// Orders streaming stores before the op returns.
inline void StoreFence() {
#if KV_SSE2
  _mm_sfence();
#endif
}

}  // namespace KV_CPU_ISA
}  // namespace kvcache
