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
  // Whether a slot's key and value rows lie together, the value row right after the key row (layouts 0 and 1).
  bool KeyValueTogether() const { return kv < slot; }
};

// Everything the compute needs about a validated call. The index inputs are owned copies, taken once
// before any of their values is checked: validation and compute read only these, so an index input
// that aliases the cache cannot change under the kernel (spec: index inputs are read once).
struct CallPlan {
  int64_t batch = 0, heads = 0, head_dim = 0, groups = 0, max_t = 0, max_p = 0, tokens = 0, kv_tokens = 0;
  int64_t out_heads = 0;  // H * num_repeat, checked to fit
  int64_t out_bytes = 0;  // bytes of one output, checked to fit
  RowStrides cache_rows;  // offsets in elements of Dh rows
  RowStrides scale_rows;  // offsets in elements of G rows
  std::vector<int64_t> seqstarts;    // [B+1]
  std::vector<int64_t> kvstarts;     // [B+1]
  std::vector<int64_t> start_pos;    // [B]
  std::vector<int64_t> cachestarts;  // [B] or [B, MaxP]
};

// Dtype/shape checks of current_key/value (t1 tensors), cache and scale; returns {H, Dh, MaxT}.
struct CacheDims {
  int64_t heads, head_dim, max_t;
};
CacheDims CheckTensors(const Attrs& a, const TensorArg& key, const TensorArg& value, const TensorArg& cache,
                       const TensorArg& scale);

// The checks of CheckTensors from the cache's rank on (cache shape, scale), for a cache whose H and Dh
// (>= 1) are already known; names only `cache` and `scale`. Returns MaxT.
int64_t CheckCacheAndScale(const Attrs& a, const TensorArg& cache, const TensorArg& scale, int64_t heads,
                           int64_t head_dim);

// An owned copy of an int64 tensor's elements (the tensor's type must already be checked to be int64).
std::vector<int64_t> SnapshotInt64(const TensorArg& t);

// True for the float element types of T1 (float32, float16, bfloat16).
bool IsT1(int32_t onnx_type);

// Type and shape checks of a 1-D int64 index input (of `length` elements when length >= 0), then its
// snapshot: the only read of its data.
std::vector<int64_t> IndexVector(const char* name, const TensorArg& t, int64_t length);

// The value of an int64 scalar index input (rank 0 or shape (1,)), read once.
int64_t IndexScalar(const char* name, const TensorArg& t);

// Lengths of a starts vector [batch + 1]; checks starts[0] == 0, non-decreasing, and starts[batch] ==
// *total when total is given (total_name names it in the message).
std::vector<int64_t> Lengths(const char* name, const std::vector<int64_t>& starts, int64_t batch,
                             const char* total_name, const int64_t* total);

// A launch bound (max_seqlen, max_kvlen) must cover the longest of `lengths` (what: "seqlen"...), and be
// >= 0 for an empty batch.
void CheckMax(const char* name, const char* what, int64_t given, const std::vector<int64_t>& lengths);

// The error for an H whose H * num_repeat does not fit in int64 (no output dim can hold it).
std::string OutputHeadsMessage(int64_t heads, int64_t num_repeat);

// "KeyValueCache output key would be (...) elements of T: <why>": the error for an output whose size
// does not fit; `out_heads` is printed as H*num_repeat.
std::string OutputSizeMessage(const CallPlan& p, const Attrs& a, int32_t t1, const char* why);

// Python-tuple rendering of a shape, as the reference's messages print it: (), (3,), (1, 2).
std::string ShapeStr(const std::vector<int64_t>& shape);

const char* ElemName(int32_t onnx_type);

// inputs: the op's 10 inputs in order (scale may be absent). Throws KvError; returns the plan, which
// owns copies of the index inputs (the inputs' index data is read exactly once, here). Output sizes:
// right after the attributes, H * num_repeat must fit in int64 (H from a rank-3 current_key: the check
// a static H gets at session creation); last, the outputs (kv_tokens, H * num_repeat, Dh) must have a
// byte count that fits in int64, and so must one row when kv_tokens is 0.
// An empty scale with quant_bit 0 is first made absent in `inputs` (DropEmptyScale).
CallPlan ValidateCall(const Attrs& a, TensorArg* inputs);

// Throws KvError when a slot is stored twice in the call, or a stored slot is loaded by another sequence
// or at another position (the reference's messages). For a plan whose indices ValidateCall has checked;
// seq_len and kv_len are the sequences' lengths.
void CheckAliasing(const Attrs& a, const CallPlan& p, const std::vector<int64_t>& seq_len,
                   const std::vector<int64_t>& kv_len);

// ppl.pmx exports an unquantized cache with an empty `kv_scale` input: with quant_bit 0 a scale of zero
// elements is absent (spec: compatibility), so nothing downstream sees it. Any other scale is left as is.
void DropEmptyScale(const Attrs& a, TensorArg* scale);

// Row strides of a rank-5 tensor in `layout` with last dim `last` (Dh for cache, G for scale). All zero
// for max_t == 0 (no row of an empty tensor is ever addressed); otherwise throws KvError if the
// tensor's element count does not fit in int64, so every stride and every in-bounds row offset fits.
RowStrides LayoutRowStrides(int64_t layout, int64_t num_layer, int64_t max_t, int64_t heads, int64_t last);

// The cache's element type for this quant_bit when current_key is of type t1: int8, int4, or t1 itself.
int32_t CacheElemType(const Attrs& a, int32_t t1);

// Slot of position pos of sequence b (valid only for positions that ValidateCall bounds-checked).
// pos is unsigned: start_pos[b] + i may exceed INT64_MAX when start_pos is near it; the page index
// and the slot (< MaxT) always fit.
inline int64_t SlotOf(const CallPlan& p, const Attrs& a, int64_t b, uint64_t pos) {
  if (a.cache_mode == 0) return p.cachestarts[b] + static_cast<int64_t>(pos);
  const uint64_t page_size = static_cast<uint64_t>(a.page_size);
  return p.cachestarts[b * p.max_p + static_cast<int64_t>(pos / page_size)] + static_cast<int64_t>(pos % page_size);
}

// fn(i, slot, n) for the runs of consecutive slots of sequence b's positions first + i, i in [0, count) (positions
// ValidateCall bounds-checked): one run per page in paged mode, one run in offset mode. One division, for the
// first position; every later run starts a page.
template <class Fn>
inline void ForEachSlotRun(const CallPlan& p, const Attrs& a, int64_t b, uint64_t first, int64_t count, Fn&& fn) {
  if (count <= 0) return;
  if (a.cache_mode == 0) return fn(int64_t(0), SlotOf(p, a, b, first), count);
  const uint64_t page_size = static_cast<uint64_t>(a.page_size);
  const int64_t* page_start = p.cachestarts.data() + b * p.max_p + static_cast<int64_t>(first / page_size);
  int64_t offset = static_cast<int64_t>(first % page_size);
  for (int64_t i = 0; i < count; ++page_start, offset = 0) {
    const int64_t n = count - i < a.page_size - offset ? count - i : a.page_size - offset;
    fn(i, *page_start + offset, n);
    i += n;
  }
}

}  // namespace kvcache
