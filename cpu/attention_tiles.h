// The register-tiled matrix product prefill attention runs for both of its products: a tile of query rows
// against transposed key panels (the scores), and a tile of weight rows against value rows (the output). One
// kTileRows x kTileCols block of C stays in vector registers while the inner dimension streams through it: each
// loaded row of B serves every row of the tile, and each element of A is broadcast once per block, so the
// loop runs at the machine's multiply-add throughput instead of its load throughput. Built once per
// instruction set (KV_CPU_ISA); each build is deterministic, and builds differ only in summation order
// (fused multiply-adds in the vector builds).
#pragma once

#include <cstdint>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kvcache {
namespace KV_CPU_ISA {
namespace attention_detail {

// One vector of the build's width for TileProduct: zero, load, broadcast, multiply-add, store.
#if defined(__AVX512F__)
struct TileVector {
  using V = __m512;
  static constexpr int kWidth = 16;
  static V Zero() { return _mm512_setzero_ps(); }
  static V Load(const float* p) { return _mm512_loadu_ps(p); }
  static V Splat(const float* p) { return _mm512_set1_ps(*p); }
  static V MulAdd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static void Store(float* p, V v) { _mm512_storeu_ps(p, v); }
};
// 8 rows x 2 vectors of 16: 16 accumulators of the 32 registers, the rest for B's two vectors and broadcasts.
constexpr int kTileRows = 8;
#elif defined(__AVX2__) && defined(__FMA__)
struct TileVector {
  using V = __m256;
  static constexpr int kWidth = 8;
  static V Zero() { return _mm256_setzero_ps(); }
  static V Load(const float* p) { return _mm256_loadu_ps(p); }
  static V Splat(const float* p) { return _mm256_broadcast_ss(p); }
  static V MulAdd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void Store(float* p, V v) { _mm256_storeu_ps(p, v); }
};
// 6 rows x 2 vectors of 8: 12 accumulators, two for B, one broadcast: 15 of the 16 registers.
constexpr int kTileRows = 6;
#else
struct TileVector {  // one float: the portable build's loops (the compiler may vectorize them)
  using V = float;
  static constexpr int kWidth = 8;
};
constexpr int kTileRows = 4;
#endif
constexpr int kTileCols = 2 * TileVector::kWidth;

// c[r * ldc + n] = sum_{k < depth} a[r * lda + k] * b[k * ldb + n] for r < kTileRows, n < kTileCols, summed in
// k order (per element one chain of multiply-adds). `b` and `c` hold kTileCols floats per row from the given
// pointers; `a` holds depth floats per row.
inline void TileProduct(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t depth, float* c,
                        int64_t ldc) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  using X = TileVector;
  constexpr int W = X::kWidth;
  typename X::V acc[kTileRows][2];
#pragma GCC unroll 8
  for (int r = 0; r < kTileRows; ++r) acc[r][0] = acc[r][1] = X::Zero();
  for (int64_t k = 0; k < depth; ++k) {
    const typename X::V b0 = X::Load(b + k * ldb), b1 = X::Load(b + k * ldb + W);
#pragma GCC unroll 8
    for (int r = 0; r < kTileRows; ++r) {
      const typename X::V x = X::Splat(a + r * lda + k);
      acc[r][0] = X::MulAdd(x, b0, acc[r][0]);
      acc[r][1] = X::MulAdd(x, b1, acc[r][1]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < kTileRows; ++r) {
    X::Store(c + r * ldc, acc[r][0]);
    X::Store(c + r * ldc + W, acc[r][1]);
  }
#else
  float acc[kTileRows][kTileCols] = {};
  for (int64_t k = 0; k < depth; ++k)
    for (int r = 0; r < kTileRows; ++r)
      for (int n = 0; n < kTileCols; ++n) acc[r][n] += a[r * lda + k] * b[k * ldb + n];
  for (int r = 0; r < kTileRows; ++r)
    for (int n = 0; n < kTileCols; ++n) c[r * ldc + n] = acc[r][n];
#endif
}

// n rounded up to whole tiles of columns.
inline int64_t TileColumns(int64_t n) { return (n + kTileCols - 1) / kTileCols * kTileCols; }

}  // namespace attention_detail
}  // namespace KV_CPU_ISA
}  // namespace kvcache
