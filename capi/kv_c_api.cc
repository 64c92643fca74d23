// The C entry points on the host: KeyValueCache and KeyCacheRotaryShift on host pointers, the output
// shape query, the attribute defaults. Same validation and kernels as the ONNX Runtime CPU op.
#include <cstring>
#include <vector>

#include "c_tensors.h"
#include "rotary_c_args.h"
#include "kv_cpu.h"
#include "kvcache_op.h"
#include "rotary_shift.h"

namespace kvcache {
namespace {

CallPlan ValidateC(const KvcacheKeyValueCacheAttrs* c, const KvcacheTensor* inputs, Attrs* attrs, TensorArg* in) {
  if (c == nullptr || inputs == nullptr) Fail("KeyValueCache: attrs and inputs must not be NULL");
  *attrs = ToAttrs(*c);
  ToKeyValueCacheArgs(inputs, in);
  return ValidateCall(*attrs, in);  // snapshots the index inputs, then checks them
}

}  // namespace

CallPlan ValidateWithOutputs(const KvcacheKeyValueCacheAttrs* c, const KvcacheTensor* inputs,
                             const KvcacheTensor* outputs, Attrs* attrs, TensorArg* in) {
  const CallPlan plan = ValidateC(c, inputs, attrs, in);
  if (outputs == nullptr) Fail("KeyValueCache: outputs must not be NULL");
  const std::vector<int64_t> out_shape{plan.kv_tokens, plan.out_heads, plan.head_dim};
  const char* out_names[2] = {"output key", "output value"};
  for (int i = 0; i < 2; ++i) CheckOutput(outputs[i], out_names[i], in[0].type, out_shape);
  CheckKeyValueBuffersApart(in, outputs[0].data, outputs[1].data, plan.out_bytes);
  return plan;
}

}  // namespace kvcache

using namespace kvcache;

extern "C" {

int32_t kvcache_op_c_api_version(void) { return KVCACHE_OP_C_API_VERSION; }

const char* kvcache_op_cpu_kernel(void) { return kvcache::CpuKernelName(); }

const char* kvcache_op_cpu_stores(void) {
  const kvcache::StorePlan plan = kvcache::LargeOutputStores();
  return !plan.stream ? "cached" : plan.side_by_side ? "side-by-side" : "stream";
}

const char* kvcache_op_cpu_cached_gather(void) { return kvcache::CachedGatherHeadRuns() ? "head-runs" : "tokens"; }

int64_t kvcache_op_cpu_streamed_heads(int64_t quant_bit) {
  if (quant_bit != 0 && quant_bit != 4 && quant_bit != 8) return -1;
  return kvcache::StreamedGatherHeads(quant_bit != 0);
}

int64_t kvcache_op_cpu_gather_tile_bytes(int64_t cache_layout, int64_t quant_bit) {
  if (cache_layout < 0 || cache_layout > 3 || (quant_bit != 0 && quant_bit != 4 && quant_bit != 8)) return -1;
  // The layout's row strides for one layer of two slots of one head tell whether a slot's key and value rows lie
  // together, as the kernel reads them from the call's strides.
  return kvcache::GatherTileBytes(kvcache::LayoutRowStrides(cache_layout, 1, 2, 1, 1).KeyValueTogether(),
                                  quant_bit != 0);
}

const char* kvcache_op_cpu_code_stores(void) { return kvcache::StreamedCodeStores() ? "stream" : "cached"; }

int64_t kvcache_op_cpu_token_streams(void) { return kvcache::TokenStreams(); }

int64_t kvcache_op_cpu_token_prefetch_bytes(int64_t row_bytes) {
  return row_bytes < 1 ? -1 : kvcache::TokenPrefetchBytes(row_bytes);
}

const char* kvcache_op_cpu_head_prefetch(void) { return kvcache::HeadPrefetchToL2() ? "l2" : "l1"; }

void kvcache_op_key_value_cache_defaults(KvcacheKeyValueCacheAttrs* attrs) {
  if (attrs == nullptr) return;  // nothing to fill; every other entry point refuses a null pointer too
  const Attrs a;  // the spec's defaults
  *attrs = KvcacheKeyValueCacheAttrs{a.num_layer, a.layer_idx, a.quant_bit, a.quant_group,
                                     a.num_repeat, a.cache_mode, a.cache_layout, a.page_size};
}

void kvcache_op_key_cache_rotary_shift_defaults(KvcacheRotaryShiftAttrs* attrs) {
  if (attrs == nullptr) return;  // nothing to fill; every other entry point refuses a null pointer too
  const RotaryAttrs a;
  *attrs = KvcacheRotaryShiftAttrs{a.base.num_layer, a.base.layer_idx, a.base.quant_bit, a.base.quant_group,
                                   a.base.cache_layout, a.rotary_dim, a.rotary_interleaved};
}

int32_t kvcache_op_key_value_cache_output_shape(const KvcacheKeyValueCacheAttrs* attrs, const KvcacheTensor inputs[10],
                                                int64_t out_shape[3], char* message, size_t message_size) {
  return CatchAll(
      [&] {
        Attrs a;
        TensorArg in[10];
        const CallPlan plan = ValidateC(attrs, inputs, &a, in);
        if (out_shape == nullptr) Fail("KeyValueCache: out_shape must not be NULL");
        out_shape[0] = plan.kv_tokens;
        out_shape[1] = plan.out_heads;
        out_shape[2] = plan.head_dim;
      },
      message, message_size);
}

int32_t kvcache_op_key_value_cache_cpu(const KvcacheKeyValueCacheAttrs* attrs, const KvcacheTensor inputs[10],
                                       const KvcacheTensor outputs[2], int32_t num_threads, char* message,
                                       size_t message_size) {
  return CatchAll(
      [&] {
        Attrs a;
        TensorArg in[10];
        const DescriptorSnapshot<2> out(outputs);
        const CallPlan plan = ValidateWithOutputs(attrs, inputs, out.get(), &a, in);  // nothing written before
        ComputeArgs args{&a, &plan, in[0].type, in[9].type, in[0].data, in[1].data,
                         const_cast<void*>(in[8].data), in[9].present ? const_cast<void*>(in[9].data) : nullptr,
                         out.get()[0].data, out.get()[1].data};
        ComputeCpu(args, [num_threads](size_t n, const std::function<void(size_t)>& fn) {
          ParallelOnThreads(num_threads, n, fn);
        });
      },
      message, message_size);
}

int32_t kvcache_op_key_cache_rotary_shift_cpu(const KvcacheRotaryShiftAttrs* attrs, const KvcacheTensor inputs[5],
                                              const KvcacheTensor* output, int32_t num_threads, char* message,
                                              size_t message_size) {
  return CatchAll(
      [&] {
        RotaryAttrs a;
        TensorArg in[5];
        const DescriptorSnapshot<1> out(output);
        const RotaryPlan plan = ValidateRotaryWithOutput(attrs, inputs, out.get(), &a, in);  // nothing written before
        RotaryShiftCpu(a, plan, in, [num_threads](size_t count, const std::function<void(size_t)>& fn) {
          ParallelOnThreads(num_threads, count, fn);
        });
        WriteSlots(plan, out.get());
      },
      message, message_size);
}

}  // extern "C"
