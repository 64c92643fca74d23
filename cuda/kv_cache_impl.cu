// Kernels of KeyValueCache: thin wrappers that map (block, thread) to the per-thread work of
// kv_cache_work.h. Arithmetic is the spec's: float32, the stored scale used to quantize, round to
// nearest even everywhere, no contraction (built with -fmad=false, no fast math). The conversions and
// quantization helpers are the same functions the CPU kernel uses, except one: dequantized values that
// cannot be NaN are rounded to float16 / bfloat16 two at a time by the GPU's own conversion instruction
// (PackTwoNotNaN), which gives the same bits for every input but NaN.
#include "kv_cache_impl.cuh"

#include "device_mem.cuh"
#include "launch_errors.h"

namespace kvcache {
namespace cuda {
namespace {

template <class T1, class T3, int QBits>
__global__ void __launch_bounds__(kThreads) StoreKernel(Params p, int64_t unit) {
  DeviceMem<Params> mem{p};
  StoreThread<T1, T3, QBits>(p, mem, unit, blockIdx.x, blockIdx.y, threadIdx.x, blockDim.x);
}

template <class T1, class T3, int QBits>
__global__ void __launch_bounds__(kThreads) GatherKernel(Params p, int64_t unit) {
  DeviceMem<Params> mem{p};
  GatherThread<T1, T3, QBits>(p, mem, unit, blockIdx.x, blockIdx.y, threadIdx.x, blockDim.x);
}

dim3 GridDim(const Grid& g) { return dim3(static_cast<unsigned>(g.blocks_x), static_cast<unsigned>(g.blocks_y)); }

struct Launcher {
  const Params& p;
  int quant_bit;
  cudaStream_t stream;
  bool gather;  // false: the stores alone (MultiHeadCacheAttention reads the cache in place)

  template <class T1, class T3, int QBits>
  cudaError_t Run() const {
    // The grids were checked against the device limits on the host (CheckLaunchable).
    const Grid store = StoreGrid(p, QBits);
    if (!store.Empty()) {
      if (cudaError_t e = Launched([&] {
            StoreKernel<T1, T3, QBits><<<GridDim(store), static_cast<unsigned>(store.threads), 0, stream>>>(p,
                                                                                                       store.unit);
          });
          e != cudaSuccess)
        return e;
    }
    const Grid gather = GatherGrid(p);
    if (this->gather && !gather.Empty()) {
      if (cudaError_t e = Launched([&] {
            GatherKernel<T1, T3, QBits><<<GridDim(gather), static_cast<unsigned>(gather.threads), 0, stream>>>(p,
                                                                                                         gather.unit);
          });
          e != cudaSuccess)
        return e;
    }
    return cudaSuccess;
  }
};

}  // namespace

cudaError_t LaunchKeyValueCache(const Params& p, int32_t t1, int32_t scale_type, int quant_bit, cudaStream_t stream) {
  return DispatchTypes(t1, scale_type, quant_bit, Launcher{p, quant_bit, stream, true});
}

cudaError_t LaunchKeyValueStores(const Params& p, int32_t t1, int32_t scale_type, int quant_bit, cudaStream_t stream) {
  return DispatchTypes(t1, scale_type, quant_bit, Launcher{p, quant_bit, stream, false});
}

}  // namespace cuda
}  // namespace kvcache
