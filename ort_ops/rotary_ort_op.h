// ONNX Runtime glue of KeyCacheRotaryShift: the op's declaration shared by both EPs, and the CPU kernel
// (the CUDA one is in rotary_ort_cuda_op.h).
#pragma once

#include "kv_ort_op.h"
#include "rotary_shift.h"

namespace kvcache {

constexpr const char* kRotaryOpName = "KeyCacheRotaryShift";

// The kernel's attributes, checked, and a constant cache (or scale) refused: at session creation.
RotaryAttrs ReadRotaryAttrs(const OrtKernelInfo* info);

// Reads the 5 inputs into `in`, validates them (throws KvError; nothing written) and allocates the output
// slots_out (its data pointer into `out`). Shared by the CPU and CUDA kernels.
RotaryPlan ValidateAndAllocate(Ort::KernelContext& ctx, const RotaryAttrs& attrs, TensorArg* in, void** out);

struct RotaryCpuKernel {
  explicit RotaryCpuKernel(const OrtKernelInfo* info) : attrs(ReadRotaryAttrs(info)) {}
  OrtStatusPtr ComputeV2(OrtKernelContext* context);
  RotaryAttrs attrs;
};

template <typename TOp, typename TKernel>
struct RotaryOpBase : Ort::CustomOpBase<TOp, TKernel, /*WithStatus=*/true> {
  RotaryOpBase() { DeclareApiVersion(*this); }
  OrtStatusPtr CreateKernelV2(const OrtApi&, const OrtKernelInfo* info, void** kernel) const {
    return NewKernel<TKernel>(info, kernel);
  }
  const char* GetName() const { return kRotaryOpName; }
  size_t GetInputTypeCount() const { return 5; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 2 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64
           : i >= 3 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT
                    : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i == 1 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  // slots, cos and sin are read on the host (validated and snapshotted before any write), on either EP.
  OrtMemType GetInputMemoryType(size_t i) const { return i >= 2 ? OrtMemTypeCPUInput : OrtMemTypeDefault; }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64; }
};

struct RotaryCpuOp : RotaryOpBase<RotaryCpuOp, RotaryCpuKernel> {
  const char* GetExecutionProviderType() const { return nullptr; }  // the CPU EP
};

}  // namespace kvcache
