// The KeyCacheRotaryShift kernel: a thin wrapper that maps (block, thread) to RotaryThread
// (rotary_work.h). Built with -fmad=false like the KeyValueCache kernels: the spec's float32 arithmetic.
#include "rotary_impl.cuh"

#include "device_mem.cuh"
#include "launch_errors.h"

namespace kvcache {
namespace cuda {
namespace {

template <class T2, class T3, int QBits>
__global__ void __launch_bounds__(kThreads) RotaryKernel(RotaryParams p) {
  DeviceMem<RotaryParams> mem{p};
  RotaryThread<T2, T3, QBits>(p, mem, blockIdx.x, threadIdx.x, blockDim.x);
}

struct RotaryLauncher {
  const RotaryParams& p;
  cudaStream_t stream;
  template <class T2, class T3, int QBits>
  cudaError_t Run() const {
    const Grid grid = RotaryGrid(p);  // checked against the launch limits on the host (CheckRotaryLaunchable)
    if (grid.Empty()) return cudaSuccess;
    return Launched([&] {
      RotaryKernel<T2, T3, QBits><<<static_cast<unsigned>(grid.blocks_x), static_cast<unsigned>(grid.threads), 0,
                                    stream>>>(p);
    });
  }
};

}  // namespace

cudaError_t LaunchRotaryShift(const RotaryParams& p, int32_t cache_type, int32_t scale_type, int quant_bit,
                              cudaStream_t stream) {
  return DispatchRotaryTypes(cache_type, scale_type, quant_bit, RotaryLauncher{p, stream});
}

}  // namespace cuda
}  // namespace kvcache
