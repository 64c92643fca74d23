// CUDA glue: every index is validated on the host (the index inputs are host-resident), the
// validated copies are sent to the device in one transfer on ORT's compute stream, then the kernels run
// on that stream. Nothing is written before validation succeeds.
#include "kv_ort_cuda_op.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <vector>

#include "kv_cache_impl.cuh"
#include "kv_checked.h"

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

// Length of the longest sequence of a validated starts vector.
int64_t Longest(const std::vector<int64_t>& starts) {
  int64_t longest = 0;
  for (size_t b = 0; b + 1 < starts.size(); ++b) longest = std::max(longest, starts[b + 1] - starts[b]);
  return longest;
}

// The grids of the kernels (kv_cache_impl.cu): x = ceil(longest sequence / 8) < 2^31, y = batch <= 65535,
// and the per-block work counter 16 * H * num_repeat * Dh fits in int64. Checked before the first
// launch, so a call that cannot run fails with the cache unchanged instead of after the stores.
void CheckLaunchable(const CallPlan& plan, int64_t longest) {
  if (plan.batch > 65535)
    Fail("KeyValueCache on CUDA runs at most 65535 sequences per call, got B = ", plan.batch);
  if ((longest + 7) / 8 > 0x7fffffff)
    Fail("KeyValueCache on CUDA runs sequences of at most 2^34 tokens, got ", longest);
  int64_t work = 0;
  if (!MulFits(plan.out_heads, plan.head_dim, &work) || !MulFits(work, 16, &work))
    Fail("KeyValueCache on CUDA: H*num_repeat*Dh = ", plan.out_heads, "*", plan.head_dim, " is too large");
}

}  // namespace

OrtStatusPtr CudaKernel::ComputeV2(OrtKernelContext* context) {
  try {
    Ort::KernelContext ctx(context);
    TensorArg in[kNumInputs];
    ReadInputs(ctx, in);
    // Host data only; the plan owns the snapshots of the index inputs. Throws before anything is written.
    const CallPlan plan = ValidateCall(attrs, in);
    auto key = AllocateOutput(ctx, 0, plan, in[0].type);
    auto value = AllocateOutput(ctx, 1, plan, in[0].type);
    if (plan.batch == 0) return nullptr;
    // Launch bounds: the longest sequence (validated <= max_seqlen / max_kvlen).
    const int64_t longest_seq = Longest(plan.seqstarts), longest_kv = Longest(plan.kvstarts);
    CheckLaunchable(plan, std::max(longest_seq, longest_kv));

    // One host buffer with every index array (from the plan's snapshots), copied to the device once.
    std::vector<int64_t> host;
    host.reserve(plan.seqstarts.size() + plan.kvstarts.size() + plan.start_pos.size() + plan.cachestarts.size());
    for (const auto* part : {&plan.seqstarts, &plan.kvstarts, &plan.start_pos, &plan.cachestarts})
      host.insert(host.end(), part->begin(), part->end());

    auto stream = static_cast<cudaStream_t>(ctx.GetGPUComputeStream());
    const int device = ctx.GetInput(0).GetTensorMemoryInfo().GetDeviceId();
    Ort::MemoryInfo device_memory("Cuda", OrtDeviceAllocator, device, OrtMemTypeDefault);
    Ort::Allocator allocator(ctx.GetAllocator(*static_cast<const OrtMemoryInfo*>(device_memory)));
    DeviceBuffer indices(allocator, host.size() * sizeof(int64_t));
    Check(cudaMemcpyAsync(indices.data, host.data(), host.size() * sizeof(int64_t), cudaMemcpyHostToDevice, stream),
          "copying the index inputs");
    const auto* d = static_cast<const int64_t*>(indices.data);

    cuda::Params p{};
    p.layer_idx = attrs.layer_idx;
    p.quant_group = attrs.quant_group;
    p.num_repeat = attrs.num_repeat;
    p.out_heads = plan.out_heads;
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
