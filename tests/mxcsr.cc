// Sets or clears the calling thread's denormals-are-zero flag (MXCSR bit 6) for tests of how the CPU kernel
// behaves when a caller runs it with that flag on. Returns the previous MXCSR value.
#include <xmmintrin.h>

extern "C" unsigned kv_test_set_denormals_are_zero(int on) {
  const unsigned before = _mm_getcsr();
  _mm_setcsr(on ? (before | 0x0040u) : (before & ~0x0040u));
  return before;
}
