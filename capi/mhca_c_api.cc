// The C entry points of MultiHeadCacheAttention: the ONNX Runtime op's validation and kernels (CPU on host pointers,
// CUDA on device pointers), with a caller-allocated output; the cache and scale written in place.
#include "attention_c_args.h"
#include "c_tensors.h"
#include "kvcache_op.h"
#include "mhca_cpu.h"
#include "stream_scratch.h"

using namespace kvcache;

extern "C" {

void kvcache_op_multi_head_cache_attention_defaults(KvcacheMultiHeadCacheAttentionAttrs* attrs) {
  if (attrs == nullptr) return;  // nothing to fill; every other entry point refuses a null pointer too
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
        const DescriptorSnapshot<1> out(output);
        const MhcaPlan plan = ValidateMhcaWithOutput(attrs, inputs, out.get(), &a, in);  // nothing written before
        const TensorArg& scale = in[kMhcaScaleInput];
        const MhcaArgs args{&a, &plan, in[0].type, scale.type, in[0].data, in[1].data, in[2].data,
                            const_cast<void*>(in[kMhcaCacheInput].data),
                            scale.present ? const_cast<void*>(scale.data) : nullptr,
                            in[kMhcaMaskInput].present ? in[kMhcaMaskInput].data : nullptr, out.get()->data};
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
        const DescriptorSnapshot<1> out(output);
        const MhcaPlan plan = ValidateMhcaWithOutput(attrs, inputs, out.get(), &a, in);  // nothing written before
        StreamScratch scratch(static_cast<cudaStream_t>(stream));
        const TensorArg &scale = in[kMhcaScaleInput], &mask = in[kMhcaMaskInput];
        const cuda::AttnTensors tensors{in[0].data, nullptr, nullptr, in[kMhcaCacheInput].data,
                                        scale.present ? scale.data : nullptr, mask.present ? mask.data : nullptr,
                                        out.get()->data};
        cuda::RunCacheAttentionValidated(a, plan, in[0].type, scale.type, in[1].data, in[2].data, tensors,
                                         static_cast<cudaStream_t>(stream), scratch);
      },
      message, message_size);
#else
  (void)attrs, (void)inputs, (void)output, (void)stream;
  return NoCuda(message, message_size);
#endif
}

}  // extern "C"
