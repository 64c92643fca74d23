#include "kv_validate.h"

#include <algorithm>
#include <sstream>
#include <tuple>

#include "kv_checked.h"
#include "kv_types.h"

namespace kvcache {
namespace {

using Big = __int128;  // exact arithmetic for positions: start_pos may be INT64_MAX

std::string BigStr(Big v) {
  if (v == 0) return "0";
  const bool negative = v < 0;
  std::string digits;
  while (v != 0) {
    const int d = static_cast<int>(v % 10);
    digits.push_back(static_cast<char>('0' + (d < 0 ? -d : d)));
    v /= 10;
  }
  if (negative) digits.push_back('-');
  std::reverse(digits.begin(), digits.end());
  return digits;
}

const char* LayoutAxes(int64_t layout) {
  static const char* axes[] = {"('MaxT', 'L', 'KV', 'H', 'Dh')", "('L', 'MaxT', 'KV', 'H', 'Dh')",
                               "('L', 'KV', 'MaxT', 'H', 'Dh')", "('L', 'KV', 'H', 'MaxT', 'Dh')"};
  return axes[layout];
}

std::vector<int64_t> LayoutShape(int64_t layout, int64_t L, int64_t max_t, int64_t H, int64_t last) {
  switch (layout) {
    case 0: return {max_t, L, 2, H, last};
    case 1: return {L, max_t, 2, H, last};
    case 2: return {L, 2, max_t, H, last};
    default: return {L, 2, H, max_t, last};
  }
}

}  // namespace

bool IsT1(int32_t t) {
  return t == int32_t(Elem::kFloat32) || t == int32_t(Elem::kFloat16) || t == int32_t(Elem::kBFloat16);
}

std::string ShapeStr(const std::vector<int64_t>& shape) {
  std::ostringstream s;
  s << "(";
  for (size_t i = 0; i < shape.size(); ++i) s << (i ? ", " : "") << shape[i];
  if (shape.size() == 1) s << ",";
  s << ")";
  return s.str();
}

int32_t CacheElemType(const Attrs& a, int32_t t1) {
  return a.quant_bit == 8 ? int32_t(Elem::kInt8) : a.quant_bit == 4 ? int32_t(Elem::kInt4) : t1;
}

CacheDims CheckTensors(const Attrs& a, const TensorArg& key, const TensorArg& value, const TensorArg& cache,
                       const TensorArg& scale) {
  for (auto [name, x] : {std::pair<const char*, const TensorArg*>{"current_key", &key}, {"current_value", &value}}) {
    if (!IsT1(x->type)) Fail(name, " dtype must be float32, float16 or bfloat16, got ", ElemName(x->type));
    if (x->shape.size() != 3) Fail(name, " must have rank 3 (tokens, H, Dh), got shape ", ShapeStr(x->shape));
  }
  if (value.type != key.type || value.shape != key.shape)
    Fail("current_value (", ElemName(value.type), ShapeStr(value.shape), ") must match current_key (",
         ElemName(key.type), ShapeStr(key.shape), ")");
  const int64_t heads = key.shape[1], head_dim = key.shape[2];
  if (heads < 1 || head_dim < 1) Fail("current_key must have H >= 1 and Dh >= 1, got shape ", ShapeStr(key.shape));
  const int32_t want = CacheElemType(a, key.type);
  if (cache.type != want)
    Fail("cache dtype must be ", ElemName(want), " for quant_bit=", a.quant_bit, " and current_key ",
         ElemName(key.type), ", got ", ElemName(cache.type));
  return {heads, head_dim, CheckCacheAndScale(a, cache, scale, heads, head_dim)};
}

int64_t CheckCacheAndScale(const Attrs& a, const TensorArg& cache, const TensorArg& scale, int64_t heads,
                           int64_t head_dim) {
  if (cache.shape.size() != 5)
    Fail("cache must have rank 5 ", LayoutAxes(a.cache_layout), ", got shape ", ShapeStr(cache.shape));
  const int64_t max_t = cache.shape[a.cache_layout];  // in layout k, MaxT is axis k
  const auto expected = LayoutShape(a.cache_layout, a.num_layer, max_t, heads, head_dim);
  if (cache.shape != expected)
    Fail("cache shape must be ", ShapeStr(expected), " for cache_layout=", a.cache_layout, " ",
         LayoutAxes(a.cache_layout), ", num_layer=", a.num_layer, ", H=", heads, ", Dh=", head_dim, "; got ",
         ShapeStr(cache.shape));
  if (a.quant_bit == 0) {
    if (scale.present) Fail("scale must be absent when quant_bit is 0");
    return max_t;
  }
  if (head_dim % a.quant_group) Fail("quant_group=", a.quant_group, " must divide Dh=", head_dim);
  if (cache.type == int32_t(Elem::kInt4) && head_dim % 2)
    Fail("int4 cache needs an even Dh (whole bytes per row), got Dh=", head_dim);
  if (!scale.present) Fail("scale is required when quant_bit is ", a.quant_bit);
  if (scale.type != int32_t(Elem::kFloat32) && scale.type != int32_t(Elem::kFloat16))
    Fail("scale dtype must be float32 or float16, got ", ElemName(scale.type));
  const auto scale_shape = LayoutShape(a.cache_layout, a.num_layer, max_t, heads, head_dim / a.quant_group);
  if (scale.shape != scale_shape)
    Fail("scale shape must be ", ShapeStr(scale_shape), " (cache shape with last dim Dh/quant_group), got ",
         ShapeStr(scale.shape));
  return max_t;
}

namespace {

// The element count of an index input, whose bytes are checked to fit in int64 (so are its rows' addresses).
int64_t IndexCount(const TensorArg& t) {
  int64_t count = 0, bytes = 0;
  if (!CountFits(t.shape, &count) || !MulFits(count, int64_t{sizeof(int64_t)}, &bytes))
    Fail("an index input has more than 2^63 - 1 bytes, shape ", ShapeStr(t.shape));
  return count;
}

}  // namespace

std::vector<int64_t> SnapshotInt64(const TensorArg& t) {
  const int64_t count = IndexCount(t);
  const auto* data = static_cast<const int64_t*>(t.data);
  return std::vector<int64_t>(data, data + count);
}

std::vector<int64_t> IndexVector(const char* name, const TensorArg& t, int64_t length) {
  if (t.type != int32_t(Elem::kInt64)) Fail(name, " must be int64, got ", ElemName(t.type));
  if (t.shape.size() != 1) Fail(name, " must be 1-D, got shape ", ShapeStr(t.shape));
  if (length >= 0 && t.shape[0] != length) Fail(name, " must have shape (", length, ",), got ", ShapeStr(t.shape));
  return SnapshotInt64(t);
}

int64_t IndexScalar(const char* name, const TensorArg& t) {
  if (t.type != int32_t(Elem::kInt64)) Fail(name, " must be an int64 scalar, got ", ElemName(t.type));
  if (t.shape.size() > 1 || (t.shape.size() == 1 && t.shape[0] != 1))
    Fail(name, " must be a scalar or shape (1,), got shape ", ShapeStr(t.shape));
  return *static_cast<const int64_t*>(t.data);
}

std::vector<int64_t> Lengths(const char* name, const std::vector<int64_t>& starts, int64_t batch, const char* total_name,
                             const int64_t* total) {
  if (starts[0] != 0) Fail(name, "[0] must be 0, got ", starts[0]);
  std::vector<int64_t> lengths(batch);
  for (int64_t b = 0; b < batch; ++b) {
    if (starts[b + 1] < starts[b])
      Fail(name, " must be non-decreasing: ", name, "[", b + 1, "] = ", starts[b + 1], " < ", name, "[", b,
           "] = ", starts[b]);
    lengths[b] = starts[b + 1] - starts[b];
  }
  if (total && starts[batch] != *total)
    Fail(name, "[B=", batch, "] = ", starts[batch], " must equal ", total_name, " = ", *total);
  return lengths;
}

void CheckMax(const char* name, const char* what, int64_t given, const std::vector<int64_t>& lengths) {
  if (lengths.empty()) {
    if (given < 0) Fail(name, " = ", given, " must be >= 0");
    return;
  }
  const auto it = std::max_element(lengths.begin(), lengths.end());  // first maximum, as Python's index()
  if (given < *it)
    Fail(name, " = ", given, " is smaller than ", what, " of sequence ", it - lengths.begin(), " = ", *it);
}

namespace {

// Sets out_heads and out_bytes, or throws when an output's dim or byte count does not fit in int64
// (the count would wrap and the output would be allocated too small for the gather's writes). One row
// must fit even when kv_tokens is 0: no array library can describe a shape whose other dims overflow.
void CheckOutputSize(const Attrs& a, int32_t t1, CallPlan& p) {
  if (!MulFits(p.heads, a.num_repeat, &p.out_heads)) throw KvError(OutputHeadsMessage(p.heads, a.num_repeat));
  const int64_t elem_bytes = t1 == int32_t(Elem::kFloat32) ? 4 : 2;
  int64_t row_bytes = 0;
  if (!CountFits({p.out_heads, p.head_dim, elem_bytes}, &row_bytes))
    throw KvError(OutputSizeMessage(p, a, t1, "a single row would be 2^63 bytes or more"));
  if (!MulFits(p.kv_tokens, row_bytes, &p.out_bytes)) throw KvError(OutputSizeMessage(p, a, t1, "2^63 bytes or more"));
}

}  // namespace

const char* ElemName(int32_t t) {
  switch (t) {
    case 1: return "float32";
    case 2: return "uint8";
    case 3: return "int8";
    case 4: return "uint16";
    case 5: return "int16";
    case 6: return "int32";
    case 7: return "int64";
    case 9: return "bool";
    case 10: return "float16";
    case 11: return "float64";
    case 12: return "uint32";
    case 13: return "uint64";
    case 16: return "bfloat16";
    case 21: return "uint4";
    case 22: return "int4";
    default: return "an unsupported type";
  }
}

void CheckAttrs(const Attrs& a) {
  if (a.num_layer < 1) Fail("num_layer must be >= 1, got ", a.num_layer);
  if (a.layer_idx < 0 || a.layer_idx >= a.num_layer)
    Fail("layer_idx must be in [0, num_layer=", a.num_layer, "), got ", a.layer_idx);
  if (a.quant_bit != 0 && a.quant_bit != 4 && a.quant_bit != 8) Fail("quant_bit must be 0, 4 or 8, got ", a.quant_bit);
  if (a.quant_group < 1) Fail("quant_group must be >= 1, got ", a.quant_group);
  if (a.num_repeat < 1) Fail("num_repeat must be >= 1, got ", a.num_repeat);
  if (a.cache_mode != 0 && a.cache_mode != 1) Fail("cache_mode must be 0 (offset) or 1 (paged), got ", a.cache_mode);
  if (a.cache_layout < 0 || a.cache_layout > 3) Fail("cache_layout must be 0, 1, 2 or 3, got ", a.cache_layout);
  if (a.page_size < 1) Fail("page_size must be >= 1, got ", a.page_size);
}

RowStrides LayoutRowStrides(int64_t layout, int64_t L, int64_t max_t, int64_t H, int64_t last) {
  if (max_t == 0) return {};
  // Every stride below is a product of a subset of the dims, so it fits once their product does.
  int64_t count = 0;
  if (!CountFits({L, 2, max_t, H, std::max<int64_t>(last, 1)}, &count))  // last = 0: scale of no quantization
    Fail("cache has more than 2^63 - 1 elements: L=", L, ", MaxT=", max_t, ", H=", H, ", last dim ", last);
  // Strides of (L, KV, H, MaxT) rows, in elements, for each layout's axis order.
  switch (layout) {
    case 0: return {2 * H * last, H * last, last, L * 2 * H * last};
    case 1: return {max_t * 2 * H * last, H * last, last, 2 * H * last};
    case 2: return {2 * max_t * H * last, max_t * H * last, last, H * last};
    default: return {2 * H * max_t * last, H * max_t * last, max_t * last, last};
  }
}

std::string OutputHeadsMessage(int64_t heads, int64_t num_repeat) {
  std::ostringstream s;
  s << "KeyValueCache output key would have H*num_repeat=" << heads << "*" << num_repeat
    << " heads: H*num_repeat does not fit in int64";
  return s.str();
}

void DropEmptyScale(const Attrs& a, TensorArg* scale) {
  int64_t count = 0;
  if (a.quant_bit == 0 && scale->present && CountFits(scale->shape, &count) && count == 0) *scale = TensorArg{};
}

namespace {

// The end of the positions sequence b touches: those it stores, [start_pos, start_pos + seqlen), and those it loads,
// [0, kvlen), kvlen being at most start_pos + seqlen; only loads when it stores nothing.
Big TouchedEnd(int64_t start_pos, int64_t seqlen, int64_t kvlen) {
  return seqlen ? Big(start_pos) + seqlen : Big(kvlen);
}

// The page-table columns a call reads: sequence b touches positions [0, start_pos + seqlen), or [0, kvlen) when it
// stores nothing (as ValidateCall checks them), so no column past the longest one's last page is read. At most
// `table_cols`; a sequence the checks refuse (a negative start_pos) counts for nothing, as its pages are not read.
int64_t ColumnsTouched(const std::vector<int64_t>& start_pos, const std::vector<int64_t>& seq_len,
                       const std::vector<int64_t>& kv_len, int64_t page_size, int64_t table_cols) {
  Big most = 0;
  for (size_t b = 0; b < start_pos.size(); ++b) {
    if (start_pos[b] < 0) continue;
    most = std::max(most, (TouchedEnd(start_pos[b], seq_len[b], kv_len[b]) + page_size - 1) / page_size);
  }
  return static_cast<int64_t>(std::min(most, Big(table_cols)));
}

// The first `cols` columns of each of the `rows` rows of a 2-D int64 table, row after row.
std::vector<int64_t> SnapshotColumns(const TensorArg& t, int64_t rows, int64_t cols) {
  const auto* data = static_cast<const int64_t*>(t.data);
  const int64_t stride = t.shape[1];
  if (cols == stride) return std::vector<int64_t>(data, data + rows * cols);
  std::vector<int64_t> out(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) std::copy_n(data + r * stride, cols, out.begin() + r * cols);
  return out;
}

}  // namespace

CallPlan ValidateCall(const Attrs& a, TensorArg* in) {
  CheckAttrs(a);
  DropEmptyScale(a, &in[9]);
  int64_t out_heads = 0;
  if (in[0].shape.size() == 3 && in[0].shape[1] >= 0 && !MulFits(in[0].shape[1], a.num_repeat, &out_heads))
    throw KvError(OutputHeadsMessage(in[0].shape[1], a.num_repeat));
  const CacheDims dims = CheckTensors(a, in[0], in[1], in[8], in[9]);
  CallPlan p;
  const TensorArg& seq = in[2];
  // Each index input is copied into the plan right after its type and shape are checked, before any of
  // its values is looked at; nothing below reads the caller's index memory again.
  p.seqstarts = IndexVector("seqstarts", seq, -1);
  if (seq.shape[0] < 1) Fail("seqstarts must have B + 1 >= 1 elements, got 0");
  p.batch = seq.shape[0] - 1;
  p.kvstarts = IndexVector("kvstarts", in[3], p.batch + 1);
  p.start_pos = IndexVector("start_pos", in[5], p.batch);
  const TensorArg& cs = in[4];
  if (cs.type != int32_t(Elem::kInt64)) Fail("cachestarts must be int64, got ", ElemName(cs.type));
  const size_t want_rank = a.cache_mode == 0 ? 1 : 2;
  if (cs.shape.size() != want_rank || cs.shape[0] != p.batch)
    Fail("cachestarts must have shape ", a.cache_mode == 0 ? "(B,)" : "(B, MaxP)", " with B = ", p.batch,
         " for cache_mode=", a.cache_mode, ", got ", ShapeStr(cs.shape));
  IndexCount(cs);  // its rows' addresses are computed below, so its bytes must fit
  const int64_t table_cols = a.cache_mode == 1 ? cs.shape[1] : 0;  // the caller's MaxP
  const int64_t max_seqlen = IndexScalar("max_seqlen", in[6]);
  const int64_t max_kvlen = IndexScalar("max_kvlen", in[7]);
  const int64_t tokens = in[0].shape[0];
  const auto seq_len = Lengths("seqstarts", p.seqstarts, p.batch, "current_key.shape[0]", &tokens);
  const auto kv_len = Lengths("kvstarts", p.kvstarts, p.batch, "", nullptr);
  CheckMax("max_seqlen", "seqlen", max_seqlen, seq_len);
  CheckMax("max_kvlen", "kvlen", max_kvlen, kv_len);
  // A page table is copied only as far as the call reads it (none of its values is looked at before): a table
  // sized for the longest context a model allows, with short sequences in it, costs what the sequences use, here
  // and in the device copy. The plan's max_p is the copy's row length.
  p.max_p = a.cache_mode == 1 ? ColumnsTouched(p.start_pos, seq_len, kv_len, a.page_size, table_cols) : 0;
  p.cachestarts = a.cache_mode == 1 ? SnapshotColumns(cs, p.batch, p.max_p) : SnapshotInt64(cs);
  p.heads = dims.heads;
  p.head_dim = dims.head_dim;
  p.max_t = dims.max_t;
  p.tokens = tokens;
  p.kv_tokens = p.kvstarts[p.batch];
  p.groups = a.quant_bit ? dims.head_dim / a.quant_group : 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t pos = p.start_pos[b];
    if (pos < 0) Fail("start_pos[", b, "] = ", pos, " must be >= 0");
    const Big end = Big(pos) + seq_len[b];
    if (Big(kv_len[b]) > end)
      Fail("kvstarts: kvlen of sequence ", b, " = ", kv_len[b], " exceeds start_pos[", b, "] + seqlen = ", pos,
           " + ", seq_len[b], " = ", BigStr(end), "; only positions stored by this or earlier calls can be loaded");
    const Big touched_end = TouchedEnd(pos, seq_len[b], kv_len[b]);
    if (touched_end == 0) continue;
    if (a.cache_mode == 0) {
      const int64_t base = p.cachestarts[b];
      if (base < 0 || Big(base) > Big(p.max_t) - touched_end)
        Fail("cachestarts[", b, "] = ", base, ": sequence ", b, " touches positions [0, ", BigStr(touched_end),
             ") so it needs 0 <= cachestarts[", b, "] and cachestarts[", b, "] + ", BigStr(touched_end),
             " <= MaxT = ", p.max_t);
      continue;
    }
    const Big last_page = (touched_end - 1) / a.page_size;
    if (last_page >= table_cols)
      Fail("cachestarts: sequence ", b, " touches position ", BigStr(touched_end - 1), ", which is in page ",
           BigStr(last_page), ", but cachestarts has MaxP = ", table_cols, " pages per sequence");
    // Touched pages, ascending: store pages [pos/ps, (end-1)/ps] and load pages [0, (kvlen-1)/ps].
    const int64_t store_lo = seq_len[b] ? pos / a.page_size : 1, store_hi = seq_len[b] ? int64_t((end - 1) / a.page_size) : 0;
    const int64_t load_hi = kv_len[b] ? (kv_len[b] - 1) / a.page_size : -1;
    for (int64_t page = 0; page <= int64_t(last_page); ++page) {
      if (!(page <= load_hi || (page >= store_lo && page <= store_hi))) continue;
      const int64_t start = p.cachestarts[b * p.max_p + page];
      if (start < 0 || start > p.max_t - a.page_size)
        Fail("cachestarts[", b, ", ", page, "] = ", start, ": page ", page, " of sequence ", b,
             " is used, so it needs 0 <= cachestarts[", b, ", ", page, "] and cachestarts[", b, ", ", page,
             "] + page_size (", a.page_size, ") <= MaxT = ", p.max_t);
    }
  }
  p.cache_rows = LayoutRowStrides(a.cache_layout, a.num_layer, p.max_t, p.heads, p.head_dim);
  p.scale_rows = LayoutRowStrides(a.cache_layout, a.num_layer, p.max_t, p.heads, p.groups);
  CheckAliasing(a, p, seq_len, kv_len);
  CheckOutputSize(a, in[0].type, p);
  return p;
}

std::string OutputSizeMessage(const CallPlan& p, const Attrs& a, int32_t t1, const char* why) {
  std::ostringstream s;
  s << "KeyValueCache output key would be (kv_tokens=" << p.kv_tokens << ", H*num_repeat=" << p.heads << "*"
    << a.num_repeat << ", Dh=" << p.head_dim << ") elements of " << ElemName(t1) << ": " << why;
  return s.str();
}

}  // namespace kvcache
