// Overflow-checked size arithmetic. Shapes, attributes and index values are chosen by the caller: a
// product of them that wraps would size a buffer too small and turn later offsets into wild pointers.
#pragma once

#include <cstdint>
#include <vector>

namespace kvcache {

// *out = a * b; false (and *out unspecified) when the exact product does not fit in int64.
inline bool MulFits(int64_t a, int64_t b, int64_t* out) { return !__builtin_mul_overflow(a, b, out); }

// *out = product of the dims (1 for a scalar); false when it does not fit in int64. A zero dim makes
// the product 0 whatever the others are, as for a tensor's element count.
inline bool CountFits(const std::vector<int64_t>& shape, int64_t* out) {
  for (int64_t d : shape)
    if (d == 0) return *out = 0, true;
  int64_t n = 1;
  for (int64_t d : shape)
    if (!MulFits(n, d, &n)) return false;
  *out = n;
  return true;
}

}  // namespace kvcache
