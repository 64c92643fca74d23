// The decode kernel's work: attention for tiles of one query row (a sequence of one token), up to kDecodeHeads
// heads of one kv head, as __host__ __device__ functions over a block's team of kDecodeThreads threads.
//
// Decode reads every key and value of a sequence once for one query row: it is bound by the bytes in flight and by
// the instructions issued per key, not by arithmetic. The block's threads form head rows: a row is Dh / kVec
// consecutive lanes (a power of two, so a row never straddles a warp), lane x holding elements [x kVec, (x+1) kVec)
// of one head's query, output sums and of every key and value row it reads (one 16-byte load of float16,
// coalesced across the row). Thread t is lane x = t % lanes of the row for head y = t / lanes % kDecodeHeads in key
// group z = t / (lanes x kDecodeHeads); the groups walk different keys, the kDecodeHeads rows of a group the same
// keys (their loads of one row meet in the L1 cache). A row keeps only its head's registers (a query slice, output
// sums, max and weight sum), so many blocks fit a multiprocessor. A step of a row:
//   load    each lane loads its slices of kDecodeUnroll key rows and of their value rows (all in flight at once)
//           and dots its key slices with its query slice;
//   sum     the row's lanes add their parts (team.Butterfly: on the GPU, shuffles within the warp), so every lane
//           holds the step's dot products;
//   values  the scores finished (scale, softcap, mask, ALiBi) and their max taken in every lane alike, the running
//           max raised once per step and the sums rescaled by exp(old max - new max), each key's weight times its
//           value slice added (online softmax, one pass over the keys).
// At the end each row leaves (max, weight sum, output sums) in shared memory, and the block combines its key groups
// by log-sum-exp into the output rows or, for a key range split over several blocks, into its parts' records for
// the merge (attention_work.h's MergeThread).
//
// team.Butterfly(lo, hi, get, op) is the one cooperation beyond attention_work.h's Each and Sync: for masks lo,
// 2 lo, ... below hi, every thread replaces each element of its array get(state) by op(its value, the value of
// the thread whose index differs by the mask) — on the GPU __shfl_xor_sync within a warp (masks below kWarp); on the
// host runner the same exchange over every thread's saved state. Semantics are the tile kernel's, element for
// element: a key the query does not see never enters; a -inf score enters with weight 0 (a non-finite value still
// reaches the sums); a NaN max makes the row NaN; a row whose scores are all -inf is exactly zero.
#pragma once

#include <cmath>
#include <cstdint>

#include "attention_work.h"

