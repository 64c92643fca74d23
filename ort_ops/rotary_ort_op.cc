#include "rotary_ort_op.h"

#include <cstring>
#include <vector>

namespace kvcache {

RotaryAttrs ReadRotaryAttrs(const OrtKernelInfo* info) {
  RotaryAttrs attrs;
  attrs.base.num_layer = AttrOr(info, "num_layer", 1);
  attrs.base.layer_idx = AttrOr(info, "layer_idx", 0);
  attrs.base.cache_layout = AttrOr(info, "cache_layout", 0);
  attrs.base.quant_bit = AttrOr(info, "quant_bit", 0);
  attrs.base.quant_group = AttrOr(info, "quant_group", 8);
  attrs.rotary_dim = AttrOr(info, "rotary_dim", 0);
  attrs.rotary_interleaved = AttrOr(info, "rotary_interleaved", 0);
  CheckRotaryAttrs(attrs);
  RejectConstantCache(info, "KeyCacheRotaryShift", 0, attrs.base.quant_bit);
  return attrs;
}

RotaryPlan ValidateAndAllocate(Ort::KernelContext& ctx, const RotaryAttrs& attrs, TensorArg* in, void** out) {
  ReadInputs(ctx, in, 5);
  RotaryPlan plan = ValidateRotaryShift(attrs, in);  // throws before anything is written
  // Allocated before the rotation, so that a failure here leaves the cache unchanged.
  const int64_t n = static_cast<int64_t>(plan.slots.size());
  *out = ctx.GetOutput(0, {n}).GetTensorMutableRawData();
  CheckRotaryBuffersApart(in, *out, n);  // a bound output may point anywhere
  return plan;
}

OrtStatusPtr RotaryCpuKernel::ComputeV2(OrtKernelContext* context) {
  try {
    Ort::KernelContext ctx(context);
    TensorArg in[5];
    void* out = nullptr;
    const RotaryPlan plan = ValidateAndAllocate(ctx, attrs, in, &out);
    // The output is the slots as given: the snapshot (the input may alias the cache rows rotated below).
    if (!plan.slots.empty()) std::memcpy(out, plan.slots.data(), plan.slots.size() * sizeof(int64_t));
    RotaryShiftCpu(attrs, plan, in, [&ctx](size_t n, const std::function<void(size_t)>& fn) { ParallelForOnOrt(ctx, n, fn); });
    return nullptr;
  } catch (...) {
    return StatusFromCurrentException();
  }
}

}  // namespace kvcache
