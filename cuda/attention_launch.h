// What one attention launch (MultiHeadAttention or MultiHeadCacheAttention on CUDA) works on: its buffers, its
// parameters, and the tiles its blocks take. Shared by the kernels (attention_work.h), the host that plans the
// tiles (attention_params.h) and the host runner (tests/host_runner).
#pragma once

#include <cstdint>

#include "kv_cache_launch.h"
#include "kv_types.h"

namespace kvcache {
namespace cuda {

// The buffers of one attention call. Offsets passed to Mem are bytes from a buffer's base.
enum ABuf : int {
  kAQuery,     // T1 [tokens, H, Dh]
  kAKey,       // T1 [kv_tokens, Hkv, Dh] (MultiHeadAttention's packed keys)
  kAValue,     // T1 [kv_tokens, Hkv, Dh]
  kACache,     // MultiHeadCacheAttention's cache (rank 5 by layout: T1, int8 or packed int4)
  kAScale,     // its scales (T3), absent without quantization
  kAMask,      // T1 attn_mask [H, tokens, M] or [tokens, M]; absent when not given
  kAOut,       // T1 [tokens, H, Dh]
  kAIndex,     // int64: seqstarts [B+1], kvstarts [B+1], causal [B], cachestarts, ALiBi slopes (float bits) [H]
  kATiles,     // int64: the tiles, then the merges (Tile / Merge records)
  kAPartials,  // float32: each split part's (max, sum, output) per query vector
  kAShared,    // the block's shared memory (float32 words)
  kABufCount
};

// Threads of every attention block, and keys per chunk (one key per thread in the score phase).
constexpr int64_t kAttnThreads = 256;
// At most this many query vectors (rows x heads of one kv head) per tile.
constexpr int64_t kMaxTileQueries = 16;
// Elements of a row one thread holds in the value phase (a 16-byte load of float16).
constexpr int64_t kSliceElems = kVec;
// Query vectors a value-phase thread accumulates side by side (its registers: kVectorGroup x kSliceElems sums).
constexpr int64_t kVectorGroup = 4;
// The widest head the kernels run: one query vector's slices must fit in a block's threads.
constexpr int64_t kMaxCudaHeadDim = kAttnThreads * kSliceElems;

// The decode kernel (attention_decode.h) takes the tiles of one query row (sequences of one token): up to
// kDecodeHeads heads of one kv head per block of kDecodeThreads threads. A row of Dh / kVec lanes (kVec elements
// each: one 16-byte load of float16) serves one head, so head_dim must be kVec times a power of two, at most
// kWarp * kVec; the block's kDecodeThreads / (kDecodeHeads x lanes) groups of head rows walk different keys, each
// lane kDecodeUnroll key and value rows in flight.
constexpr int64_t kWarp = 32;
constexpr int64_t kDecodeThreads = 128;
constexpr int64_t kDecodeHeads = 4;
constexpr int64_t kDecodeUnroll = 4;
KV_HD bool DecodeKernelFits(int64_t head_dim) {
  const int64_t lanes = head_dim / kVec;
  return head_dim % kVec == 0 && lanes >= 1 && lanes <= kWarp && (lanes & (lanes - 1)) == 0;
}

// The staged decode kernel (attention_decode_staged.h) takes the same tiles where the key and value rows are
// float16 / bfloat16 as stored (packed, or an unquantized cache), or int8 / int4 codes with their scales, in rows of
// whole 16-byte chunks, 16-byte aligned: the block copies its keys' rows into a ring of stages in shared memory
// (cp.async: the copies in flight hold no registers). A stage holds kStagedStageBytes / (2 Dh) keys whatever Dh is
// (so every key group of the block takes kStagedKeysPerGroup keys of a stage): their key rows, their value rows and,
// quantized, the key rows' scales and the value rows' scales. Float16 rows fill kStagedStageBytes a kind; codes a
// half or a quarter of that, so a quantized ring has more stages in the same shared memory (StagedStages).
constexpr int64_t kStagedThreads = 128;
constexpr int64_t kStagedStageBytes = 4096;  // one stage's key rows of float16 (its value rows as many again)
constexpr int64_t kStagedKeysPerGroup = kStagedStageBytes / 2 / kVec * kDecodeHeads / kStagedThreads;
constexpr int64_t kStagedSharedWords = 4 * 2 * kStagedStageBytes / 4;  // four stages of float16 rows
static_assert(kStagedKeysPerGroup == 8, "a key group's keys of a stage: the dots each lane sums in one butterfly");
// The bytes of one stage's rows of one kind (key or value): codes of `qbits` (0: float16 / bfloat16 as stored), and
// at most of their scales (one float32 a group of kVec elements, the smallest group the kernel takes).
KV_HD constexpr int64_t StagedRowBytes(int qbits) { return qbits ? kStagedStageBytes * qbits / 16 : kStagedStageBytes; }
KV_HD constexpr int64_t StagedScaleBytesMost(int qbits) { return qbits ? kStagedStageBytes / 2 / kVec * 4 : 0; }
// The stages of the ring: as many as the shared memory holds (4 of float16 rows, 5 of int8, 8 of int4).
KV_HD constexpr int64_t StagedStages(int qbits) {
  return kStagedSharedWords * 4 / (2 * (StagedRowBytes(qbits) + StagedScaleBytesMost(qbits)));
}
static_assert(StagedStages(0) == 4 && StagedStages(8) == 5 && StagedStages(4) == 8, "the rings as documented");

// The tensor-core tile kernel (attention_mma.h) takes the tiles of longer sequences (prefill, chunks) where T1 is
// float16 or bfloat16: kMmaQueries query vectors (rows x heads of one kv head) per block of kMmaThreads threads, a
// warp's kMmaWarpRows of them one fragment of the matrix products, kMmaKeys keys per chunk staged in shared memory;
// head_dim a multiple of kMmaFrag, at most kMmaMaxHeadDim.
constexpr int64_t kMmaThreads = 128;
constexpr int64_t kMmaFrag = 16;  // the products' fragment side (m16n16k16)
constexpr int64_t kMmaWarpRows = kMmaFrag;
constexpr int64_t kMmaQueries = kMmaThreads / kWarp * kMmaWarpRows;
constexpr int64_t kMmaKeys = 64;
constexpr int64_t kMmaMaxHeadDim = 128;
KV_HD bool MmaKernelFits(int64_t head_dim) {
  return head_dim % kMmaFrag == 0 && head_dim >= kMmaFrag && head_dim <= kMmaMaxHeadDim;
}

// One block's work: query rows [row0, row0 + rows) of sequence b (row indices within the sequence), query heads
// [head0, head0 + heads) (all of one kv head), over keys [key0, key1) of the sequence. partial < 0: the block writes
// the output; else its results go to partial record `partial` and a merge combines the parts.
struct Tile {
  int64_t b, row0, rows, head0, heads, key0, key1, partial;
};
constexpr int64_t kTileWords = 8;

// One merge: the parts' records [first, first + parts) of the same query vectors (b, row0, rows, head0, heads).
struct Merge {
  int64_t b, row0, rows, head0, heads, first, parts, unused;
};
constexpr int64_t kMergeWords = 8;

struct AttnParams {
  // attention attributes
  int64_t num_heads, head_dim, kv_heads, group, sliding_window;
  float scale, softcap;
  int64_t alibi;
  int64_t mask_rank, mask_cols, tokens;  // mask_rank 0: no attn_mask
  // the call
  int64_t batch;
  int64_t tiles, decode_tiles, mma_tiles, merges;  // in kATiles: the tile kernel's tiles, the decode kernel's, the
                                                    // tensor-core kernel's, the merges
  int64_t slices;         // ceil(head_dim / kSliceElems)
  int64_t mma_form;       // the tensor-core tiles' kernel: 1 attention_mma.h, 2 attention_mma_regs.h
  int64_t decode_form;    // the decode tiles' kernel: 1 attention_decode.h, 2 attention_decode_staged.h (3: its
                          // second form, every head in a thread's registers)
  // MultiHeadCacheAttention's cache (unused by MultiHeadAttention)
  int64_t layer_idx, quant_group, cache_mode, page_size, max_p;
  Rows cache_rows, scale_rows;
  bool vector_rows;  // 8 elements of a row (and of a quantization group) load as one access: Dh % 8 == 0,
                     // quant_group % 8 == 0 and every buffer 16-byte aligned
  void* ptr[kABufCount];
};

// Word offsets of the index arrays in kAIndex.
KV_HD int64_t KvstartsAt(const AttnParams& p) { return p.batch + 1; }
KV_HD int64_t CausalAt(const AttnParams& p) { return 2 * (p.batch + 1); }
KV_HD int64_t CachestartsAt(const AttnParams& p) { return 3 * p.batch + 2; }
KV_HD int64_t SlopesAt(const AttnParams& p) {
  return CachestartsAt(p) + (p.cache_mode == 1 ? p.batch * p.max_p : p.batch);
}

// The query vectors of a tile the value phase can hold side by side: kAttnThreads / slices, at most
// kMaxTileQueries.
KV_HD int64_t TileQueries(int64_t slices) {
  const int64_t fit = kAttnThreads / slices;
  return fit < kMaxTileQueries ? fit : kMaxTileQueries;
}

// Shared memory of a block, in float32 words: the tile's queries [Q][Dh] (Q * Dh <= threads * kSliceElems), the
// chunk's scores [Q][threads] (after the last chunk: the key groups' sums), per query vector the running max and
// this chunk's rescale factor, the max reduction [2 x threads] (after the last chunk: the key groups' weight sums), and
// the chunk's rows (int64 per key: where the score phase found each key's row, for the value phase), and per query
// vector the range of keys it sees (two int64).
constexpr int64_t kSmemQueries = 0;
constexpr int64_t kSmemScores = kSmemQueries + kAttnThreads * kSliceElems;
constexpr int64_t kSmemMax = kSmemScores + kMaxTileQueries * kAttnThreads;
constexpr int64_t kSmemRescale = kSmemMax + kMaxTileQueries;
constexpr int64_t kSmemReduce = kSmemRescale + kMaxTileQueries;
constexpr int64_t kSmemRows = kSmemReduce + 2 * kAttnThreads;  // even: 8-byte aligned
constexpr int64_t kSmemVisible = kSmemRows + 2 * kAttnThreads;  // per query vector its visible keys [lo, hi)
constexpr int64_t kSharedWords = kSmemVisible + 4 * kMaxTileQueries;
static_assert(kSmemRows % 2 == 0 && kSmemScores % 4 == 0, "shared rows 8-byte, queries 16-byte aligned");
// A decode block's shared memory: per key group and head its (max, weight sum, output sums [Dh]). Groups x heads =
// kDecodeThreads / lanes = kDecodeThreads x kVec / Dh, so the words, (kDecodeThreads x kVec / Dh) x (Dh + 2), are
// most at the narrowest head (Dh = kVec).
constexpr int64_t kDecodeSharedWords = kDecodeThreads * (kVec + 2);
static_assert(kDecodeSharedWords <= kSharedWords, "one shared array serves both kernels");
// The staged kernel's second form leaves a part per row of lanes, of all kDecodeHeads heads: most at one lane a row.
static_assert(kStagedThreads * kDecodeHeads * (kVec + 2) <= kStagedSharedWords,
              "the second staged form's parts fit where its stages were");
static_assert(kDecodeThreads == kStagedThreads && kDecodeSharedWords <= kStagedSharedWords,
              "the staged form leaves its groups' parts where its stages were, as the first form does");

}  // namespace cuda
}  // namespace kvcache
