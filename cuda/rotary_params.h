// From a validated KeyCacheRotaryShift call to the CUDA kernel's RotaryParams: the slot and rotation
// tables packed for one host-to-device copy, the launch limits checked. Host code without CUDA headers,
// so the host runner builds exactly the params the GPU path launches with.
#pragma once

#include <cstdint>
#include <vector>

#include "rotary_shift.h"
#include "rotary_work.h"

namespace kvcache {
namespace cuda {

// The plan's snapshots in one byte array: slots (int64 [N]), cos, sin (float32 [N, R/2] each).
std::vector<uint8_t> PackRotaryTables(const RotaryPlan& plan);

// Throws KvError when the call cannot run on the GPU: a quantized row longer than the kernel's buffer
// (kMaxQuantizedShiftHeadDim), or more rows than one launch covers. Called before anything is written.
void CheckRotaryLaunchable(const RotaryAttrs& a, const RotaryPlan& plan);

// Params for a validated call whose packed tables (PackRotaryTables) are at `tables` on the device.
RotaryParams MakeRotaryParams(const RotaryAttrs& a, const RotaryPlan& plan, const uint8_t* tables, void* cache,
                              void* scale);

}  // namespace cuda
}  // namespace kvcache
