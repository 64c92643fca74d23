// CPU compute of a validated KeyValueCache call: all stores, then all loads.
#pragma once

#include <cstddef>
#include <functional>

#include "kv_validate.h"

namespace kvcache {

struct ComputeArgs {
  const Attrs* attrs;
  const CallPlan* plan;
  int32_t t1;           // element type of current_key/value and outputs
  int32_t scale_type;   // element type of scale (quant_bit != 0)
  const void* key;      // [tokens, H, Dh]
  const void* value;    // [tokens, H, Dh]
  void* cache;          // rank 5, layout attrs->cache_layout; int4 packed
  void* scale;          // rank 5, last dim G; nullptr without quantization
  void* out_key;        // [kv_tokens, H * num_repeat, Dh]; nullptr (with out_value): stores only
  void* out_value;      // [kv_tokens, H * num_repeat, Dh]
};

// Runs fn(i) for i in [0, count), possibly in parallel; returns when all are done. A task's exception never unwinds
// through a worker thread: the first is kept and rethrown on the calling thread once the tasks have returned
// (ParallelForOnOrt, ParallelOnThreads).
using ParallelFor = std::function<void(size_t count, const std::function<void(size_t)>& fn)>;

// Stores then gathers. The plan must come from ValidateCall on the same inputs. Runs the best build of the
// kernel that the library has and the processor runs (AVX-512, AVX2+F16C+FMA, generic; kv_cpu_dispatch.cc);
// every build computes the same bits.
void ComputeCpu(const ComputeArgs& args, const ParallelFor& parallel_for);

// The build ComputeCpu runs now: "avx512", "avx2" or "generic".
const char* CpuKernelName();

// How gathers write outputs too large to stay cached: streaming stores of one source stream, measured ahead on AMD
// EPYCs and two Intel Xeon models (kv_cpu_dispatch.cc; $KVCACHE_OP_STORES = side-by-side | stream | cached overrides it).
struct StorePlan {
  bool stream;        // streaming stores (the output is not read into the cache first)
  bool side_by_side;  // streamed unquantized gathers read several source streams side by side
};
StorePlan LargeOutputStores();
// Whether quantized layout-3 gathers into outputs that stay cached walk the cache a head's page run at a time
// (else token by token): chosen per CPU vendor by measurement, or by $KVCACHE_OP_CACHED_GATHER ("head-runs" or
// "tokens"). The same bits either way.
bool CachedGatherHeadRuns();
// How many of a token's heads (1 to kMaxStreamedHeads) layout-3 gathers into streamed outputs read side by side, a
// page run at a time, each slot's heads one output row without repeats, from a quantized cache or not: quantized
// heads eight on Intel processors running the AVX-512 build (measured on an Intel Xeon of model 167), four elsewhere
// (codes and scales: eight source streams; measured best on an AMD EPYC); eight heads of values (measured on an AMD
// EPYC and an Intel Xeon); or $KVCACHE_OP_STREAMED_HEADS for both (a positive count, larger ones taken as
// kMaxStreamedHeads). The same bits whatever the count.
constexpr int64_t kMaxStreamedHeads = 16;
int64_t StreamedGatherHeads(bool quantized);
// How many bytes of whole tokens gathers in token order (not side by side) write to each output in
// turn (a tile's keys, then its values), one token where that is less than a token's row, from a cache whose
// slots hold a token's key and value rows together or not (RowStrides::KeyValueTogether): chosen by measurement
// (a token where they lie together, and for quantized rows on Intel processors; tiles where they lie apart), or by
// $KVCACHE_OP_GATHER_TILE (bytes, a non-negative integer). Streamed gathers that read runs side by side
// (TokenStreams) take no tiles. The same bits whatever the size.
int64_t GatherTileBytes(bool key_value_together, bool quantized);
// How many runs of a gather task's rows streamed unquantized gathers read side by side where a token's heads are one
// row in the cache and in the output (layouts 0-2 without repeats; one stream, not side by side, in the store plan;
// rows of whole 64-byte vectors at even addresses, in the AVX-512 build: RowsGoSideBySide):
// a token's key row then its value row, the task's rows split into this many runs, 256 bytes of each run's row in
// turn. 1 reads them one row after another (in tiles, GatherTileBytes). Chosen by measurement (in the AVX-512 build
// 8 on Intel processors and 4 on AMD processors; 1 in the other builds, which never read runs), or by
// $KVCACHE_OP_TOKEN_STREAMS (a positive count, larger ones taken as kMaxTokenStreams). The same bits whatever the
// count.
constexpr int64_t kMaxTokenStreams = 16;
int64_t TokenStreams();
// How many bytes of a quantized token's codes (from its first head on, with their scales) gathers in token order
// ask for ahead of their use where a token's heads lie together in the cache (layouts 0-2; software prefetch), for
// tokens of row_bytes of codes; 0 for all of them: chosen by measurement (on AMD processors the whole row up to
// 1 KiB and 512 B of longer ones; 1 KiB elsewhere, measured on Intel; rounded down to whole heads, at least one),
// or by $KVCACHE_OP_TOKEN_PREFETCH (bytes, a non-negative integer, whatever the row). The same bits whatever the
// count.
int64_t TokenPrefetchBytes(int64_t row_bytes);
// Whether KeyValueCache's stores write a token's quantized codes with streaming stores where the AVX-512 build's
// blocks of 16 groups cover its rows and they start on a line, and in layout 3 its scale rows too, each head's a
// whole line at a time (InterleavedStreams: rows of 32 bytes on a half line held until the next token's complete
// the line, rows of 64 on a line streamed at once, others stored as before; only tokens whose output rows are not
// read back from the cache, and never for stores-only calls, whose rows MultiHeadCacheAttention reads at once): by
// measurement, wherever the AVX-512 build runs (AMD and Intel measured), or by $KVCACHE_OP_CODE_STORES ("stream" or
// "cached"; the other builds never stream codes). The same bits either way.
bool StreamedCodeStores();
// Whether gathers of an unquantized layout-3 cache ask for head rows ahead of their use into the second-level cache
// (prefetcht1) rather than the first: on AMD processors, in every build (measured on an AMD EPYC of Zen 4; the
// first level's sets cannot hold a token's heads, which lie a multiple of 4 KiB apart, kv_cpu_dispatch.cc), into
// the first elsewhere (the second no faster on an Intel Xeon of model 207), or as $KVCACHE_OP_HEAD_PREFETCH says
// ("l2" or "l1"). Quantized rows are asked for into the first (measured mixed). The same bits either way.
bool HeadPrefetchToL2();
// Whether each KeyValueCache call on the CPU prints its plan, one line on stderr ($KVCACHE_OP_CPU_VERBOSE=1, read each
// call): the build running it, the call's shape, whether its outputs are streamed (a call's own size decides it,
// which the per-choice queries cannot say) and the choices above as passed to its kernel.
bool CallReportWanted();

}  // namespace kvcache
