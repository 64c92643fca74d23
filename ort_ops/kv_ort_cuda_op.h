// The CUDA-EP variant of KeyValueCache (built only with CUDA).
#pragma once

#include "kv_ort_op.h"

namespace kvcache {

struct CudaKernel {
  explicit CudaKernel(const OrtKernelInfo* info) : attrs(ReadAttrs(info)) {
    RejectConstantCache(info, "KeyValueCache", 8, attrs.quant_bit);
    CheckStaticHeads(info, attrs);
  }
  OrtStatusPtr ComputeV2(OrtKernelContext* context);
  Attrs attrs;
};

struct CudaOp : KeyValueCacheOpBase<CudaOp, CudaKernel> {
  const char* GetExecutionProviderType() const { return "CUDAExecutionProvider"; }
};

}  // namespace kvcache
