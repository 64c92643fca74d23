#include "attention_params.h"

#include <algorithm>
#include <cstring>

#include "attention_work.h"
#include "byte_ranges.h"
#include "kv_checked.h"
#include "kv_cuda_params.h"
#include "spec_float_mode.h"

namespace kvcache {
namespace cuda {

namespace {

// The visible range of query row i of sequence b, as the kernels compute it.
void Visible(const MhaAttrs& a, const MhaPlan& plan, int64_t b, int64_t i, int64_t* lo, int64_t* hi) {
  const int64_t S = plan.seqstarts[b + 1] - plan.seqstarts[b], K = plan.kvstarts[b + 1] - plan.kvstarts[b];
  VisibleKeys(a.sliding_window, plan.causal[b] != 0, S, K, i, lo, hi);
  if (*hi < *lo) *hi = *lo;
}

// Whether the key and value rows start 16-byte aligned: the cache's, or the packed keys' and values'.
bool RowsAligned16(const AttnTensors& t, const CacheSide* cache) {
  return cache ? Aligned16(t.cache) : Aligned16(t.key) && Aligned16(t.value);
}

bool TwoByteT1(int32_t t1) { return t1 == int32_t(Elem::kFloat16) || t1 == int32_t(Elem::kBFloat16); }

}  // namespace

AttnLaunchPlan PlanAttention(const MhaAttrs& a, const MhaPlan& plan, const CacheSide* cache, const TilePolicy& policy) {
  static_assert(kMergeWords == kTileWords, "merges follow the tiles in records of the same size");
  AttnLaunchPlan out;
  if (plan.batch == 0 || plan.tokens == 0) return out;
  const int64_t D = a.head_dim, H = a.num_heads, G = plan.group, Hkv = plan.kv_heads, B = plan.batch;
  if (D > kMaxCudaHeadDim)
    Fail("attention on CUDA runs head_dim <= ", kMaxCudaHeadDim, ", got ", D, " (the CPU kernel runs any)");
  // Index words: seqstarts, kvstarts, causal, cachestarts (B placeholders without a cache), ALiBi slopes.
  auto& index = out.words;
  index.insert(index.end(), plan.seqstarts.begin(), plan.seqstarts.end());
  index.insert(index.end(), plan.kvstarts.begin(), plan.kvstarts.end());
  for (int64_t b = 0; b < B; ++b) index.push_back(plan.causal[b]);
  if (cache)
    index.insert(index.end(), cache->plan->cachestarts.begin(), cache->plan->cachestarts.end());
  else
    index.insert(index.end(), static_cast<size_t>(B), int64_t{0});
  if (a.is_alibi) {  // H is bounded here: the query holds tokens * H * Dh elements, tokens >= 1
    const SpecFloatMode spec_mode;  // on the caller's thread: the slopes as the spec rounds them, not in its mode
    for (int64_t h = 0; h < H; ++h) {
      const float slope = AlibiSlope(h, H);
      uint32_t bits;
      std::memcpy(&bits, &slope, 4);
      index.push_back(bits);
    }
  }

  // Tiles: per sequence and kv head, up to TileQueries() query vectors (its heads first, then rows). A sequence of
  // one token goes to the decode kernel where its head_dim fits it, kDecodeHeads heads of one kv head per tile.
  const int64_t slices = (D + kSliceElems - 1) / kSliceElems, capacity = TileQueries(slices);
  const int64_t tile_heads = std::min(G, capacity), tile_rows = std::max<int64_t>(1, capacity / tile_heads);
  const bool decode_kernel = policy.decode_kernel && DecodeKernelFits(D);
  const bool mma_kernel = policy.mma_kernel && MmaKernelFits(D);
  const int64_t mma_heads = std::min(G, kMmaQueries), mma_rows = std::max<int64_t>(1, kMmaQueries / mma_heads);
  // Whether sequence b (S queries) runs in the tensor-core kernel, else (one query) in the decode kernel.
  auto mma_takes = [&](int64_t S) { return mma_kernel && (S > 1 || (S == 1 && policy.mma_decode)); };
  auto decode_takes = [&](int64_t S) { return S == 1 && decode_kernel; };
  // Each kind's tiles (the tile kernel's, the decode kernel's, the tensor-core kernel's) are counted, then written
  // straight into the words, sized once, in a second pass of the same walk (a kind that splits nothing is counted
  // without one): a prefill's tiles run to megabytes, and lists of them grown beside the words, then copied, took
  // 1.4x as long (tools/attention_host_cost.py), and up to 2 ms where the lists' memory was mapped fresh each call.
  enum Kind { kTileKernel, kDecodeKernel, kMmaKernel, kKinds };
  auto kind_of = [&](int64_t S) { return mma_takes(S) ? kMmaKernel : decode_takes(S) ? kDecodeKernel : kTileKernel; };
  // The unsplit tiles, counted before any is built: a call needing more blocks than one launch runs is refused
  // before the host holds them (at 64 bytes a tile, 2^31 tiles would be 128 GiB). Splitting adds fewer tiles than
  // the GPU has blocks to fill (`most` below), so only the unsplit count can be out of range.
  auto ceil_div = [](int64_t n, int64_t d) { return (n + d - 1) / d; };
  int64_t unsplit[kKinds] = {0, 0, 0};
  int64_t counted = 0;  // <= 2^31 + one sequence's tiles (<= H * S, within the query's elements): fits
  for (int64_t b = 0; b < B && counted <= 0x7fffffff; ++b) {
    const int64_t S = plan.seqstarts[b + 1] - plan.seqstarts[b];
    if (S == 0) continue;
    const Kind kind = kind_of(S);
    const int64_t n = Hkv * (kind == kMmaKernel      ? ceil_div(G, mma_heads) * ceil_div(S, mma_rows)
                             : kind == kDecodeKernel ? ceil_div(G, kDecodeHeads)
                                                     : ceil_div(G, tile_heads) * ceil_div(S, tile_rows));
    unsplit[kind] += n;
    counted += n;
  }
  if (counted > 0x7fffffff)
    Fail("attention on CUDA: the call needs at least ", counted, " blocks, more than one launch runs");
  // Too few blocks for the GPU: long key ranges split, each part a block of its own, merged after. The tile and
  // decode launches run one after the other: each fills the GPU by itself. A kind splits a tile into at most
  // `most` parts of at least `min_keys` keys.
  auto want = [](int64_t tiles, int64_t blocks) {
    const int64_t count = std::max<int64_t>(1, tiles);
    return count < blocks ? (blocks + count - 1) / count : int64_t{1};
  };
  const int64_t min_keys[kKinds] = {policy.min_split_keys, policy.min_decode_split_keys, policy.min_split_keys};
  const int64_t most[kKinds] = {want(unsplit[kTileKernel], policy.min_blocks),
                                want(unsplit[kDecodeKernel], policy.min_decode_blocks),
                                want(unsplit[kMmaKernel], policy.min_blocks)};
  // Kind `kind`'s tiles in launch order (its sequences in order; per kv head, head group and rows), split:
  // on_tile(tile) for each, on_merge(merge) for each split one. Records are numbered in the walk's order.
  int64_t records = 0;
  auto walk = [&](Kind kind, auto&& on_tile, auto&& on_merge) {
    auto split = [&](const Tile& t) {
      if (most[kind] == 1) {  // (a prefill's many tiles: no division)
        on_tile(t);
        return;
      }
      const int64_t span = t.key1 - t.key0;
      const int64_t parts = std::clamp<int64_t>(span / std::max<int64_t>(1, min_keys[kind]), 1, most[kind]);
      const int64_t part_keys = parts > 1 ? (span + parts - 1) / parts : span;
      if (parts == 1 || part_keys >= span) {
        on_tile(t);
        return;
      }
      const int64_t q = t.rows * t.heads;
      Merge m{t.b, t.row0, t.rows, t.head0, t.heads, records, 0, 0};
      for (int64_t k0 = t.key0; k0 < t.key1; k0 += part_keys) {
        Tile part = t;
        part.key0 = k0;
        part.key1 = std::min(t.key1, k0 + part_keys);
        part.partial = records;
        records += q;
        ++m.parts;
        on_tile(part);
      }
      on_merge(m);
    };
    // Sequence b's tiles of up to `heads` heads (of one kv head) x `rows_most` rows, each over the keys its rows see.
    auto row_tiles = [&](int64_t b, int64_t S, int64_t heads, int64_t rows_most) {
      for (int64_t g = 0; g < Hkv; ++g)
        for (int64_t hh = 0; hh < G; hh += heads)
          for (int64_t r0 = 0; r0 < S; r0 += rows_most) {
            const int64_t rows = std::min(rows_most, S - r0);
            int64_t lo, hi, lo_last, hi_last;
            Visible(a, plan, b, r0, &lo, &hi);
            Visible(a, plan, b, r0 + rows - 1, &lo_last, &hi_last);
            split(Tile{b, r0, rows, g * G + hh, std::min(heads, G - hh), lo, std::max(lo, hi_last), -1});
          }
    };
    for (int64_t b = 0; b < B; ++b) {
      const int64_t S = plan.seqstarts[b + 1] - plan.seqstarts[b];
      if (S == 0 || kind_of(S) != kind) continue;
      if (kind == kMmaKernel) {
        row_tiles(b, S, mma_heads, mma_rows);
      } else if (kind == kDecodeKernel) {
        int64_t lo, hi;
        Visible(a, plan, b, 0, &lo, &hi);
        for (int64_t g = 0; g < Hkv; ++g)
          for (int64_t hh = 0; hh < G; hh += kDecodeHeads)
            split(Tile{b, 0, 1, g * G + hh, std::min(kDecodeHeads, G - hh), lo, hi, -1});
      } else {
        row_tiles(b, S, tile_heads, tile_rows);
      }
    }
  };
  int64_t tiles[kKinds] = {0, 0, 0}, merges = 0;
  for (const Kind kind : {kTileKernel, kDecodeKernel, kMmaKernel}) {
    if (most[kind] == 1)  // nothing split: the unsplit count
      tiles[kind] = unsplit[kind];
    else
      walk(kind, [&](const Tile&) { ++tiles[kind]; }, [&](const Merge&) { ++merges; });
  }
  out.tiles = tiles[kTileKernel];
  out.decode_tiles = tiles[kDecodeKernel];
  out.mma_tiles = tiles[kMmaKernel];
  out.mma_form = policy.mma_form;
  out.decode_form = policy.decode_form;
  out.merges = merges;
  out.records = records;
  int64_t floats = 0;
  if (out.tiles > 0x7fffffff || out.decode_tiles > 0x7fffffff || out.mma_tiles > 0x7fffffff ||
      out.merges > 0x7fffffff || !MulFits(out.records, D + 2, &floats) || !MulFits(floats, 4, &floats))
    Fail("attention on CUDA: the call needs ", out.tiles + out.decode_tiles + out.mma_tiles, " blocks and ",
         out.records, " partial records, more than one launch runs");
  out.index_words = static_cast<int64_t>(index.size());
  const int64_t all_tiles = out.tiles + out.decode_tiles + out.mma_tiles;
  index.resize(static_cast<size_t>(out.index_words + (all_tiles + out.merges) * kTileWords));
  int64_t* tile_at = index.data() + out.index_words;
  int64_t* const tiles_end = tile_at + all_tiles * kTileWords;
  int64_t* merge_at = tiles_end;
  int64_t* const merges_end = index.data() + index.size();
  // The second walk writes what the first counted; the cursors are checked all the same, so that a count and a walk
  // that ever disagree are refused instead of writing past the words.
  bool disagree = false;
  records = 0;
  for (const Kind kind : {kTileKernel, kDecodeKernel, kMmaKernel})
    walk(
        kind,
        [&](const Tile& t) {
          if (tile_at == tiles_end) return void(disagree = true);
          const int64_t w[kTileWords] = {t.b, t.row0, t.rows, t.head0, t.heads, t.key0, t.key1, t.partial};
          tile_at = std::copy(w, w + kTileWords, tile_at);
        },
        [&](const Merge& m) {
          if (merge_at == merges_end) return void(disagree = true);
          const int64_t w[kMergeWords] = {m.b, m.row0, m.rows, m.head0, m.heads, m.first, m.parts, int64_t{0}};
          merge_at = std::copy(w, w + kMergeWords, merge_at);
        });
  if (disagree || tile_at != tiles_end || merge_at != merges_end || records != out.records)
    Fail("attention on CUDA: the planner's tile count and its tiles disagree (a defect; the call is refused)");
  return out;
}

bool MmaRowsFit(int32_t t1, const AttnTensors& t, const CacheSide* cache) {
  const bool groups = !cache || cache->attrs->quant_bit == 0 || cache->attrs->quant_group % kVec == 0;
  return TwoByteT1(t1) && Aligned16(t.query) && RowsAligned16(t, cache) && groups;
}

bool StagedRowsFit(int32_t t1, int32_t scale_type, const AttnTensors& t, const CacheSide* cache) {
  if (!RowsAligned16(t, cache)) return false;
  if (!cache || cache->attrs->quant_bit == 0) return TwoByteT1(t1);
  // Codes: a lane's eight elements in one quantization group, the code rows and the scale rows whole 16-byte chunks;
  // and a head_dim of 8 x a power of two (the planner's decode tiles have it), whose chunk counts the kernel finds
  // by shifts and masks.
  const int64_t D = cache->plan->head_dim, group = cache->attrs->quant_group;
  const int64_t scale_bytes = TensorBytes(scale_type, {1});
  return Aligned16(t.scale) && DecodeKernelFits(D) && group % kVec == 0 && D * cache->attrs->quant_bit / 8 % 16 == 0 &&
         D / group * scale_bytes % 16 == 0;
}

int64_t AppendStoreIndices(const CallPlan& cache, AttnLaunchPlan* launch) {
  if (cache.tokens == 0) return -1;
  const auto at = static_cast<int64_t>(launch->words.size());
  const std::vector<int64_t> stores = PackIndices(cache);
  launch->words.insert(launch->words.end(), stores.begin(), stores.end());
  return at;
}

int MmaFormFor(int asked, const CacheSide* cache) {
  return asked == 2 && (cache == nullptr || cache->attrs->quant_bit == 0) ? 2 : 1;
}

AttnParams MakeAttnParams(const MhaAttrs& a, const MhaPlan& plan, const CacheSide* cache, const AttnLaunchPlan& launch,
                          const AttnTensors& t, const int64_t* words, float* partials) {
  AttnParams p{};
  p.num_heads = a.num_heads;
  p.head_dim = a.head_dim;
  p.kv_heads = plan.kv_heads;
  p.group = plan.group;
  p.sliding_window = a.sliding_window;
  p.scale = plan.scale;
  p.softcap = a.softcap;
  p.alibi = a.is_alibi;
  p.mask_rank = plan.mask_rank;
  p.mask_cols = plan.mask_cols;
  p.tokens = plan.tokens;
  p.batch = plan.batch;
  p.tiles = launch.tiles;
  p.decode_tiles = launch.decode_tiles;
  p.mma_tiles = launch.mma_tiles;
  p.mma_form = launch.mma_form;
  p.decode_form = launch.decode_form;
  p.merges = launch.merges;
  p.slices = (a.head_dim + kSliceElems - 1) / kSliceElems;
  const bool quantized = cache && cache->attrs->quant_bit != 0;
  if (cache) {
    const CallPlan& c = *cache->plan;
    p.layer_idx = cache->attrs->layer_idx;
    p.quant_group = cache->attrs->quant_group;
    p.cache_mode = cache->attrs->cache_mode;
    p.page_size = cache->attrs->page_size;
    p.max_p = c.max_p;
    p.cache_rows = {c.cache_rows.layer, c.cache_rows.kv, c.cache_rows.head, c.cache_rows.slot};
    p.scale_rows = {c.scale_rows.layer, c.scale_rows.kv, c.scale_rows.head, c.scale_rows.slot};
  }
  p.vector_rows =
      a.head_dim % kSliceElems == 0 && RowsAligned16(t, cache) && (!quantized || p.quant_group % kSliceElems == 0);
  p.ptr[kAQuery] = const_cast<void*>(t.query);
  p.ptr[kAKey] = const_cast<void*>(t.key);
  p.ptr[kAValue] = const_cast<void*>(t.value);
  p.ptr[kACache] = const_cast<void*>(t.cache);
  p.ptr[kAScale] = const_cast<void*>(t.scale);
  p.ptr[kAMask] = const_cast<void*>(t.mask);
  p.ptr[kAOut] = t.out;
  p.ptr[kAIndex] = const_cast<int64_t*>(words);
  p.ptr[kATiles] = const_cast<int64_t*>(words + launch.index_words);
  p.ptr[kAPartials] = partials;
  return p;
}

}  // namespace cuda
}  // namespace kvcache
