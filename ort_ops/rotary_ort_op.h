// ONNX Runtime glue of KeyCacheRotaryShift (CPU EP).
#pragma once

#include "kv_ort_op.h"
#include "rotary_shift.h"

namespace kvcache {

constexpr const char* kRotaryOpName = "KeyCacheRotaryShift";

struct RotaryCpuKernel {
  explicit RotaryCpuKernel(const OrtKernelInfo* info);
  OrtStatusPtr ComputeV2(OrtKernelContext* context);
  RotaryAttrs attrs;
};

struct RotaryCpuOp : Ort::CustomOpBase<RotaryCpuOp, RotaryCpuKernel, /*WithStatus=*/true> {
  RotaryCpuOp();
  OrtStatusPtr CreateKernelV2(const OrtApi&, const OrtKernelInfo* info, void** kernel) const;
  const char* GetName() const { return kRotaryOpName; }
  const char* GetExecutionProviderType() const { return nullptr; }  // the CPU EP
  size_t GetInputTypeCount() const { return 5; }
  ONNXTensorElementDataType GetInputType(size_t i) const;
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i == 1 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64; }
};

}  // namespace kvcache
