// Byte sizes of dense tensors and the check that a buffer an op writes shares no byte with another it
// reads or writes. Used by the C entry points and by the ONNX Runtime glue (an output bound by the caller
// through IOBinding may point anywhere).
#pragma once

#include <cstdint>
#include <vector>

namespace kvcache {

// Bytes of a dense tensor of this type and shape (int4: two per byte, rounded up). Throws KvError when
// they do not fit in int64 (a declared shape may be anything: a wrapped count would hide an overlap).
int64_t TensorBytes(int32_t type, const std::vector<int64_t>& shape);

// Throws KvError when the byte ranges of two named buffers overlap (empty buffers never do).
struct ByteRange {
  const char* name;
  const void* data;
  int64_t bytes;
};
void CheckDisjoint(const ByteRange& written, const ByteRange& other);

// CheckDisjoint of `written` against each of `others`.
void CheckApart(const ByteRange& written, const std::vector<ByteRange>& others);

struct TensorArg;
// The byte range of an input as the validator saw it (empty when absent).
ByteRange RangeOf(const char* name, const TensorArg& t);

// KeyValueCache's buffers (inputs `in` in the op's order): cache and scale, written in place, apart from each
// other and from current_key and current_value, which are read meanwhile; the outputs key and value apart
// from each other and from all four. Buffers a caller binds (C entry, IOBinding, OrtValues over its own
// memory) may point anywhere; throws KvError before anything is written.
void CheckKeyValueBuffersApart(const TensorArg* in, const void* key, const void* value, int64_t out_bytes);

// MultiHeadAttention's output (query's type and shape) apart from query, key, value and attn_mask.
void CheckAttentionOutputApart(const TensorArg* in, const void* output);

}  // namespace kvcache
