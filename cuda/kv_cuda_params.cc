#include "kv_cuda_params.h"

#include <algorithm>
#include <cstdint>

#include "kv_checked.h"

namespace kvcache {
namespace cuda {

namespace {

// Length of the longest sequence of a validated starts vector.
int64_t Longest(const std::vector<int64_t>& starts) {
  int64_t longest = 0;
  for (size_t b = 0; b + 1 < starts.size(); ++b) longest = std::max(longest, starts[b + 1] - starts[b]);
  return longest;
}

}  // namespace

std::vector<int64_t> PackIndices(const CallPlan& plan) {
  std::vector<int64_t> host;
  host.reserve(plan.seqstarts.size() + plan.kvstarts.size() + plan.start_pos.size() + plan.cachestarts.size());
  for (const auto* part : {&plan.seqstarts, &plan.kvstarts, &plan.start_pos, &plan.cachestarts})
    host.insert(host.end(), part->begin(), part->end());
  return host;
}

void CheckLaunchable(const CallPlan& plan) {
  // Grids (StoreGrid / GatherGrid): y = batch <= 65535, x = ceil(longest / 8) < 2^31.
  if (plan.batch > 65535)
    Fail("the cache's stores on CUDA (KeyValueCache, MultiHeadCacheAttention) run at most 65535 sequences per "
         "call, got B = ", plan.batch);
  const int64_t longest = std::max(Longest(plan.seqstarts), Longest(plan.kvstarts));
  if ((longest + kTokensPerBlock - 1) / kTokensPerBlock > 0x7fffffff)
    Fail("KeyValueCache on CUDA runs sequences of at most 2^34 tokens, got ", longest);
  // A block's work counter: kTokensPerBlock * 2 * H * num_repeat * Dh (units of at least one element).
  int64_t work = 0;
  if (!MulFits(plan.out_heads, plan.head_dim, &work) || !MulFits(work, 2 * kTokensPerBlock, &work))
    Fail("KeyValueCache on CUDA: H*num_repeat*Dh = ", plan.out_heads, "*", plan.head_dim, " is too large");
}

Params MakeParams(const Attrs& a, const CallPlan& plan, const int64_t* indices, const DeviceTensors& t) {
  Params p{};
  p.layer_idx = a.layer_idx;
  p.quant_group = a.quant_group;
  p.num_repeat = a.num_repeat;
  p.out_heads = plan.out_heads;
  p.cache_mode = a.cache_mode;
  p.page_size = a.page_size;
  p.batch = plan.batch;
  p.heads = plan.heads;
  p.head_dim = plan.head_dim;
  p.max_p = plan.max_p;
  p.longest_seq = Longest(plan.seqstarts);
  p.longest_kv = Longest(plan.kvstarts);
  p.cache_rows = {plan.cache_rows.layer, plan.cache_rows.kv, plan.cache_rows.head, plan.cache_rows.slot};
  p.scale_rows = {plan.scale_rows.layer, plan.scale_rows.kv, plan.scale_rows.head, plan.scale_rows.slot};
  // 16-byte accesses only where every buffer they touch is 16-byte aligned (a caller's pointer may be
  // an offset view; a misaligned vector access faults on the GPU).
  p.aligned16 = Aligned16(t.key) && Aligned16(t.value) && Aligned16(t.cache) && Aligned16(t.out_key) &&
                Aligned16(t.out_value);
  const int64_t batch = plan.batch;
  p.ptr[kSeqstarts] = const_cast<int64_t*>(indices);
  p.ptr[kKvstarts] = const_cast<int64_t*>(indices + batch + 1);
  p.ptr[kStartPos] = const_cast<int64_t*>(indices + 2 * (batch + 1));
  p.ptr[kCachestarts] = const_cast<int64_t*>(indices + 3 * batch + 2);
  p.ptr[kKey] = const_cast<void*>(t.key);
  p.ptr[kValue] = const_cast<void*>(t.value);
  p.ptr[kCache] = t.cache;
  p.ptr[kScale] = t.scale;
  p.ptr[kOutKey] = t.out_key;
  p.ptr[kOutValue] = t.out_value;
  return p;
}

}  // namespace cuda
}  // namespace kvcache
