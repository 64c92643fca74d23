// Launchers of the attention CUDA kernels over raw device pointers (framework-free). The caller has validated the
// call on the host and planned it (attention_params.h); the index and work arrays in the params are device copies.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "attention_launch.h"

namespace kvcache {
namespace cuda {

// The tile kernel, then the merge kernel when tiles were split, on `stream` (never the default stream). t1 and
// scale_type are ONNX element types; `cache`: keys and values from the cache (quant_bit 0, 4 or 8) rather than
// MultiHeadAttention's packed rows. Returns the first launch error.
cudaError_t LaunchAttention(const AttnParams& params, int32_t t1, int32_t scale_type, int quant_bit, bool cache,
                            cudaStream_t stream);

// The PTX architecture the tensor-core kernels were compiled for on the current device (e.g. 90), read from the
// kernel as the driver loaded it: below 80 their products are not there (a build without sm_80 code, JIT-compiled).
cudaError_t MmaKernelPtxVersion(int* version);

}  // namespace cuda
}  // namespace kvcache
