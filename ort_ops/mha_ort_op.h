// ONNX Runtime glue of MultiHeadAttention (CPU EP): attributes, inputs, output, shape inference.
#pragma once

#include "kv_ort_op.h"
#include "mha_validate.h"

namespace kvcache {

constexpr const char* kMhaOpName = "MultiHeadAttention";

// Reads the attention attributes (num_heads and head_dim required, spec defaults for the others) and rejects
// invalid values (KvError), so a bad node fails when the session is created. `op` names the op in the message
// of a missing attribute.
MhaAttrs ReadMhaAttrs(const OrtKernelInfo* info, const char* op = kMhaOpName);

// A MultiHeadAttention call of a kernel context: its inputs, validated (the index inputs snapshotted), and its output
// allocated and checked apart from them (a bound output may point anywhere). Nothing is written before this returns.
struct MhaCall {
  TensorArg in[kMhaNumInputs];
  MhaPlan plan;
  void* out = nullptr;
  const void* Mask() const { return in[kMhaMaskInput].present ? in[kMhaMaskInput].data : nullptr; }
};
void PrepareMhaCall(Ort::KernelContext& ctx, const MhaAttrs& attrs, MhaCall* call);

struct MhaCpuKernel {
  explicit MhaCpuKernel(const OrtKernelInfo* info) : attrs(ReadMhaAttrs(info)) {}
  OrtStatusPtr ComputeV2(OrtKernelContext* context);
  MhaAttrs attrs;
};

// attention_output: query's element type and shape (symbolic dims included).
OrtStatusPtr InferMhaOutputShape(const OrtCustomOp* op, OrtShapeInferContext* ctx);

// The op for either EP (TOp says which): inputs, memory types, output.
template <class TOp, class TKernel>
struct MhaOpBase : Ort::CustomOpBase<TOp, TKernel, /*WithStatus=*/true> {
  MhaOpBase() {
    DeclareApiVersion(*this);
    OrtCustomOp::InferOutputShapeFn = InferMhaOutputShape;  // the output is query's type and shape
  }
  OrtStatusPtr CreateKernelV2(const OrtApi&, const OrtKernelInfo* info, void** kernel) const {
    return NewKernel<TKernel>(info, kernel);
  }
  const char* GetName() const { return kMhaOpName; }
  size_t GetInputTypeCount() const { return kMhaNumInputs; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return (i >= 3 && i <= 7) ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i == kMhaMaskInput ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  // The index inputs are read on the host (as KeyValueCache's are).
  OrtMemType GetInputMemoryType(size_t i) const {
    return (i >= 3 && i <= 7) ? OrtMemTypeCPUInput : OrtMemTypeDefault;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
};

struct MhaCpuOp : MhaOpBase<MhaCpuOp, MhaCpuKernel> {
  const char* GetExecutionProviderType() const { return nullptr; }  // the CPU EP
};

}  // namespace kvcache
