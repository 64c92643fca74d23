// The tensor-core kernel's second form: the scores, weights and output sums in the registers of the matrix
// products' fragments (as FlashAttention 2 keeps them), for the same tiles as the first form (attention_mma.h).
//
// The first form keeps S, P and O in shared memory and was latency-bound on an H100 at two blocks per
// multiprocessor, executing mostly the scalar work around its products (benchmarks/gpu/attention_h100/ncu.md). Here
// warp w owns query vectors [16 w, 16 w + 16) of the tile as the row blocks of m16n8k16 products (team.Mma): lane l
// of the warp holds, of every 16 x 8 accumulator tile, rows g = l / 4 and g + 8, columns 2 (l % 4) and 2 (l % 4) + 1
// (the products' documented fragment layout). Per chunk of kMmaKeys keys:
//   stage   the key and value rows copied as stored (the form runs rows stored as T1 only) into one of two stages of
//           shared memory with cp.async (team.CopyAsync16): the next chunk's copies are issued as soon as this
//           chunk's have landed (team.WaitSync<0>), so they fly while this chunk is computed; rows past the chunk
//           are zeroed;
//   scores  S = Q K^T: the queries' A fragments loaded once per tile, the key rows' B fragments four at a time by
//           team.LoadMatrix (ldmatrix), eight accumulator tiles of 8 keys per warp;
//   softmax each lane finishes its 32 scores (scale, softcap, mask, ALiBi, visibility), the four lanes of a row
//           exchange their maxima (team.Butterfly), the output sums and weight sums are rescaled in registers, and
//           the weights, exp(score - max), become the A fragments of the next product without leaving registers;
//   values  O += P V: each 16 x 8 output tile from four products over the chunk's keys, the value rows' B
//           fragments four at a time by team.LoadMatrix<.., Trans> (ldmatrix.trans).
// A chunk whose value rows hold inf or NaN (each thread looks at the value slices it copied, then team.SyncOr) adds
// its weights one by one through shared memory instead, skipping the keys each query does not see, as the first form
// does. At the end the four lanes of a row add their weight sums and write the output (or the split part's record).
//
// team.Mma<T1>(a, b, c) is one m16n8k16 product per warp: c += a b, a, b, c each thread's fragment registers
// (get(state) arrays of 4 words, 2 words, 4 floats); on the GPU mma.sync, on the host runner the same layout
// gathered from every lane's saved registers and multiplied in float. team.LoadMatrix<Count, Trans>(mem, row_byte,
// get) is the warp's ldmatrix of Count 8 x 8 matrices: on the host runner each row is read as the lane that gives
// its address (checked as any shared read) and dealt out in the same layout.
#pragma once

#include <cmath>
#include <cstdint>

#include "attention_mma.h"

