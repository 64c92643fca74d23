// CUDA glue: every index is validated on the host (the index inputs are host-resident), the
// validated copies are sent to the device in one transfer on ORT's compute stream, then the kernels run
// on that stream. Nothing is written before validation succeeds.
#include "kv_ort_cuda_op.h"

#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "kv_cache_impl.cuh"

namespace kvcache {

namespace {

void Check(cudaError_t error, const char* what) {
  if (error != cudaSuccess) throw std::runtime_error(std::string("KeyValueCache CUDA: ") + what + ": " +
                                                     cudaGetErrorString(error));
}

struct DeviceBuffer {  // scratch from ORT's allocator for the device, returned at scope exit
  Ort::Allocator& allocator;
  void* data;
  DeviceBuffer(Ort::Allocator& a, size_t bytes) : allocator(a), data(bytes ? a.Alloc(bytes) : nullptr) {}
  ~DeviceBuffer() {
    if (data) allocator.Free(data);
  }
};

}  // namespace

OrtStatusPtr CudaKernel::ComputeV2(OrtKernelContext* context) {
  try {
    Ort::KernelContext ctx(context);
    TensorArg in[kNumInputs];
    ReadInputs(ctx, in);
    const CallPlan plan = ValidateCall(attrs, in);  // host data only: throws before anything is written
    const std::vector<int64_t> out_shape{plan.kv_tokens, plan.heads * attrs.num_repeat, plan.head_dim};
    auto key = ctx.GetOutput(0, out_shape);
    auto value = ctx.GetOutput(1, out_shape);
    if (plan.batch == 0) return nullptr;

    // One host buffer with every index array, copied once.
    const int64_t table = attrs.cache_mode == 0 ? plan.batch : plan.batch * plan.max_p;
    std::vector<int64_t> host;
    host.reserve(3 * plan.batch + 2 + table);
    host.insert(host.end(), plan.seqstarts, plan.seqstarts + plan.batch + 1);
    host.insert(host.end(), plan.kvstarts, plan.kvstarts + plan.batch + 1);
    host.insert(host.end(), plan.start_pos, plan.start_pos + plan.batch);
    host.insert(host.end(), plan.cachestarts, plan.cachestarts + table);

    auto stream = static_cast<cudaStream_t>(ctx.GetGPUComputeStream());
    const int device = ctx.GetInput(0).GetTensorMemoryInfo().GetDeviceId();
    Ort::MemoryInfo device_memory("Cuda", OrtDeviceAllocator, device, OrtMemTypeDefault);
    Ort::Allocator allocator(ctx.GetAllocator(*static_cast<const OrtMemoryInfo*>(device_memory)));
    DeviceBuffer indices(allocator, host.size() * sizeof(int64_t));
    Check(cudaMemcpyAsync(indices.data, host.data(), host.size() * sizeof(int64_t), cudaMemcpyHostToDevice, stream),
          "copying the index inputs");
    const auto* d = static_cast<const int64_t*>(indices.data);

    // Launch bounds: the longest sequence (validated <= max_seqlen / max_kvlen).
    int64_t longest_seq = 0, longest_kv = 0;
    for (int64_t b = 0; b < plan.batch; ++b) {
      longest_seq = std::max(longest_seq, plan.seqstarts[b + 1] - plan.seqstarts[b]);
      longest_kv = std::max(longest_kv, plan.kvstarts[b + 1] - plan.kvstarts[b]);
    }
    cuda::Params p{};
    p.layer_idx = attrs.layer_idx;
    p.quant_group = attrs.quant_group;
    p.num_repeat = attrs.num_repeat;
    p.cache_mode = attrs.cache_mode;
    p.page_size = attrs.page_size;
    p.batch = plan.batch;
    p.heads = plan.heads;
    p.head_dim = plan.head_dim;
    p.max_p = plan.max_p;
    p.max_seqlen = longest_seq;
    p.max_kvlen = longest_kv;
    p.cache_rows = {plan.cache_rows.layer, plan.cache_rows.kv, plan.cache_rows.head, plan.cache_rows.slot};
    p.scale_rows = {plan.scale_rows.layer, plan.scale_rows.kv, plan.scale_rows.head, plan.scale_rows.slot};
    p.seqstarts = d;
    p.kvstarts = d + plan.batch + 1;
    p.start_pos = d + 2 * (plan.batch + 1);
    p.cachestarts = d + 3 * plan.batch + 2;
    p.key = in[0].data;
    p.value = in[1].data;
    p.cache = const_cast<void*>(in[8].data);  // written in place (spec: in-out input)
    p.scale = in[kScaleInput].present ? const_cast<void*>(in[kScaleInput].data) : nullptr;
    p.out_key = key.GetTensorMutableRawData();
    p.out_value = value.GetTensorMutableRawData();
    Check(cuda::LaunchKeyValueCache(p, in[0].type, in[kScaleInput].type, static_cast<int>(attrs.quant_bit), stream),
          "launching the kernels");
    // The index scratch is returned to ORT's stream-ordered arena after the launches were enqueued.
    return nullptr;
  } catch (...) {
    return StatusFromCurrentException();
  }
}

}  // namespace kvcache
