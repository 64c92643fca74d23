// The decode kernel's work: attention for tiles of one query row (a sequence of one token), up to kDecodeHeads
// heads of one kv head, as __host__ __device__ functions over a block's team of kDecodeThreads threads.
//
// Decode reads every key and value of a sequence once for one query row: it is bound by how many bytes are in
// flight, not by arithmetic. So the block's kDecodeWarps warps walk their keys independently, with no barrier
// until the end, and a key row is read by Dh / kVec lanes of a warp side by side (one 16-byte load each for
// float16, coalesced), kWarp / (Dh / kVec) keys per load instruction. A step of a warp:
//   load    each lane loads its slice of kDecodeUnroll key rows and of their value rows (all in flight at once)
//           and dots its key slices with its slices of the query vectors (in shared memory, read once per step:
//           GQA heads share each loaded key);
//   sum     the lanes of a key add their parts (team.Butterfly: on the GPU, shuffles within the warp);
//   max     the step's scores finished (scale, softcap, mask, ALiBi) and the warp's largest per query vector;
//   values  the running max raised, the sums rescaled by exp(old max - new max), each key's weight times its
//           value slice added (online softmax, one pass over the keys).
// At the end the warp's key groups' sums are added (a butterfly), each warp leaves (max, weight sum, output sums)
// in shared memory, and the block combines its warps by log-sum-exp into the output rows or, for a key range split
// over several blocks, into its parts' records for the merge (attention_work.h's MergeThread).
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

// A decode thread's registers: its (and, after the last butterfly, its warp's) sums,
// the warp's running max, and one step's value slices and dot products (then scores).
struct DecodeThread {
  static constexpr int64_t kSumWords = kVec + 1;  // per query vector: the output sums of its slice, the weight sum
  float sums[kDecodeHeads * kSumWords];
  float max[kDecodeHeads];
  float top[kDecodeHeads];  // the step's largest score per query vector
  float v[kDecodeUnroll][kVec];
  float dots[kDecodeUnroll * kDecodeHeads];
  int32_t enters;  // bit u: the step's key u of this lane's group is one the query sees
};

struct AddOp {
  KV_HD float operator()(float a, float b) const { return a + b; }
};
struct MaxOp {  // numpy's max: NaN sticks; a, b and b, a may differ only in a NaN's payload or a zero's sign, which
               // the max is never shown through (it is subtracted and compared)
  KV_HD float operator()(float a, float b) const { return MaxStep(a, b); }
};

