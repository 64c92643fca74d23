// Reading a custom op's attributes from ONNX Runtime's kernel info, strictly: an attribute the node sets with
// another type (FLOAT 2.0 for an INT, INT 3 for a FLOAT, a list, a string) is an error naming it, never taken
// for absent. ORT's getters fail alike for "absent" and "another type", so the other types are probed.
#pragma once

#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT

#include <cstdint>

namespace kvcache {

// An INT attribute, or `fallback` (the spec's default) when the node does not set it; KvError when it sets it
// with another type.
int64_t AttrOr(const OrtKernelInfo* info, const char* name, int64_t fallback);

// An INT attribute the op needs (`op`: its name, for the message); KvError when absent or of another type.
int64_t RequiredAttr(const OrtKernelInfo* info, const char* op, const char* name);

// A FLOAT attribute, or `fallback` when absent; KvError when the node sets it with another type.
float FloatAttrOr(const OrtKernelInfo* info, const char* name, float fallback);

}  // namespace kvcache
