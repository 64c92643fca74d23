// What every CUDA-EP kernel of the library needs from its kernel context: ORT's compute stream (fetched per call)
// and device scratch from ORT's allocator for the device of input 0 (stream-ordered: kv_cuda_run.h's contract).
#pragma once

#include "kv_cuda_run.h"
#include "kv_ort_op.h"

namespace kvcache {

// Runs fn(stream, scratch) on ORT's compute stream with a scratch of ORT's device allocator.
template <class Fn>
void WithOrtDevice(Ort::KernelContext& ctx, Fn&& fn) {
  auto stream = static_cast<cudaStream_t>(ctx.GetGPUComputeStream());
  const int device = ctx.GetInput(0).GetTensorMemoryInfo().GetDeviceId();
  Ort::MemoryInfo device_memory("Cuda", OrtDeviceAllocator, device, OrtMemTypeDefault);
  Ort::Allocator allocator(ctx.GetAllocator(*static_cast<const OrtMemoryInfo*>(device_memory)));
  cuda::AllocatorScratch scratch(allocator);
  fn(stream, scratch);
}

}  // namespace kvcache
