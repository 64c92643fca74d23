// What every CUDA-EP kernel of the library needs from its kernel context: ORT's compute stream (fetched per call)
// and device scratch in that stream's order (kv_cuda_run.h's contract).
#pragma once

#include <stdexcept>

#include "kv_cuda_run.h"
#include "kv_ort_op.h"
#include "launch_errors.h"

namespace kvcache {

// Scratch from ONNX Runtime's device arena, tied to the kernel's compute stream. KernelContext_GetScratchBuffer
// tells the arena which stream will use the block, so after Free the arena hands the block to another stream (a
// concurrent Run, or a second stream of one Run) only once this stream's work is done with it. The context's
// allocator alone (KernelContext_GetAllocator) allocates with no stream, and the arena takes such a block as free for
// any stream the moment it is freed: another Run could write it while this call's kernels still read their index
// words from it. Blocks go back through that allocator, as ONNX Runtime's own kernels return theirs.
struct OrtStreamScratch : cuda::DeviceScratch {
  Ort::KernelContext& ctx;
  const OrtMemoryInfo* memory;
  Ort::Allocator& allocator;
  OrtStreamScratch(Ort::KernelContext& c, const OrtMemoryInfo* m, Ort::Allocator& a)
      : ctx(c), memory(m), allocator(a) {}
  void* Alloc(size_t bytes) override {
    void* data = nullptr;
    Ort::ThrowOnError(Ort::GetApi().KernelContext_GetScratchBuffer(ctx.GetOrtKernelContext(), memory, bytes, &data));
    if (data == nullptr && bytes > 0) throw std::runtime_error("kvcache-op CUDA: ONNX Runtime gave no device scratch");
    return data;
  }
  void Free(void* data) override { allocator.Free(data); }
};

// Runs fn(stream, scratch) on ORT's compute stream with scratch from ORT's device arena in that stream's order.
template <class Fn>
void WithOrtDevice(Ort::KernelContext& ctx, Fn&& fn) {
  auto stream = static_cast<cudaStream_t>(ctx.GetGPUComputeStream());
  const int device = ctx.GetInput(0).GetTensorMemoryInfo().GetDeviceId();
  Ort::MemoryInfo device_memory("Cuda", OrtDeviceAllocator, device, OrtMemTypeDefault);
  const auto* memory = static_cast<const OrtMemoryInfo*>(device_memory);
  Ort::Allocator allocator(ctx.GetAllocator(*memory));
  OrtStreamScratch scratch(ctx, memory, allocator);
  fn(stream, scratch);
}

}  // namespace kvcache
