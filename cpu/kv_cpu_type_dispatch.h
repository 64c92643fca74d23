// The run-time choice of a CPU kernel's element types, shared by the kernels that read or write the cache:
// Launcher<T1, T3, QBits>::Run(args, parallel_for) for the call's T1 (float32, float16, bfloat16), and for a
// quantized cache its QBits (8, 4) and scale type T3 (float16, else float32; F32 and 0 when unquantized).
#pragma once

#include <cstdint>

#include "kv_cpu.h"
#include "kv_types.h"

namespace kvcache {
namespace KV_CPU_ISA {

template <template <class, class, int> class Launcher, class Args>
void DispatchTypes(int32_t t1, int64_t quant_bit, int32_t scale_type, const Args& args,
                   const ParallelFor& parallel_for) {
  auto quantized = [&](auto t1_tag) {
    using T1 = decltype(t1_tag);
    const bool f16_scale = scale_type == int32_t(Elem::kFloat16);
    switch (quant_bit) {
      case 0: return Launcher<T1, F32, 0>::Run(args, parallel_for);
      case 8: return f16_scale ? Launcher<T1, F16, 8>::Run(args, parallel_for) : Launcher<T1, F32, 8>::Run(args, parallel_for);
      default: return f16_scale ? Launcher<T1, F16, 4>::Run(args, parallel_for) : Launcher<T1, F32, 4>::Run(args, parallel_for);
    }
  };
  switch (static_cast<Elem>(t1)) {
    case Elem::kFloat32: return quantized(F32{});
    case Elem::kFloat16: return quantized(F16{});
    default: return quantized(BF16{});
  }
}

}  // namespace KV_CPU_ISA
}  // namespace kvcache
