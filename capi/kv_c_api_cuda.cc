// The CUDA C entry point. In a build without CUDA it exists too and answers KVCACHE_OP_UNAVAILABLE, so
// callers can link against one symbol set whatever the build.
#include "c_tensors.h"
#include "kvcache_op.h"
#include "rotary_c_args.h"
#include "stream_scratch.h"

using namespace kvcache;

extern "C" {

int32_t kvcache_op_has_cuda(void) {
#ifdef KVCACHE_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}

int32_t kvcache_op_key_value_cache_cuda(const KvcacheKeyValueCacheAttrs* attrs, const KvcacheTensor inputs[10],
                                        const KvcacheTensor outputs[2], void* stream, char* message,
                                        size_t message_size) {
#ifdef KVCACHE_WITH_CUDA
  return CatchAll(
      [&] {
        Attrs a;
        TensorArg in[10];
        const DescriptorSnapshot<2> out(outputs);
        const CallPlan plan = ValidateWithOutputs(attrs, inputs, out.get(), &a, in);  // nothing written before
        StreamScratch scratch(static_cast<cudaStream_t>(stream));
        const cuda::DeviceTensors tensors{in[0].data, in[1].data, const_cast<void*>(in[8].data),
                                          in[9].present ? const_cast<void*>(in[9].data) : nullptr, out.get()[0].data,
                                          out.get()[1].data};
        cuda::RunValidated(a, plan, in[0].type, in[9].type, tensors, static_cast<cudaStream_t>(stream), scratch);
      },
      message, message_size);
#else
  (void)attrs, (void)inputs, (void)outputs, (void)stream;
  return NoCuda(message, message_size);
#endif
}

int32_t kvcache_op_key_cache_rotary_shift_cuda(const KvcacheRotaryShiftAttrs* attrs, const KvcacheTensor inputs[5],
                                               const KvcacheTensor* output, void* stream, char* message,
                                               size_t message_size) {
#ifdef KVCACHE_WITH_CUDA
  return CatchAll(
      [&] {
        RotaryAttrs a;
        TensorArg in[5];
        const DescriptorSnapshot<1> out(output);
        const RotaryPlan plan = ValidateRotaryWithOutput(attrs, inputs, out.get(), &a, in);  // nothing written before
        StreamScratch scratch(static_cast<cudaStream_t>(stream));
        cuda::RunRotaryValidated(a, plan, in[0].type, in[1].type, const_cast<void*>(in[0].data),
                                 in[1].present ? const_cast<void*>(in[1].data) : nullptr,
                                 static_cast<cudaStream_t>(stream), scratch);
        WriteSlots(plan, out.get());
      },
      message, message_size);
#else
  (void)attrs, (void)inputs, (void)output, (void)stream;
  return NoCuda(message, message_size);
#endif
}

}  // extern "C"
