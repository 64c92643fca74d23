// The library's only entry point: registers KeyValueCache in domain opmx.dynamic_batching for the
// CPU EP (and the CUDA EP in a CUDA build), and KeyCacheRotaryShift for the CPU EP.
#include <memory>
#include <mutex>
#include <vector>

#include "kv_ort_op.h"
#include "rotary_ort_op.h"

#ifdef KVCACHE_WITH_CUDA
#include "kv_ort_cuda_op.h"
#endif

namespace {

// Ops and domains must outlive every session that uses them: kept for the life of the process.
struct Registry {
  kvcache::CpuOp cpu_op;
  kvcache::RotaryCpuOp rotary_cpu_op;
#ifdef KVCACHE_WITH_CUDA
  kvcache::CudaOp cuda_op;
#endif
  std::vector<Ort::CustomOpDomain> domains;
  std::mutex mutex;
};

Registry& GetRegistry() {
  static Registry* registry = new Registry();  // never destroyed: sessions may outlive static teardown
  return *registry;
}

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) {
    return api_base->GetApi(1)->CreateStatus(
        ORT_FAIL, "kvcache-op needs ONNX Runtime with API version >= 29 (onnxruntime >= 1.29)");
  }
  Ort::InitApi(api);
  try {
    Registry& registry = GetRegistry();
    std::lock_guard<std::mutex> lock(registry.mutex);
    Ort::CustomOpDomain domain(kvcache::kDomain);
    domain.Add(&registry.cpu_op);
    domain.Add(&registry.rotary_cpu_op);
#ifdef KVCACHE_WITH_CUDA
    domain.Add(&registry.cuda_op);
#endif
    Ort::UnownedSessionOptions(options).Add(domain);
    registry.domains.push_back(std::move(domain));
    return nullptr;
  } catch (...) {
    return kvcache::StatusFromCurrentException();
  }
}
