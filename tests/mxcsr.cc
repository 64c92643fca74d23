// Sets or clears the calling thread's denormals-are-zero flag (MXCSR bit 6), or sets its rounding mode, for tests of
// how the CPU kernel behaves when a caller runs it so. Each returns the previous MXCSR value.
#include <xmmintrin.h>

extern "C" unsigned kv_test_set_denormals_are_zero(int on) {
  const unsigned before = _mm_getcsr();
  _mm_setcsr(on ? (before | 0x0040u) : (before & ~0x0040u));
  return before;
}

// mode: 0 to nearest, 1 down, 2 up, 3 toward zero (MXCSR bits 13-14).
extern "C" unsigned kv_test_set_rounding(unsigned mode) {
  const unsigned before = _mm_getcsr();
  _mm_setcsr((before & ~0x6000u) | ((mode & 3u) << 13));
  return before;
}
