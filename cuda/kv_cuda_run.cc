#include "kv_cuda_run.h"

#include <stdexcept>
#include <string>
#include <vector>

#include "kv_cache_impl.cuh"
#include "rotary_impl.cuh"
#include "rotary_params.h"

namespace kvcache {
namespace cuda {

namespace {

void Check(cudaError_t error, const char* what) {
  if (error != cudaSuccess)
    throw std::runtime_error(std::string("kvcache-op CUDA: ") + what + ": " + cudaGetErrorString(error));
}

struct ScratchBlock {  // returned to the scratch at scope exit (stream order keeps it alive for the kernels)
  DeviceScratch& scratch;
  void* data;
  ScratchBlock(DeviceScratch& s, size_t bytes) : scratch(s), data(bytes ? s.Alloc(bytes) : nullptr) {}
  ~ScratchBlock() {
    if (data) scratch.Free(data);
  }
};

}  // namespace

void RunValidated(const Attrs& a, const CallPlan& plan, int32_t t1, int32_t scale_type, const DeviceTensors& t,
                  cudaStream_t stream, DeviceScratch& scratch) {
  if (plan.batch == 0) return;
  CheckLaunchable(plan);  // before anything is enqueued: a call that cannot run leaves the cache unchanged
  // One host buffer with every index array (the plan's snapshots), copied to the device once. A pageable
  // source is staged by the driver before cudaMemcpyAsync returns, so `host` may go out of scope after.
  const std::vector<int64_t> host = PackIndices(plan);
  ScratchBlock indices(scratch, host.size() * sizeof(int64_t));
  Check(cudaMemcpyAsync(indices.data, host.data(), host.size() * sizeof(int64_t), cudaMemcpyHostToDevice, stream),
        "copying the index inputs");
  const Params p = MakeParams(a, plan, static_cast<const int64_t*>(indices.data), t);
  Check(LaunchKeyValueCache(p, t1, scale_type, static_cast<int>(a.quant_bit), stream), "launching the kernels");
}

void RunRotaryValidated(const RotaryAttrs& a, const RotaryPlan& plan, int32_t cache_type, int32_t scale_type,
                        void* cache, void* scale, cudaStream_t stream, DeviceScratch& scratch) {
  if (plan.slots.empty()) return;
  CheckRotaryLaunchable(a, plan);  // before anything is enqueued
  const std::vector<uint8_t> host = PackRotaryTables(plan);
  ScratchBlock tables(scratch, host.size());
  Check(cudaMemcpyAsync(tables.data, host.data(), host.size(), cudaMemcpyHostToDevice, stream),
        "copying the slots and rotation tables");
  const RotaryParams p = MakeRotaryParams(a, plan, static_cast<const uint8_t*>(tables.data), cache, scale);
  Check(LaunchRotaryShift(p, cache_type, scale_type, static_cast<int>(a.base.quant_bit), stream), "launching the kernel");
}

}  // namespace cuda
}  // namespace kvcache
