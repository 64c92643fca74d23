// MultiHeadCacheAttention on the CPU: KeyValueCache's stores (kv_cpu.cc, gathers skipped), then the shared
// attention kernel (attention_kernel.h) reading keys and values straight from the cache: float32 rows of
// adjacent heads in place; decode tiles dequantize codes in groups of 8 in registers; others are converted or
// dequantized (exactly as KeyValueCache's gather would) into a row buffer of the task. Built once per
// instruction set like kv_cpu.cc; the attention itself per element type in the generated files that include
// mhca_cpu_source.h.
#include "mhca_cpu.h"

#include "kv_types.h"
#include "mhca_cpu_attend.h"

namespace kvcache {
namespace KV_CPU_ISA {

void MhcaComputeCpu(const MhcaArgs& args, const ParallelFor& parallel_for) {
  // The stores first, all of them (spec: every store of the call before any load): KeyValueCache's own.
  const ComputeArgs stores{&args.attrs->cache, &args.plan->cache, args.t1, args.scale_type, args.key, args.value,
                           args.cache, args.scale, nullptr, nullptr};
  ComputeCpu(stores, parallel_for);
  switch (static_cast<Elem>(args.t1)) {
    case Elem::kFloat32: return MhcaAttend<F32>(args, parallel_for);
    case Elem::kFloat16: return MhcaAttend<F16>(args, parallel_for);
    default: return MhcaAttend<BF16>(args, parallel_for);
  }
}

}  // namespace KV_CPU_ISA
}  // namespace kvcache
