// KeyCacheRotaryShift's C-entry arguments as the validator's: shared by the CPU and CUDA entries (and the
// CUDA host runner), so every path refuses the same calls with the same messages.
#pragma once

#include "kvcache_op.h"
#include "rotary_shift.h"

namespace kvcache {

// Validates a call (inputs: cache, scale, slots, cos, sin; `output`, the slots' host copy, may be NULL):
// the op's checks, then a scale inside the cache or an output sharing memory with either is refused.
// Throws KvError before anything is written.
RotaryPlan ValidateRotaryWithOutput(const KvcacheRotaryShiftAttrs* c, const KvcacheTensor* inputs,
                                    const KvcacheTensor* output, RotaryAttrs* a, TensorArg* in);

// Copies the validated slots into `output` (nothing when it is NULL).
void WriteSlots(const RotaryPlan& plan, const KvcacheTensor* output);

}  // namespace kvcache
