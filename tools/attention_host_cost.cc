// The host side of a MultiHeadCacheAttention call on CUDA, timed on the CPU: the validation, the attention's plan
// (tiles and merges) and the stores' index words appended to it, as cuda/kv_cuda_run.cc does them before anything is
// enqueued.
// Built and driven by attention_host_cost.py; no GPU or CUDA headers needed.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

#include "attention_c_args.h"
#include "attention_params.h"
#include "c_tensors.h"
#include "kv_cuda_params.h"
#include "mhca_validate.h"

namespace {

using Clock = std::chrono::steady_clock;

double Nanoseconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::nano>(b - a).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

// out[0..2]: median ns per call of the validation, the stores' index words and the plan; out[3]: the plan's words,
// out[4]: its tiles. The policy is the GPU path's defaults, with the tensor-core kernel for sequences longer than one
// token when `mma` is set.
// Returns 0, or -1 when the call is refused (out[0] then unset).
extern "C" __attribute__((visibility("default"))) int attention_host_cost(
    const KvcacheMultiHeadCacheAttentionAttrs* attrs, const KvcacheTensor inputs[13], const KvcacheTensor* output,
    int mma, int rounds, int calls, double* out) {
  using namespace kvcache;
  try {
    std::vector<double> validate, pack, planning;
    cuda::TilePolicy policy;
    policy.decode_form = 2;
    policy.mma_kernel = mma != 0;
    for (int r = 0; r < rounds; ++r) {
      double v = 0, k = 0, l = 0;
      for (int c = 0; c < calls; ++c) {
        const auto t0 = Clock::now();
        MhcaAttrs a;
        TensorArg in[kMhcaNumInputs];
        const MhcaPlan plan = ValidateMhcaWithOutput(attrs, inputs, output, &a, in);
        const auto t1 = Clock::now();
        const cuda::CacheSide side{&a.cache, &plan.cache};
        cuda::AttnLaunchPlan launch = cuda::PlanAttention(a.attention, plan.attention, &side, policy);
        const auto t2 = Clock::now();
        const auto planned = static_cast<double>(launch.words.size());
        cuda::AppendStoreIndices(plan.cache, &launch);
        const auto t3 = Clock::now();
        v += Nanoseconds(t0, t1);
        l += Nanoseconds(t1, t2);
        k += Nanoseconds(t2, t3);
        out[3] = planned;
        out[4] = static_cast<double>(launch.tiles + launch.decode_tiles + launch.mma_tiles);
      }
      validate.push_back(v / calls);
      pack.push_back(k / calls);
      planning.push_back(l / calls);
    }
    out[0] = Median(validate);
    out[1] = Median(pack);
    out[2] = Median(planning);
    return 0;
  } catch (const std::exception&) {
    return -1;
  }
}
