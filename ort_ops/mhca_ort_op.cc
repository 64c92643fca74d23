#include "mhca_ort_op.h"

#include <functional>

#include "byte_ranges.h"
#include "mha_ort_op.h"
#include "mhca_cpu.h"
#include "ort_attrs.h"

namespace kvcache {

MhcaAttrs ReadMhcaAttrs(const OrtKernelInfo* info) {
  MhcaAttrs a;
  // KeyValueCache's attributes (a node setting num_repeat, which this op does not have, is refused by
  // CheckMhcaAttrs unless it sets 1), then the attention's.
  a.cache = ReadAttrs(info);
  a.attention = ReadMhaAttrs(info, kMhcaOpName);
  CheckMhcaAttrs(a);
  return a;
}

void PrepareMhcaCall(Ort::KernelContext& ctx, const MhcaAttrs& attrs, MhcaCall* call) {
  ReadInputs(ctx, call->in, kMhcaNumInputs);
  call->plan = ValidateCacheAttention(attrs, call->in);  // throws before anything is written
  call->out = ctx.GetOutput(0, call->in[0].shape).GetTensorMutableRawData();
  CheckCacheAttentionApart(call->in, call->out);  // bound buffers may point anywhere
}

OrtStatusPtr MhcaCpuKernel::ComputeV2(OrtKernelContext* context) {
  try {
    Ort::KernelContext ctx(context);
    MhcaCall call;
    PrepareMhcaCall(ctx, attrs, &call);
    const TensorArg* in = call.in;
    const MhcaArgs args{&attrs, &call.plan, in[0].type, in[kMhcaScaleInput].type, in[0].data, in[1].data, in[2].data,
                        call.Cache(), call.Scale(), call.Mask(), call.out};
    MhcaComputeCpu(args, [&ctx](size_t n, const std::function<void(size_t)>& fn) { ParallelForOnOrt(ctx, n, fn); });
    return nullptr;
  } catch (...) {
    return StatusFromCurrentException();
  }
}

}  // namespace kvcache
