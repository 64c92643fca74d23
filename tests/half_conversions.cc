// The element conversions of ort_ops/kv_types.h over runs of consecutive input bit patterns, for
// tests/test_half_conversions.py. Plain loops like the CPU kernel's portable ones: built with the kernel's
// flags they are vectorized as those are.
#include <cstdint>

#include "kv_types.h"

extern "C" {

// out[i] = FloatToHalf(the float32 with bits first + i), i < n.
void kv_float_to_half(uint32_t first, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = kvcache::FloatToHalf(kvcache::BitsFloat(first + static_cast<uint32_t>(i)));
}

// out[i] = FloatToBFloat16(the float32 with bits first + i), i < n.
void kv_float_to_bfloat16(uint32_t first, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    out[i] = kvcache::FloatToBFloat16(kvcache::BitsFloat(first + static_cast<uint32_t>(i)));
}

// out[i] = the bits of HalfToFloat(first + i), i < n <= 65536 - first.
void kv_half_to_float(uint32_t first, uint32_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    out[i] = kvcache::FloatBits(kvcache::HalfToFloat(static_cast<uint16_t>(first + static_cast<uint32_t>(i))));
}

// out[i] = the bits of BFloat16ToFloat(first + i), i < n <= 65536 - first.
void kv_bfloat16_to_float(uint32_t first, uint32_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    out[i] = kvcache::FloatBits(kvcache::BFloat16ToFloat(static_cast<uint16_t>(first + static_cast<uint32_t>(i))));
}

}  // extern "C"
