// From a validated attention call to the CUDA launch: the tiles and merges planned on the host, the index arrays
// packed for one host-to-device copy, the launch limits checked, the buffers named. Host code without CUDA
// headers, so the host runner plans and launches exactly as the GPU path does.
#pragma once

#include <cstdint>
#include <vector>

#include "attention_launch.h"
#include "kv_validate.h"
#include "mha_validate.h"

namespace kvcache {
namespace cuda {

// How the planner cuts work. Long key ranges of few-query tiles are split (with a merge) until the launch has
// about min_blocks blocks (min_decode_blocks of the decode kernel's), each part keeping at least min_split_keys keys
// (min_decode_split_keys).
struct TilePolicy {
  int64_t min_blocks = 528;  // 4 blocks per multiprocessor of a 132-SM GPU; the GPU path reads the device's count
  int64_t min_split_keys = 512;
  int64_t min_decode_blocks = 1056;  // 8 per multiprocessor: a decode block has half the threads
  int64_t min_decode_split_keys = 256;
  bool decode_kernel = true;  // false: every tile to the tile kernel (the host runner tests both kernels so)
  // Sequences of more than one token to the tensor-core kernel where its head_dim fits it: for float16 / bfloat16
  // calls whose rows it can read 16 bytes at a time (MmaRowsFit) on a GPU that has its products (sm_80 on).
  bool mma_kernel = false;
  bool mma_decode = false;  // sequences of one token too (instead of the tile or decode kernel)
  int mma_form = 1;  // 1: products through shared memory (attention_mma.h); 2: in registers (attention_mma_regs.h)
  // The decode kernel's form: 1 (reads in registers, attention_decode.h), 2 (rows staged in shared memory,
  // attention_decode_staged.h: only where StagedRowsFit) or 3 (the same, every head of a tile in each thread).
  int decode_form = 1;
};

// The host side of one launch, copied to the device as one block of words: kAIndex's words (the first
// index_words), then the tile kernel's tiles, the decode kernel's, the tensor-core kernel's and the merges
// (kATiles's words); and how many partial records the split tiles write.
struct AttnLaunchPlan {
  std::vector<int64_t> words;
  int64_t index_words = 0, tiles = 0, decode_tiles = 0, mma_tiles = 0, merges = 0, records = 0;
  int64_t mma_form = 1;
  int64_t decode_form = 1;
};

// The cache side of MultiHeadCacheAttention (nullptr for MultiHeadAttention).
struct CacheSide {
  const Attrs* attrs;
  const CallPlan* plan;
};

// Throws KvError when the call cannot be launched: a head_dim above kMaxCudaHeadDim, more tiles or merges than
// a grid holds, or scratch sizes that do not fit. Called before anything is written.
AttnLaunchPlan PlanAttention(const MhaAttrs& a, const MhaPlan& plan, const CacheSide* cache, const TilePolicy& policy);

// MultiHeadCacheAttention: appends its stores' packed index inputs (PackIndices of `cache`) to a planned launch's
// words, after its tiles and merges, so that one copy brings both to the device. Returns where the stores' words
// begin, or -1 (nothing appended) for a call that stores no token and so launches no stores.
int64_t AppendStoreIndices(const CallPlan& cache, AttnLaunchPlan* launch);

// The device buffers of a call; absent ones null.
struct AttnTensors {
  const void* query;
  const void* key;    // MultiHeadAttention
  const void* value;  // MultiHeadAttention
  const void* cache;  // MultiHeadCacheAttention (after its stores)
  const void* scale;
  const void* mask;
  void* out;
};

// Whether the tensor-core kernel can read this call: T1 float16 or bfloat16, the query and the key and value rows
// (packed, or the cache) 16-byte aligned, quantization groups a whole number of 8-element loads.
bool MmaRowsFit(int32_t t1, const AttnTensors& t, const CacheSide* cache);

// The tensor-core kernel's form for a call that asks for `asked` (1 or 2): the second form is built only for rows
// stored as T1 (packed keys, unquantized caches), so a quantized cache always takes the first.
int MmaFormFor(int asked, const CacheSide* cache);

// Whether the staged decode kernel can read this call (it copies rows 16 bytes at a time): T1 float16 or bfloat16
// with the key and value rows stored as T1 (packed, or an unquantized cache), or a quantized cache (any T1) whose
// quant_group is a multiple of 8 and whose code rows and scale rows (of scale_type, the scale's ONNX type) are
// multiples of 16 bytes; the rows' buffers 16-byte aligned.
bool StagedRowsFit(int32_t t1, int32_t scale_type, const AttnTensors& t, const CacheSide* cache);

// Params for a planned call whose words (launch.words) and partial records are at the given device addresses.
AttnParams MakeAttnParams(const MhaAttrs& a, const MhaPlan& plan, const CacheSide* cache, const AttnLaunchPlan& launch,
                          const AttnTensors& t, const int64_t* words, float* partials);

}  // namespace cuda
}  // namespace kvcache
