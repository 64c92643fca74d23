// The C entry point of MultiHeadAttention on host pointers: the ONNX Runtime op's validation and kernel,
// with a caller-allocated output.
#include <vector>

#include "c_tensors.h"
#include "kvcache_op.h"
#include "mha_cpu.h"
#include "stream_scratch.h"

namespace kvcache {
namespace {

const char* const kMhaNames[kMhaNumInputs] = {"query",    "key",        "value",     "seqstarts", "kvstarts",
                                              "decoding_batches", "max_seqlen", "max_kvlen", "attn_mask"};
const bool kMhaOptional[kMhaNumInputs] = {false, false, false, false, false, false, false, false, true};

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

// The output must be query's type and shape, and share no memory with what the kernel reads meanwhile.
void CheckMhaOutput(const KvcacheTensor* output, const TensorArg* in) {
  if (output == nullptr) Fail("MultiHeadAttention: output must not be NULL");
  CheckOutput(*output, "output attention_output", in[0].type, in[0].shape);
  CheckAttentionOutputApart(in, output->data);
}

}  // namespace
}  // namespace kvcache

using namespace kvcache;

extern "C" {

void kvcache_op_multi_head_attention_defaults(KvcacheMultiHeadAttentionAttrs* attrs) {
  const MhaAttrs a;  // the spec's defaults; num_heads and head_dim 0 (required)
  *attrs = KvcacheMultiHeadAttentionAttrs{a.num_heads, a.head_dim, a.is_causal, a.is_alibi, a.num_kv_heads,
                                          a.sliding_window, a.softmax_scale, a.softcap};
}

int32_t kvcache_op_multi_head_attention_cpu(const KvcacheMultiHeadAttentionAttrs* attrs, const KvcacheTensor inputs[9],
                                            const KvcacheTensor* output, int32_t num_threads, char* message,
                                            size_t message_size) {
  return CatchAll(
      [&] {
        if (attrs == nullptr || inputs == nullptr) Fail("MultiHeadAttention: attrs and inputs must not be NULL");
        const MhaAttrs a = ToMhaAttrs(*attrs);
        TensorArg in[kMhaNumInputs];
        ToTensorArgs(inputs, kMhaNumInputs, kMhaNames, kMhaOptional, in);
        const MhaPlan plan = ValidateAttention(a, in);  // index inputs snapshotted, then checked
        CheckMhaOutput(output, in);                     // nothing written before this passes
        const MhaArgs args{&a, &plan, in[0].type, in[0].data, in[1].data, in[2].data,
                           in[kMhaMaskInput].present ? in[kMhaMaskInput].data : nullptr, output->data};
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
        if (attrs == nullptr || inputs == nullptr) Fail("MultiHeadAttention: attrs and inputs must not be NULL");
        const MhaAttrs a = ToMhaAttrs(*attrs);
        TensorArg in[kMhaNumInputs];
        ToTensorArgs(inputs, kMhaNumInputs, kMhaNames, kMhaOptional, in);
        const MhaPlan plan = ValidateAttention(a, in);  // index inputs snapshotted, then checked
        CheckMhaOutput(output, in);                     // nothing written before this passes
        StreamScratch scratch(static_cast<cudaStream_t>(stream));
        const cuda::AttnTensors tensors{in[0].data, in[1].data, in[2].data, nullptr, nullptr,
                                        in[kMhaMaskInput].present ? in[kMhaMaskInput].data : nullptr, output->data};
        cuda::RunAttentionValidated(a, plan, in[0].type, tensors, static_cast<cudaStream_t>(stream), scratch);
      },
      message, message_size);
#else
  (void)attrs, (void)inputs, (void)output, (void)stream;
  WriteMessage(kNoCuda, message, message_size);
  return KVCACHE_OP_UNAVAILABLE;
#endif
}

}  // extern "C"
