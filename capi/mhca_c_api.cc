// The C entry point of MultiHeadCacheAttention on host pointers: the ONNX Runtime op's validation and kernel,
// with a caller-allocated output; the cache and scale written in place.
#include <vector>

#include "byte_ranges.h"
#include "c_tensors.h"
#include "kvcache_op.h"
#include "mhca_cpu.h"
#include "stream_scratch.h"

namespace kvcache {
namespace {

const char* const kMhcaNames[kMhcaNumInputs] = {"query",      "current_key", "current_value", "seqstarts", "kvstarts",
                                                "cachestarts", "start_pos", "decoding_batches", "max_seqlen",
                                                "max_kvlen",  "cache",       "scale",         "attn_mask"};
const bool kMhcaOptional[kMhcaNumInputs] = {false, false, false, false, false, false, false,
                                            false, false, false, false, true,  true};

MhcaAttrs ToMhcaAttrs(const KvcacheMultiHeadCacheAttentionAttrs& c) {
  MhcaAttrs a;
  a.cache.num_layer = c.num_layer;
  a.cache.layer_idx = c.layer_idx;
  a.cache.quant_bit = c.quant_bit;
  a.cache.quant_group = c.quant_group;
  a.cache.cache_mode = c.cache_mode;
  a.cache.cache_layout = c.cache_layout;
  a.cache.page_size = c.page_size;
  a.attention.num_heads = c.num_heads;
  a.attention.head_dim = c.head_dim;
  a.attention.is_causal = c.is_causal;
  a.attention.is_alibi = c.is_alibi;
  a.attention.num_kv_heads = c.num_kv_heads;
  a.attention.sliding_window = c.sliding_window;
  a.attention.softmax_scale = c.softmax_scale;
  a.attention.softcap = c.softcap;
  return a;
}

// The validated call, its output checked: nothing is written before this returns.
MhcaPlan ValidateWithOutput(const KvcacheMultiHeadCacheAttentionAttrs* attrs, const KvcacheTensor* inputs,
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

}  // namespace
}  // namespace kvcache

using namespace kvcache;

extern "C" {

void kvcache_op_multi_head_cache_attention_defaults(KvcacheMultiHeadCacheAttentionAttrs* attrs) {
  const MhcaAttrs a;  // the spec's defaults; num_heads and head_dim 0 (required)
  const Attrs& c = a.cache;
  const MhaAttrs& m = a.attention;
  *attrs = KvcacheMultiHeadCacheAttentionAttrs{c.num_layer, c.layer_idx, c.quant_bit, c.quant_group, c.cache_mode,
                                               c.cache_layout, c.page_size, m.num_heads, m.head_dim, m.is_causal,
                                               m.is_alibi, m.num_kv_heads, m.sliding_window, m.softmax_scale,
                                               m.softcap};
}

int32_t kvcache_op_multi_head_cache_attention_cpu(const KvcacheMultiHeadCacheAttentionAttrs* attrs,
                                                  const KvcacheTensor inputs[13], const KvcacheTensor* output,
                                                  int32_t num_threads, char* message, size_t message_size) {
  return CatchAll(
      [&] {
        MhcaAttrs a;
        TensorArg in[kMhcaNumInputs];
        const MhcaPlan plan = ValidateWithOutput(attrs, inputs, output, &a, in);  // nothing written before
        const TensorArg& scale = in[kMhcaScaleInput];
        const MhcaArgs args{&a, &plan, in[0].type, scale.type, in[0].data, in[1].data, in[2].data,
                            const_cast<void*>(in[kMhcaCacheInput].data),
                            scale.present ? const_cast<void*>(scale.data) : nullptr,
                            in[kMhcaMaskInput].present ? in[kMhcaMaskInput].data : nullptr, output->data};
        MhcaComputeCpu(args, [num_threads](size_t n, const std::function<void(size_t)>& fn) {
          ParallelOnThreads(num_threads, n, fn);
        });
      },
      message, message_size);
}

int32_t kvcache_op_multi_head_cache_attention_cuda(const KvcacheMultiHeadCacheAttentionAttrs* attrs,
                                                   const KvcacheTensor inputs[13], const KvcacheTensor* output,
                                                   void* stream, char* message, size_t message_size) {
#ifdef KVCACHE_WITH_CUDA
  return CatchAll(
      [&] {
        MhcaAttrs a;
        TensorArg in[kMhcaNumInputs];
        const MhcaPlan plan = ValidateWithOutput(attrs, inputs, output, &a, in);  // nothing written before
        StreamScratch scratch(static_cast<cudaStream_t>(stream));
        const TensorArg &scale = in[kMhcaScaleInput], &mask = in[kMhcaMaskInput];
        const cuda::AttnTensors tensors{in[0].data, nullptr, nullptr, in[kMhcaCacheInput].data,
                                        scale.present ? scale.data : nullptr, mask.present ? mask.data : nullptr,
                                        output->data};
        cuda::RunCacheAttentionValidated(a, plan, in[0].type, scale.type, in[1].data, in[2].data, tensors,
                                         static_cast<cudaStream_t>(stream), scratch);
      },
      message, message_size);
#else
  (void)attrs, (void)inputs, (void)output, (void)stream;
  WriteMessage(kNoCuda, message, message_size);
  return KVCACHE_OP_UNAVAILABLE;
#endif
}

}  // extern "C"
