// The C entry points' tensors as the validators' TensorArgs, and the checks only a caller-allocated
// output needs (shape, type, no overlap with what the op reads or writes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "byte_ranges.h"
#include "kv_types.h"
#include "kv_validate.h"
#include "kvcache_op.h"

namespace kvcache {

// Converts `count` tensors; names[i] is used in messages. Throws KvError for a rank outside
// [0, KVCACHE_OP_MAX_RANK], a required input with type 0, or NULL data for a non-empty tensor.
void ToTensorArgs(const KvcacheTensor* tensors, size_t count, const char* const* names, const bool* optional,
                  TensorArg* out);


// A caller's `N` output descriptors, copied once at entry (null stays null): validation and the writes then use the
// same pointers and shapes, which a caller's thread changing its descriptors meanwhile cannot move past what was
// checked. (Inputs are copied by ToTensorArgs, once each.)
template <size_t N>
class DescriptorSnapshot {
 public:
  explicit DescriptorSnapshot(const KvcacheTensor* given) {
    if (given == nullptr) return;
    for (size_t i = 0; i < N; ++i) copies_[i] = given[i];
    at_ = copies_;
  }
  const KvcacheTensor* get() const { return at_; }

 private:
  KvcacheTensor copies_[N] = {};
  const KvcacheTensor* at_ = nullptr;
};

// Throws KvError unless `t` has this type and shape and non-NULL data when it holds any byte.
void CheckOutput(const KvcacheTensor& t, const char* name, int32_t type, const std::vector<int64_t>& shape);


// Runs `body` and turns its exceptions into a return code and message (the C boundary).
int32_t CatchAll(const std::function<void()>& body, char* message, size_t message_size);

// Copies `text` into the caller's buffer, truncated and NUL-terminated (nothing when message is NULL).
void WriteMessage(const std::string& text, char* message, size_t message_size);

// fn(i) for i in [0, count) on up to `threads` threads (the calling thread included).
void ParallelOnThreads(int32_t threads, size_t count, const std::function<void(size_t)>& fn);

// Attribute structs of the C API as the validators' attributes.
Attrs ToAttrs(const KvcacheKeyValueCacheAttrs& a);

// KeyValueCache's 10 inputs, in the op's order, by name (scale optional).
extern const char* const kKeyValueCacheInputs[10];

// ToTensorArgs for KeyValueCache's 10 inputs.
void ToKeyValueCacheArgs(const KvcacheTensor* inputs, TensorArg* out);

// Validates a call with caller-allocated outputs: shapes and types as the call produces, and no output,
// cache or scale sharing memory with what the op reads or writes meanwhile. Shared by the CPU and CUDA
// entries. Throws KvError before anything is written.
CallPlan ValidateWithOutputs(const KvcacheKeyValueCacheAttrs* c, const KvcacheTensor* inputs,
                             const KvcacheTensor* outputs, Attrs* attrs, TensorArg* in);


}  // namespace kvcache
