// The attention launch's dispatch: the call's element type and rows pick one of the launchers that the generated
// instance files compile (attention_instances.cuh).
#include "attention_impl.cuh"

#include "attention_instances.cuh"
#include "attention_work.h"

namespace kvcache {
namespace cuda {
namespace {

template <class T1>
cudaError_t LaunchCache(const AttnParams& p, int32_t scale_type, int quant_bit, cudaStream_t stream, AttnStep step) {
  const bool f16_scale = scale_type == int32_t(Elem::kFloat16);
  switch (quant_bit) {
    case 0: return LaunchRows<T1, CacheRows<T1, F32, 0>>(p, stream, step);
    case 8:
      return f16_scale ? LaunchRows<T1, CacheRows<T1, F16, 8>>(p, stream, step)
                       : LaunchRows<T1, CacheRows<T1, F32, 8>>(p, stream, step);
    default:
      return f16_scale ? LaunchRows<T1, CacheRows<T1, F16, 4>>(p, stream, step)
                       : LaunchRows<T1, CacheRows<T1, F32, 4>>(p, stream, step);
  }
}

template <class T1>
cudaError_t LaunchFor(const AttnParams& p, int32_t scale_type, int quant_bit, bool cache, cudaStream_t stream,
                      AttnStep step) {
  return cache ? LaunchCache<T1>(p, scale_type, quant_bit, stream, step)
               : LaunchRows<T1, PackedRows<T1>>(p, stream, step);
}

}  // namespace

cudaError_t MmaKernelPtxVersion(int* version) { return MmaPtxVersionOf<F16, PackedRows<F16>>(version); }

cudaError_t LaunchAttention(const AttnParams& p, int32_t t1, int32_t scale_type, int quant_bit, bool cache,
                            cudaStream_t stream, AttnStep step) {
  switch (static_cast<Elem>(t1)) {
    case Elem::kFloat32: return LaunchFor<F32>(p, scale_type, quant_bit, cache, stream, step);
    case Elem::kFloat16: return LaunchFor<F16>(p, scale_type, quant_bit, cache, stream, step);
    default: return LaunchFor<BF16>(p, scale_type, quant_bit, cache, stream, step);
  }
}

}  // namespace cuda
}  // namespace kvcache
