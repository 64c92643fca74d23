#include "mhca_validate.h"

#include <cstring>

#include "byte_ranges.h"
#include "kv_types.h"

namespace kvcache {
namespace {
void CheckNumRepeat(const Attrs& cache) {
  if (cache.num_repeat != 1) Fail("num_repeat must be 1 in MultiHeadCacheAttention, got ", cache.num_repeat);
}
}  // namespace

void CheckMhcaAttrs(const MhcaAttrs& a) {
  CheckNumRepeat(a.cache);
  CheckAttrs(a.cache);
  CheckMhaAttrs(a.attention);
}

MhcaPlan ValidateCacheAttention(const MhcaAttrs& a, TensorArg* in) {
  // The spec's order: every rule of KeyValueCache (its attributes, in ValidateCall), then the attention's (its
  // attributes, in ValidateAttention), so a call breaking one of each is refused for the cache's. (The ONNX
  // Runtime op checks every attribute once, when its session is made: a node's attributes never change, so there
  // an attribute is refused before any call.)
  CheckNumRepeat(a.cache);
  MhcaPlan plan;
  // Index inputs 3..9: int64 ones are copied once, here (others are refused by the rules below, unread), as both
  // rule sets read them. Not cachestarts: only the cache's rules read it, and they copy just the page-table columns
  // the call reads (a table sized for a model's longest context would cost a copy of all of it per layer).
  for (size_t i = 3; i <= 9; ++i) {
    TensorArg& t = in[i];
    if (i == kMhcaCachestartsInput || !t.present || t.type != int32_t(Elem::kInt64)) continue;
    const int64_t bytes = TensorBytes(t.type, t.shape);
    std::vector<int64_t> copy(static_cast<size_t>(bytes / 8));
    if (bytes) std::memcpy(copy.data(), t.data, static_cast<size_t>(bytes));
    plan.index_copies.push_back(std::move(copy));
    t.data = plan.index_copies.back().data();  // a moved vector keeps its buffer
  }
  TensorArg cache_in[10] = {in[1], in[2], in[3], in[4], in[5], in[6], in[8], in[9], in[kMhcaCacheInput],
                            in[kMhcaScaleInput]};
  plan.cache = ValidateCall(a.cache, cache_in);
  in[kMhcaScaleInput] = cache_in[9];  // an empty scale without quantization is now absent
  // The keys and values the gather would give: (kvstarts[B], Hkv, head_dim) of current_key's type.
  TensorArg gathered{true, in[1].type, {plan.cache.kv_tokens, in[1].shape[1], in[1].shape[2]}, nullptr};
  TensorArg attention_in[kMhaNumInputs] = {in[0], gathered, gathered, in[3], in[4], in[7], in[8], in[9],
                                           in[kMhcaMaskInput]};
  plan.attention = ValidateAttention(a.attention, attention_in);
  return plan;
}

void CheckCacheAttentionApart(const TensorArg* in, const void* output) {
  const ByteRange query = RangeOf("query", in[0]), key = RangeOf("current_key", in[1]),
                  value = RangeOf("current_value", in[2]), cache = RangeOf("cache", in[kMhcaCacheInput]),
                  scale = RangeOf("scale", in[kMhcaScaleInput]), mask = RangeOf("attn_mask", in[kMhcaMaskInput]);
  CheckApart({"output", output, TensorBytes(in[0].type, in[0].shape)}, {query, key, value, cache, scale, mask});
  CheckApart(cache, {query, key, value, mask});
  CheckApart(scale, {query, key, value, cache, mask});
}

}  // namespace kvcache
