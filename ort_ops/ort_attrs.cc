#include "ort_attrs.h"

#include "kv_validate.h"

namespace kvcache {
namespace {

// True when the getter succeeded (the attribute exists with that type); a failure status is released.
bool Ok(OrtStatus* status) {
  if (status == nullptr) return true;
  Ort::GetApi().ReleaseStatus(status);
  return false;
}

// The ONNX type the node gives attribute `name`, probed as each type but `expected`; nullptr when absent (or
// of a type no probe reads, such as a tensor, which no op here takes).
const char* OtherType(const OrtKernelInfo* info, const char* name, const char* expected) {
  const OrtApi& api = Ort::GetApi();
  int64_t i = 0;
  float f = 0.0f;
  size_t size = 0;
  if (std::string(expected) != "INT" && Ok(api.KernelInfoGetAttribute_int64(info, name, &i))) return "INT";
  if (std::string(expected) != "FLOAT" && Ok(api.KernelInfoGetAttribute_float(info, name, &f))) return "FLOAT";
  if (Ok(api.KernelInfoGetAttribute_string(info, name, nullptr, &size))) return "STRING";
  // Asked for its size only, ORT's list getters answer for an attribute of any type (the size of their own
  // kind of list in it, 0 when it holds none): the non-empty one tells the type.
  size_t floats = 0, ints = 0;
  const bool found_floats = Ok(api.KernelInfoGetAttributeArray_float(info, name, nullptr, &floats));
  const bool found_ints = Ok(api.KernelInfoGetAttributeArray_int64(info, name, nullptr, &ints));
  const bool found = found_floats || found_ints;
  if (floats) return "FLOATS";
  if (ints) return "INTS";
  return found ? "a list, tensor or graph" : nullptr;
}

[[noreturn]] void WrongType(const char* name, const char* expected, const char* got) {
  Fail("the attribute ", name, " must be of type ", expected, ", the node gives it as ", got);
}

}  // namespace

int64_t AttrOr(const OrtKernelInfo* info, const char* name, int64_t fallback) {
  int64_t value = fallback;
  if (Ok(Ort::GetApi().KernelInfoGetAttribute_int64(info, name, &value))) return value;
  if (const char* got = OtherType(info, name, "INT")) WrongType(name, "INT", got);
  return fallback;  // absent: the spec's default
}

int64_t RequiredAttr(const OrtKernelInfo* info, const char* op, const char* name) {
  int64_t value = 0;
  if (Ok(Ort::GetApi().KernelInfoGetAttribute_int64(info, name, &value))) return value;
  if (const char* got = OtherType(info, name, "INT")) WrongType(name, "INT", got);
  Fail(op, " needs the attribute ", name, " (ppl gives it no default)");
}

float FloatAttrOr(const OrtKernelInfo* info, const char* name, float fallback) {
  float value = fallback;
  if (Ok(Ort::GetApi().KernelInfoGetAttribute_float(info, name, &value))) return value;
  if (const char* got = OtherType(info, name, "FLOAT")) WrongType(name, "FLOAT", got);
  return fallback;  // absent: the spec's default
}

}  // namespace kvcache
