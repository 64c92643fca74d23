// Quantization of one group exactly as spec/KeyValueCache.md "Quantization": float32 arithmetic,
// the scale rounded to its storage type first and that stored value used to quantize.
#pragma once

#include <cmath>

#include "kv_types.h"

namespace kvcache {

constexpr float kScaleEps = 1e-5f;

// Bits of |x| for a float x: on these (non-negative floats) the integer order is the float order, and every
// NaN's bits exceed infinity's, so an integer max over a group is max|x|, or a NaN if the group has one.
constexpr uint32_t kAbsMask = 0x7fffffffu, kInfBits = 0x7f800000u, kQuietNanBits = 0x7fc00000u;

// The max|x| bits above with any NaN made the canonical quiet NaN (the spec leaves NaN payloads open; this
// keeps every CPU path's bits the same).
KV_HD uint32_t CanonicalAbsMax(uint32_t max_abs_bits) { return max_abs_bits > kInfBits ? kQuietNanBits : max_abs_bits; }

// max|v| with NaN propagation (numpy's max): once NaN, stays NaN.
KV_HD float AbsMaxStep(float amax, float v) {
  const float a = fabsf(v);
  return (a > amax || a != a) ? a : amax;
}

// max(amax / qmax, eps) in float32; NaN stays NaN.
KV_HD float GroupScale(float amax, float qmax) {
  const float s = amax / qmax;
  return (s != s || s > kScaleEps) ? s : kScaleEps;  // comparisons, not fmaxf: no libm call
}

// clamp(rint(v / scale), -qmax, qmax); 0 for a NaN quotient.
KV_HD int32_t QuantizeValue(float v, float stored_scale, float qmax) {
  const float q = v / stored_scale;
  if (q != q) return 0;
  const float r = rintf(q);  // default rounding mode: to nearest, ties to even
  return static_cast<int32_t>(r < -qmax ? -qmax : (r > qmax ? qmax : r));
}

}  // namespace kvcache
