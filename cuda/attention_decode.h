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

// What every thread of a decode block knows of its tile: the tile, its sequence, the query token and position,
// the keys the query sees [lo, hi), and how the block's threads divide (lanes per head row, key groups).
struct DecodeBlock {
  Tile tile;
  SeqSpan seq;
  int64_t g, token, position, lo, hi, lanes, groups;
  // Thread t's lane, head (within the tile) and key group.
  KV_HD int64_t LaneOf(int64_t t) const { return t % lanes; }
  KV_HD int64_t HeadOf(int64_t t) const { return t / lanes % kDecodeHeads; }
  KV_HD int64_t GroupOf(int64_t t) const { return t / (lanes * kDecodeHeads); }
};

template <class Mem>
KV_HD DecodeBlock DecodeBlockAt(const AttnParams& p, Mem& mem, int64_t tile_index, int64_t threads) {
  DecodeBlock d;
  d.tile = TileAt(mem, p.tiles + tile_index);
  d.seq = SeqAt(p, mem, d.tile.b);
  d.g = d.tile.head0 / p.group;
  d.token = d.seq.seq0 + d.tile.row0;
  d.position = d.seq.K - d.seq.S + d.tile.row0;
  VisibleKeys(p.sliding_window, d.seq.causal, d.seq.S, d.seq.K, d.tile.row0, &d.lo, &d.hi);
  d.lanes = p.head_dim / kVec;
  d.groups = threads / (d.lanes * kDecodeHeads);
  return d;
}

// Thread t's start: its head's query slice, zero sums, a max of -inf.
template <class T1, class Mem, class State>
KV_HD void DecodeStart(const AttnParams& p, Mem& mem, const DecodeBlock& d, int64_t t, State& s) {
  using T = typename T1::Storage;
  const int64_t d0 = d.LaneOf(t) * kVec, qi = d.HeadOf(t);
  KV_UNROLL
  for (int64_t e = 0; e < kVec; ++e) {
    const int64_t at = (d.token * p.num_heads + d.tile.head0 + qi) * p.head_dim + d0 + e;
    s.q[e] = qi < d.tile.heads ? ElemToFloat<T1>(mem.template Load<T>(kAQuery, at * int64_t(sizeof(T)))) : 0.0f;
    s.acc[e] = 0.0f;
  }
  s.max = MinusInf();
  s.sum = 0.0f;
}

// One head's scores and running max for the U keys whose bits are set in `enters` (key_of(u): the key's index in the
// sequence) and whose dot products dots[0..U) holds: the scores finished in place (tile head qi), the running max
// raised once and the sums rescaled to it. Returns the new max; each key's weight is then KeyWeight(score, max).
template <int64_t U, class T1, class Mem, class KeyOf>
KV_HD float DecodeRaiseMax(const AttnParams& p, Mem& mem, const DecodeBlock& d, int64_t qi, int32_t enters,
                           float* dots, float& max, float& sum, float (&acc)[kVec], KeyOf&& key_of) {
  float top = MinusInf();
  KV_UNROLL
  for (int64_t u = 0; u < U; ++u) {
    if (!(enters >> u & 1)) continue;
    const int64_t j = key_of(u);
    dots[u] = ScoreOf<T1>(p, mem, dots[u], d.tile.head0 + qi, d.token, d.seq.col0 + j, j - d.position);
    top = MaxStep(top, dots[u]);
  }
  const float m = MaxStep(max, top);
  const float f = RescaleFactor(max, m);  // 0 after -inf; NaN for a NaN max
  if (f != 1.0f) {
    KV_UNROLL
    for (int64_t e = 0; e < kVec; ++e) acc[e] *= f;
    sum *= f;
  }
  max = m;
  return m;
}

// A key's weight under the running max m: nothing but -inf so far gives weight 0, which still lets a non-finite
// value through.
KV_HD float KeyWeight(float score, float m) { return m == MinusInf() ? 0.0f : expf(score - m); }

// The values step of thread t for the U keys of its step whose bits are set in s.enters and whose dot products s.dots
// holds: the scores and running max (DecodeRaiseMax), then each key's weight times its value slice added
// (add_value(u, w, s.acc): acc[e] += w x element e of key u's value slice, one key's slice at a time in registers).
template <int64_t U, class T1, class Mem, class State, class KeyOf, class AddValue>
KV_HD void DecodeAddKeys(const AttnParams& p, Mem& mem, const DecodeBlock& d, int64_t t, State& s, KeyOf&& key_of,
                         AddValue&& add_value) {
  if (s.enters == 0) return;  // no key this step (or a head past the tile's): nothing changes
  const float m = DecodeRaiseMax<U, T1>(p, mem, d, d.HeadOf(t), s.enters, s.dots, s.max, s.sum, s.acc, key_of);
  KV_UNROLL
  for (int64_t u = 0; u < U; ++u) {
    if (!(s.enters >> u & 1)) continue;
    const float w = KeyWeight(s.dots[u], m);
    add_value(u, w, s.acc);
    s.sum += w;
  }
}

// The block's parts in shared memory from word 0, [group][head][max, weight sum, output sums]: word k (0 max,
// 1 weight sum, 2 + e output sum e) of group z's part of head qi.
KV_HD int64_t DecodePartWord(int64_t head_dim, int64_t z, int64_t qi, int64_t k) {
  return (z * kDecodeHeads + qi) * (head_dim + 2) + k;
}

