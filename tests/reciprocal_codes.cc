// Test entry point of the AVX-512 quantizer's division-free codes (QuantizeCodes16ByReciprocal,
// cpu/kv_cpu_quant_avx512.h), built with the AVX-512 build's flags: for every stored scale s of a 16-bit scale
// type and every 16-bit input x whose quotient x / s lies within (-127.5, 127.5), the code from x * (1 / s)
// against the spec's own, rint(float32(x / s)) rounding half to even, from an IEEE division. Inputs with |x| >= s / 16 are all taken; smaller ones, whose codes are 0, every 61st (by bit pattern).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kv_cpu_quant_avx512.h"

namespace {

using namespace kvcache;
using namespace kvcache::KV_CPU_ISA;

// Every non-negative finite value of a 16-bit type, ascending (their bit patterns are in value order).
std::vector<float> NonNegative(int bfloat16) {
  std::vector<float> v;
  const uint32_t last = bfloat16 ? 0x7f7f : 0x7bff;
  for (uint32_t b = 0; b <= last; ++b)
    v.push_back(bfloat16 ? BFloat16ToFloat(static_cast<uint16_t>(b)) : HalfToFloat(static_cast<uint16_t>(b)));
  return v;
}

struct Batch {
  std::vector<float> x, s, r;
  int64_t checked = 0, wrong = 0;
  float wrong_x = 0, wrong_s = 0;

  void Add(float xv, float sv, float rv) {
    x.push_back(xv), s.push_back(sv), r.push_back(rv);
    if (x.size() == 4096) Run();
  }
  void Run() {
    while (x.size() % 16 != 0) x.push_back(0.0f), s.push_back(1.0f), r.push_back(1.0f);
    for (size_t i = 0; i < x.size(); i += 16) {
      alignas(64) int32_t fast[16], want[16];
      const __m512 xv = _mm512_loadu_ps(&x[i]), sv = _mm512_loadu_ps(&s[i]);
      _mm512_store_si512(fast, QuantizeCodes16ByReciprocal(xv, _mm512_loadu_ps(&r[i])));
      _mm512_store_si512(want, _mm512_cvtps_epi32(_mm512_div_ps(xv, sv)));
      for (int k = 0; k < 16; ++k) {
        // The spec's rint(x / s) once more, by the C library (half to even in the default rounding mode).
        const float q = x[i + k] / s[i + k];
        const bool ok = fast[k] == want[k] && want[k] == static_cast<int32_t>(std::nearbyint(q));
        if (!ok && wrong++ == 0) wrong_x = x[i + k], wrong_s = s[i + k];
      }
      checked += 16;
    }
    x.clear(), s.clear(), r.clear();
  }
};

}  // namespace

// Checks every (x, s) pair described above for inputs of type t1 and scales of type t3 (0 float16, 1
// bfloat16), scales from T3(1e-5) up. Returns the number of wrong codes; *checked counts the pairs, and
// *first_x / *first_s hold the first wrong pair.
extern "C" int64_t reciprocal_codes_check(int t1, int t3, int64_t* checked, float* first_x, float* first_s) {
  const std::vector<float> xs = NonNegative(t1), ss = NonNegative(t3);
  const float smallest = t3 ? BFloat16ToFloat(FloatToBFloat16(1e-5f)) : HalfToFloat(FloatToHalf(1e-5f));
  Batch batch;
  for (float s : ss) {
    if (s < smallest) continue;
    const float r = 1.0f / s;
    const size_t near = std::lower_bound(xs.begin(), xs.end(), s / 16) - xs.begin();
    for (size_t i = 0; i < xs.size(); i = i < near ? std::min(i + 61, near) : i + 1) {
      const float x = xs[i];
      if (!(x / s < 127.5f)) break;
      batch.Add(x, s, r);
      batch.Add(-x, s, r);
    }
  }
  batch.Run();
  *checked = batch.checked;
  *first_x = batch.wrong_x;
  *first_s = batch.wrong_s;
  return batch.wrong;
}
