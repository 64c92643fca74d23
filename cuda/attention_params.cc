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
  // The tiles counted before any is built: a call needing more blocks than one launch runs is refused before the
  // host holds them (at 64 bytes a tile, 2^31 tiles would be 128 GiB). Splitting adds fewer tiles than the GPU has
  // blocks to fill (`want` below), so only the unsplit count can be out of range.
  auto ceil_div = [](int64_t n, int64_t d) { return (n + d - 1) / d; };
  int64_t counted = 0;  // <= 2^31 + one sequence's tiles (<= H * S, within the query's elements): fits
  for (int64_t b = 0; b < B && counted <= 0x7fffffff; ++b) {
    const int64_t S = plan.seqstarts[b + 1] - plan.seqstarts[b];
    if (S == 0) continue;
    counted += Hkv * (mma_takes(S)      ? ceil_div(G, mma_heads) * ceil_div(S, mma_rows)
                      : decode_takes(S) ? ceil_div(G, kDecodeHeads)
                                        : ceil_div(G, tile_heads) * ceil_div(S, tile_rows));
  }
  if (counted > 0x7fffffff)
    Fail("attention on CUDA: the call needs at least ", counted, " blocks, more than one launch runs");
  std::vector<Tile> base, decode_base, mma_base;
  // Sequence b's tiles of up to `heads` heads (of one kv head) x `tile_rows` rows, each over the keys its rows see.
  auto row_tiles = [&](int64_t b, int64_t S, int64_t heads, int64_t tile_rows, std::vector<Tile>& into) {
    for (int64_t g = 0; g < Hkv && S > 0; ++g)
      for (int64_t hh = 0; hh < G; hh += heads)
        for (int64_t r0 = 0; r0 < S; r0 += tile_rows) {
          const int64_t rows = std::min(tile_rows, S - r0);
          int64_t lo, hi, lo_last, hi_last;
          Visible(a, plan, b, r0, &lo, &hi);
          Visible(a, plan, b, r0 + rows - 1, &lo_last, &hi_last);
          into.push_back(Tile{b, r0, rows, g * G + hh, std::min(heads, G - hh), lo, std::max(lo, hi_last), -1});
        }
  };
  for (int64_t b = 0; b < B; ++b) {
    const int64_t S = plan.seqstarts[b + 1] - plan.seqstarts[b];
    if (mma_takes(S)) {
      row_tiles(b, S, mma_heads, mma_rows, mma_base);
      continue;
    }
    if (decode_takes(S)) {
      int64_t lo, hi;
      Visible(a, plan, b, 0, &lo, &hi);
      for (int64_t g = 0; g < Hkv; ++g)
        for (int64_t hh = 0; hh < G; hh += kDecodeHeads)
          decode_base.push_back(Tile{b, 0, 1, g * G + hh, std::min(kDecodeHeads, G - hh), lo, hi, -1});
      continue;
    }
    row_tiles(b, S, tile_heads, tile_rows, base);
  }
  // Too few blocks for the GPU: long key ranges split, each part a block of its own, merged after. The tile and
  // decode launches run one after the other: each fills the GPU by itself.
  auto want = [](size_t tiles, int64_t blocks) {
    const int64_t count = std::max<int64_t>(1, static_cast<int64_t>(tiles));
    return count < blocks ? (blocks + count - 1) / count : 1;
  };
  std::vector<Tile> tiles, decode_tiles, mma_tiles;
  std::vector<Merge> merges;
  auto split = [&](const std::vector<Tile>& from, int64_t min_keys, int64_t most, std::vector<Tile>& into) {
    for (const Tile& t : from) {
      const int64_t span = t.key1 - t.key0;
      const int64_t parts = std::clamp<int64_t>(span / std::max<int64_t>(1, min_keys), 1, most);
      const int64_t part_keys = parts > 1 ? (span + parts - 1) / parts : span;
      if (parts == 1 || part_keys >= span) {
        into.push_back(t);
        continue;
      }
      const int64_t q = t.rows * t.heads;
      Merge m{t.b, t.row0, t.rows, t.head0, t.heads, out.records, 0, 0};
      for (int64_t k0 = t.key0; k0 < t.key1; k0 += part_keys) {
        Tile part = t;
        part.key0 = k0;
        part.key1 = std::min(t.key1, k0 + part_keys);
        part.partial = out.records;
        out.records += q;
        ++m.parts;
        into.push_back(part);
      }
      merges.push_back(m);
    }
  };
  split(base, policy.min_split_keys, want(base.size(), policy.min_blocks), tiles);
  split(decode_base, policy.min_decode_split_keys, want(decode_base.size(), policy.min_decode_blocks), decode_tiles);
  split(mma_base, policy.min_split_keys, want(mma_base.size(), policy.min_blocks), mma_tiles);
  out.tiles = static_cast<int64_t>(tiles.size());
  out.decode_tiles = static_cast<int64_t>(decode_tiles.size());
  out.mma_tiles = static_cast<int64_t>(mma_tiles.size());
  out.mma_form = policy.mma_form;
  out.decode_form = policy.decode_form;
  out.merges = static_cast<int64_t>(merges.size());
  int64_t floats = 0;
  if (out.tiles > 0x7fffffff || out.decode_tiles > 0x7fffffff || out.mma_tiles > 0x7fffffff ||
      out.merges > 0x7fffffff || !MulFits(out.records, D + 2, &floats) || !MulFits(floats, 4, &floats))
    Fail("attention on CUDA: the call needs ", out.tiles + out.decode_tiles + out.mma_tiles, " blocks and ",
         out.records, " partial records, more than one launch runs");
  out.index_words = static_cast<int64_t>(index.size());
  index.reserve(index.size() +
                static_cast<size_t>((out.tiles + out.decode_tiles + out.mma_tiles + out.merges) * kTileWords));
  for (const auto* list : {&tiles, &decode_tiles, &mma_tiles})
    for (const Tile& t : *list)
      index.insert(index.end(), {t.b, t.row0, t.rows, t.head0, t.heads, t.key0, t.key1, t.partial});
  for (const Merge& m : merges)
    index.insert(index.end(), {m.b, m.row0, m.rows, m.head0, m.heads, m.first, m.parts, int64_t{0}});
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
