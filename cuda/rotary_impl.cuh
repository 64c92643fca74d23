// Launcher of the KeyCacheRotaryShift CUDA kernel over raw device pointers (framework-free). The caller
// validated the call on the host (rotary_shift.h) and built the params from the plan (rotary_params.h).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "rotary_work.h"

namespace kvcache {
namespace cuda {

// Rotates on `stream`. cache_type / scale_type are ONNX element types; quant_bit 0, 4 or 8. Returns the
// launch error.
cudaError_t LaunchRotaryShift(const RotaryParams& params, int32_t cache_type, int32_t scale_type, int quant_bit,
                              cudaStream_t stream);

}  // namespace cuda
}  // namespace kvcache