namespace kvcache {
namespace cuda {

// Shared memory of a block (byte offsets): two stages of a chunk's key and value rows, 68 KB (two blocks fit an
// A100's multiprocessor). The queries are staged where stage 1's keys go (their fragments are loaded before the first
// wait, after which the second chunk's copies may land there), and the one-by-one path's float weights
// [64][kMmaLdScores] where the chunk's own keys are (read by then: a barrier comes between).
constexpr int64_t kMmaRegRowsBytes = kMmaKeys * kMmaLdRows * 2;  // a chunk's key (or value) rows
constexpr int64_t kMmaRegSharedBytes = 2 * 2 * kMmaRegRowsBytes;
constexpr int64_t kMmaRegSharedWords = kMmaRegSharedBytes / 4;
// Where stage `stage`'s key (kv 0) or value (kv 1) rows start.
KV_HD constexpr int64_t MmaRegRowsAt(int64_t stage, int kv) { return (2 * stage + kv) * kMmaRegRowsBytes; }
constexpr int64_t kMmaRegSmemQ = MmaRegRowsAt(1, 0);
static_assert(kMmaQueries * kMmaLdRows * 2 <= kMmaRegRowsBytes, "the queries fit where a chunk's keys go");
static_assert(kMmaQueries * kMmaLdScores * 4 <= kMmaRegRowsBytes, "the float weights fit where a chunk's keys are");
static_assert(kMmaRegRowsBytes % 128 == 0, "stages start 128-byte aligned");

constexpr int kMmaKSteps = static_cast<int>(kMmaMaxHeadDim / 16);  // query fragments (16 dims each)
constexpr int kMmaKeyTiles = static_cast<int>(kMmaKeys / 8);       // score tiles (8 keys each)
constexpr int kMmaDimTiles = static_cast<int>(kMmaMaxHeadDim / 8);  // output tiles (8 dims each)
constexpr int kMmaKeySteps = static_cast<int>(kMmaKeys / 16);      // weight fragments (16 keys each)
static_assert(kMmaKSteps % 2 == 0 && kMmaKeySteps % 2 == 0, "fragments are loaded two k-steps at a time");

// A lane's registers.
struct MmaRegThread {
  uint32_t qa[kMmaKSteps][4];   // the queries' A fragments
  float s[kMmaKeyTiles][4];     // the chunk's scores, then weights
  float o[kMmaDimTiles][4];     // output sums
  uint32_t pa[kMmaKeySteps][4];  // the weights as A fragments
  uint32_t kb[kMmaKSteps][2];   // B fragments of one key tile (scores) or one output tile (values)
  uint32_t frag[4];             // what one team.LoadMatrix gave
  float max[2], sum[2], chunk_max[2];  // rows g and g + 8
  uint32_t hidden;              // bit 4 j + c: element c of score tile j is a key its query does not see
  int64_t lo[2], hi[2];         // the rows' visible keys
  int32_t nonfinite;
};


// A thread's walk over its slices of a chunk's rows, u = t, t + kMmaThreads, ...: slice u is kVec elements from
// column (u % slices) kVec of row (key) u / slices. Stepped by a quotient and a remainder found once per tile, so a
// chunk's copies and checks divide once per thread, not once per slice (a division takes about twenty instructions,
// and a lane walks up to 16 slices twice a chunk).
struct SliceSteps {
  int64_t slices, rows, cols;  // a step of kMmaThreads slices: `rows` rows and `cols` columns more
  KV_HD explicit SliceSteps(int64_t slices_per_row)
      : slices(slices_per_row), rows(kMmaThreads / slices_per_row), cols(kMmaThreads % slices_per_row) {}
};
struct SliceWalk {
  int64_t kk, col;
  KV_HD SliceWalk(int64_t t, const SliceSteps& s) : kk(t / s.slices), col(t % s.slices) {}
  KV_HD void Next(const SliceSteps& s) {
    kk += s.rows;
    col += s.cols;
    if (col >= s.slices) {
      col -= s.slices;
      ++kk;
    }
  }
  KV_HD int64_t At() const { return (kk * kMmaLdRows + col * kVec) * 2; }  // bytes within a chunk's row block
};

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
  auto word_at = [&](int64_t base, int64_t row, int64_t col) {  // two T1 elements, col even
    return mem.template Load<uint32_t>(kAShared, base + (row * kMmaLdRows + col) * 2);
  };

  // Whether a score is the dot product times the scale alone (ScoreOf's first step) where the key is seen.
  const bool scale_only = p.softcap == 0.0f && p.mask_rank == 0 && !p.alibi;
  // Thread t's slices of a chunk's rows: slice u = t + i kMmaThreads is 8 elements at d0 of row (key) kk.
  const int64_t slices = D / kVec;
  const SliceSteps steps_of(slices);
  // Copies chunk c0's key and value rows into stage `stage` (rows past the chunk's n keys zeroed: the value product
  // reads them with weight 0, and 0 x NaN would be NaN), or does nothing past the tile's keys.
  auto issue = [&](int64_t c0, int64_t stage) {
    if (c0 >= key1) return;
    const int64_t n = key1 - c0 < NK ? key1 - c0 : NK;
    team.Each([&](int64_t t, MmaRegThread&) {
      for (SliceWalk u(t, steps_of); u.kk < NK; u.Next(steps_of)) {
        const int64_t kk = u.kk, d0 = u.col * kVec, at = u.At();
        if (kk >= n) {
          mem.template Store<Vec16>(kAShared, MmaRegRowsAt(stage, 0) + at, Vec16{});
          mem.template Store<Vec16>(kAShared, MmaRegRowsAt(stage, 1) + at, Vec16{});
          continue;
        }
        const int64_t where = rows_of.Where(p, mem, b, col0, c0 + kk);
        KV_UNROLL
        for (int kv = 0; kv < 2; ++kv)
          team.CopyAsync16(mem, MmaRegRowsAt(stage, kv) + at, rows_of.BufferOf(kv),
                           (rows_of.At(p, kv, g, where).elem + d0) * int64_t(sizeof(T)));
      }
    });
  };

