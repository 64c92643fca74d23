// Host-side validation of a KeyValueCache call: every condition of spec/KeyValueCache.md "Validity",
// in its order, before anything is written. Messages match the numpy reference's.
#pragma once

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvcache {

struct KvError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Throws KvError with the parts streamed together (the reference's message format).
template <typename... Parts>
[[noreturn]] void Fail(const Parts&... parts) {
  std::ostringstream s;
  (s << ... << parts);
  throw KvError(s.str());
}

struct Attrs {
  int64_t num_layer = 1, layer_idx = 0, quant_bit = 0, quant_group = 8, num_repeat = 1, cache_mode = 0,
          cache_layout = 0, page_size = 128;
};

// Throws KvError for an attribute value the spec does not allow.
void CheckAttrs(const Attrs& a);

// One input as seen by the kernel: ONNX element type, shape and (host-readable) data.
struct TensorArg {
  bool present = false;
  int32_t type = 0;
  std::vector<int64_t> shape;
  const void* data = nullptr;
};

// Element strides (in elements of the innermost axis unit) of the rows of a cache or scale tensor.
struct RowStrides {
  int64_t layer = 0, kv = 0, head = 0, slot = 0;
  int64_t Row(int64_t l, int64_t kv_index, int64_t h, int64_t s) const {
    return l * layer + kv_index * kv + h * head + s * slot;
  }
};

// Everything the compute needs about a validated call.
struct CallPlan {
  int64_t batch = 0, heads = 0, head_dim = 0, groups = 0, max_t = 0, max_p = 0, tokens = 0, kv_tokens = 0;
  RowStrides cache_rows;  // offsets in elements of Dh rows
  RowStrides scale_rows;  // offsets in elements of G rows
  const int64_t* seqstarts = nullptr;    // [B+1]
  const int64_t* kvstarts = nullptr;     // [B+1]
  const int64_t* start_pos = nullptr;    // [B]
  const int64_t* cachestarts = nullptr;  // [B] or [B, MaxP]
};

// Dtype/shape checks of current_key/value (t1 tensors), cache and scale; returns {H, Dh, MaxT}.
struct CacheDims {
  int64_t heads, head_dim, max_t;
};
CacheDims CheckTensors(const Attrs& a, const TensorArg& key, const TensorArg& value, const TensorArg& cache,
                       const TensorArg& scale);

// Python-tuple rendering of a shape, as the reference's messages print it: (), (3,), (1, 2).
std::string ShapeStr(const std::vector<int64_t>& shape);

const char* ElemName(int32_t onnx_type);

// inputs: the op's 10 inputs in order (scale may be absent). Throws KvError; returns the plan.
CallPlan ValidateCall(const Attrs& a, const TensorArg* inputs);

// Row strides of a rank-5 tensor in `layout` with last dim `last` (Dh for cache, G for scale).
RowStrides LayoutRowStrides(int64_t layout, int64_t num_layer, int64_t max_t, int64_t heads, int64_t last);

// Slot of position p of sequence b (valid only for positions that ValidateCall bounds-checked).
inline int64_t SlotOf(const CallPlan& p, const Attrs& a, int64_t b, int64_t pos) {
  if (a.cache_mode == 0) return p.cachestarts[b] + pos;
  return p.cachestarts[b * p.max_p + pos / a.page_size] + pos % a.page_size;
}

}  // namespace kvcache
