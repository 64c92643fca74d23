// CUDA glue: every index is validated on the host (the index inputs are host-resident), then the shared
// GPU path (cuda/kv_cuda_run.h) copies the validated snapshots to the device in one transfer on ORT's
// compute stream and launches the kernels on that stream. Nothing is written before validation succeeds.
#include "kv_ort_cuda_op.h"

#include "byte_ranges.h"
#include "ort_cuda_device.h"

namespace kvcache {

OrtStatusPtr CudaKernel::ComputeV2(OrtKernelContext* context) {
  try {
    Ort::KernelContext ctx(context);
    TensorArg in[kNumInputs];
    ReadInputs(ctx, in);
    // Host data only; the plan owns the snapshots of the index inputs. Throws before anything is written.
    const CallPlan plan = ValidateCall(attrs, in);
    auto key = AllocateOutput(ctx, 0, plan, in[0].type);
    auto value = AllocateOutput(ctx, 1, plan, in[0].type);
    CheckKeyValueBuffersApart(in, key.GetTensorMutableRawData(), value.GetTensorMutableRawData(), plan.out_bytes);
    if (plan.batch == 0) return nullptr;
    const cuda::DeviceTensors tensors{in[0].data, in[1].data,
                                      const_cast<void*>(in[8].data),  // written in place (spec: in-out input)
                                      in[kScaleInput].present ? const_cast<void*>(in[kScaleInput].data) : nullptr,
                                      key.GetTensorMutableRawData(), value.GetTensorMutableRawData()};
    WithOrtDevice(ctx, [&](cudaStream_t stream, cuda::DeviceScratch& scratch) {
      cuda::RunValidated(attrs, plan, in[0].type, in[kScaleInput].type, tensors, stream, scratch);
    });
    return nullptr;
  } catch (...) {
    return StatusFromCurrentException();
  }
}

}  // namespace kvcache