// Everything decode block `tile_index` (tile p.tiles + tile_index of kATiles) does, over its kDecodeThreads threads.
template <class T1, class Rows, class Team, class Mem>
KV_HD void DecodeTile(const AttnParams& p, const Rows& rows_of, Mem& mem, Team& team, int64_t tile_index) {
  using T = typename T1::Storage;
  constexpr int64_t W = kDecodeWarps, U = kDecodeUnroll, HQ = kDecodeHeads, SW = DecodeThread::kSumWords;
  auto tile_word = [&](int64_t k) {
    return mem.template Load<int64_t>(kATiles, 8 * ((p.tiles + tile_index) * kTileWords + k));
  };
  const int64_t b = tile_word(0), row = tile_word(1), head0 = tile_word(3), Q = tile_word(4), key0 = tile_word(5),
                key1 = tile_word(6), partial = tile_word(7);
  const int64_t D = p.head_dim, H = p.num_heads, lanes = D / kVec, per_load = kWarp / lanes;
  const int64_t warp_keys = per_load * U, block_keys = W * warp_keys;
  const int64_t seq0 = IndexWord(mem, b), S = IndexWord(mem, b + 1) - seq0;
  const int64_t col0 = IndexWord(mem, KvstartsAt(p) + b), K = IndexWord(mem, KvstartsAt(p) + b + 1) - col0;
  const bool causal = IndexWord(mem, CausalAt(p) + b) != 0;
  const int64_t g = head0 / p.group, token = seq0 + row, position = K - S + row;
  int64_t lo, hi;
  VisibleKeys(p.sliding_window, causal, S, K, row, &lo, &hi);
  // Key u of thread t's group in step `step`.
  auto key_of = [&](int64_t step, int64_t t, int64_t u) {
    return key0 + (step * W + t / kWarp) * warp_keys + u * per_load + t % kWarp / lanes;
  };

  team.Each([&](int64_t t, DecodeThread& s) {  // the query vectors into shared memory (read by every warp)
    for (int64_t i = t; i < Q * D; i += kDecodeThreads) {
      const int64_t at = (token * H + head0 + i / D) * D + i % D;
      SharedPut(mem, kDecodeSmemQueries + i, ElemToFloat<T1>(mem.template Load<T>(kAQuery, at * int64_t(sizeof(T)))));
    }
    KV_UNROLL
    for (int64_t qi = 0; qi < HQ; ++qi) s.max[qi] = MinusInf();
    KV_UNROLL
    for (int64_t i = 0; i < HQ * SW; ++i) s.sums[i] = 0.0f;
  });
  team.Sync();

  const int64_t steps = (key1 - key0 + block_keys - 1) / block_keys;
  for (int64_t step = 0; step < steps; ++step) {
    team.Each([&](int64_t t, DecodeThread& s) {  // load: key and value slices, the parts of the dot products
      const int64_t d0 = t % kWarp % lanes * kVec;
      float k[U][kVec];
      s.enters = 0;
      KV_UNROLL
      for (int64_t u = 0; u < U; ++u) {
        const int64_t j = key_of(step, t, u);
        if (j < key1 && j >= lo && j < hi) {
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
      for (int64_t qi = 0; qi < HQ; ++qi) {  // each query slice read once per step (16-byte shared loads)
        float q[kVec];
        if (qi < Q) {
          SharedFour(mem, kDecodeSmemQueries + qi * D + d0, q);
          SharedFour(mem, kDecodeSmemQueries + qi * D + d0 + 4, q + 4);
        }
        KV_UNROLL
        for (int64_t u = 0; u < U; ++u) {
          float dot = 0.0f;
          KV_UNROLL
          for (int64_t e = 0; e < kVec; ++e) dot += (qi < Q ? q[e] : 0.0f) * k[u][e];
          s.dots[u * HQ + qi] = dot;
        }
      }
    });
    // sum: every lane of a key's group holds its dot products (bit for bit the same: addition commutes)
    team.Butterfly(1, lanes, [](DecodeThread& s) -> auto& { return s.dots; }, AddOp{});
    team.Each([&](int64_t t, DecodeThread& s) {  // max: the scores, the step's largest per query vector
      KV_UNROLL
      for (int64_t qi = 0; qi < HQ; ++qi) s.top[qi] = MinusInf();
      KV_UNROLL
      for (int64_t u = 0; u < U; ++u) {
        if (!(s.enters >> u & 1)) continue;
        const int64_t j = key_of(step, t, u);
        KV_UNROLL
        for (int64_t qi = 0; qi < HQ; ++qi) {
          if (qi >= Q) continue;
          const float sc = ScoreOf<T1>(p, mem, s.dots[u * HQ + qi], head0 + qi, token, col0 + j, j - position);
          s.dots[u * HQ + qi] = sc;
          s.top[qi] = MaxStep(s.top[qi], sc);
        }
      }
    });
    team.Butterfly(lanes, kWarp, [](DecodeThread& s) -> auto& { return s.top; }, MaxOp{});  // the warp's largest
    team.Each([&](int64_t, DecodeThread& s) {  // values: the running max raised, the weights times the value slices
      KV_UNROLL
      for (int64_t qi = 0; qi < HQ; ++qi) {
        if (qi >= Q) continue;
        const float m = MaxStep(s.max[qi], s.top[qi]);
        const float f = RescaleFactor(s.max[qi], m);  // 0 after -inf; NaN for a NaN max
        if (f != 1.0f) {
          KV_UNROLL
          for (int64_t e = 0; e < SW; ++e) s.sums[qi * SW + e] *= f;
        }
        s.max[qi] = m;
        KV_UNROLL
        for (int64_t u = 0; u < U; ++u) {
          if (!(s.enters >> u & 1)) continue;
          // Nothing but -inf so far: weight 0, which still lets a non-finite value through.
          const float w = m == MinusInf() ? 0.0f : expf(s.dots[u * HQ + qi] - m);
          KV_UNROLL
          for (int64_t e = 0; e < kVec; ++e) s.sums[qi * SW + e] += w * s.v[u][e];
          s.sums[qi * SW + kVec] += w;
        }
      }
    });
  }

  // The warp's key groups share its max: their sums add. Group 0 of each warp leaves the warp's part in shared
  // memory, [warp][query vector][max, weight sum, output sums].
  team.Butterfly(lanes, kWarp, [](DecodeThread& s) -> auto& { return s.sums; }, AddOp{});
  auto part_word = [&](int64_t warp, int64_t qi, int64_t k) { return (warp * HQ + qi) * (D + 2) + k; };
  team.Each([&](int64_t t, DecodeThread& s) {
    const int64_t warp = t / kWarp, lane = t % kWarp;
    if (lane >= lanes) return;
    KV_UNROLL
    for (int64_t qi = 0; qi < HQ; ++qi) {  // constant indices: the arrays stay in registers
      if (qi >= Q) continue;
      if (lane == 0) {
        SharedPut(mem, part_word(warp, qi, 0), s.max[qi]);
        SharedPut(mem, part_word(warp, qi, 1), s.sums[qi * SW + kVec]);
      }
      KV_UNROLL
      for (int64_t e = 0; e < kVec; ++e) SharedPut(mem, part_word(warp, qi, 2 + lane * kVec + e), s.sums[qi * SW + e]);
    }
  });
  team.Sync();
  team.Each([&](int64_t t, DecodeThread&) {  // the warps combined: the output rows, or the part's records
    for (int64_t i = t; i < Q * D; i += kDecodeThreads) {
      const int64_t qi = i / D, d = i % D;
      const Combined c =
          CombineParts(W, [&](int64_t k, int64_t field) { return SharedAt(mem, part_word(k, qi, field < 2 ? field : 2 + d)); });
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
