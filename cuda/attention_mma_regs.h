// The tensor-core kernel's second form: the scores, weights and output sums in the registers of the matrix
// products' fragments (as FlashAttention 2 keeps them), for the same tiles as the first form (attention_mma.h).
//
// The first form keeps S, P and O in shared memory and was latency-bound on an H100 at two blocks per
// multiprocessor, executing mostly the scalar work around its products (benchmarks/gpu/attention_h100/ncu.md). Here
// warp w owns query vectors [16 w, 16 w + 16) of the tile as the row blocks of m16n8k16 products (team.Mma): lane l
// of the warp holds, of every 16 x 8 accumulator tile, rows g = l / 4 and g + 8, columns 2 (l % 4) and 2 (l % 4) + 1
// (the products' documented fragment layout). Per chunk of kMmaKeys keys:
//   stage   the key and value rows into shared memory as T1 (as the first form);
//   scores  S = Q K^T: the queries' A fragments loaded once per tile, each key row's B fragment read from shared
//           memory with 32-bit loads, eight accumulator tiles of 8 keys per warp;
//   softmax each lane finishes its 32 scores (scale, softcap, mask, ALiBi, visibility), the four lanes of a row
//           exchange their maxima (team.Butterfly), the output sums and weight sums are rescaled in registers, and
//           the weights, exp(score - max), become the A fragments of the next product without leaving registers;
//   values  O += P V: each 16 x 8 output tile from four products over the chunk's keys, the value rows' B
//           fragments read from shared memory two elements at a time.
// A chunk whose value rows hold inf or NaN (team.SyncOr) adds its weights one by one through shared memory instead,
// skipping the keys each query does not see, as the first form does. At the end the four lanes of a row add their
// weight sums and write the output (or the split part's record).
//
// team.Mma<T1>(a, b, c) is one m16n8k16 product per warp: c += a b, a, b, c each thread's fragment registers
// (get(state) arrays of 4 words, 2 words, 4 floats); on the GPU mma.sync, on the host runner the same layout
// gathered from every lane's saved registers and multiplied in float.
#pragma once

#include <cmath>
#include <cstdint>

#include "attention_mma.h"

