#include "rotary_params.h"

#include <cstring>

namespace kvcache {
namespace cuda {

std::vector<uint8_t> PackRotaryTables(const RotaryPlan& plan) {
  const size_t slots = plan.slots.size() * sizeof(int64_t), table = plan.cos.size() * sizeof(float);
  std::vector<uint8_t> bytes(slots + 2 * table);
  if (slots) std::memcpy(bytes.data(), plan.slots.data(), slots);
  if (table) {
    std::memcpy(bytes.data() + slots, plan.cos.data(), table);
    std::memcpy(bytes.data() + slots + table, plan.sin.data(), table);
  }
  return bytes;
}

void CheckRotaryLaunchable(const RotaryAttrs& a, const RotaryPlan& plan) {
  if (a.base.quant_bit && plan.head_dim > kMaxQuantizedShiftHeadDim)
    Fail("KeyCacheRotaryShift on CUDA rotates quantized rows of at most ", kMaxQuantizedShiftHeadDim,
         " elements, got Dh = ", plan.head_dim);
  // N <= MaxT and H are dims of the validated cache, so N * H fits; one launch covers 2^31 - 1 blocks.
  const int64_t rows = static_cast<int64_t>(plan.slots.size()) * plan.heads;
  if ((rows + kThreads - 1) / kThreads > 0x7fffffff)
    Fail("KeyCacheRotaryShift on CUDA rotates at most 2^39 rows per call, got N*H = ", rows);
}

RotaryParams MakeRotaryParams(const RotaryAttrs& a, const RotaryPlan& plan, const uint8_t* tables, void* cache,
                              void* scale) {
  RotaryParams p{};
  p.layer_idx = a.base.layer_idx;
  p.quant_group = a.base.quant_group;
  p.heads = plan.heads;
  p.head_dim = plan.head_dim;
  p.rotary = plan.rotary;
  p.slots = static_cast<int64_t>(plan.slots.size());
  p.interleaved = a.rotary_interleaved != 0;
  p.cache_rows = {plan.rows.layer, plan.rows.kv, plan.rows.head, plan.rows.slot};
  p.scale_rows = {plan.scale_rows.layer, plan.scale_rows.kv, plan.scale_rows.head, plan.scale_rows.slot};
  const size_t slots = plan.slots.size() * sizeof(int64_t), table = plan.cos.size() * sizeof(float);
  p.ptr[kCache] = cache;
  p.ptr[kScale] = scale;
  p.ptr[kSlots] = const_cast<uint8_t*>(tables);
  p.ptr[kCos] = const_cast<uint8_t*>(tables + slots);
  p.ptr[kSin] = const_cast<uint8_t*>(tables + slots + table);
  return p;
}

}  // namespace cuda
}  // namespace kvcache
