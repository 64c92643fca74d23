// The staged decode kernel: the decode tiles (one query row, up to kDecodeHeads heads of one kv head, a range of
// keys) where the key and value rows are stored as T1 of two bytes (float16 / bfloat16: packed, or an
// unquantized cache) and 16-byte aligned.
//
// Decode reads every key and value row once: its speed is the bytes it keeps in flight per multiprocessor. The first
// form (attention_decode.h) holds its reads in registers (four key and four value slices per lane), so the bytes in
// flight are bounded by registers, and each of the tile's head rows finds the same rows again (where they lie, the
// loads). Here the block copies its keys' rows into shared memory with asynchronous copies (cp.async: the copy in
// flight holds no register), kStagedStages stages of a ring in flight at once, and every head row reads the staged
// rows from shared memory (lanes of a row contiguous, the tile's head rows the same bytes: broadcasts).
//
// A stage holds C = kStagedStageBytes / (2 Dh) consecutive keys of the tile: their key rows, then their value rows,
// each row Dh / kVec chunks of 16 bytes. The block's threads are head rows as in the first form (lane x of head y in
// key group z); key group z takes the stage's keys u groups + z (u < kStagedKeysPerGroup). A stage:
//   wait    the stage's copies landed (team.WaitSync<kStagedStages - 2>: this thread's older copy groups done,
//           then the block's barrier, so every thread's copies are seen);
//   issue   the copies of the stage kStagedStages - 1 ahead, into the slot the previous stage read (every thread
//           passed the barrier, so none reads it any more), then team.Commit() closes the group (one per stage,
//           empty past the last, so the count of groups stays the same for every thread);
//   dots    each lane dots its query slice with its slices of its group's staged key rows; the row's lanes add
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

// Everything staged decode block `tile_index` (tile p.tiles + tile_index of kATiles) does, over its
// kStagedThreads threads. Rows must be stored as T1 of two bytes, 16-byte aligned (the planner's StagedRowsFit).
template <class T1, class Rows, class Team, class Mem>
KV_HD void StagedDecodeTile(const AttnParams& p, const Rows& rows_of, Mem& mem, Team& team, int64_t tile_index) {
  using T = typename T1::Storage;
  static_assert(sizeof(T) == 2 && Rows::kStoredAsT1, "staged rows are float16 / bfloat16 as stored");
  constexpr int64_t U = kStagedKeysPerGroup, S = kStagedStages;
  const DecodeBlock d = DecodeBlockAt(p, mem, tile_index, kStagedThreads);
  const int64_t D = p.head_dim, row_bytes = D * int64_t(sizeof(T)), C = kStagedStageBytes / row_bytes;
  // The keys a block reads: the tile's, within what the query sees (lo <= key0 and key1 <= hi for planned tiles;
  // kept as a bound, not assumed).
  const int64_t first = d.tile.key0 > d.lo ? d.tile.key0 : d.lo, last = d.tile.key1 < d.hi ? d.tile.key1 : d.hi;
  const int64_t stages = last > first ? (last - first + C - 1) / C : 0;
  // Byte offset in shared memory of stage `stage`'s row `k` (key or value: kv) chunk x.
  auto staged_at = [&](int64_t stage, int kv, int64_t k, int64_t x) {
    return ((stage % S) * 2 + kv) * kStagedStageBytes + k * row_bytes + x * 16;
  };
  // This thread's copies of stage `stage`: of its 2 kStagedStageBytes / 16 chunks, chunk i is (kv, key, lane) in
  // that order. Lanes and C are powers of two, so shifts and masks (no division on the GPU's long path).
  int lane_bits = 0;
  while ((int64_t{1} << lane_bits) < d.lanes) ++lane_bits;
  constexpr int64_t kChunksPerKv = kStagedStageBytes / 16;
  auto issue = [&](int64_t stage) {
    if (stage >= stages) return;
    team.Each([&](int64_t t, StagedThread&) {
      KV_UNROLL
      for (int64_t n = 0; n < 2 * kChunksPerKv / kStagedThreads; ++n) {
        const int32_t i = static_cast<int32_t>(t + n * kStagedThreads);
        const int kv = i >= kChunksPerKv ? 1 : 0;
        const int32_t within = i & int32_t(kChunksPerKv - 1), k = within >> lane_bits,
                      x = within & int32_t(d.lanes - 1);
        const int64_t j = first + stage * C + k;
        if (j >= last) continue;
        const RowAt r = rows_of.At(p, kv, d.g, rows_of.Where(p, mem, d.tile.b, d.seq.col0, j));
        team.CopyAsync16(mem, staged_at(stage, kv, k, x), rows_of.BufferOf(kv),
                         (r.elem + x * kVec) * int64_t(sizeof(T)));
      }
    });
  };

  team.Each([&](int64_t t, StagedThread& s) { DecodeStart<T1>(p, mem, d, t, s); });
  for (int64_t stage = 0; stage < S - 1; ++stage) {
    issue(stage);
    team.Commit();
  }
  for (int64_t stage = 0; stage < stages; ++stage) {
    team.template WaitSync<S - 2>();
    issue(stage + S - 1);
    team.Commit();
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
          const Vec16 w = mem.template Load<Vec16>(kAShared, staged_at(stage, 0, k, x));
          KV_UNROLL
          for (int i = 0; i < 4; ++i) {
            dot += s.q[2 * i] * ElemToFloat<T1>(static_cast<T>(w.w[i] & 0xffffu));
            dot += s.q[2 * i + 1] * ElemToFloat<T1>(static_cast<T>(w.w[i] >> 16));
          }
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
            const Vec16 v = mem.template Load<Vec16>(kAShared, staged_at(stage, 1, key_in_stage(t, u), x));
            KV_UNROLL
            for (int i = 0; i < 4; ++i) {
              acc[2 * i] += w * ElemToFloat<T1>(static_cast<T>(v.w[i] & 0xffffu));
              acc[2 * i + 1] += w * ElemToFloat<T1>(static_cast<T>(v.w[i] >> 16));
            }
          });
    });
  }
  team.template WaitSync<0>();  // no copy in flight (the groups past the last stage are empty) before the parts
  DecodeFinish<T1, kStagedThreads>(p, mem, team, d);
}

}  // namespace cuda
}  // namespace kvcache
