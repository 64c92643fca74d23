// The tensor-core tile kernel's work: attention for tiles of longer sequences (prefill, chunks) in float16 or
// bfloat16, as __host__ __device__ functions over a block's team of kMmaThreads threads.
//
// Prefill is bound by arithmetic: every key meets every query row. A block takes kMmaQueries query vectors (rows x
// heads of one kv head; warp w the vectors [16 w, 16 w + 16)) and walks the tile's keys in chunks of kMmaKeys:
//   stage   the chunk's key and value rows into shared memory as T1 (copied as stored, or dequantized and rounded
//           to T1 exactly as KeyValueCache's gather gives them), 16 bytes per access, rows past the chunk zero;
//   scores  S = Q K^T: each warp one matrix product of its 16 query vectors with the chunk's keys on the tensor
//           cores (float32 sums);
//   softmax two threads per query vector, each half the chunk's keys: the scores finished (scale, softcap, mask,
//           ALiBi, visibility), the chunk max exchanged (team.Butterfly), the running max raised, the output sums
//           so far rescaled by exp(old max - new max), the weights exp(score - max) written as T1 (P) and their
//           float32 sum kept (online softmax, one pass over the keys);
//   values  O += P V: each warp one matrix product of its 16 rows of weights with the chunk's value rows.
// At the end the two threads of a query vector write its output row (O / weight sum) or, for a key range split over
// several blocks, its (max, weight sum, output sums) record for the merge (attention_work.h's MergeThread).
//
// Semantics are the tile kernel's: a key the query does not see has weight 0 in P and never enters its sums; a
// visible key whose score is -inf, or every key while nothing but -inf has been seen, has weight 0; a NaN max makes
// the row NaN; a row whose scores are all -inf is exactly zero. One case needs care: 0 x inf is NaN in a matrix
// product, so a chunk whose value rows hold inf or NaN (a block-wide vote when staging, team.SyncOr) adds its
// weights one by one instead, skipping the keys each query does not see, as the tile kernel does. The weights enter
// the product rounded to T1 and the weight sum unrounded: the output moves by at most u_T times the largest value,
// which the spec's tolerance allows (spec/MultiHeadAttention.md: the weights may be rounded to T); an output that
// this carries past T1's largest finite value saturates to it (SaturatingFromFloat) rather than rounding to inf.
//
// Cooperation beyond Each, Sync and Butterfly: team.SyncOr(get) is a barrier that answers whether get(state) is
// non-zero in any thread (on the GPU __syncthreads_or); team.MatMul<T1, BCols, Accumulate>(mem, product) is one
// matrix product per warp in shared memory (WarpProduct; on the GPU the warp's tensor-core fragments, on the host
// runner the same sums in float over the checked memory).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "attention_work.h"