// The block's end, once every group's parts are in shared memory (DecodePartWord): the groups combined by
// log-sum-exp give the output rows or, for a split key range, the part's records.
template <class T1, int64_t Threads, class Team, class Mem>
KV_HD void DecodeCombine(const AttnParams& p, Mem& mem, Team& team, const DecodeBlock& d) {
  using T = typename T1::Storage;
  const int64_t D = p.head_dim, Q = d.tile.heads, groups = d.groups;
  team.Each([&](int64_t t, auto&) {  // the groups combined: the output rows, or the part's records
    for (int64_t i = t; i < Q * D; i += Threads) {
      const int64_t qi = i / D, dd = i % D;
      const Combined c = CombineParts(groups, [&](int64_t k, int64_t field) {
        return SharedAt(mem, DecodePartWord(D, k, qi, field < 2 ? field : 2 + dd));
      });
      if (d.tile.partial >= 0) {
        const int64_t record = (d.tile.partial + qi) * (D + 2);
        if (dd == 0) {
          mem.template Store<float>(kAPartials, 4 * record, c.top);
          mem.template Store<float>(kAPartials, 4 * (record + 1), c.total);
        }
        mem.template Store<float>(kAPartials, 4 * (record + 2 + dd), c.acc);
        continue;
      }
      const int64_t at = (d.token * p.num_heads + d.tile.head0 + qi) * D + dd;
      mem.template Store<T>(kAOut, at * int64_t(sizeof(T)), SaturatingFromFloat<T1>(c.Output()));
    }
  });
}

// The block's end: each head row leaves its part in shared memory (DecodePartWord), and the groups combined by
// log-sum-exp give the output rows or, for a split key range, the part's records. Shared memory from word 0 must be
// free for it (no copy in flight to it).
template <class T1, int64_t Threads, class Team, class Mem>
KV_HD void DecodeFinish(const AttnParams& p, Mem& mem, Team& team, const DecodeBlock& d) {
  const int64_t D = p.head_dim, Q = d.tile.heads;
  team.Each([&](int64_t t, auto& s) {
    const int64_t x = d.LaneOf(t), qi = d.HeadOf(t), z = d.GroupOf(t);
    if (qi >= Q) return;
    if (x == 0) {
      SharedPut(mem, DecodePartWord(D, z, qi, 0), s.max);
      SharedPut(mem, DecodePartWord(D, z, qi, 1), s.sum);
    }
    KV_UNROLL
    for (int64_t e = 0; e < kVec; ++e) SharedPut(mem, DecodePartWord(D, z, qi, 2 + x * kVec + e), s.acc[e]);
  });
  team.Sync();
  DecodeCombine<T1, Threads>(p, mem, team, d);
}

// Everything decode block `tile_index` (tile p.tiles + tile_index of kATiles) does, over its kDecodeThreads threads.
template <class T1, class Rows, class Team, class Mem>
KV_HD void DecodeTile(const AttnParams& p, const Rows& rows_of, Mem& mem, Team& team, int64_t tile_index) {
  constexpr int64_t U = kDecodeUnroll;
  const DecodeBlock d = DecodeBlockAt(p, mem, tile_index, kDecodeThreads);
  const int64_t key0 = d.tile.key0, key1 = d.tile.key1, groups = d.groups;
  // The key of thread t's group's step `step`, slot u.
  auto key_of = [&](int64_t step, int64_t t, int64_t u) { return key0 + (step * groups + d.GroupOf(t)) * U + u; };

  team.Each([&](int64_t t, DecodeThread& s) { DecodeStart<T1>(p, mem, d, t, s); });

  const int64_t steps = (key1 - key0 + groups * U - 1) / (groups * U);
  for (int64_t step = 0; step < steps; ++step) {
    team.Each([&](int64_t t, DecodeThread& s) {  // load: key and value slices, the parts of the dot products
      const int64_t d0 = d.LaneOf(t) * kVec;
      float k[U][kVec];
      s.enters = 0;
      KV_UNROLL
      for (int64_t u = 0; u < U; ++u) {
        const int64_t j = key_of(step, t, u);
        if (d.HeadOf(t) < d.tile.heads && j < key1 && j >= d.lo && j < d.hi) {
          s.enters |= 1 << u;
          const int64_t where = rows_of.Where(p, mem, d.tile.b, d.seq.col0, j);
          rows_of.Load(p, mem, 0, rows_of.At(p, 0, d.g, where), d0, kVec, k[u]);
          rows_of.Load(p, mem, 1, rows_of.At(p, 1, d.g, where), d0, kVec, s.v[u]);
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
    team.Butterfly(1, d.lanes, [](DecodeThread& s) -> auto& { return s.dots; }, AddOp{});
    team.Each([&](int64_t t, DecodeThread& s) {  // values: scores, the running max, the weights times the values
      DecodeAddKeys<U, T1>(
          p, mem, d, t, s, [&](int64_t u) { return key_of(step, t, u); },
          [&](int64_t u, float w, float(&acc)[kVec]) {
            KV_UNROLL
            for (int64_t e = 0; e < kVec; ++e) acc[e] += w * s.v[u][e];
          });
    });
  }
  DecodeFinish<T1, kDecodeThreads>(p, mem, team, d);
}

}  // namespace cuda
}  // namespace kvcache
