// KeyCacheRotaryShift on the CPU: validation (spec/KeyCacheRotaryShift.md, the reference's messages)
// and the in-place rotation of the keys of given slots.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "kv_validate.h"

namespace kvcache {

struct RotaryAttrs {
  Attrs base;  // num_layer, layer_idx, quant_bit, quant_group, cache_layout (others keep defaults)
  int64_t rotary_dim = 0, rotary_interleaved = 0;
};

// Attribute checks that need no input (run when the session is created).
void CheckRotaryAttrs(const RotaryAttrs& a);

// A validated call. slots, cos and sin are owned copies taken before any of their values is checked:
// the rotation reads only these, so a slots/cos/sin input that aliases the cache cannot change under it.
struct RotaryPlan {
  int64_t heads = 0, head_dim = 0, max_t = 0, rotary = 0, groups = 0;
  RowStrides rows, scale_rows;
  std::vector<int64_t> slots;  // [N], each in [0, MaxT), distinct
  std::vector<float> cos, sin;  // [N, rotary / 2]
};

// inputs: cache, scale (may be absent), slots, cos, sin. Every check of spec/KeyCacheRotaryShift.md, in
// the reference's order and with its messages, which name only these inputs. Throws KvError. An empty
// scale with quant_bit 0 is first made absent in `inputs` (DropEmptyScale).
RotaryPlan ValidateRotaryShift(const RotaryAttrs& a, TensorArg* inputs);

// The buffers the op writes apart: scale from cache, and the output slots (`n` int64 at `out_slots`, when not
// null) from both. Buffers a caller binds may point anywhere; throws KvError before anything is written.
void CheckRotaryBuffersApart(const TensorArg* inputs, const void* out_slots, int64_t n);

// Rotates the key rows of plan.slots in place (cache, and scale when quantized). The plan must come from
// ValidateRotaryShift on the same inputs.
void RotaryShiftCpu(const RotaryAttrs& a, const RotaryPlan& plan, const TensorArg* inputs,
                    const std::function<void(size_t, const std::function<void(size_t)>&)>& parallel_for);

}  // namespace kvcache
