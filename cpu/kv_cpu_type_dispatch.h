// The run-time choice of a CPU kernel's element types, shared by the kernels that read or write the cache:
// Launcher<T1, T3, QBits>::Run(args, parallel_for) for the call's T1 (float32, float16, bfloat16), and for a
// quantized cache its QBits (8, 4) and scale type T3 (float16, else float32; F32 and 0 when unquantized).
#pragma once

#include <cstdint>

#include "kv_cpu.h"
#include "kv_types.h"

namespace kvcache {
namespace KV_CPU_ISA {

// Launcher<T1, T3, QBits>::Run for a known T1: the quantization's QBits and scale type T3.
template <template <class, class, int> class Launcher, class T1, class Args>
void DispatchQuantTypes(int64_t quant_bit, int32_t scale_type, const Args& args, const ParallelFor& parallel_for) {
  const bool f16_scale = scale_type == int32_t(Elem::kFloat16);
  switch (quant_bit) {
    case 0: return Launcher<T1, F32, 0>::Run(args, parallel_for);
    case 8: return f16_scale ? Launcher<T1, F16, 8>::Run(args, parallel_for) : Launcher<T1, F32, 8>::Run(args, parallel_for);
    default: return f16_scale ? Launcher<T1, F16, 4>::Run(args, parallel_for) : Launcher<T1, F32, 4>::Run(args, parallel_for);
  }
}

template <template <class, class, int> class Launcher, class Args>
void DispatchTypes(int32_t t1, int64_t quant_bit, int32_t scale_type, const Args& args,
                   const ParallelFor& parallel_for) {
  switch (static_cast<Elem>(t1)) {
    case Elem::kFloat32: return DispatchQuantTypes<Launcher, F32>(quant_bit, scale_type, args, parallel_for);
    case Elem::kFloat16: return DispatchQuantTypes<Launcher, F16>(quant_bit, scale_type, args, parallel_for);
    default: return DispatchQuantTypes<Launcher, BF16>(quant_bit, scale_type, args, parallel_for);
  }
}

}  // namespace KV_CPU_ISA
}  // namespace kvcache
