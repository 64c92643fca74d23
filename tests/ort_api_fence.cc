// Test shim (tests/test_ort_api_version.py builds it): a custom-op library that loads the real one,
// $KVCACHE_OP_FENCED_LIBRARY, and registers it with an ONNX Runtime API cut down to version
// KVCACHE_FENCE_VERSION. The OrtApi table only grows, one version after another, so the functions of that
// version are the slots before KVCACHE_FENCE_FIRST_NEW (the first function of the next version): those are
// copied from the real table; every later slot aborts, naming itself. GetApi answers only versions up to
// KVCACHE_FENCE_VERSION. A library that calls only what that version has runs exactly as without the shim.
#include <dlfcn.h>

#include <array>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "onnxruntime_c_api.h"

namespace {

constexpr size_t kSlots = sizeof(OrtApi) / sizeof(void*);
constexpr size_t kFirstNewSlot = offsetof(OrtApi, KVCACHE_FENCE_FIRST_NEW) / sizeof(void*);

template <size_t Slot>
void Trap() {
  std::fprintf(stderr, "api fence: OrtApi slot %zu called, past API version %d\n", Slot, KVCACHE_FENCE_VERSION);
  std::abort();
}

template <size_t... Slot>
constexpr std::array<void (*)(), sizeof...(Slot)> Traps(std::index_sequence<Slot...>) {
  return {&Trap<Slot>...};
}

OrtApi fenced_api;
const OrtApiBase* real_base = nullptr;

const OrtApi* ORT_API_CALL GetFencedApi(uint32_t version) noexcept {
  return version >= 1 && version <= KVCACHE_FENCE_VERSION ? &fenced_api : nullptr;
}

const char* ORT_API_CALL GetVersionString() noexcept { return real_base->GetVersionString(); }

const OrtApiBase fenced_base{GetFencedApi, GetVersionString};

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  real_base = api_base;
  const OrtApi* real = api_base->GetApi(KVCACHE_FENCE_VERSION);  // null from a runtime older than the fence
  if (real == nullptr) return api_base->GetApi(1)->CreateStatus(ORT_FAIL, "api fence: runtime older than the fence");
  static constexpr auto traps = Traps(std::make_index_sequence<kSlots>());
  void** slots = reinterpret_cast<void**>(&fenced_api);
  std::memcpy(slots, real, kFirstNewSlot * sizeof(void*));
  for (size_t i = kFirstNewSlot; i < kSlots; ++i) slots[i] = reinterpret_cast<void*>(traps[i]);

  const char* path = std::getenv("KVCACHE_OP_FENCED_LIBRARY");
  void* library = path ? dlopen(path, RTLD_NOW | RTLD_LOCAL) : nullptr;
  if (library == nullptr) return real->CreateStatus(ORT_FAIL, path ? dlerror() : "KVCACHE_OP_FENCED_LIBRARY unset");
  using Register = OrtStatus*(ORT_API_CALL*)(OrtSessionOptions*, const OrtApiBase*);
  auto target = reinterpret_cast<Register>(dlsym(library, "RegisterCustomOps"));
  if (target == nullptr) return real->CreateStatus(ORT_FAIL, "no RegisterCustomOps in KVCACHE_OP_FENCED_LIBRARY");
  return target(options, &fenced_base);
}
