// The CUDA-EP variants of MultiHeadAttention and MultiHeadCacheAttention (built only with CUDA).
#pragma once

#include "mha_ort_op.h"
#include "mhca_ort_op.h"

namespace kvcache {

struct MhaCudaKernel {
  explicit MhaCudaKernel(const OrtKernelInfo* info) : attrs(ReadMhaAttrs(info)) {}
  OrtStatusPtr ComputeV2(OrtKernelContext* context);
  MhaAttrs attrs;
};

struct MhaCudaOp : MhaOpBase<MhaCudaOp, MhaCudaKernel> {
  const char* GetExecutionProviderType() const { return "CUDAExecutionProvider"; }
};

struct MhcaCudaKernel {
  explicit MhcaCudaKernel(const OrtKernelInfo* info) : attrs(ReadMhcaAttrs(info)) {
    RejectConstantCache(info, kMhcaOpName, kMhcaCacheInput, attrs.cache.quant_bit);
  }
  OrtStatusPtr ComputeV2(OrtKernelContext* context);
  MhcaAttrs attrs;
};

struct MhcaCudaOp : MhcaOpBase<MhcaCudaOp, MhcaCudaKernel> {
  const char* GetExecutionProviderType() const { return "CUDAExecutionProvider"; }
};

}  // namespace kvcache