namespace kvcache {
namespace cuda {

// Shared memory of a block (byte offsets): the queries (then, for the one-by-one path, the float weights
// [64][kMmaLdScores], the same bytes), the chunk's key and value rows.
constexpr int64_t kMmaRegSmemQ = 0;
constexpr int64_t kMmaRegSmemS = 0;
constexpr int64_t kMmaRegSmemK = kMmaQueries * kMmaLdRows * 2;
constexpr int64_t kMmaRegSmemV = kMmaRegSmemK + kMmaKeys * kMmaLdRows * 2;
constexpr int64_t kMmaRegSharedBytes = kMmaRegSmemV + kMmaKeys * kMmaLdRows * 2;
constexpr int64_t kMmaRegSharedWords = kMmaRegSharedBytes / 4;
static_assert(kMmaQueries * kMmaLdScores * 4 <= kMmaRegSmemK, "the float weights fit where the queries were");

constexpr int kMmaKSteps = static_cast<int>(kMmaMaxHeadDim / 16);  // query fragments (16 dims each)
constexpr int kMmaKeyTiles = static_cast<int>(kMmaKeys / 8);       // score tiles (8 keys each)
constexpr int kMmaDimTiles = static_cast<int>(kMmaMaxHeadDim / 8);  // output tiles (8 dims each)
constexpr int kMmaKeySteps = static_cast<int>(kMmaKeys / 16);      // weight fragments (16 keys each)

// A lane's registers.
struct MmaRegThread {
  uint32_t qa[kMmaKSteps][4];   // the queries' A fragments
  float s[kMmaKeyTiles][4];     // the chunk's scores, then weights
  float o[kMmaDimTiles][4];     // output sums
  uint32_t pa[kMmaKeySteps][4];  // the weights as A fragments
  uint32_t kb[kMmaKSteps][2];   // B fragments of one key tile (scores) or one output tile (values)
  float max[2], sum[2], chunk_max[2];  // rows g and g + 8
  uint32_t hidden;              // bit 4 j + c: element c of score tile j is a key its query does not see
  int64_t lo[2], hi[2];         // the rows' visible keys
  int32_t nonfinite;
};

// Two T1 elements packed in a word (the lower one first, as the fragments hold them).
KV_HD uint32_t PackPair(uint16_t lo, uint16_t hi) { return uint32_t(lo) | uint32_t(hi) << 16; }

// Everything block `tile_index` of the tensor-core launch does, in the second form.
template <class T1, class Rows, class Team, class Mem>
KV_HD void MmaRegTile(const AttnParams& p, const Rows& rows_of, Mem& mem, Team& team, int64_t tile_index) {
  using T = typename T1::Storage;
  static_assert(sizeof(T) == 2, "the tensor-core kernel runs float16 and bfloat16");
  constexpr int64_t NK = kMmaKeys;
  const Tile tile = TileAt(mem, p.tiles + p.decode_tiles + tile_index);
  const int64_t b = tile.b, row0 = tile.row0, rows = tile.rows, head0 = tile.head0, heads = tile.heads,
                key0 = tile.key0, key1 = tile.key1, partial = tile.partial;
  const int64_t D = p.head_dim, H = p.num_heads, Q = rows * heads;
  const int ksteps = static_cast<int>(D / 16), dtiles = static_cast<int>(D / 8);
  const SeqSpan seq = SeqAt(p, mem, b);
  const int64_t seq0 = seq.seq0, S = seq.S, col0 = seq.col0, K = seq.K;
  const bool causal = seq.causal;
  const int64_t g = head0 / p.group;
  auto row_of = [&](int64_t qi) { return row0 + static_cast<int32_t>(qi) / static_cast<int32_t>(heads); };
  auto head_of = [&](int64_t qi) { return head0 + static_cast<int32_t>(qi) % static_cast<int32_t>(heads); };
  // Lane geometry: thread t is lane t % 32 of warp t / 32; its rows (query vectors) and its column pair.
  auto vector_of = [](int64_t t, int r) { return t / kWarp * kMmaWarpRows + t % kWarp / 4 + 8 * r; };
  auto pair_of = [](int64_t t) { return 2 * (t % 4); };
  auto half_at = [&](int64_t base, int64_t row, int64_t col) {
    return mem.template Load<uint16_t>(kAShared, base + (row * kMmaLdRows + col) * 2);
  };
  auto word_at = [&](int64_t base, int64_t row, int64_t col) {  // two T1 elements, col even
    return mem.template Load<uint32_t>(kAShared, base + (row * kMmaLdRows + col) * 2);
  };

  team.Each([&](int64_t t, MmaRegThread&) {  // the tile's query vectors as T1 (vectors past Q zero)
    StageQueries<T1>(p, mem, t, Q, seq0, row_of, head_of, kMmaRegSmemQ);
  });
  team.Sync();
  team.Each([&](int64_t t, MmaRegThread& s) {  // the queries' fragments, the sums zeroed, the rows' visible keys
    const int64_t r0 = vector_of(t, 0), r1 = vector_of(t, 1), c = pair_of(t);
    KV_UNROLL
    for (int i = 0; i < kMmaKSteps; ++i) {
      if (i >= ksteps) continue;
      s.qa[i][0] = word_at(kMmaRegSmemQ, r0, 16 * i + c);
      s.qa[i][1] = word_at(kMmaRegSmemQ, r1, 16 * i + c);
      s.qa[i][2] = word_at(kMmaRegSmemQ, r0, 16 * i + c + 8);
      s.qa[i][3] = word_at(kMmaRegSmemQ, r1, 16 * i + c + 8);
    }
    KV_UNROLL
    for (int n = 0; n < kMmaDimTiles; ++n)
      KV_UNROLL
      for (int e = 0; e < 4; ++e) s.o[n][e] = 0.0f;
    KV_UNROLL
    for (int r = 0; r < 2; ++r) {
      const int64_t qi = vector_of(t, r);
      s.max[r] = MinusInf();
      s.sum[r] = 0.0f;
      s.lo[r] = s.hi[r] = 0;
      if (qi < Q) VisibleKeys(p.sliding_window, causal, S, K, row_of(qi), &s.lo[r], &s.hi[r]);
    }
  });

  for (int64_t c0 = key0; c0 < key1; c0 += NK) {
    const int64_t n = key1 - c0 < NK ? key1 - c0 : NK;
    // StageChunk's first barrier also orders the query fragments' loads before the one-by-one path's writes there.
    const bool nonfinite_values =
        StageChunk<T1>(p, rows_of, mem, team, b, col0, g, c0, n, kMmaRegSmemK, kMmaRegSmemV);

    KV_UNROLL
    for (int j = 0; j < kMmaKeyTiles; ++j) {  // S = Q K^T, one tile of 8 keys at a time
      team.Each([&](int64_t t, MmaRegThread& s) {
        const int64_t key = 8 * j + t % kWarp / 4, c = pair_of(t);
        KV_UNROLL
        for (int i = 0; i < kMmaKSteps; ++i) {
          if (i >= ksteps) continue;
          s.kb[i][0] = word_at(kMmaRegSmemK, key, 16 * i + c);
          s.kb[i][1] = word_at(kMmaRegSmemK, key, 16 * i + c + 8);
        }
        KV_UNROLL
        for (int e = 0; e < 4; ++e) s.s[j][e] = 0.0f;
      });
      KV_UNROLL
      for (int i = 0; i < kMmaKSteps; ++i) {
        if (i >= ksteps) continue;
        team.template Mma<T1>([i](MmaRegThread& s) -> auto& { return s.qa[i]; },
                              [i](MmaRegThread& s) -> auto& { return s.kb[i]; },
                              [j](MmaRegThread& s) -> auto& { return s.s[j]; });
      }
    }
    team.Each([&](int64_t t, MmaRegThread& s) {  // the scores finished, each row's max over this lane's keys
      s.hidden = 0;
      float m[2] = {MinusInf(), MinusInf()};
      KV_UNROLL
      for (int j = 0; j < kMmaKeyTiles; ++j) {
        KV_UNROLL
        for (int e = 0; e < 4; ++e) {
          const int r = e / 2;
          const int64_t qi = vector_of(t, r), kk = 8 * j + pair_of(t) + e % 2, key = c0 + kk;
          if (qi >= Q || kk >= n || key < s.lo[r] || key >= s.hi[r]) {
            s.hidden |= 1u << (4 * j + e);
            s.s[j][e] = MinusInf();
            continue;
          }
          s.s[j][e] = ScoreOf<T1>(p, mem, s.s[j][e], head_of(qi), seq0 + row_of(qi), col0 + key,
                                  key - (K - S + row_of(qi)));
          m[r] = MaxStep(m[r], s.s[j][e]);
        }
      }
      s.chunk_max[0] = m[0];
      s.chunk_max[1] = m[1];
    });
    team.Butterfly(1, 4, [](MmaRegThread& s) -> auto& { return s.chunk_max; }, MaxOp{});
    team.Each([&](int64_t t, MmaRegThread& s) {  // running max, rescaled sums, weights as A fragments
      float f[2];
      KV_UNROLL
      for (int r = 0; r < 2; ++r) {
        const float old = s.max[r], m = MaxStep(old, s.chunk_max[r]);
        f[r] = RescaleFactor(old, m);
        s.max[r] = m;
        s.sum[r] *= f[r];
      }
      if (f[0] != 1.0f || f[1] != 1.0f) {
        KV_UNROLL
        for (int d = 0; d < kMmaDimTiles; ++d)
          KV_UNROLL
          for (int e = 0; e < 4; ++e) s.o[d][e] *= f[e / 2];
      }
      KV_UNROLL
      for (int j = 0; j < kMmaKeyTiles; ++j) {
        KV_UNROLL
        for (int e = 0; e < 4; ++e) {
          const int r = e / 2;
          const bool hidden = (s.hidden >> (4 * j + e)) & 1u;
          // Nothing but -inf so far: weight 0, which still lets a non-finite value through (the one-by-one path).
          const float w = hidden ? kHidden : s.max[r] == MinusInf() ? 0.0f : expf(s.s[j][e] - s.max[r]);
          if (!hidden) s.sum[r] += w;
          s.s[j][e] = w;
          if (nonfinite_values) {
            const int64_t qi = vector_of(t, r), kk = 8 * j + pair_of(t) + e % 2;
            SharedPut(mem, kMmaRegSmemS / 4 + qi * kMmaLdScores + kk, w);
          }
        }
      }
      KV_UNROLL
      for (int kk = 0; kk < kMmaKeySteps; ++kk) {  // score tiles 2 kk and 2 kk + 1 are this step's A fragment
        auto weight = [&](int j, int e) { return s.s[j][e] == kHidden ? 0.0f : s.s[j][e]; };
        s.pa[kk][0] = PackTwoNotNaN<T1>(weight(2 * kk, 0), weight(2 * kk, 1));
        s.pa[kk][1] = PackTwoNotNaN<T1>(weight(2 * kk, 2), weight(2 * kk, 3));
        s.pa[kk][2] = PackTwoNotNaN<T1>(weight(2 * kk + 1, 0), weight(2 * kk + 1, 1));
        s.pa[kk][3] = PackTwoNotNaN<T1>(weight(2 * kk + 1, 2), weight(2 * kk + 1, 3));
      }
    });
    if (!nonfinite_values) {
      KV_UNROLL
      for (int d = 0; d < kMmaDimTiles; ++d) {  // O += P V, one tile of 8 output dims at a time
        if (d >= dtiles) continue;
        team.Each([&](int64_t t, MmaRegThread& s) {
          const int64_t dim = 8 * d + t % kWarp / 4, c = pair_of(t);
          KV_UNROLL
          for (int kk = 0; kk < kMmaKeySteps; ++kk) {
            s.kb[kk][0] = PackPair(half_at(kMmaRegSmemV, 16 * kk + c, dim),
                                   half_at(kMmaRegSmemV, 16 * kk + c + 1, dim));
            s.kb[kk][1] = PackPair(half_at(kMmaRegSmemV, 16 * kk + c + 8, dim),
                                   half_at(kMmaRegSmemV, 16 * kk + c + 9, dim));
          }
        });
        KV_UNROLL
        for (int kk = 0; kk < kMmaKeySteps; ++kk)
          team.template Mma<T1>([kk](MmaRegThread& s) -> auto& { return s.pa[kk]; },
                                [kk](MmaRegThread& s) -> auto& { return s.kb[kk]; },
                                [d](MmaRegThread& s) -> auto& { return s.o[d]; });
      }
    } else {
      team.Sync();
      // Weights one by one: 0 x inf must not reach a query that does not see the key.
      team.Each([&](int64_t t, MmaRegThread& s) {
        KV_UNROLL
        for (int d = 0; d < kMmaDimTiles; ++d) {
          if (d >= dtiles) continue;
          KV_UNROLL
          for (int e = 0; e < 4; ++e) {
            const int64_t qi = vector_of(t, e / 2), dim = 8 * d + pair_of(t) + e % 2;
            if (qi >= Q) continue;
            for (int64_t kk = 0; kk < n; ++kk) {
              const float w = SharedAt(mem, kMmaRegSmemS / 4 + qi * kMmaLdScores + kk);
              if (w != kHidden) s.o[d][e] += w * ElemToFloat<T1>(half_at(kMmaRegSmemV, kk, dim));
            }
          }
        }
      });
    }
  }
  team.Butterfly(1, 4, [](MmaRegThread& s) -> auto& { return s.sum; }, AddOp{});
  team.Each([&](int64_t t, MmaRegThread& s) {  // the output rows, or the part's records
    KV_UNROLL
    for (int d = 0; d < kMmaDimTiles; ++d) {
      if (d >= dtiles) continue;
      KV_UNROLL
      for (int e = 0; e < 4; ++e) {
        const int r = e / 2;
        const int64_t qi = vector_of(t, r), dim = 8 * d + pair_of(t) + e % 2;
        if (qi >= Q) continue;
        if (partial >= 0) {
          const int64_t record = (partial + qi) * (D + 2);
          if (dim == 0) {
            mem.template Store<float>(kAPartials, 4 * record, s.max[r]);
            mem.template Store<float>(kAPartials, 4 * (record + 1), s.sum[r]);
          }
          mem.template Store<float>(kAPartials, 4 * (record + 2 + dim), s.o[d][e]);
          continue;
        }
        const float out = s.max[r] == MinusInf() ? 0.0f : s.o[d][e] / s.sum[r];
        mem.template Store<T>(kAOut, (((seq0 + row_of(qi)) * H + head_of(qi)) * D + dim) * int64_t(sizeof(T)),
                              SaturatingFromFloat<T1>(out));
      }
    }
  });
}

}  // namespace cuda
}  // namespace kvcache
