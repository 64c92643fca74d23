// The staged decode kernel: the decode tiles (one query row, up to kDecodeHeads heads of one kv head, a range of
// keys) where the key and value rows are stored as T1 of two bytes (float16 / bfloat16: packed, or an
// unquantized cache), or as int8 / int4 codes with a scale per quant_group elements, in rows of whole 16-byte chunks,
// 16-byte aligned.
//
// Decode reads every key and value row once: its speed is the bytes it keeps in flight per multiprocessor. The first
// form (attention_decode.h) holds its reads in registers (four key and four value slices per lane), so the bytes in
// flight are bounded by registers, and each of the tile's head rows finds the same rows again (where they lie, the
// loads). Here the block copies its keys' rows into shared memory with asynchronous copies (cp.async: the copy in
// flight holds no register), S - 1 stages of a ring of S in flight at once, and every head row reads the staged
// rows from shared memory (lanes of a row contiguous, the tile's head rows the same bytes: broadcasts). Codes are
// dequantized where they are read, in registers: a stage of codes is a half (int8) or a quarter (int4) of a stage of
// float16 rows, so the ring of the same shared memory has more stages (S = StagedStages(QBits): 4, 5 or 8).
//
// A stage holds C = kStagedStageBytes / (2 Dh) consecutive keys of the tile: their key rows, then their value rows,
// then (quantized) the key rows' scales and the value rows' scales, each row whole chunks of 16 bytes. The block's
// threads are head rows as in the first form (lane x of head y in key group z); key group z takes the stage's keys
// u groups + z (u < kStagedKeysPerGroup). A stage:
//   wait    the stage's copies landed (team.WaitSync<S - 2>: this thread's older copy groups done,
//           then the block's barrier, so every thread's copies are seen);
//   issue   the copies of the stage S - 1 ahead, into the slot the previous stage read (every thread
//           passed the barrier, so none reads it any more), then team.Commit() closes the group (one per stage,
//           empty past the last, so the count of groups stays the same for every thread);
//   dots    each lane dots its query slice with its slices of its group's staged key rows (codes times their
//           group's scale, rounded to T1 exactly as KeyValueCache's gather gives them); the row's lanes add
//           their parts (team.Butterfly);
//   values  as the first form (DecodeAddKeys): scores, the running max, each key's weight times its staged value
//           slice added.
// A key the query does not see is never copied and never read. After the last stage, with no copy in flight, the
// groups' parts go where the stages were and are combined as in the first form (DecodeFinish).
//
// team.CopyAsync16(mem, shared_byte, buffer, byte) (in Each: this thread's copy of 16 bytes), team.Commit() and
// team.WaitSync<N>() (every thread) are the cooperation beyond the first form's: on the GPU cp.async.cg,
// cp.async.commit_group and cp.async.wait_group N then __syncthreads; on the host runner the copies of a group are
// made at the wait that covers them, and a read or write of a byte a copy in flight targets is reported as a race.
#pragma once

#include <cstdint>

#include "attention_decode.h"

