// The floating-point environment the specs' arithmetic assumes, held for a kernel task's scope: round to nearest
// even, and subnormals neither read as zero nor flushed to zero ("no flush of subnormals"), whatever the caller's
// thread holds. A caller may run the ops in another mode (a directed rounding mode; denormals-are-zero and
// flush-to-zero, which ONNX Runtime's session.set_denormal_as_zero sets): a directed mode had taken int4 codes to
// -8, and denormals-are-zero had read a float16 scale below 2^-14 back as 0 and stored sign-only codes beside the
// right scale. The caller's mode comes back at the scope's end. MXCSR is per thread: one per task.
#pragma once

#if defined(__SSE2__)
#include <xmmintrin.h>
#endif

namespace kvcache {
// In the instruction-set builds' namespace where there is one (kv_cpu.cc and the attention kernels are compiled
// generic, AVX2 and AVX-512): each build's inline copy stays its own, never merged with another build's.
#if defined(KV_CPU_ISA)
namespace KV_CPU_ISA {
#endif

class SpecFloatMode {
 public:
#if defined(__SSE2__)
  SpecFloatMode() : saved_(_mm_getcsr()) {
    if (saved_ & kChangedBits) _mm_setcsr(saved_ & ~kChangedBits);
  }
  ~SpecFloatMode() {
    if (saved_ & kChangedBits) _mm_setcsr(saved_);
  }
  SpecFloatMode(const SpecFloatMode&) = delete;
  SpecFloatMode& operator=(const SpecFloatMode&) = delete;

 private:
  // MXCSR: bit 6 denormals-are-zero, bits 13-14 the rounding mode (00: to nearest), bit 15 flush-to-zero.
  static constexpr unsigned kChangedBits = 0x0040u | 0x6000u | 0x8000u;
  unsigned saved_;
#else
  SpecFloatMode() {}  // other processors: the caller's default environment (round to nearest) is assumed
#endif
};

#if defined(KV_CPU_ISA)
}  // namespace KV_CPU_ISA
#endif
}  // namespace kvcache
