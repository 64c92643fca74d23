// The C entry points of MultiHeadAttention: the ONNX Runtime op's validation and kernels (CPU on host pointers,
// CUDA on device pointers), with a caller-allocated output.
#include "attention_c_args.h"
#include "c_tensors.h"
#include "kvcache_op.h"
#include "mha_cpu.h"
#include "stream_scratch.h"

using namespace kvcache;

extern "C" {

void kvcache_op_multi_head_attention_defaults(KvcacheMultiHeadAttentionAttrs* attrs) {
  if (attrs == nullptr) return;  // nothing to fill; every other entry point refuses a null pointer too
  const MhaAttrs a;  // the spec's defaults; num_heads and head_dim 0 (required)
  *attrs = KvcacheMultiHeadAttentionAttrs{a.num_heads, a.head_dim, a.is_causal, a.is_alibi, a.num_kv_heads,
                                          a.sliding_window, a.softmax_scale, a.softcap};
}

int32_t kvcache_op_multi_head_attention_cpu(const KvcacheMultiHeadAttentionAttrs* attrs, const KvcacheTensor inputs[9],
                                            const KvcacheTensor* output, int32_t num_threads, char* message,
                                            size_t message_size) {
  return CatchAll(
      [&] {
        MhaAttrs a;
        TensorArg in[kMhaNumInputs];
        const DescriptorSnapshot<1> out(output);
        const MhaPlan plan = ValidateMhaWithOutput(attrs, inputs, out.get(), &a, in);  // nothing written before
        const MhaArgs args{&a, &plan, in[0].type, in[0].data, in[1].data, in[2].data,
                           in[kMhaMaskInput].present ? in[kMhaMaskInput].data : nullptr, out.get()->data};
        MhaComputeCpu(args, [num_threads](size_t n, const std::function<void(size_t)>& fn) {
          ParallelOnThreads(num_threads, n, fn);
        });
      },
      message, message_size);
}

int32_t kvcache_op_multi_head_attention_cuda(const KvcacheMultiHeadAttentionAttrs* attrs,
                                             const KvcacheTensor inputs[9], const KvcacheTensor* output, void* stream,
                                             char* message, size_t message_size) {
#ifdef KVCACHE_WITH_CUDA
  return CatchAll(
      [&] {
        MhaAttrs a;
        TensorArg in[kMhaNumInputs];
        const DescriptorSnapshot<1> out(output);
        const MhaPlan plan = ValidateMhaWithOutput(attrs, inputs, out.get(), &a, in);  // nothing written before
        StreamScratch scratch(static_cast<cudaStream_t>(stream));
        const cuda::AttnTensors tensors{in[0].data, in[1].data, in[2].data, nullptr, nullptr,
                                        in[kMhaMaskInput].present ? in[kMhaMaskInput].data : nullptr, out.get()->data};
        cuda::RunAttentionValidated(a, plan, in[0].type, tensors, static_cast<cudaStream_t>(stream), scratch);
      },
      message, message_size);
#else
  (void)attrs, (void)inputs, (void)output, (void)stream;
  return NoCuda(message, message_size);
#endif
}

}  // extern "C"
