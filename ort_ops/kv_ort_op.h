// ONNX Runtime glue of KeyValueCache: the kernel (attributes, inputs, outputs) and the custom-op
// definitions for the CPU EP (and, in a CUDA build, the CUDA EP).
#pragma once

#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT

#include <cstdint>
#include <functional>
#include <string>

#include "kv_validate.h"
#include "ort_attrs.h"

namespace kvcache {

// The ONNX Runtime C API version the library asks for and declares on every op: that of the oldest release
// that runs it. Every function it calls is in version 17 (the newest: ShapeInferContext_*, ReadOpAttr,
// SetSymbolicDimensions, KernelContext_ParallelFor; ORT also reads an op's InferOutputShapeFn only from op
// version 17 on), but onnxruntime before 1.22 refuses the KeyValueCache schema: CreateSchema
// (custom_ops.cc) allows a dynamically typed output only with exactly one dynamically typed input, and
// KeyValueCache has four. Asking for 22 turns that into a clear error at registration.
constexpr uint32_t kOrtApiVersion = 22;
constexpr const char* kOrtMinRelease = "1.22";
// ORT reads an op's struct up to the fields of the version it declares: the headers must have them all.
static_assert(ORT_API_VERSION >= kOrtApiVersion, "kvcache-op needs the headers of onnxruntime >= 1.22");

constexpr const char* kDomain = "opmx.dynamic_batching";
constexpr const char* kOpName = "KeyValueCache";
constexpr size_t kNumInputs = 10;
constexpr size_t kScaleInput = 9;

// Reads the attributes (spec defaults for absent ones) and rejects invalid values (KvError).
Attrs ReadAttrs(const OrtKernelInfo* info);

// Runs fn(i), i in [0, n), on ORT's intra-op thread pool. A task's exception (an allocation failure) is kept and
// rethrown here once every task has returned (the pool's workers would std::terminate); the other tasks still run, so
// a call failing this way may have written part of its outputs and cache.
void ParallelForOnOrt(Ort::KernelContext& ctx, size_t n, const std::function<void(size_t)>& fn);

// Rejects a cache or scale (inputs `cache_input`, `cache_input + 1` of op `op`) that is a constant
// initializer: in-place writes to it would be lost or would corrupt a constant shared by sessions. With
// quant_bit 0 the scale is never written (a constant empty one is ppl.pmx's placeholder) and is let be.
void RejectConstantCache(const OrtKernelInfo* info, const char* op, size_t cache_input, int64_t quant_bit);

// At session creation: throws KvError (OutputHeadsMessage) when current_key's H is static in the graph and
// H * num_repeat does not fit in int64. A symbolic H is checked when the op runs (ValidateCall).
void CheckStaticHeads(const OrtKernelInfo* info, const Attrs& attrs);

// The first num_inputs inputs of a call as TensorArgs (shape, type, raw data pointer); absent optional
// inputs are left not present.
void ReadInputs(Ort::KernelContext& ctx, TensorArg* inputs, size_t num_inputs = kNumInputs);

// The data pointer of a tensor, through API version 1 only (see kv_ort_op.cc).
const void* TensorData(const Ort::ConstValue& value);

// Declares kOrtApiVersion on `op`. ORT refuses to create a kernel for an op whose version is above its own
// API version, and reads only the op fields that exist at the declared version (custom_ops.cc:
// CreateKernelV2/KernelComputeV2 from 16, InferOutputShapeFn from 17). Ort::CustomOpBase declares the
// headers' version instead, which would tie the library to onnxruntime releases at least as new as the
// headers it was built with.
inline void DeclareApiVersion(OrtCustomOp& op) { op.version = kOrtApiVersion; }

// OrtStatus for an exception caught at the C boundary.
OrtStatusPtr StatusFromCurrentException();

// CreateKernelV2 of every op: a TKernel from the kernel info, a status instead of an exception (an invalid
// attribute is refused when the session is created).
template <typename TKernel>
OrtStatusPtr NewKernel(const OrtKernelInfo* info, void** kernel) {
  try {
    *kernel = new TKernel(info);
    return nullptr;
  } catch (...) {
    return StatusFromCurrentException();
  }
}

// Output `index` (0 key, 1 value) of shape (kv_tokens, H * num_repeat, Dh). An allocation failure is
// rethrown as KvError naming the shape and byte count; nothing has been written at that point.
Ort::UnownedValue AllocateOutput(Ort::KernelContext& ctx, size_t index, const CallPlan& plan, int32_t t1);

struct CpuKernel {
  explicit CpuKernel(const OrtKernelInfo* info) : attrs(ReadAttrs(info)) {
    RejectConstantCache(info, "KeyValueCache", 8, attrs.quant_bit);
    CheckStaticHeads(info, attrs);
  }
  OrtStatusPtr ComputeV2(OrtKernelContext* context);
  Attrs attrs;
};

// Shape/type inference shared by both EPs: outputs get current_key's type and (?, H*num_repeat, Dh).
// When H*num_repeat does not fit in int64 the dim is left unknown (never a wrapped value) and an error
// status is returned.
OrtStatusPtr InferOutputShapes(const OrtCustomOp* op, OrtShapeInferContext* ctx);

template <typename TOp, typename TKernel>
struct KeyValueCacheOpBase : Ort::CustomOpBase<TOp, TKernel, /*WithStatus=*/true> {
  KeyValueCacheOpBase() {
    DeclareApiVersion(*this);
    OrtCustomOp::InferOutputShapeFn = InferOutputShapes;
  }
  OrtStatusPtr CreateKernelV2(const OrtApi&, const OrtKernelInfo* info, void** kernel) const {
    return NewKernel<TKernel>(info, kernel);
  }
  const char* GetName() const { return kOpName; }
  size_t GetInputTypeCount() const { return kNumInputs; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return (i >= 2 && i <= 7) ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i == kScaleInput ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  // The small index inputs live on the host, so every bound is checked there before any write.
  OrtMemType GetInputMemoryType(size_t i) const {
    return (i >= 2 && i <= 7) ? OrtMemTypeCPUInput : OrtMemTypeDefault;
  }
  size_t GetOutputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
};

struct CpuOp : KeyValueCacheOpBase<CpuOp, CpuKernel> {
  const char* GetExecutionProviderType() const { return nullptr; }  // nullptr: the CPU EP
};

}  // namespace kvcache
