// Launchers of the attention CUDA kernels over raw device pointers (framework-free). The caller has validated the
// call on the host and planned it (attention_params.h); the index and work arrays in the params are device copies.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "attention_instances.cuh"
#include "attention_launch.h"

namespace kvcache {
namespace cuda {

// kLaunch: the tile, decode and tensor-core kernels, then the merge kernel when tiles were split, on `stream` (never
// the default stream); returns the first launch error. kPrepare (before anything of the call is enqueued): what may
// fail short of launching, done for that call. t1 and scale_type are ONNX element types; `cache`: keys and values
// from the cache (quant_bit 0, 4 or 8) rather than MultiHeadAttention's packed rows.
cudaError_t LaunchAttention(const AttnParams& params, int32_t t1, int32_t scale_type, int quant_bit, bool cache,
                            cudaStream_t stream, AttnStep step);

// The PTX architecture the tensor-core kernels were compiled for on the current device (e.g. 90), read from the
// kernel as the driver loaded it: below 80 their products are not there (a build without sm_80 code, JIT-compiled).
cudaError_t MmaKernelPtxVersion(int* version);

}  // namespace cuda
}  // namespace kvcache
