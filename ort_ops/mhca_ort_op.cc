#include "mhca_ort_op.h"

#include <functional>

#include "byte_ranges.h"
#include "mha_ort_op.h"
#include "mhca_cpu.h"
#include "ort_attrs.h"

namespace kvcache {

MhcaAttrs ReadMhcaAttrs(const OrtKernelInfo* info) {
  MhcaAttrs a;
  Attrs& c = a.cache;
  c.num_layer = AttrOr(info, "num_layer", c.num_layer);
  c.layer_idx = AttrOr(info, "layer_idx", c.layer_idx);
  c.quant_bit = AttrOr(info, "quant_bit", c.quant_bit);
  c.quant_group = AttrOr(info, "quant_group", c.quant_group);
  c.cache_mode = AttrOr(info, "cache_mode", c.cache_mode);
  c.cache_layout = AttrOr(info, "cache_layout", c.cache_layout);
  c.page_size = AttrOr(info, "page_size", c.page_size);
  a.attention = ReadMhaAttrs(info, kMhcaOpName);
  a.softcap = FloatAttrOr(info, "softcap", a.softcap);
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

MhcaCpuOp::MhcaCpuOp() {
  DeclareApiVersion(*this);
  OrtCustomOp::InferOutputShapeFn = InferMhaOutputShape;  // the output is query's type and shape
}

OrtStatusPtr MhcaCpuOp::CreateKernelV2(const OrtApi&, const OrtKernelInfo* info, void** kernel) const {
  return NewKernel<MhcaCpuKernel>(info, kernel);
}

}  // namespace kvcache
