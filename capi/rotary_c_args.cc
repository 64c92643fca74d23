#include "rotary_c_args.h"

#include <cstring>

#include "c_tensors.h"

namespace kvcache {
namespace {

const char* const kRotaryNames[5] = {"cache", "scale", "slots", "cos", "sin"};
const bool kRotaryOptional[5] = {false, true, false, false, false};

}  // namespace

RotaryPlan ValidateRotaryWithOutput(const KvcacheRotaryShiftAttrs* c, const KvcacheTensor* inputs,
                                    const KvcacheTensor* output, RotaryAttrs* a, TensorArg* in) {
  if (c == nullptr || inputs == nullptr) Fail("KeyCacheRotaryShift: attrs and inputs must not be NULL");
  a->base.num_layer = c->num_layer;
  a->base.layer_idx = c->layer_idx;
  a->base.quant_bit = c->quant_bit;
  a->base.quant_group = c->quant_group;
  a->base.cache_layout = c->cache_layout;
  a->rotary_dim = c->rotary_dim;
  a->rotary_interleaved = c->rotary_interleaved;
  ToTensorArgs(inputs, 5, kRotaryNames, kRotaryOptional, in);
  const RotaryPlan plan = ValidateRotaryShift(*a, in);  // slots, cos, sin snapshotted, then checked
  const int64_t n = static_cast<int64_t>(plan.slots.size());
  if (output != nullptr) CheckOutput(*output, "output slots", int32_t(Elem::kInt64), {n});
  CheckRotaryBuffersApart(in, output != nullptr ? output->data : nullptr, n);
  return plan;
}

void WriteSlots(const RotaryPlan& plan, const KvcacheTensor* output) {
  if (output != nullptr && !plan.slots.empty())
    std::memcpy(output->data, plan.slots.data(), plan.slots.size() * sizeof(int64_t));
}

}  // namespace kvcache
