// CUDA glue of KeyCacheRotaryShift: slots, cos and sin are host inputs, validated and snapshotted there;
// the shared GPU path (cuda/kv_cuda_run.h) copies the snapshots to the device on ORT's compute stream and
// rotates there. The output (the slots as given) is device memory, which that path fills from the snapshot.
#include "rotary_ort_cuda_op.h"

#include "ort_cuda_device.h"

namespace kvcache {

OrtStatusPtr RotaryCudaKernel::ComputeV2(OrtKernelContext* context) {
  try {
    Ort::KernelContext ctx(context);
    TensorArg in[5];
    void* out = nullptr;
    const RotaryPlan plan = ValidateAndAllocate(ctx, attrs, in, &out);
    if (plan.slots.empty()) return nullptr;
    WithOrtDevice(ctx, [&](cudaStream_t stream, cuda::DeviceScratch& scratch) {
      cuda::RunRotaryValidated(attrs, plan, in[0].type, in[1].type, const_cast<void*>(in[0].data),
                               in[1].present ? const_cast<void*>(in[1].data) : nullptr, stream, scratch,
                               static_cast<int64_t*>(out));
    });
    return nullptr;
  } catch (...) {
    return StatusFromCurrentException();
  }
}

}  // namespace kvcache
