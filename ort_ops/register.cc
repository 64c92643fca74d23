// The library's only entry point: registers KeyValueCache in domain opmx.dynamic_batching for the
// CPU EP (and the CUDA EP in a CUDA build); KeyCacheRotaryShift, MultiHeadAttention and MultiHeadCacheAttention
// likewise.
#include <string>

#include "kv_ort_op.h"
#include "mha_ort_op.h"
#include "mhca_ort_op.h"
#include "rotary_ort_op.h"

#ifdef KVCACHE_WITH_CUDA
#include "kv_ort_cuda_op.h"
#include "mha_ort_cuda_op.h"
#include "rotary_ort_cuda_op.h"
#endif

namespace {

// The ops and their one domain, created on the first registration and kept for the life of the process:
// sessions keep pointers to the ops, and every SessionOptions that the library was registered in keeps
// a pointer to the domain until a session is created from it. ONNX Runtime unloads a registered library with the
// last SessionOptions holding it (LibraryHandles, core/framework/library_handles.cc); the library is linked
// -z nodelete (CMakeLists.txt) so it stays loaded and this registry is built once, not once per reload.
//
// One domain serves every registration. ONNX Runtime reads a domain only while creating a session:
// CreateCustomRegistry (onnxruntime/core/session/custom_ops.cc) copies the domain's name into the
// session's CustomRegistry, builds schemas and kernel definitions from its ops, and keeps only the op
// pointers (CustomOpKernel holds `const OrtCustomOp&`), noting there that "two sessions using the same
// session_options should not add the same custom op domain ... twice". A domain per registration, as
// before, grew the heap by one domain for every SessionOptions ever registered.
struct Registry {
  kvcache::CpuOp cpu_op;
  kvcache::RotaryCpuOp rotary_cpu_op;
  kvcache::MhaCpuOp mha_cpu_op;
  kvcache::MhcaCpuOp mhca_cpu_op;
#ifdef KVCACHE_WITH_CUDA
  kvcache::CudaOp cuda_op;
  kvcache::RotaryCudaOp rotary_cuda_op;
  kvcache::MhaCudaOp mha_cuda_op;
  kvcache::MhcaCudaOp mhca_cuda_op;
#endif
  Ort::CustomOpDomain domain{kvcache::kDomain};

  Registry() {
    domain.Add(&cpu_op);
    domain.Add(&rotary_cpu_op);
    domain.Add(&mha_cpu_op);
    domain.Add(&mhca_cpu_op);
#ifdef KVCACHE_WITH_CUDA
    domain.Add(&cuda_op);
    domain.Add(&rotary_cuda_op);
    domain.Add(&mha_cuda_op);
    domain.Add(&mhca_cuda_op);
#endif
  }
};

// Thread-safe (a function-local static); the Ort API must be initialized first.
Registry& GetRegistry() {
  static Registry* registry = new Registry();  // never destroyed: sessions may outlive static teardown
  return *registry;
}

}  // namespace

// Registers the ops in `options` (ONNX Runtime calls this from register_custom_ops_library). Adds the
// process-wide domain: repeated registrations allocate nothing.
// Asks for API version kOrtApiVersion exactly, whatever the headers' version, so the library runs on every
// onnxruntime from kOrtMinRelease on; an older one gets an error status naming the release needed.
extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(kvcache::kOrtApiVersion);
  if (api == nullptr) {
    const std::string message = std::string("kvcache-op needs onnxruntime >= ") + kvcache::kOrtMinRelease +
                                " (ONNX Runtime C API version " + std::to_string(kvcache::kOrtApiVersion) +
                                "), but this is onnxruntime " + api_base->GetVersionString();
    return api_base->GetApi(1)->CreateStatus(ORT_FAIL, message.c_str());
  }
  Ort::InitApi(api);
  try {
    Ort::UnownedSessionOptions(options).Add(GetRegistry().domain);
    return nullptr;
  } catch (...) {
    return kvcache::StatusFromCurrentException();
  }
}
