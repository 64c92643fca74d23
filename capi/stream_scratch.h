// What the CUDA C entry points share: device scratch from the CUDA runtime's stream-ordered allocator (in a CUDA
// build), and the answer of a build without CUDA.
#pragma once

#include "c_tensors.h"
#include "kvcache_op.h"

#ifdef KVCACHE_WITH_CUDA
#include <stdexcept>
#include <string>

#include "kv_cuda_run.h"
#include "launch_errors.h"
#endif

namespace kvcache {

// A CUDA entry's answer in a build without CUDA: KVCACHE_OP_UNAVAILABLE, and the message saying why.
inline int32_t NoCuda(char* message, size_t message_size) {
  WriteMessage("this build of kvcache-op has no CUDA kernels (build it where nvcc is found, KVCACHE_OP_CUDA=1)",
               message, message_size);
  return KVCACHE_OP_UNAVAILABLE;
}

#ifdef KVCACHE_WITH_CUDA
struct StreamScratch : cuda::DeviceScratch {  // stream-ordered allocations of the CUDA runtime
  cudaStream_t stream;
  explicit StreamScratch(cudaStream_t s) : stream(s) {}
  void* Alloc(size_t bytes) override {
    void* data = nullptr;
    if (cudaError_t e = cudaMallocAsync(&data, bytes, stream); e != cudaSuccess) {
      cuda::DropError();  // reported here, not again as a later call's launch error
      throw std::runtime_error(std::string("kvcache-op CUDA: allocating scratch: ") + cudaGetErrorString(e));
    }
    return data;
  }
  // A free that fails (the stream broken) leaks the block; its error must not become a later launch's.
  void Free(void* data) override {
    if (cudaFreeAsync(data, stream) != cudaSuccess) cuda::DropError();
  }
};
#endif

}  // namespace kvcache
