// The CUDA-EP variant of KeyCacheRotaryShift (built only with CUDA).
#pragma once

#include "rotary_ort_op.h"

namespace kvcache {

struct RotaryCudaKernel {
  explicit RotaryCudaKernel(const OrtKernelInfo* info) : attrs(ReadRotaryAttrs(info)) {}
  OrtStatusPtr ComputeV2(OrtKernelContext* context);
  RotaryAttrs attrs;
};

struct RotaryCudaOp : RotaryOpBase<RotaryCudaOp, RotaryCudaKernel> {
  const char* GetExecutionProviderType() const { return "CUDAExecutionProvider"; }
};

}  // namespace kvcache