namespace kvcache {
namespace cuda {

// A staged decode thread's registers: its head's query slice, its slice of the output sums, the row's running max
// and weight sum, and a stage's dot products (then scores) of its group's keys.
struct StagedThread {
  float q[kVec];
  float acc[kVec];
  float max, sum;
  float dots[kStagedKeysPerGroup];
  int32_t enters;  // bit u: the stage's key u of the group is one the query sees
};

// Whether the staged decode kernel is built for these rows: float16 / bfloat16 as stored, or codes (StagedRowsFit
// then says whether a call's rows fit it).
template <class T1, class Rows>
constexpr bool kStagedRows = Rows::kQBits != 0 || (sizeof(typename T1::Storage) == 2 && Rows::kStoredAsT1);

// Lane x's eight elements of a staged row, each given to each(e, value) in element order: float16 / bfloat16 as
// stored (16 bytes at x 16), or codes (8 or 4 bytes at x times that) times their group's staged scale, rounded to
// T1 exactly as KeyValueCache's gather gives them. Staged rows are whole 16-byte chunks, so every read is aligned for
// its width. (Each element is handed on as it is made: a caller's sums then hold no converted row in registers.)
template <class T1, class Rows, class Mem, class Each>
KV_HD void StagedRow(const AttnParams& p, Mem& mem, int64_t row_byte, int64_t scale_byte, int64_t x, Each&& each) {
  constexpr int QBits = Rows::kQBits;
  if constexpr (QBits == 0) {
    using T = typename T1::Storage;
    const Vec16 w = mem.template Load<Vec16>(kAShared, row_byte + 16 * x);
    KV_UNROLL
    for (int i = 0; i < 4; ++i) {
      each(2 * i, ElemToFloat<T1>(static_cast<T>(w.w[i] & 0xffffu)));
      each(2 * i + 1, ElemToFloat<T1>(static_cast<T>(w.w[i] >> 16)));
    }
  } else {
    using S = typename Rows::Scale::Storage;
    // Element x kVec's group (head_dim and quant_group fit 32 bits: the cheaper division).
    const int32_t group = static_cast<int32_t>(x * kVec) / static_cast<int32_t>(p.quant_group);
    const float scale = Rows::Scale::ToFloat(mem.template Load<S>(kAShared, scale_byte + group * int64_t(sizeof(S))));
    const int64_t at = row_byte + x * kVec * QBits / 8;
    uint64_t word;
    if constexpr (QBits == 8)
      word = mem.template Load<uint64_t>(kAShared, at);
    else
      word = mem.template Load<uint32_t>(kAShared, at);
    float v[kVec];
    DequantizeEight<QBits, T1>(word, scale, v);
    KV_UNROLL
    for (int e = 0; e < kVec; ++e) each(e, v[e]);
  }
}

// A staged decode block's ring of S stages (StagedDecodeTile's and StagedHeadsTile's): the keys the block reads,
// where each stage's rows and scales lie in shared memory, and Issue(stage): every thread's copies of that stage.
template <class T1, class Rows>
struct StagedRing {
  static constexpr int QBits = Rows::kQBits;
  static constexpr int64_t S = StagedStages(QBits);
  // A row's bytes (D x 16 or QBits bits), a stage's rows of one kind (C rows: a constant, C x D being) and their
  // 16-byte chunks; the same of the scales (none unquantized). Chunk counts are powers of two: shifts and masks.
  static constexpr int64_t kRowsBytes = StagedRowBytes(QBits), kRowsChunks = kRowsBytes / 16;
  // A row's chunks (1 << row_bits): a lane's 16 bytes of float16, or 16 bytes of codes for 2 (int8) or 4 (int4) lanes.
  static constexpr int kLanesPerChunkBits = QBits == 8 ? 1 : QBits == 4 ? 2 : 0;
  static constexpr int64_t kMostChunks = 2 * (kRowsBytes + StagedScaleBytesMost(QBits)) / 16;
  const AttnParams& p;
  const Rows& rows_of;
  const DecodeBlock& d;
  int64_t C, row_bytes, scale_row_bytes, stage_bytes, first, last, stages;
  int row_bits, scale_bits;
  int32_t scale_chunks;

