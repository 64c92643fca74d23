// Picks the CPU kernel build for this processor: AVX2 + F16C when the library has that build (CMake adds
// it, and defines KVCACHE_CPU_AVX2 here, only where the compiler targets x86-64) and the processor has
// both; else the generic one. KeyValueCache's builds compute identical bits; MultiHeadAttention's differ
// only in the summation order of dot products (within the spec's tolerance); only the speed differs.
#include "kv_cpu.h"
#include "mha_cpu.h"

#include <cstdlib>
#include <cstring>

namespace kvcache {
namespace generic {
void ComputeCpu(const ComputeArgs& args, const ParallelFor& parallel_for);
void MhaComputeCpu(const MhaArgs& args, const ParallelFor& parallel_for);
}
#ifdef KVCACHE_CPU_AVX2
namespace avx2 {
void ComputeCpu(const ComputeArgs& args, const ParallelFor& parallel_for);
void MhaComputeCpu(const MhaArgs& args, const ParallelFor& parallel_for);
}
#endif

bool ForceGenericCpuKernel() {
  const char* choice = std::getenv("KVCACHE_OP_CPU_KERNEL");
  return choice != nullptr && std::strcmp(choice, "generic") == 0;
}

#ifdef KVCACHE_CPU_AVX2
static bool CpuHasAvx2F16c() {
  // __builtin_cpu_supports is an x86-only builtin, hence the guard.
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return has;
}
#endif

void ComputeCpu(const ComputeArgs& args, const ParallelFor& parallel_for) {
#ifdef KVCACHE_CPU_AVX2
  if (CpuHasAvx2F16c() && !ForceGenericCpuKernel()) return avx2::ComputeCpu(args, parallel_for);
#endif
  generic::ComputeCpu(args, parallel_for);
}

void MhaComputeCpu(const MhaArgs& args, const ParallelFor& parallel_for) {
#ifdef KVCACHE_CPU_AVX2
  if (CpuHasAvx2F16c() && !ForceGenericCpuKernel()) return avx2::MhaComputeCpu(args, parallel_for);
#endif
  generic::MhaComputeCpu(args, parallel_for);
}

}  // namespace kvcache
