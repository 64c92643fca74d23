// CUDA glue of the attention ops: every index is validated on the host (the index inputs are host-resident),
// then the shared GPU path (cuda/kv_cuda_run.h) copies the snapshots and the planned tiles to the device in one
// transfer on ORT's compute stream, with scratch from ORT's device allocator. Nothing is written before
// validation succeeds.
#include "mha_ort_cuda_op.h"

#include "ort_cuda_device.h"

namespace kvcache {
OrtStatusPtr MhaCudaKernel::ComputeV2(OrtKernelContext* context) {
  try {
    Ort::KernelContext ctx(context);
    MhaCall call;
    PrepareMhaCall(ctx, attrs, &call);
    const TensorArg* in = call.in;
    const cuda::AttnTensors tensors{in[0].data, in[1].data, in[2].data, nullptr, nullptr, call.Mask(), call.out};
    WithOrtDevice(ctx, [&](cudaStream_t stream, cuda::DeviceScratch& scratch) {
      cuda::RunAttentionValidated(attrs, call.plan, in[0].type, tensors, stream, scratch);
    });
    return nullptr;
  } catch (...) {
    return StatusFromCurrentException();
  }
}

OrtStatusPtr MhcaCudaKernel::ComputeV2(OrtKernelContext* context) {
  try {
    Ort::KernelContext ctx(context);
    MhcaCall call;
    PrepareMhcaCall(ctx, attrs, &call);
    const TensorArg* in = call.in;
    const cuda::AttnTensors tensors{in[0].data, nullptr, nullptr, call.Cache(), call.Scale(), call.Mask(), call.out};
    WithOrtDevice(ctx, [&](cudaStream_t stream, cuda::DeviceScratch& scratch) {
      cuda::RunCacheAttentionValidated(attrs, call.plan, in[0].type, in[kMhcaScaleInput].type, in[1].data, in[2].data,
                                       tensors, stream, scratch);
    });
    return nullptr;
  } catch (...) {
    return StatusFromCurrentException();
  }
}

}  // namespace kvcache