namespace kvcache {
namespace cuda {

// A decode thread's registers: its head's query slice, its slice of the output sums, the row's running max and
// weight sum (the same in every lane of the row), and one step's value slices and dot products (then scores).
struct DecodeThread {
  float q[kVec];
  float acc[kVec];
  float max, sum;
  float v[kDecodeUnroll][kVec];
  float dots[kDecodeUnroll];
  int32_t enters;  // bit u: the step's key u is one the query sees
};

// Everything decode block `tile_index` (tile p.tiles + tile_index of kATiles) does, over its kDecodeThreads threads.
template <class T1, class Rows, class Team, class Mem>
KV_HD void DecodeTile(const AttnParams& p, const Rows& rows_of, Mem& mem, Team& team, int64_t tile_index) {
  using T = typename T1::Storage;
  constexpr int64_t U = kDecodeUnroll, HQ = kDecodeHeads;
  const Tile tile = TileAt(mem, p.tiles + tile_index);
  const int64_t b = tile.b, row = tile.row0, head0 = tile.head0, Q = tile.heads, key0 = tile.key0, key1 = tile.key1,
                partial = tile.partial;
  const int64_t D = p.head_dim, H = p.num_heads, lanes = D / kVec, groups = kDecodeThreads / (lanes * HQ);
  const SeqSpan seq = SeqAt(p, mem, b);
  const int64_t seq0 = seq.seq0, S = seq.S, col0 = seq.col0, K = seq.K;
  const bool causal = seq.causal;
  const int64_t g = head0 / p.group, token = seq0 + row, position = K - S + row;
  int64_t lo, hi;
  VisibleKeys(p.sliding_window, causal, S, K, row, &lo, &hi);
  // Thread t: lane, head (within the tile) and key group; the key of its group's step `step`, slot u.
  auto lane_of = [&](int64_t t) { return t % lanes; };
  auto head_of = [&](int64_t t) { return t / lanes % HQ; };
  auto group_of = [&](int64_t t) { return t / (lanes * HQ); };
  auto key_of = [&](int64_t step, int64_t t, int64_t u) { return key0 + (step * groups + group_of(t)) * U + u; };

  team.Each([&](int64_t t, DecodeThread& s) {
    const int64_t d0 = lane_of(t) * kVec, qi = head_of(t);
    KV_UNROLL
    for (int64_t e = 0; e < kVec; ++e) {
      const int64_t at = (token * H + head0 + qi) * D + d0 + e;
      s.q[e] = qi < Q ? ElemToFloat<T1>(mem.template Load<T>(kAQuery, at * int64_t(sizeof(T)))) : 0.0f;
      s.acc[e] = 0.0f;
    }
    s.max = MinusInf();
    s.sum = 0.0f;
  });

  const int64_t steps = (key1 - key0 + groups * U - 1) / (groups * U);
  for (int64_t step = 0; step < steps; ++step) {
    team.Each([&](int64_t t, DecodeThread& s) {  // load: key and value slices, the parts of the dot products
      const int64_t d0 = lane_of(t) * kVec;
      float k[U][kVec];
      s.enters = 0;
      KV_UNROLL
      for (int64_t u = 0; u < U; ++u) {
        const int64_t j = key_of(step, t, u);
        if (head_of(t) < Q && j < key1 && j >= lo && j < hi) {
          s.enters |= 1 << u;
          const int64_t where = rows_of.Where(p, mem, b, col0, j);
          rows_of.Load(p, mem, 0, rows_of.At(p, 0, g, where), d0, kVec, k[u]);
          rows_of.Load(p, mem, 1, rows_of.At(p, 1, g, where), d0, kVec, s.v[u]);
        } else {
          KV_UNROLL
          for (int64_t e = 0; e < kVec; ++e) k[u][e] = s.v[u][e] = 0.0f;
        }
      }
      KV_UNROLL
      for (int64_t u = 0; u < U; ++u) {
        float dot = 0.0f;
        KV_UNROLL
        for (int64_t e = 0; e < kVec; ++e) dot += s.q[e] * k[u][e];
        s.dots[u] = dot;
      }
    });
    // sum: every lane of the row holds the dot products (bit for bit the same: addition commutes)
    team.Butterfly(1, lanes, [](DecodeThread& s) -> auto& { return s.dots; }, AddOp{});
    team.Each([&](int64_t t, DecodeThread& s) {  // values: scores, the running max, the weights times the values
      if (s.enters == 0) return;  // no key this step (or a head past the tile's): nothing changes
      const int64_t qi = head_of(t);
      float top = MinusInf();
      KV_UNROLL
      for (int64_t u = 0; u < U; ++u) {
        if (!(s.enters >> u & 1)) continue;
        const int64_t j = key_of(step, t, u);
        s.dots[u] = ScoreOf<T1>(p, mem, s.dots[u], head0 + qi, token, col0 + j, j - position);
        top = MaxStep(top, s.dots[u]);
      }
      const float m = MaxStep(s.max, top);
      const float f = RescaleFactor(s.max, m);  // 0 after -inf; NaN for a NaN max
      if (f != 1.0f) {
        KV_UNROLL
        for (int64_t e = 0; e < kVec; ++e) s.acc[e] *= f;
        s.sum *= f;
      }
      s.max = m;
      KV_UNROLL
      for (int64_t u = 0; u < U; ++u) {
        if (!(s.enters >> u & 1)) continue;
        // Nothing but -inf so far: weight 0, which still lets a non-finite value through.
        const float w = m == MinusInf() ? 0.0f : expf(s.dots[u] - m);
        KV_UNROLL
        for (int64_t e = 0; e < kVec; ++e) s.acc[e] += w * s.v[u][e];
        s.sum += w;
      }
    });
  }

  // Each row leaves its part in shared memory, [group][head][max, weight sum, output sums].
  auto part_word = [&](int64_t z, int64_t qi, int64_t k) { return (z * HQ + qi) * (D + 2) + k; };
  team.Each([&](int64_t t, DecodeThread& s) {
    const int64_t x = lane_of(t), qi = head_of(t), z = group_of(t);
    if (qi >= Q) return;
    if (x == 0) {
      SharedPut(mem, part_word(z, qi, 0), s.max);
      SharedPut(mem, part_word(z, qi, 1), s.sum);
    }
    KV_UNROLL
    for (int64_t e = 0; e < kVec; ++e) SharedPut(mem, part_word(z, qi, 2 + x * kVec + e), s.acc[e]);
  });
  team.Sync();
  team.Each([&](int64_t t, DecodeThread&) {  // the groups combined: the output rows, or the part's records
    for (int64_t i = t; i < Q * D; i += kDecodeThreads) {
      const int64_t qi = i / D, d = i % D;
      const Combined c = CombineParts(
          groups, [&](int64_t k, int64_t field) { return SharedAt(mem, part_word(k, qi, field < 2 ? field : 2 + d)); });
      if (partial >= 0) {
        const int64_t record = (partial + qi) * (D + 2);
        if (d == 0) {
          mem.template Store<float>(kAPartials, 4 * record, c.top);
          mem.template Store<float>(kAPartials, 4 * (record + 1), c.total);
        }
        mem.template Store<float>(kAPartials, 4 * (record + 2 + d), c.acc);
        continue;
      }
      const int64_t at = (token * H + head0 + qi) * D + d;
      mem.template Store<T>(kAOut, at * int64_t(sizeof(T)), T1::FromFloat(c.Output()));
    }
  });
}

}  // namespace cuda
}  // namespace kvcache
