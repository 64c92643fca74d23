// Picks the CPU kernel build for this processor: AVX2 + F16C when present, else the generic one.
// Both compute identical bits; only the speed differs.
#include "kv_cpu.h"

#include <cstdlib>
#include <cstring>

namespace kvcache {
namespace generic {
void ComputeCpu(const ComputeArgs& args, const ParallelFor& parallel_for);
}
namespace avx2 {
void ComputeCpu(const ComputeArgs& args, const ParallelFor& parallel_for);
}

bool ForceGenericCpuKernel() {
  const char* choice = std::getenv("KVCACHE_OP_CPU_KERNEL");
  return choice != nullptr && std::strcmp(choice, "generic") == 0;
}

static bool CpuHasAvx2F16c() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return has;
}

void ComputeCpu(const ComputeArgs& args, const ParallelFor& parallel_for) {
  if (CpuHasAvx2F16c() && !ForceGenericCpuKernel()) return avx2::ComputeCpu(args, parallel_for);
  generic::ComputeCpu(args, parallel_for);
}

}  // namespace kvcache