  issue(key0, 0);  // the first chunk's copies fly while the queries are staged
  team.Commit();
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

  int64_t stage = 0;
  for (int64_t c0 = key0; c0 < key1; c0 += NK, stage ^= 1) {
    const int64_t n = key1 - c0 < NK ? key1 - c0 : NK;
    const int64_t k_rows = MmaRegRowsAt(stage, 0), v_rows = MmaRegRowsAt(stage, 1);
    // This chunk's rows landed, and every thread is past the previous chunk (which read the other stage: its rows and
    // the one-by-one path's weights there), and, before the first, has loaded its query fragments from stage 1.
    team.template WaitSync<0>();
    issue(c0 + NK, stage ^ 1);
    team.Commit();
    team.Each([&](int64_t t, MmaRegThread& s) {  // the value slices this thread copied: any inf or NaN?
      bool any = false;
      for (SliceWalk u(t, steps_of); u.kk < n; u.Next(steps_of))
        any = any || AnyNonFinite<T1>(mem.template Load<Vec16>(kAShared, v_rows + u.At()));
      s.nonfinite = any;
    });
    const bool nonfinite_values = team.SyncOr([](MmaRegThread& s) -> int32_t& { return s.nonfinite; });

    KV_UNROLL
    for (int j = 0; j < kMmaKeyTiles; ++j) {  // S = Q K^T, one tile of 8 keys at a time
      // Lane l gives row 8 j + l % 8, columns 16 i + 8 (l / 8): the B fragments of k-steps i and i + 1.
      auto key_row = [&](int i) {
        return [&, i](int64_t t, MmaRegThread&) {
          return k_rows + ((8 * j + t % 8) * kMmaLdRows + 16 * i + 8 * (t % kWarp / 8)) * 2;
        };
      };
      KV_UNROLL
      for (int i = 0; i < kMmaKSteps; i += 2) {
        if (i >= ksteps) continue;
        if (i + 1 < ksteps)
          team.template LoadMatrix<4, false>(mem, key_row(i), [](MmaRegThread& s) -> auto& { return s.frag; });
        else
          team.template LoadMatrix<2, false>(mem, key_row(i), [](MmaRegThread& s) -> auto& { return s.frag; });
        team.Each([&](int64_t, MmaRegThread& s) {
          s.kb[i][0] = s.frag[0];
          s.kb[i][1] = s.frag[1];
          if (i + 1 < ksteps) {  // (and so < kMmaKSteps)
            s.kb[i + 1][0] = s.frag[2];
            s.kb[i + 1][1] = s.frag[3];
          }
        });
      }
      team.Each([&](int64_t, MmaRegThread& s) {
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
      const int64_t q0 = vector_of(t, 0), q1 = vector_of(t, 1);
      if (scale_only && n == NK && q1 < Q && s.lo[0] <= c0 && c0 + NK <= s.hi[0] && s.lo[1] <= c0 &&
          c0 + NK <= s.hi[1]) {  // (q0 < q1) both rows see every key of the chunk: ScoreOf is the scale alone
        KV_UNROLL
        for (int j = 0; j < kMmaKeyTiles; ++j) {
          KV_UNROLL
          for (int e = 0; e < 4; ++e) {
            s.s[j][e] = p.scale * s.s[j][e];
            m[e / 2] = MaxStep(m[e / 2], s.s[j][e]);
          }
        }
        s.chunk_max[0] = m[0];
        s.chunk_max[1] = m[1];
        return;
      }
      KV_UNROLL
      for (int j = 0; j < kMmaKeyTiles; ++j) {
        KV_UNROLL
        for (int e = 0; e < 4; ++e) {
          const int r = e / 2;
          const int64_t qi = r == 0 ? q0 : q1, kk = 8 * j + pair_of(t) + e % 2, key = c0 + kk;
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
    if (nonfinite_values) team.Sync();  // every warp's key fragments read before the weights go where the keys are
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
      if (s.hidden == 0 && !nonfinite_values) {  // every key seen by both rows, the weights kept in registers
        const bool none[2] = {s.max[0] == MinusInf(), s.max[1] == MinusInf()};
        KV_UNROLL
        for (int j = 0; j < kMmaKeyTiles; ++j) {
          KV_UNROLL
          for (int e = 0; e < 4; ++e) {
            const int r = e / 2;
            const float w = none[r] ? 0.0f : WeightExp(s.s[j][e] - s.max[r]);  // as below, without the hidden keys
            s.sum[r] += w;
            s.s[j][e] = w;
          }
        }
      } else {
        KV_UNROLL
        for (int j = 0; j < kMmaKeyTiles; ++j) {
          KV_UNROLL
          for (int e = 0; e < 4; ++e) {
            const int r = e / 2;
            const bool hidden = (s.hidden >> (4 * j + e)) & 1u;
            // Nothing but -inf so far: weight 0, which still lets a non-finite value through (the one-by-one path).
            const float w = hidden ? kHidden : s.max[r] == MinusInf() ? 0.0f : WeightExp(s.s[j][e] - s.max[r]);
            if (!hidden) s.sum[r] += w;
            s.s[j][e] = w;
            if (nonfinite_values) {
              const int64_t qi = vector_of(t, r), kk = 8 * j + pair_of(t) + e % 2;
              SharedPut(mem, k_rows / 4 + qi * kMmaLdScores + kk, w);
            }
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
        KV_UNROLL
        for (int kk = 0; kk < kMmaKeySteps; kk += 2) {
          // Lane l gives row 16 (kk + m / 2) + 8 (m % 2) + l % 8 of matrix m = l / 8 at column 8 d, transposed: the
          // B fragments of key steps kk and kk + 1.
          team.template LoadMatrix<4, true>(
              mem,
              [&](int64_t t, MmaRegThread&) {
                const int64_t m = t % kWarp / 8;
                return v_rows + ((16 * (kk + m / 2) + 8 * (m % 2) + t % 8) * kMmaLdRows + 8 * d) * 2;
              },
              [](MmaRegThread& s) -> auto& { return s.frag; });
          team.Each([&](int64_t, MmaRegThread& s) {
            s.kb[kk][0] = s.frag[0];
            s.kb[kk][1] = s.frag[1];
            s.kb[kk + 1][0] = s.frag[2];
            s.kb[kk + 1][1] = s.frag[3];
          });
        }
        KV_UNROLL
        for (int kk = 0; kk < kMmaKeySteps; ++kk)
          team.template Mma<T1>([kk](MmaRegThread& s) -> auto& { return s.pa[kk]; },
                                [kk](MmaRegThread& s) -> auto& { return s.kb[kk]; },
                                [d](MmaRegThread& s) -> auto& { return s.o[d]; });
      }
    } else {
      team.Sync();
      // Weights one by one: 0 x inf must not reach a query that does not see the key.
      // Keys in the outer loop, not unrolled, so this rare path stays one short loop in the kernel's code.
      team.Each([&](int64_t t, MmaRegThread& s) {
        const int64_t q0 = vector_of(t, 0), q1 = vector_of(t, 1), c = pair_of(t);
        for (int64_t kk = 0; kk < n; ++kk) {
          const float w0 = q0 < Q ? SharedAt(mem, k_rows / 4 + q0 * kMmaLdScores + kk) : kHidden;
          const float w1 = q1 < Q ? SharedAt(mem, k_rows / 4 + q1 * kMmaLdScores + kk) : kHidden;
          KV_UNROLL
          for (int d = 0; d < kMmaDimTiles; ++d) {
            if (d >= dtiles) continue;
            const uint32_t v = word_at(v_rows, kk, 8 * d + c);  // this lane's two columns of the value row
            const float lo = ElemToFloat<T1>(static_cast<uint16_t>(v & 0xffffu));
            const float hi = ElemToFloat<T1>(static_cast<uint16_t>(v >> 16));
            if (w0 != kHidden) {
              s.o[d][0] += w0 * lo;
              s.o[d][1] += w0 * hi;
            }
            if (w1 != kHidden) {
              s.o[d][2] += w1 * lo;
              s.o[d][3] += w1 * hi;
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
