#include "kv_ort_op.h"

#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "byte_ranges.h"
#include "kv_checked.h"
#include "kv_cpu.h"

namespace kvcache {

namespace {

// One ParallelFor's work and the first exception a task threw: an exception (an allocation failure) must not unwind
// through ONNX Runtime's thread pool, whose workers do not catch it (std::terminate); it is rethrown on the calling
// thread once every task has returned.
struct GuardedTasks {
  const std::function<void(size_t)>& fn;
  std::mutex lock;
  std::exception_ptr failure;
};

void Trampoline(void* data, size_t i) {
  auto* tasks = static_cast<GuardedTasks*>(data);
  try {
    tasks->fn(i);
  } catch (...) {
    std::lock_guard<std::mutex> hold(tasks->lock);
    if (!tasks->failure) tasks->failure = std::current_exception();
  }
}

}  // namespace

void ParallelForOnOrt(Ort::KernelContext& ctx, size_t n, const std::function<void(size_t)>& fn) {
  if (n == 1) return fn(0);
  if (n < 1) return;
  GuardedTasks tasks{fn, {}, {}};
  ctx.ParallelFor(Trampoline, n, 0, &tasks);
  if (tasks.failure) std::rethrow_exception(tasks.failure);
}

Attrs ReadAttrs(const OrtKernelInfo* info) {
  Attrs a;
  a.num_layer = AttrOr(info, "num_layer", a.num_layer);
  a.layer_idx = AttrOr(info, "layer_idx", a.layer_idx);
  a.quant_bit = AttrOr(info, "quant_bit", a.quant_bit);
  a.quant_group = AttrOr(info, "quant_group", a.quant_group);
  a.num_repeat = AttrOr(info, "num_repeat", a.num_repeat);
  a.cache_mode = AttrOr(info, "cache_mode", a.cache_mode);
  a.cache_layout = AttrOr(info, "cache_layout", a.cache_layout);
  a.page_size = AttrOr(info, "page_size", a.page_size);
  CheckAttrs(a);
  return a;
}

void RejectConstantCache(const OrtKernelInfo* info, const char* op, size_t cache_input, int64_t quant_bit) {
  Ort::ConstKernelInfo kernel_info(info);
  const size_t count = kernel_info.GetInputCount();
  for (size_t i : {cache_input, cache_input + 1}) {
    if (i >= count || (i == cache_input + 1 && quant_bit == 0)) continue;
    int is_constant = 0;
    kernel_info.GetTensorConstantInput(i, &is_constant);
    if (is_constant)
      throw KvError(std::string(i == cache_input ? "cache" : "scale") + " is a constant initializer, but " + op +
                    " writes it in place: make it a graph input (and bind your own buffer) so the writes land "
                    "where you read them");
  }
}

void ReadInputs(Ort::KernelContext& ctx, TensorArg* inputs, size_t num_inputs) {
  const size_t count = ctx.GetInputCount();
  for (size_t i = 0; i < num_inputs; ++i) {
    inputs[i] = TensorArg{};
    if (i >= count) continue;
    Ort::ConstValue value = ctx.GetInput(i);
    if (!value) continue;
    auto info = value.GetTensorTypeAndShapeInfo();
    inputs[i].present = true;
    inputs[i].type = info.GetElementType();
    inputs[i].shape = info.GetShape();
    inputs[i].data = TensorData(value);
  }
}

const void* TensorData(const Ort::ConstValue& value) {
  // Not ConstValue::GetTensorRawData: recent headers implement it with GetTensorData (API 23), which
  // older runtimes lack. GetTensorMutableData only reads the OrtValue; nothing is written through it.
  void* data = nullptr;
  auto* ort_value = const_cast<OrtValue*>(static_cast<const OrtValue*>(value));
  Ort::ThrowOnError(Ort::GetApi().GetTensorMutableData(ort_value, &data));
  return data;
}

void CheckStaticHeads(const OrtKernelInfo* info, const Attrs& attrs) {
  Ort::ConstKernelInfo kernel_info(info);
  if (kernel_info.GetInputCount() < 1) return;
  const auto shape = kernel_info.GetInputTypeInfo(0).GetTensorTypeAndShapeInfo().GetShape();
  int64_t out_heads = 0;
  if (shape.size() == 3 && shape[1] >= 0 && !MulFits(shape[1], attrs.num_repeat, &out_heads))
    throw KvError(OutputHeadsMessage(shape[1], attrs.num_repeat));
}

Ort::UnownedValue AllocateOutput(Ort::KernelContext& ctx, size_t index, const CallPlan& plan, int32_t t1) {
  try {
    return ctx.GetOutput(index, {plan.kv_tokens, plan.out_heads, plan.head_dim});
  } catch (const Ort::Exception& e) {
    // ORT's own message ("Failed to allocate ...") names neither the op's inputs nor the shape.
    Fail("KeyValueCache output ", index == 0 ? "key" : "value", " of shape ",
         ShapeStr({plan.kv_tokens, plan.out_heads, plan.head_dim}), " ", ElemName(t1), " (", plan.out_bytes,
         " bytes) could not be allocated: ", e.what());
  }
}

OrtStatusPtr StatusFromCurrentException() {
  try {
    throw;
  } catch (const KvError& e) {
    return Ort::GetApi().CreateStatus(ORT_INVALID_ARGUMENT, e.what());
  } catch (const Ort::Exception& e) {
    return Ort::GetApi().CreateStatus(e.GetOrtErrorCode(), e.what());
  } catch (const std::exception& e) {
    return Ort::GetApi().CreateStatus(ORT_FAIL, e.what());
  } catch (...) {
    return Ort::GetApi().CreateStatus(ORT_FAIL, "KeyValueCache: unknown error");
  }
}

OrtStatusPtr CpuKernel::ComputeV2(OrtKernelContext* context) {
  try {
    Ort::KernelContext ctx(context);
    TensorArg in[kNumInputs];
    ReadInputs(ctx, in);
    const CallPlan plan = ValidateCall(attrs, in);  // throws before anything is written
    auto key = AllocateOutput(ctx, 0, plan, in[0].type);
    auto value = AllocateOutput(ctx, 1, plan, in[0].type);
    CheckKeyValueBuffersApart(in, key.GetTensorMutableRawData(), value.GetTensorMutableRawData(), plan.out_bytes);
    ComputeArgs args{&attrs, &plan, in[0].type, in[kScaleInput].type, in[0].data, in[1].data,
                     const_cast<void*>(in[8].data),  // the cache is written in place (spec: in-out input)
                     in[kScaleInput].present ? const_cast<void*>(in[kScaleInput].data) : nullptr,
                     key.GetTensorMutableRawData(), value.GetTensorMutableRawData()};
    ComputeCpu(args, [&ctx](size_t n, const std::function<void(size_t)>& fn) { ParallelForOnOrt(ctx, n, fn); });
    return nullptr;
  } catch (...) {
    return StatusFromCurrentException();
  }
}

namespace {

// A name for an output dim whose size no other value's dim is known to share. ONNX Runtime's memory planner takes
// values whose dims carry the same name as the same size and reuses one's buffer for the other, so two KeyValueCache
// nodes of a graph (a draft and a target model, say) whose outputs shared "kv_tokens" would have the larger one's
// output refused at run time ("Shape mismatch attempting to re-use buffer").
std::string UnsharedDimName(const char* what) {
  static std::atomic<uint64_t> next{0};
  return std::string("KeyValueCache_") + what + "_" + std::to_string(next.fetch_add(1));
}

}  // namespace

OrtStatusPtr InferOutputShapes(const OrtCustomOp*, OrtShapeInferContext* ctx) {
  const OrtApi& api = Ort::GetApi();
  OrtTensorTypeAndShapeInfo* key_info = nullptr;  // owned by the context
  if (OrtStatus* s = api.ShapeInferContext_GetInputTypeShape(ctx, 0, &key_info)) return s;
  ONNXTensorElementDataType type;
  size_t rank = 0;
  if (OrtStatus* s = api.GetTensorElementType(key_info, &type)) return s;
  if (OrtStatus* s = api.GetDimensionsCount(key_info, &rank)) return s;
  std::vector<int64_t> dims(rank, -1);
  std::vector<const char*> names(rank, "");
  if (rank) {
    if (OrtStatus* s = api.GetDimensions(key_info, dims.data(), rank)) {
      api.ReleaseStatus(s);
      dims.assign(rank, -1);
    }
    if (OrtStatus* s = api.GetSymbolicDimensions(key_info, names.data(), rank)) {
      api.ReleaseStatus(s);
      names.assign(rank, "");
    }
  }
  int64_t repeat = 1;
  const OrtOpAttr* attr = nullptr;
  // An absent num_repeat (the spec's default, 1) comes back as an error status, released here.
  if (OrtStatus* s = api.ShapeInferContext_GetAttribute(ctx, "num_repeat", &attr)) {
    api.ReleaseStatus(s);
  } else if (attr != nullptr) {
    size_t size = 0;
    if (OrtStatus* s = api.ReadOpAttr(attr, ORT_OP_ATTR_INT, &repeat, sizeof(repeat), &size)) api.ReleaseStatus(s);
  }
  std::vector<int64_t> out{-1, -1, -1};
  if (rank == 3) {
    out[2] = dims[2];
    if (dims[1] < 0 || repeat < 1 || !MulFits(dims[1], repeat, &out[1]))
      out[1] = -1;  // a bad num_repeat, or a product that would wrap: reported by the kernel (CheckStaticHeads)
  }
  // Unknown dims get names (a bare -1 would be taken as a fixed, and then mismatching, size): current_key's own where
  // the output's dim is that very dim (its head_dim; its heads when not repeated), else one no other value shares.
  auto named = [&](size_t i) { return rank == 3 && names[i] != nullptr && names[i][0] != '\0'; };
  const std::string symbols[3] = {
      UnsharedDimName("kv_tokens"),
      out[1] >= 0 ? "" : repeat == 1 && named(1) ? names[1] : UnsharedDimName("kv_heads"),
      out[2] >= 0 ? "" : named(2) ? names[2] : UnsharedDimName("head_dim")};
  const char* symbol_ptrs[3] = {symbols[0].c_str(), symbols[1].c_str(), symbols[2].c_str()};
  OrtTensorTypeAndShapeInfo* info = nullptr;
  if (OrtStatus* s = api.CreateTensorTypeAndShapeInfo(&info)) return s;
  OrtStatus* status = api.SetTensorElementType(info, type);
  if (!status) status = api.SetDimensions(info, out.data(), out.size());
  if (!status) status = api.SetSymbolicDimensions(info, symbol_ptrs, 3);
  if (!status) status = api.ShapeInferContext_SetOutputTypeShape(ctx, 0, info);
  if (!status) status = api.ShapeInferContext_SetOutputTypeShape(ctx, 1, info);
  api.ReleaseTensorTypeAndShapeInfo(info);
  if (!status && rank == 3 && out[1] < 0 && dims[1] >= 0 && repeat >= 1)
    // ONNX Runtime (custom_ops.cc, CreateSchema) ignores this status, so the kernel constructor makes the
    // same check to fail session creation; the status is for runtimes that do read it.
    status = api.CreateStatus(ORT_INVALID_ARGUMENT, OutputHeadsMessage(dims[1], repeat).c_str());
  return status;
}

}  // namespace kvcache
