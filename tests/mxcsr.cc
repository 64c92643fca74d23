// Sets the calling thread's denormals-are-zero and flush-to-zero flags (MXCSR bits 6 and 15), or its rounding mode,
// for tests of how the CPU kernels behave when a caller runs them so. Each returns the previous MXCSR value.
#include <xmmintrin.h>

// modes: bit 0 denormals-are-zero, bit 1 flush-to-zero; each flag set or cleared as asked.
extern "C" unsigned kv_test_set_flush_modes(unsigned modes) {
  const unsigned before = _mm_getcsr();
  const unsigned wanted = ((modes & 1u) ? 0x0040u : 0u) | ((modes & 2u) ? 0x8000u : 0u);
  _mm_setcsr((before & ~0x8040u) | wanted);
  return before;
}

// mode: 0 to nearest, 1 down, 2 up, 3 toward zero (MXCSR bits 13-14).
extern "C" unsigned kv_test_set_rounding(unsigned mode) {
  const unsigned before = _mm_getcsr();
  _mm_setcsr((before & ~0x6000u) | ((mode & 3u) << 13));
  return before;
}
