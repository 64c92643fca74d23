#include "mha_ort_op.h"

#include <functional>

#include "byte_ranges.h"
#include "mha_cpu.h"
#include "ort_attrs.h"

namespace kvcache {

MhaAttrs ReadMhaAttrs(const OrtKernelInfo* info, const char* op) {
  MhaAttrs a;
  a.num_heads = RequiredAttr(info, op, "num_heads");
  a.head_dim = RequiredAttr(info, op, "head_dim");
  a.is_causal = AttrOr(info, "is_causal", a.is_causal);
  a.is_alibi = AttrOr(info, "is_alibi", a.is_alibi);
  a.num_kv_heads = AttrOr(info, "num_kv_heads", a.num_kv_heads);
  a.sliding_window = AttrOr(info, "sliding_window", a.sliding_window);
  a.softmax_scale = FloatAttrOr(info, "softmax_scale", a.softmax_scale);
  a.softcap = FloatAttrOr(info, "softcap", a.softcap);
  CheckMhaAttrs(a);
  return a;
}

void PrepareMhaCall(Ort::KernelContext& ctx, const MhaAttrs& attrs, MhaCall* call) {
  ReadInputs(ctx, call->in, kMhaNumInputs);
  call->plan = ValidateAttention(attrs, call->in);  // throws before the output exists
  call->out = ctx.GetOutput(0, call->in[0].shape).GetTensorMutableRawData();
  CheckAttentionOutputApart(call->in, call->out);
}

OrtStatusPtr MhaCpuKernel::ComputeV2(OrtKernelContext* context) {
  try {
    Ort::KernelContext ctx(context);
    MhaCall call;
    PrepareMhaCall(ctx, attrs, &call);
    const TensorArg* in = call.in;
    const MhaArgs args{&attrs, &call.plan, in[0].type, in[0].data, in[1].data, in[2].data, call.Mask(), call.out};
    MhaComputeCpu(args, [&ctx](size_t n, const std::function<void(size_t)>& fn) { ParallelForOnOrt(ctx, n, fn); });
    return nullptr;
  } catch (...) {
    return StatusFromCurrentException();
  }
}

OrtStatusPtr InferMhaOutputShape(const OrtCustomOp*, OrtShapeInferContext* ctx) {
  const OrtApi& api = Ort::GetApi();
  OrtTensorTypeAndShapeInfo* query = nullptr;  // owned by the context
  if (OrtStatus* s = api.ShapeInferContext_GetInputTypeShape(ctx, 0, &query)) return s;
  return api.ShapeInferContext_SetOutputTypeShape(ctx, 0, query);
}

}  // namespace kvcache
