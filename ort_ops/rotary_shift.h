// KeyCacheRotaryShift on the CPU: validation (spec/KeyCacheRotaryShift.md, the reference's messages)
// and the in-place rotation of the keys of given slots.
#pragma once

#include <cstdint>
#include <functional>

#include "kv_validate.h"

namespace kvcache {

struct RotaryAttrs {
  Attrs base;  // num_layer, layer_idx, quant_bit, quant_group, cache_layout (others keep defaults)
  int64_t rotary_dim = 0, rotary_interleaved = 0;
};

// Attribute checks that need no input (run when the session is created).
void CheckRotaryAttrs(const RotaryAttrs& a);

// inputs: cache, scale (may be absent), slots, cos, sin. Validates all, then rotates in place.
void RotaryShiftCpu(const RotaryAttrs& a, const TensorArg* inputs,
                    const std::function<void(size_t, const std::function<void(size_t)>&)>& parallel_for);

}  // namespace kvcache