namespace kvcache {
namespace cuda {

// Shared memory of a block, byte offsets. Row strides are padded (8 T1 elements, 4 floats) so the 16 rows of a
// fragment start in different banks; every region starts 128-byte aligned (a fragment's rows need 32 bytes).
constexpr int64_t kMmaLdRows = kMmaMaxHeadDim + 8;  // queries, keys, values: T1 [row][Dh]
constexpr int64_t kMmaLdScores = kMmaKeys + 4;      // scores, then float weights: float [query vector][key]
constexpr int64_t kMmaLdWeights = kMmaKeys + 8;     // weights P: T1 [query vector][key]
constexpr int64_t kMmaLdOut = kMmaMaxHeadDim + 4;   // output sums O: float [query vector][Dh]
constexpr int64_t kMmaSmemQ = 0;
constexpr int64_t kMmaSmemK = kMmaSmemQ + kMmaQueries * kMmaLdRows * 2;
constexpr int64_t kMmaSmemV = kMmaSmemK + kMmaKeys * kMmaLdRows * 2;
constexpr int64_t kMmaSmemS = kMmaSmemV + kMmaKeys * kMmaLdRows * 2;
constexpr int64_t kMmaSmemP = kMmaSmemS + kMmaQueries * kMmaLdScores * 4;
constexpr int64_t kMmaSmemO = kMmaSmemP + kMmaQueries * kMmaLdWeights * 2;
constexpr int64_t kMmaSharedBytes = kMmaSmemO + kMmaQueries * kMmaLdOut * 4;
constexpr int64_t kMmaSharedWords = kMmaSharedBytes / 4;
static_assert(kMmaSmemK % 128 == 0 && kMmaSmemV % 128 == 0 && kMmaSmemS % 128 == 0 && kMmaSmemP % 128 == 0 &&
                  kMmaSmemO % 128 == 0,
              "fragment rows must start 32-byte aligned");
static_assert(kMmaLdRows % 8 == 0 && kMmaLdWeights % 8 == 0 && kMmaLdScores % 4 == 0 && kMmaLdOut % 4 == 0,
              "fragment strides: multiples of 16 bytes");
static_assert(kMmaThreads == 2 * kMmaQueries, "two threads per query vector");

// One matrix product per warp w of the block, in shared memory (byte offsets a, b, c; strides in elements):
// C_w [16 x n] (float, row-major, ldc) = [C_w +] A_w [16 x k] (T1, row-major, lda) x B [k x n] (T1: element (i, j)
// at j x ldb + i when the product's BCols, else i x ldb + j). Warp w's A starts w x a_warp bytes past a, its C
// w x c_warp bytes past c; B is the same for every warp. n and k are multiples of kMmaFrag, k at most
// kMmaMaxProductDepth.
struct WarpProduct {
  int64_t a, a_warp, lda, b, ldb, c, c_warp, ldc, n, k;
};
constexpr int64_t kMmaMaxProductDepth = kMmaMaxHeadDim > kMmaKeys ? kMmaMaxHeadDim : kMmaKeys;

// A tensor-core thread's registers: its query vector's visible keys, running max and (its half's) weight sum, and
// the chunk's scores of its half of the keys.
struct MmaThread {
  float score[kMmaKeys / 2];
  uint32_t sees;        // bit i: key i of its half is one the query sees
  float chunk_max[1];   // exchanged with the other half (team.Butterfly)
  float max;            // the running max (the same in both threads of a query vector)
  float sum[1];         // its half's weight sum; at the end, the vector's
  int64_t lo, hi;       // the query vector's visible keys
  int32_t nonfinite;    // a value row it staged this chunk holds inf or NaN
};

// Eight elements [d0, d0 + 8) of a key (kv 0) or value row as T1 storage: 16 bytes as stored, or dequantized and
// rounded to T1 (exact values of T1, so packing them is exact).
template <class T1, class Rows, class Mem>
KV_HD Vec16 StageEight(const AttnParams& p, const Rows& rows_of, Mem& mem, int kv, const RowAt& row, int64_t d0) {
  if constexpr (Rows::kStoredAsT1) {
    return rows_of.LoadVec16(mem, kv, row, d0);
  } else {
    float v[kVec];
    rows_of.Load(p, mem, kv, row, d0, kVec, v);
    Vec16 w;
    for (int i = 0; i < 4; ++i) w.w[i] = PackTwoNotNaN<T1>(v[2 * i], v[2 * i + 1]);  // a NaN stays NaN
    return w;
  }
}

// A key's weight exp(x), x its score less the row's running max (<= 0, or -inf, or NaN), as both forms take it: 2^(x
// log2 e) by the GPU's exp2 unit, two instructions where expf takes about ten for each of a chunk's scores. Its
// relative error (the unit's 2^-22 and a few 2^-24 |x| from rounding x log2 e) is far below the rounding each weight
// then takes to T1 as a factor of the value product (2^-11 for float16, 2^-8 for bfloat16). -inf gives 0 and NaN
// NaN, as expf does; a weight below 2^-126 is 0 (so small a weight moves the output by under 2^-126 of the largest
// value's magnitude, though an inf value under it now gives NaN, not inf: the spec leaves the weights' underflow open).
KV_HD float WeightExp(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
#if defined(__CUDA_ARCH__)
  float w;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(w) : "f"(x * kLog2e));
  return w;
#else
  const float w = std::exp2(x * kLog2e);  // flushed as the unit flushes, so the host runner shows what the GPU gives
  return w < std::numeric_limits<float>::min() ? 0.0f : w;  // (NaN stays NaN)
#endif
}

// Whether any of eight T1 elements is inf or NaN (all exponent bits set). Per word of two elements: their exponent
// fields (sign bits cleared) plus one at each field's lowest bit carry into an element's sign bit exactly where its
// field is all ones, and the low element's sum stays below the high one's bits: three integer operations a word, no
// branch (each thread checks its share of every chunk's value rows).
template <class T1>
KV_HD bool AnyNonFinite(const Vec16& w) {
  constexpr bool half = T1::kElem == Elem::kFloat16;
  constexpr uint32_t exponents = half ? 0x7c007c00u : 0x7f807f80u, lowest = half ? 0x04000400u : 0x00800080u;
  uint32_t carried = 0;
  KV_UNROLL
  for (int i = 0; i < 4; ++i) carried |= (w.w[i] & exponents) + lowest;
  return (carried & 0x80008000u) != 0;
}

// Stores in flight per thread while staging a chunk: kMmaStageLoads key and value slices loaded before any is stored.
constexpr int64_t kMmaStageLoads = 4;

// Thread t's part of staging the tile's query vectors as T1 rows of shared memory at byte offset `base` (vectors
// [Q, kMmaQueries) zero); vector qi is head head_of(qi) of token seq0 + row_of(qi).
template <class T1, class Mem, class RowOf, class HeadOf>
KV_HD void StageQueries(const AttnParams& p, Mem& mem, int64_t t, int64_t Q, int64_t seq0, RowOf&& row_of,
                        HeadOf&& head_of, int64_t base) {
  const int64_t D = p.head_dim, slices = D / kVec;
  for (int64_t u = t; u < kMmaQueries * slices; u += kMmaThreads) {
    const int64_t qi = u / slices, d0 = u % slices * kVec;
    Vec16 w{};
    if (qi < Q)
      w = mem.template Load<Vec16>(kAQuery, (((seq0 + row_of(qi)) * p.num_heads + head_of(qi)) * D + d0) *
                                                int64_t(sizeof(typename T1::Storage)));
    mem.template Store<Vec16>(kAShared, base + (qi * kMmaLdRows + d0) * 2, w);
  }
}

// Thread t's part of staging keys [c0, c0 + n) of sequence b (kv head g) as T1 rows of shared memory at byte offsets
// k_base and v_base (rows [n, kMmaKeys) zero); true when a value row it staged holds inf or NaN.
template <class T1, class Rows, class Mem>
KV_HD bool StageChunkRows(const AttnParams& p, const Rows& rows_of, Mem& mem, int64_t t, int64_t b, int64_t col0,
                      int64_t g, int64_t c0, int64_t n, int64_t k_base, int64_t v_base) {
  constexpr int64_t NK = kMmaKeys, NT = kMmaThreads;
  const int64_t slices = p.head_dim / kVec;
  bool nonfinite = false;
  for (int64_t u0 = t; u0 < NK * slices; u0 += NT * kMmaStageLoads) {
    Vec16 k[kMmaStageLoads], v[kMmaStageLoads];
    KV_UNROLL
    for (int64_t i = 0; i < kMmaStageLoads; ++i) {  // every load issued before any store
      const int64_t u = u0 + i * NT, kk = u / slices, d0 = u % slices * kVec;
      k[i] = v[i] = Vec16{};
      if (u < NK * slices && kk < n) {
        const int64_t where = rows_of.Where(p, mem, b, col0, c0 + kk);
        k[i] = StageEight<T1>(p, rows_of, mem, 0, rows_of.At(p, 0, g, where), d0);
        v[i] = StageEight<T1>(p, rows_of, mem, 1, rows_of.At(p, 1, g, where), d0);
      }
    }
    KV_UNROLL
    for (int64_t i = 0; i < kMmaStageLoads; ++i) {
      const int64_t u = u0 + i * NT, kk = u / slices, d0 = u % slices * kVec;
      if (u >= NK * slices) continue;
      mem.template Store<Vec16>(kAShared, k_base + (kk * kMmaLdRows + d0) * 2, k[i]);
      mem.template Store<Vec16>(kAShared, v_base + (kk * kMmaLdRows + d0) * 2, v[i]);
      nonfinite = nonfinite || AnyNonFinite<T1>(v[i]);
    }
  }
  return nonfinite;
}

// The whole block stages a chunk (StageChunkRows), behind a barrier (the previous chunk's products have read the rows
// this overwrites) and before one (the vote): true when any value row of the chunk holds inf or NaN. The thread
// state's `nonfinite` carries each thread's vote.
template <class T1, class Rows, class Team, class Mem>
KV_HD bool StageChunk(const AttnParams& p, const Rows& rows_of, Mem& mem, Team& team, int64_t b, int64_t col0,
                      int64_t g, int64_t c0, int64_t n, int64_t k_base, int64_t v_base) {
  team.Sync();
  team.Each([&](int64_t t, auto& s) {
    s.nonfinite = StageChunkRows<T1>(p, rows_of, mem, t, b, col0, g, c0, n, k_base, v_base);
  });
  return team.SyncOr([](auto& s) -> int32_t& { return s.nonfinite; });
}

// Everything tensor-core block `tile_index` (tile p.tiles + p.decode_tiles + tile_index of kATiles) does.
template <class T1, class Rows, class Team, class Mem>
KV_HD void MmaTile(const AttnParams& p, const Rows& rows_of, Mem& mem, Team& team, int64_t tile_index) {
  using T = typename T1::Storage;
  static_assert(sizeof(T) == 2, "the tensor-core kernel runs float16 and bfloat16");
  constexpr int64_t NK = kMmaKeys, HALF = kMmaKeys / 2;
  const Tile tile = TileAt(mem, p.tiles + p.decode_tiles + tile_index);
  const int64_t b = tile.b, row0 = tile.row0, rows = tile.rows, head0 = tile.head0, heads = tile.heads,
                key0 = tile.key0, key1 = tile.key1, partial = tile.partial;
  const int64_t D = p.head_dim, H = p.num_heads, Q = rows * heads, half_d = D / 2;
  const SeqSpan seq = SeqAt(p, mem, b);
  const int64_t seq0 = seq.seq0, S = seq.S, col0 = seq.col0, K = seq.K;
  const bool causal = seq.causal;
  const int64_t g = head0 / p.group;
  auto row_of = [&](int64_t qi) { return row0 + static_cast<int32_t>(qi) / static_cast<int32_t>(heads); };
  auto head_of = [&](int64_t qi) { return head0 + static_cast<int32_t>(qi) % static_cast<int32_t>(heads); };
  auto out_word = [](int64_t qi, int64_t d) { return kMmaSmemO / 4 + qi * kMmaLdOut + d; };

  // The tile's query vectors as T1 (vectors past Q zero), the output sums zeroed; thread t serves query vector t / 2.
  team.Each([&](int64_t t, MmaThread& s) {
    StageQueries<T1>(p, mem, t, Q, seq0, row_of, head_of, kMmaSmemQ);
    const int64_t qi = t / 2, d0 = t % 2 * half_d;
    for (int64_t d = 0; d < half_d; d += 4) mem.template Store<Vec16>(kAShared, 4 * out_word(qi, d0 + d), Vec16{});
    s.max = MinusInf();
    s.sum[0] = 0.0f;
    s.lo = s.hi = 0;
    if (qi < Q) VisibleKeys(p.sliding_window, causal, S, K, row_of(qi), &s.lo, &s.hi);
  });

  for (int64_t c0 = key0; c0 < key1; c0 += NK) {
    const int64_t n = key1 - c0 < NK ? key1 - c0 : NK;
    const bool nonfinite_values = StageChunk<T1>(p, rows_of, mem, team, b, col0, g, c0, n, kMmaSmemK, kMmaSmemV);
    team.template MatMul<T1, true, false>(
        mem, WarpProduct{kMmaSmemQ, kMmaWarpRows * kMmaLdRows * 2, kMmaLdRows, kMmaSmemK, kMmaLdRows, kMmaSmemS,
                         kMmaWarpRows * kMmaLdScores * 4, kMmaLdScores, NK, D});
    team.Sync();
    team.Each([&](int64_t t, MmaThread& s) {  // the scores finished, this half's max
      const int64_t qi = t / 2, k0 = t % 2 * HALF;
      float m = MinusInf();
      s.sees = 0;
      KV_UNROLL
      for (int64_t i = 0; i < HALF; ++i) {
        const int64_t kk = k0 + i, j = c0 + kk;
        s.score[i] = MinusInf();
        if (qi >= Q || kk >= n || j < s.lo || j >= s.hi) continue;
        const float dot = SharedAt(mem, kMmaSmemS / 4 + qi * kMmaLdScores + kk);
        s.score[i] = ScoreOf<T1>(p, mem, dot, head_of(qi), seq0 + row_of(qi), col0 + j, j - (K - S + row_of(qi)));
        s.sees |= 1u << i;
        m = MaxStep(m, s.score[i]);
      }
      s.chunk_max[0] = m;
    });
    team.Butterfly(1, 2, [](MmaThread& s) -> auto& { return s.chunk_max; }, MaxOp{});
    team.Each([&](int64_t t, MmaThread& s) {  // the running max, the weights, the sums so far rescaled
      const int64_t qi = t / 2, k0 = t % 2 * HALF, d0 = t % 2 * half_d;
      const float old = s.max, m = MaxStep(old, s.chunk_max[0]), f = RescaleFactor(old, m);
      s.max = m;
      float sum = 0.0f;
      KV_UNROLL
      for (int64_t i = 0; i < HALF; i += 2) {
        float w[2];
        for (int64_t e = 0; e < 2; ++e) {
          const bool sees = (s.sees >> (i + e)) & 1u;
          // Nothing but -inf so far: weight 0, which still lets a non-finite value through (the one-by-one path).
          w[e] = !sees ? kHidden : m == MinusInf() ? 0.0f : WeightExp(s.score[i + e] - m);
          SharedPut(mem, kMmaSmemS / 4 + qi * kMmaLdScores + k0 + i + e, w[e]);
          if (sees) sum += w[e];
        }
        mem.template Store<uint32_t>(kAShared, kMmaSmemP + (qi * kMmaLdWeights + k0 + i) * 2,
                                     PackTwoNotNaN<T1>(w[0] == kHidden ? 0.0f : w[0], w[1] == kHidden ? 0.0f : w[1]));
      }
      s.sum[0] = s.sum[0] * f + sum;
      if (f != 1.0f) {
        for (int64_t d = 0; d < half_d; d += 4) {
          Vec16 o = mem.template Load<Vec16>(kAShared, 4 * out_word(qi, d0 + d));
          for (int i = 0; i < 4; ++i) o.w[i] = FloatBits(BitsFloat(o.w[i]) * f);
          mem.template Store<Vec16>(kAShared, 4 * out_word(qi, d0 + d), o);
        }
      }
    });
    team.Sync();
    if (!nonfinite_values) {
      team.template MatMul<T1, false, true>(
          mem, WarpProduct{kMmaSmemP, kMmaWarpRows * kMmaLdWeights * 2, kMmaLdWeights, kMmaSmemV, kMmaLdRows,
                           kMmaSmemO, kMmaWarpRows * kMmaLdOut * 4, kMmaLdOut, D, NK});
    } else {
      team.Each([&](int64_t t, MmaThread&) {  // weights one by one: 0 x inf must not reach a query that does not see it
        const int64_t qi = t / 2, d0 = t % 2 * half_d;
        if (qi >= Q) return;
        for (int64_t kk = 0; kk < n; ++kk) {
          const float w = SharedAt(mem, kMmaSmemS / 4 + qi * kMmaLdScores + kk);
          if (w == kHidden) continue;
          for (int64_t d = d0; d < d0 + half_d; ++d) {
            const T v = mem.template Load<T>(kAShared, kMmaSmemV + (kk * kMmaLdRows + d) * 2);
            SharedPut(mem, out_word(qi, d), SharedAt(mem, out_word(qi, d)) + w * ElemToFloat<T1>(v));
          }
        }
      });
    }
  }
  team.Sync();
  team.Butterfly(1, 2, [](MmaThread& s) -> auto& { return s.sum; }, AddOp{});
  team.Each([&](int64_t t, MmaThread& s) {  // the output rows, or the part's records
    const int64_t qi = t / 2, d0 = t % 2 * half_d;
    if (qi >= Q) return;
    if (partial >= 0) {
      const int64_t record = (partial + qi) * (D + 2);
      if (d0 == 0) {
        mem.template Store<float>(kAPartials, 4 * record, s.max);
        mem.template Store<float>(kAPartials, 4 * (record + 1), s.sum[0]);
      }
      for (int64_t d = d0; d < d0 + half_d; ++d)
        mem.template Store<float>(kAPartials, 4 * (record + 2 + d), SharedAt(mem, out_word(qi, d)));
      return;
    }
    const int64_t at = ((seq0 + row_of(qi)) * H + head_of(qi)) * D;
    for (int64_t d = d0; d < d0 + half_d; ++d) {
      const float o = s.max == MinusInf() ? 0.0f : SharedAt(mem, out_word(qi, d)) / s.sum[0];
      mem.template Store<T>(kAOut, (at + d) * int64_t(sizeof(T)), SaturatingFromFloat<T1>(o));
    }
  });
}

}  // namespace cuda
}  // namespace kvcache
