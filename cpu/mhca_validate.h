// Host-side validation of a MultiHeadCacheAttention call (spec/MultiHeadCacheAttention.md "Validity"): every
// rule of KeyValueCache (num_repeat 1), then every rule of MultiHeadAttention over keys of the shape the gather
// would give, all before anything is written. Messages match the numpy reference's.
#pragma once

#include <cstdint>
#include <vector>

#include "kv_validate.h"
#include "mha_validate.h"

namespace kvcache {

// query, current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, decoding_batches, max_seqlen,
// max_kvlen, cache, scale (optional), attn_mask (optional)
constexpr size_t kMhcaNumInputs = 13;
constexpr size_t kMhcaCachestartsInput = 5, kMhcaCacheInput = 10, kMhcaScaleInput = 11, kMhcaMaskInput = 12;

struct MhcaAttrs {
  Attrs cache;  // num_repeat is always 1
  MhaAttrs attention;
};

// Throws KvError for an attribute value the spec does not allow (the cache's, then the attention's).
void CheckMhcaAttrs(const MhcaAttrs& a);

struct MhcaPlan {
  CallPlan cache;
  MhaPlan attention;
  // Owned copies of the int64 index inputs, which `in` points at after validation.
  std::vector<std::vector<int64_t>> index_copies;
};

// inputs: the op's 13 inputs in order (scale and attn_mask may be absent). The int64 index inputs are copied
// first and `inputs` repointed at the copies, so both rule sets read the same values whatever the caller's
// memory does meanwhile; an empty scale with quant_bit 0 is made absent. Throws KvError; returns the plan.
MhcaPlan ValidateCacheAttention(const MhcaAttrs& a, TensorArg* inputs);

// The byte checks of a call whose caller may have bound any buffers: the output apart from every data input,
// and the cache and scale (written before the attention reads) apart from query, current_key, current_value and
// attn_mask. Throws KvError before anything is written.
void CheckCacheAttentionApart(const TensorArg* in, const void* output);

}  // namespace kvcache
