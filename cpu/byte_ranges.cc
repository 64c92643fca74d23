#include "byte_ranges.h"

#include "kv_checked.h"
#include "kv_types.h"
#include "kv_validate.h"

namespace kvcache {

int64_t TensorBytes(int32_t type, const std::vector<int64_t>& shape) {
  int64_t elements = 0, bytes = 0;
  auto fits = [&](int64_t width) {
    if (!CountFits(shape, &elements) || !MulFits(elements, width, &bytes))
      Fail("a tensor of shape ", ShapeStr(shape), " has more than 2^63 - 1 bytes");
    return bytes;
  };
  switch (static_cast<Elem>(type)) {
    case Elem::kInt4: {
      const int64_t count = fits(1);
      return count / 2 + count % 2;
    }
    case Elem::kFloat16:
    case Elem::kBFloat16: return fits(2);
    case Elem::kFloat32:
    case Elem::kInt32: return fits(4);
    case Elem::kInt64:
    case Elem::kFloat64: return fits(8);
    default: return fits(1);  // 1-byte types; other types never pass validation
  }
}

void CheckDisjoint(const ByteRange& written, const ByteRange& other) {
  if (written.bytes <= 0 || other.bytes <= 0 || other.data == nullptr) return;
  const auto a = reinterpret_cast<uintptr_t>(written.data), b = reinterpret_cast<uintptr_t>(other.data);
  const bool apart = a + static_cast<uint64_t>(written.bytes) <= b || b + static_cast<uint64_t>(other.bytes) <= a;
  if (!apart)
    Fail(written.name, " overlaps ", other.name, ": the op writes ", written.name, " while it reads or writes ",
         other.name, ", so they must not share memory");
}

void CheckApart(const ByteRange& written, const std::vector<ByteRange>& others) {
  for (const ByteRange& other : others) CheckDisjoint(written, other);
}

ByteRange RangeOf(const char* name, const TensorArg& t) {
  return {name, t.present ? t.data : nullptr, t.present ? TensorBytes(t.type, t.shape) : 0};
}

void CheckKeyValueBuffersApart(const TensorArg* in, const void* key, const void* value, int64_t out_bytes) {
  const ByteRange current_key = RangeOf("current_key", in[0]), current_value = RangeOf("current_value", in[1]),
                  cache = RangeOf("cache", in[8]), scale = RangeOf("scale", in[9]);
  CheckApart(cache, {current_key, current_value});
  CheckApart(scale, {current_key, current_value, cache});
  const ByteRange out_key{"output key", key, out_bytes}, out_value{"output value", value, out_bytes};
  const std::vector<ByteRange> data{current_key, current_value, cache, scale};
  CheckDisjoint(out_key, out_value);
  CheckApart(out_key, data);
  CheckApart(out_value, data);
}

void CheckAttentionOutputApart(const TensorArg* in, const void* output) {
  CheckApart({"output attention_output", output, TensorBytes(in[0].type, in[0].shape)},
             {RangeOf("query", in[0]), RangeOf("key", in[1]), RangeOf("value", in[2]), RangeOf("attn_mask", in[8])});
}

}  // namespace kvcache
