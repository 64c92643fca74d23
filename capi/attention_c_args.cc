#include "attention_c_args.h"

#include "byte_ranges.h"
#include "c_tensors.h"

namespace kvcache {
namespace {

const char* const kMhaNames[kMhaNumInputs] = {"query",    "key",        "value",     "seqstarts", "kvstarts",
                                              "decoding_batches", "max_seqlen", "max_kvlen", "attn_mask"};
const bool kMhaOptional[kMhaNumInputs] = {false, false, false, false, false, false, false, false, true};
const char* const kMhcaNames[kMhcaNumInputs] = {"query",      "current_key", "current_value", "seqstarts", "kvstarts",
                                                "cachestarts", "start_pos", "decoding_batches", "max_seqlen",
                                                "max_kvlen",  "cache",       "scale",         "attn_mask"};
const bool kMhcaOptional[kMhcaNumInputs] = {false, false, false, false, false, false, false,
                                            false, false, false, false, true,  true};

MhaAttrs ToMhaAttrs(const KvcacheMultiHeadAttentionAttrs& c) {
  MhaAttrs a;
  a.num_heads = c.num_heads;
  a.head_dim = c.head_dim;
  a.is_causal = c.is_causal;
  a.is_alibi = c.is_alibi;
  a.num_kv_heads = c.num_kv_heads;
  a.sliding_window = c.sliding_window;
  a.softmax_scale = c.softmax_scale;
  a.softcap = c.softcap;
  return a;
}

MhcaAttrs ToMhcaAttrs(const KvcacheMultiHeadCacheAttentionAttrs& c) {
  MhcaAttrs a;
  a.cache.num_layer = c.num_layer;
  a.cache.layer_idx = c.layer_idx;
  a.cache.quant_bit = c.quant_bit;
  a.cache.quant_group = c.quant_group;
  a.cache.cache_mode = c.cache_mode;
  a.cache.cache_layout = c.cache_layout;
  a.cache.page_size = c.page_size;
  a.attention = ToMhaAttrs(KvcacheMultiHeadAttentionAttrs{c.num_heads, c.head_dim, c.is_causal, c.is_alibi,
                                                          c.num_kv_heads, c.sliding_window, c.softmax_scale, c.softcap});
  return a;
}

}  // namespace

MhaPlan ValidateMhaWithOutput(const KvcacheMultiHeadAttentionAttrs* attrs, const KvcacheTensor* inputs,
                              const KvcacheTensor* output, MhaAttrs* a, TensorArg* in) {
  if (attrs == nullptr || inputs == nullptr) Fail("MultiHeadAttention: attrs and inputs must not be NULL");
  *a = ToMhaAttrs(*attrs);
  ToTensorArgs(inputs, kMhaNumInputs, kMhaNames, kMhaOptional, in);
  MhaPlan plan = ValidateAttention(*a, in);  // index inputs snapshotted, then checked
  if (output == nullptr) Fail("MultiHeadAttention: output must not be NULL");
  CheckOutput(*output, "output attention_output", in[0].type, in[0].shape);
  CheckAttentionOutputApart(in, output->data);
  return plan;
}

MhcaPlan ValidateMhcaWithOutput(const KvcacheMultiHeadCacheAttentionAttrs* attrs, const KvcacheTensor* inputs,
                                const KvcacheTensor* output, MhcaAttrs* a, TensorArg* in) {
  if (attrs == nullptr || inputs == nullptr) Fail("MultiHeadCacheAttention: attrs and inputs must not be NULL");
  *a = ToMhcaAttrs(*attrs);
  ToTensorArgs(inputs, kMhcaNumInputs, kMhcaNames, kMhcaOptional, in);
  MhcaPlan plan = ValidateCacheAttention(*a, in);  // index inputs copied, then checked
  if (output == nullptr) Fail("MultiHeadCacheAttention: output must not be NULL");
  CheckOutput(*output, "output", in[0].type, in[0].shape);
  CheckCacheAttentionApart(in, output->data);
  return plan;
}

}  // namespace kvcache
