// Quantization of one group exactly as spec/KeyValueCache.md "Quantization": float32 arithmetic,
// the scale rounded to its storage type first and that stored value used to quantize.
#pragma once

#include <cmath>

#include "kv_types.h"

namespace kvcache {

constexpr float kScaleEps = 1e-5f;

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
