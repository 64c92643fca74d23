// The attention half of MultiHeadCacheAttention on the CPU, per element type T1: declared for mhca_cpu.cc,
// defined in mhca_cpu_source.h and compiled once per T1 (and instruction set) in the files CMakeLists.txt
// generates from mhca_cpu_instance.cc.in.
#pragma once

#include "kv_cpu.h"
#include "mhca_cpu.h"

namespace kvcache {
namespace KV_CPU_ISA {

// Attends over the keys and values in the cache, after the call's stores; the plan must come from
// ValidateCacheAttention on the same inputs, and args.t1 must be T1's element type.
template <class T1>
void MhcaAttend(const MhcaArgs& args, const ParallelFor& parallel_for);

}  // namespace KV_CPU_ISA
}  // namespace kvcache
