// ONNX Runtime glue of MultiHeadCacheAttention (CPU EP): attributes, inputs, output, shape inference.
#pragma once

#include "kv_ort_op.h"
#include "mha_ort_op.h"
#include "mhca_validate.h"

namespace kvcache {

constexpr const char* kMhcaOpName = "MultiHeadCacheAttention";

// Reads the attributes (num_heads and head_dim required, spec defaults for the others; num_repeat is not one
// of them) and rejects invalid values (KvError), so a bad node fails when the session is created.
MhcaAttrs ReadMhcaAttrs(const OrtKernelInfo* info);

// A MultiHeadCacheAttention call of a kernel context: its inputs validated (the index inputs copied first), its
// output allocated and checked apart from every buffer the call reads or writes. Nothing is written before this
// returns.
struct MhcaCall {
  TensorArg in[kMhcaNumInputs];
  MhcaPlan plan;
  void* out = nullptr;
  void* Cache() const { return const_cast<void*>(in[kMhcaCacheInput].data); }  // written in place (an in-out input)
  void* Scale() const { return in[kMhcaScaleInput].present ? const_cast<void*>(in[kMhcaScaleInput].data) : nullptr; }
  const void* Mask() const { return in[kMhcaMaskInput].present ? in[kMhcaMaskInput].data : nullptr; }
};
void PrepareMhcaCall(Ort::KernelContext& ctx, const MhcaAttrs& attrs, MhcaCall* call);

struct MhcaCpuKernel {
  explicit MhcaCpuKernel(const OrtKernelInfo* info) : attrs(ReadMhcaAttrs(info)) {
    RejectConstantCache(info, kMhcaOpName, kMhcaCacheInput, attrs.cache.quant_bit);
  }
  OrtStatusPtr ComputeV2(OrtKernelContext* context);
  MhcaAttrs attrs;
};

// The op for either EP (TOp says which): inputs, memory types, output.
template <class TOp, class TKernel>
struct MhcaOpBase : Ort::CustomOpBase<TOp, TKernel, /*WithStatus=*/true> {
  MhcaOpBase() {
    DeclareApiVersion(*this);
    OrtCustomOp::InferOutputShapeFn = InferMhaOutputShape;  // the output is query's type and shape
  }
  OrtStatusPtr CreateKernelV2(const OrtApi&, const OrtKernelInfo* info, void** kernel) const {
    return NewKernel<TKernel>(info, kernel);
  }
  const char* GetName() const { return kMhcaOpName; }
  size_t GetInputTypeCount() const { return kMhcaNumInputs; }
  static bool IsIndex(size_t i) { return i >= 3 && i <= 9; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return IsIndex(i) ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i >= kMhcaScaleInput ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  // The index inputs are read on the host, where every bound is checked before any write.
  OrtMemType GetInputMemoryType(size_t i) const { return IsIndex(i) ? OrtMemTypeCPUInput : OrtMemTypeDefault; }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
};

struct MhcaCpuOp : MhcaOpBase<MhcaCpuOp, MhcaCpuKernel> {
  const char* GetExecutionProviderType() const { return nullptr; }  // the CPU EP
};

}  // namespace kvcache