  KV_HD StagedRing(const AttnParams& params, const Rows& rows, const DecodeBlock& block)
      : p(params), rows_of(rows), d(block) {
    const int64_t D = p.head_dim;
    C = kStagedStageBytes / (2 * D);
    row_bytes = D * (QBits ? QBits : 16) / 8;
    scale_row_bytes = QBits ? D / p.quant_group * int64_t(sizeof(typename Rows::Scale::Storage)) : 0;
    stage_bytes = 2 * (kRowsBytes + (QBits ? C * scale_row_bytes : 0));
    int lane_bits = 0;
    scale_bits = 0;
    while ((int64_t{1} << lane_bits) < d.lanes) ++lane_bits;
    row_bits = lane_bits - kLanesPerChunkBits;
    while (QBits && (int64_t{16} << scale_bits) < scale_row_bytes) ++scale_bits;
    // The keys a block reads: the tile's, within what the query sees (lo <= key0 and key1 <= hi for planned tiles;
    // kept as a bound, not assumed).
    first = d.tile.key0 > d.lo ? d.tile.key0 : d.lo;
    last = d.tile.key1 < d.hi ? d.tile.key1 : d.hi;
    stages = last > first ? (last - first + C - 1) / C : 0;
    scale_chunks = QBits ? int32_t(2 * C) << scale_bits : 0;
  }
  // Byte offsets in shared memory of stage `stage`'s row `k` (key or value: kv) and of its scales.
  KV_HD int64_t RowAt(int64_t stage, int kv, int64_t k) const {
    return (stage % S) * stage_bytes + kv * kRowsBytes + k * row_bytes;
  }
  KV_HD int64_t ScalesAt(int64_t stage, int kv, int64_t k) const {
    return (stage % S) * stage_bytes + 2 * kRowsBytes + (kv * C + k) * scale_row_bytes;
  }
  // This thread's copies of stage `stage` (nothing past the last): of its chunks, chunk i is (rows before scales, kv,
  // key, chunk) in that order.
  template <class Mem, class Team>
  KV_HD void Issue(Mem& mem, Team& team, int64_t stage) const {
    if (stage >= stages) return;
    team.Each([&](int64_t t, auto&) {
      KV_UNROLL
      for (int64_t n = 0; n < (kMostChunks + kStagedThreads - 1) / kStagedThreads; ++n) {
        const int32_t i = static_cast<int32_t>(t + n * kStagedThreads);
        const bool scales = QBits != 0 && i >= 2 * kRowsChunks;
        if (scales && i - 2 * kRowsChunks >= scale_chunks) continue;
        int kv;
        int32_t k, x;
        if (!scales) {
          kv = i >= kRowsChunks ? 1 : 0;
          const int32_t within = i & int32_t(kRowsChunks - 1);
          k = within >> row_bits;
          // (The mask from d.lanes: written from row_bits, the float16 kernel spilled 16-36 bytes at 80 registers.)
          x = within & int32_t((d.lanes >> kLanesPerChunkBits) - 1);
        } else {
          const int32_t key = (i - int32_t(2 * kRowsChunks)) >> scale_bits;
          kv = key >= C ? 1 : 0;
          k = key - kv * int32_t(C);
          x = (i - int32_t(2 * kRowsChunks)) & ((1 << scale_bits) - 1);
        }
        const int64_t j = first + stage * C + k;
        if (j >= last) continue;
        const cuda::RowAt r = rows_of.At(p, kv, d.g, rows_of.Where(p, mem, d.tile.b, d.seq.col0, j));
        if (scales) {
          team.CopyAsync16(mem, ScalesAt(stage, kv, k) + 16 * x, kAScale,
                           r.scale * int64_t(sizeof(typename Rows::Scale::Storage)) + 16 * x);
        } else {
          const int64_t byte = QBits ? r.elem * QBits / 8 : r.elem * int64_t(sizeof(typename T1::Storage));
          team.CopyAsync16(mem, RowAt(stage, kv, k) + 16 * x, rows_of.BufferOf(kv), byte + 16 * x);
        }
      }
    });
  }
  // The block's walk over its stages: S - 1 stages' copies in flight before the first, then for each stage: wait for
  // its copies (this thread's older groups, then the barrier), issue those of the stage S - 1 ahead into the slot the
  // previous stage read (every thread passed the barrier: none reads it any more), and step(stage). After the last,
  // no copy is in flight (the groups past the last stage are empty), so shared memory is free for the parts.
  template <class Mem, class Team, class Step>
  KV_HD void Walk(Mem& mem, Team& team, Step&& step) const {
    for (int64_t stage = 0; stage < S - 1; ++stage) {
      Issue(mem, team, stage);
      team.Commit();
    }
    for (int64_t stage = 0; stage < stages; ++stage) {
      team.template WaitSync<S - 2>();
      Issue(mem, team, stage + S - 1);
      team.Commit();
      step(stage);
    }
    team.template WaitSync<0>();
  }
};

// Everything staged decode block `tile_index` (tile p.tiles + tile_index of kATiles) does, over its
// kStagedThreads threads. Rows must fit the kernel (the planner's StagedRowsFit): float16 / bfloat16 as stored, or
// codes whose rows and scale rows are whole 16-byte chunks, all 16-byte aligned.
template <class T1, class Rows, class Team, class Mem>
KV_HD void StagedDecodeTile(const AttnParams& p, const Rows& rows_of, Mem& mem, Team& team, int64_t tile_index) {
  static_assert(kStagedRows<T1, Rows>, "staged rows are float16 / bfloat16 as stored, or codes");
  constexpr int64_t U = kStagedKeysPerGroup;
  const DecodeBlock d = DecodeBlockAt(p, mem, tile_index, kStagedThreads);
  const StagedRing<T1, Rows> ring(p, rows_of, d);
  const int64_t C = ring.C, first = ring.first, last = ring.last;

  team.Each([&](int64_t t, StagedThread& s) { DecodeStart<T1>(p, mem, d, t, s); });
  ring.Walk(mem, team, [&](int64_t stage) {
    // The stage's key k of thread t's group for its slot u, and whether the thread's query sees it.
    // (Groups interleaved: the groups of one warp, at small Dh, read adjacent rows, not rows U apart in one bank.)
    auto key_in_stage = [&](int64_t t, int64_t u) { return u * d.groups + d.GroupOf(t); };
    team.Each([&](int64_t t, StagedThread& s) {  // dots: this lane's parts of its group's keys
      const int64_t x = d.LaneOf(t);
      s.enters = 0;
      KV_UNROLL
      for (int64_t u = 0; u < U; ++u) {
        const int64_t k = key_in_stage(t, u), j = first + stage * C + k;
        float dot = 0.0f;
        if (d.HeadOf(t) < d.tile.heads && k < C && j < last) {
          s.enters |= 1 << u;
          StagedRow<T1, Rows>(p, mem, ring.RowAt(stage, 0, k), ring.ScalesAt(stage, 0, k), x,
                              [&](int e, float key) { dot += s.q[e] * key; });
        }
        s.dots[u] = dot;
      }
    });
    team.Butterfly(1, d.lanes, [](StagedThread& s) -> auto& { return s.dots; }, AddOp{});
    team.Each([&](int64_t t, StagedThread& s) {  // values: scores, the running max, weights times staged values
      const int64_t x = d.LaneOf(t);
      DecodeAddKeys<U, T1>(
          p, mem, d, t, s, [&](int64_t u) { return first + stage * C + key_in_stage(t, u); },
          [&](int64_t u, float w, float(&acc)[kVec]) {
            const int64_t k = key_in_stage(t, u);
            StagedRow<T1, Rows>(p, mem, ring.RowAt(stage, 1, k), ring.ScalesAt(stage, 1, k), x,
                                [&](int e, float value) { acc[e] += w * value; });
          });
    });
  });
  DecodeFinish<T1, kStagedThreads>(p, mem, team, d);
}

// The staged decode kernel's second form (KVCACHE_OP_CUDA_DECODE_KERNEL=3): the same ring of stages, but a thread
// holds every head of its tile (kDecodeHeads query slices and output sums), so a staged key or value slice is read and
// converted (or dequantized) once and multiplied into each head's sums, where the first form's kDecodeHeads head rows
// each read and convert it again. The block's threads are key groups of one row of lanes each (kStagedThreads / lanes
// groups, kStagedHeadsKeys keys of a stage apiece); a lane's dot products of its keys for every head are summed over
// the row in one butterfly, as many values as the first form's.
constexpr int64_t kStagedHeadsKeys = kStagedKeysPerGroup / kDecodeHeads;
static_assert(kStagedHeadsKeys == 2, "a group's keys of a stage, when a group is one row of lanes");

struct StagedHeadsThread {
  float q[kDecodeHeads][kVec];
  float acc[kDecodeHeads][kVec];
  float max[kDecodeHeads], sum[kDecodeHeads];
  float dots[kDecodeHeads * kStagedHeadsKeys];  // [head][key]: dot products, then scores, then weights
  int32_t enters;                                // bit u: the stage's key u of the group is one the query sees
};

// Everything block `tile_index` of the second form does, over its kStagedThreads threads (rows as StagedDecodeTile).
// Per stage and head, the online softmax is DecodeAddKeys' step, in the same order over the group's keys.
template <class T1, class Rows, class Team, class Mem>
KV_HD void StagedHeadsTile(const AttnParams& p, const Rows& rows_of, Mem& mem, Team& team, int64_t tile_index) {
  using T = typename T1::Storage;
  static_assert(kStagedRows<T1, Rows>, "staged rows are float16 / bfloat16 as stored, or codes");
  constexpr int64_t U = kStagedHeadsKeys, HQ = kDecodeHeads;
  DecodeBlock d = DecodeBlockAt(p, mem, tile_index, kStagedThreads);
  d.groups = kStagedThreads / d.lanes;  // a group is one row of lanes (DecodeCombine combines d.groups parts)
  const StagedRing<T1, Rows> ring(p, rows_of, d);
  const int64_t C = ring.C, first = ring.first, last = ring.last, Q = d.tile.heads, D = p.head_dim;
  auto group_of = [&](int64_t t) { return t / d.lanes; };
  // The stage's key of thread t's group for its slot u (groups interleaved, as in the first form).
  auto key_in_stage = [&](int64_t t, int64_t u) { return u * d.groups + group_of(t); };

  team.Each([&](int64_t t, StagedHeadsThread& s) {  // every head's query slice (0 past the tile's), zero sums
    const int64_t d0 = d.LaneOf(t) * kVec;
    KV_UNROLL
    for (int64_t h = 0; h < HQ; ++h) {
      KV_UNROLL
      for (int64_t e = 0; e < kVec; ++e) {
        const int64_t at = (d.token * p.num_heads + d.tile.head0 + h) * D + d0 + e;
        s.q[h][e] = h < Q ? ElemToFloat<T1>(mem.template Load<T>(kAQuery, at * int64_t(sizeof(T)))) : 0.0f;
        s.acc[h][e] = 0.0f;
      }
      s.max[h] = MinusInf();
      s.sum[h] = 0.0f;
    }
  });
  ring.Walk(mem, team, [&](int64_t stage) {
    team.Each([&](int64_t t, StagedHeadsThread& s) {  // dots: this lane's parts of its group's keys, every head
      const int64_t x = d.LaneOf(t);
      s.enters = 0;
      KV_UNROLL
      for (int64_t u = 0; u < U; ++u) {
        const int64_t k = key_in_stage(t, u), j = first + stage * C + k;
        KV_UNROLL
        for (int64_t h = 0; h < HQ; ++h) s.dots[h * U + u] = 0.0f;
        if (k < C && j < last) {
          s.enters |= 1 << u;
          StagedRow<T1, Rows>(p, mem, ring.RowAt(stage, 0, k), ring.ScalesAt(stage, 0, k), x, [&](int e, float key) {
            KV_UNROLL
            for (int64_t h = 0; h < HQ; ++h) s.dots[h * U + u] += s.q[h][e] * key;
          });
        }
      }
    });
    team.Butterfly(1, d.lanes, [](StagedHeadsThread& s) -> auto& { return s.dots; }, AddOp{});
    // values: each head's scores, running max and weights (in place of the dot products), then the values
    team.Each([&](int64_t t, StagedHeadsThread& s) {
      if (s.enters == 0) return;
      const int64_t x = d.LaneOf(t);
      KV_UNROLL
      for (int64_t h = 0; h < HQ; ++h) {
        if (h >= Q) continue;
        float* dots = s.dots + h * U;
        const float m = DecodeRaiseMax<U, T1>(p, mem, d, h, s.enters, dots, s.max[h], s.sum[h], s.acc[h],
                                              [&](int64_t u) { return first + stage * C + key_in_stage(t, u); });
        KV_UNROLL
        for (int64_t u = 0; u < U; ++u) {
          if (!(s.enters >> u & 1)) continue;
          dots[u] = KeyWeight(dots[u], m);  // the weight in place of the score
          s.sum[h] += dots[u];
        }
      }
      KV_UNROLL
      for (int64_t u = 0; u < U; ++u) {
        if (!(s.enters >> u & 1)) continue;
        const int64_t k = key_in_stage(t, u);
        StagedRow<T1, Rows>(p, mem, ring.RowAt(stage, 1, k), ring.ScalesAt(stage, 1, k), x, [&](int e, float value) {
          KV_UNROLL
          for (int64_t h = 0; h < HQ; ++h)
            if (h < Q) s.acc[h][e] += s.dots[h * U + u] * value;
        });
      }
    });
  });
  team.Each([&](int64_t t, StagedHeadsThread& s) {  // the parts, [group][head], as DecodeFinish leaves them
    const int64_t x = d.LaneOf(t), z = group_of(t);
    KV_UNROLL
    for (int64_t h = 0; h < HQ; ++h) {
      if (h >= Q) continue;
      if (x == 0) {
        SharedPut(mem, DecodePartWord(D, z, h, 0), s.max[h]);
        SharedPut(mem, DecodePartWord(D, z, h, 1), s.sum[h]);
      }
      KV_UNROLL
      for (int64_t e = 0; e < kVec; ++e) SharedPut(mem, DecodePartWord(D, z, h, 2 + x * kVec + e), s.acc[h][e]);
    }
  });
  team.Sync();
  DecodeCombine<T1, kStagedThreads>(p, mem, team, d);
}

}  // namespace cuda
}  // namespace kvcache
