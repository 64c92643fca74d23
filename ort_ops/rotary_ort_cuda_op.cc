// CUDA glue of KeyCacheRotaryShift: slots, cos and sin are host inputs, validated and snapshotted there;
// the shared GPU path (cuda/kv_cuda_run.h) copies the snapshots to the device on ORT's compute stream and
// rotates there. The output (the slots as given) is device memory, copied from the snapshot.
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
      cuda::RefuseGraphCapture(stream, "KeyCacheRotaryShift");  // before the copy below is enqueued
      // slots_out first: a copy that fails after the rotation would fail the call with the cache already rotated.
      // A pageable source is staged by the driver before cudaMemcpyAsync returns: the plan may go.
      if (cudaError_t e = cudaMemcpyAsync(out, plan.slots.data(), plan.slots.size() * sizeof(int64_t),
                                          cudaMemcpyHostToDevice, stream);
          e != cudaSuccess) {
        cuda::DropError();
        throw std::runtime_error(std::string("kvcache-op CUDA: copying slots_out: ") + cudaGetErrorString(e));
      }
      cuda::RunRotaryValidated(attrs, plan, in[0].type, in[1].type, const_cast<void*>(in[0].data),
                               in[1].present ? const_cast<void*>(in[1].data) : nullptr, stream, scratch);
    });
    return nullptr;
  } catch (...) {
    return StatusFromCurrentException();
  }
}

}  // namespace kvcache
