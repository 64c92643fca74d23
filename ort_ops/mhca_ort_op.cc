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

OrtStatusPtr MhcaCpuKernel::ComputeV2(OrtKernelContext* context) {
  try {
    Ort::KernelContext ctx(context);
    TensorArg in[kMhcaNumInputs];
    ReadInputs(ctx, in, kMhcaNumInputs);
    const MhcaPlan plan = ValidateCacheAttention(attrs, in);  // throws before anything is written
    auto out = ctx.GetOutput(0, in[0].shape);
    CheckCacheAttentionApart(in, out.GetTensorMutableRawData());  // bound buffers may point anywhere
    const TensorArg& scale = in[kMhcaScaleInput];
    const MhcaArgs args{&attrs, &plan, in[0].type, scale.type, in[0].data, in[1].data, in[2].data,
                        const_cast<void*>(in[kMhcaCacheInput].data),  // written in place (spec: in-out input)
                        scale.present ? const_cast<void*>(scale.data) : nullptr,
                        in[kMhcaMaskInput].present ? in[kMhcaMaskInput].data : nullptr, out.GetTensorMutableRawData()};
    MhcaComputeCpu(args, [&ctx](size_t n, const std::function<void(size_t)>& fn) { ParallelForOnOrt(ctx, n, fn); });
    return nullptr;
  } catch (...) {
    return StatusFromCurrentException();
  }
}

}  // namespace kvcache
