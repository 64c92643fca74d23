// Launcher of the KeyValueCache CUDA kernels over raw device pointers (framework-free).
// The caller has validated every index on the host (kv_validate.h) and built the Params from the plan
// (kv_cuda_params.h); the index arrays in Params are device copies of the validated snapshots.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kv_cache_work.h"

namespace kvcache {
namespace cuda {

// Stores then gathers on `stream` (never the default stream). t1 / scale_type are ONNX element types;
// quant_bit 0, 4 or 8. Returns the first launch error.
cudaError_t LaunchKeyValueCache(const Params& params, int32_t t1, int32_t scale_type, int quant_bit,
                                cudaStream_t stream);

// The stores alone (the output pointers are not used).
cudaError_t LaunchKeyValueStores(const Params& params, int32_t t1, int32_t scale_type, int quant_bit,
                                 cudaStream_t stream);

}  // namespace cuda
}  // namespace kvcache
