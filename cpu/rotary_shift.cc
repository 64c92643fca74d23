#include "rotary_shift.h"

#include <algorithm>
#include <vector>

#include "byte_ranges.h"
#include "kv_quant.h"
#include "kv_types.h"
#include "spec_float_mode.h"

namespace kvcache {
namespace {

bool IsFloat(int32_t t) {
  return t == int32_t(Elem::kFloat32) || t == int32_t(Elem::kFloat16) || t == int32_t(Elem::kBFloat16);
}

float LoadFloat(int32_t type, const void* base, int64_t i) {
  switch (static_cast<Elem>(type)) {
    case Elem::kFloat32: return static_cast<const float*>(base)[i];
    case Elem::kFloat16: return HalfToFloat(static_cast<const uint16_t*>(base)[i]);
    default: return BFloat16ToFloat(static_cast<const uint16_t*>(base)[i]);
  }
}

void StoreFloat(int32_t type, void* base, int64_t i, float v) {
  switch (static_cast<Elem>(type)) {
    case Elem::kFloat32: static_cast<float*>(base)[i] = v; break;
    case Elem::kFloat16: static_cast<uint16_t*>(base)[i] = FloatToHalf(v); break;
    default: static_cast<uint16_t*>(base)[i] = FloatToBFloat16(v); break;
  }
}

int32_t LoadCode(const void* cache, int64_t elem, bool int4) {
  if (!int4) return static_cast<const int8_t*>(cache)[elem];
  const uint8_t byte = static_cast<const uint8_t*>(cache)[elem / 2];
  return (elem & 1) ? Int4High(byte) : Int4Low(byte);
}

}  // namespace

void CheckRotaryAttrs(const RotaryAttrs& a) {
  CheckAttrs(a.base);
  if (a.rotary_interleaved != 0 && a.rotary_interleaved != 1)
    Fail("rotary_interleaved must be 0 or 1, got ", a.rotary_interleaved);
}

namespace {

// An owned copy of a float32 table (type and shape already checked).
std::vector<float> SnapshotFloats(const TensorArg& t, int64_t count) {
  const auto* data = static_cast<const float*>(t.data);
  return std::vector<float>(data, data + count);
}

}  // namespace

RotaryPlan ValidateRotaryShift(const RotaryAttrs& ra, TensorArg* in) {
  const Attrs& a = ra.base;
  CheckAttrs(a);
  DropEmptyScale(a, &in[1]);
  const TensorArg &cache = in[0], &scale = in[1], &slots_t = in[2], &cos_t = in[3], &sin_t = in[4];
  if (a.quant_bit) {
    const int32_t want = a.quant_bit == 8 ? int32_t(Elem::kInt8) : int32_t(Elem::kInt4);
    if (cache.type != want)
      Fail("cache dtype must be ", ElemName(want), " for quant_bit=", a.quant_bit, ", got ", ElemName(cache.type));
  } else if (!IsFloat(cache.type)) {
    Fail("cache dtype must be float32, float16 or bfloat16 when quant_bit is 0, got ", ElemName(cache.type));
  }
  if (cache.shape.size() != 5) Fail("cache must have rank 5, got shape ", ShapeStr(cache.shape));
  RotaryPlan p;
  p.heads = a.cache_layout < 3 ? cache.shape[3] : cache.shape[2];
  p.head_dim = cache.shape[4];
  if (p.heads < 1 || p.head_dim < 1) Fail("cache must have H >= 1 and Dh >= 1, got shape ", ShapeStr(cache.shape));
  p.max_t = CheckCacheAndScale(a, cache, scale, p.heads, p.head_dim);
  p.rotary = ra.rotary_dim ? ra.rotary_dim : p.head_dim;
  if (p.rotary % 2 || p.rotary < 2 || p.rotary > p.head_dim) {
    if (ra.rotary_dim == 0)  // the default rotates the whole head, which cannot be split in pairs
      Fail("rotary_dim = 0 rotates the whole head, R = Dh = ", p.head_dim, ", which must be even and >= 2");
    Fail("rotary_dim must be 0 or even in [2, Dh=", p.head_dim, "], got ", ra.rotary_dim);
  }
  CheckRotaryAttrs(ra);
  if (slots_t.type != int32_t(Elem::kInt64) || slots_t.shape.size() != 1)
    Fail("slots must be a 1-D int64 tensor, got ", ElemName(slots_t.type), ShapeStr(slots_t.shape));
  const int64_t n = slots_t.shape[0];
  const std::vector<int64_t> table_shape{n, p.rotary / 2};
  for (auto [name, t] : {std::pair<const char*, const TensorArg*>{"cos", &cos_t}, {"sin", &sin_t}})
    if (t->type != int32_t(Elem::kFloat32) || t->shape != table_shape)
      Fail(name, " must be float32 of shape (", n, ", ", p.rotary / 2, "), got ", ElemName(t->type), ShapeStr(t->shape));
  // Types and shapes are right: copy, then check values on the copies only. n * rotary / 2 is the
  // element count of a tensor the caller holds, so it fits.
  p.slots = SnapshotInt64(slots_t);
  p.cos = SnapshotFloats(cos_t, n * (p.rotary / 2));
  p.sin = SnapshotFloats(sin_t, n * (p.rotary / 2));
  for (int64_t i = 0; i < n; ++i)
    if (p.slots[i] < 0 || p.slots[i] >= p.max_t)
      Fail("slots[", i, "] = ", p.slots[i], " must be in [0, MaxT=", p.max_t, ")");
  std::vector<int64_t> sorted = p.slots;
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 1; i < sorted.size(); ++i)
    if (sorted[i] == sorted[i - 1]) Fail("slots: slot ", sorted[i], " appears more than once");
  p.groups = a.quant_bit ? p.head_dim / a.quant_group : 0;
  p.rows = LayoutRowStrides(a.cache_layout, a.num_layer, p.max_t, p.heads, p.head_dim);
  p.scale_rows = LayoutRowStrides(a.cache_layout, a.num_layer, p.max_t, p.heads, p.groups);
  return p;
}

void RotaryShiftCpu(const RotaryAttrs& ra, const RotaryPlan& p, const TensorArg* in,
                    const std::function<void(size_t, const std::function<void(size_t)>&)>& parallel_for) {
  const Attrs& a = ra.base;
  const TensorArg &cache = in[0], &scale = in[1];
  const int64_t heads = p.heads, head_dim = p.head_dim, rotary = p.rotary, groups = p.groups, n = int64_t(p.slots.size());
  const RowStrides& rows = p.rows;
  const RowStrides& scale_rows = p.scale_rows;
  const int64_t* slots = p.slots.data();
  const float* cos = p.cos.data();
  const float* sin = p.sin.data();
  void* cache_data = const_cast<void*>(cache.data);  // written in place (spec: in-out input)
  void* scale_data = scale.present ? const_cast<void*>(scale.data) : nullptr;
  const bool int4 = a.quant_bit == 4;
  const float qmax = int4 ? 7.0f : 127.0f;
  parallel_for(static_cast<size_t>(n), [&](size_t i) {
    const SpecFloatMode spec_mode;  // the products, the requantization and the T2 conversion as the spec rounds them
    std::vector<float> x(head_dim), y(head_dim);
    std::vector<int32_t> codes(head_dim);
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t row = rows.Row(a.layer_idx, 0, h, slots[i]);
      const int64_t srow = scale_rows.Row(a.layer_idx, 0, h, slots[i]);
      for (int64_t d = 0; d < head_dim; ++d) {
        if (a.quant_bit) {
          const float s = LoadFloat(scale.type, scale_data, srow + d / a.quant_group);
          x[d] = static_cast<float>(LoadCode(cache_data, row + d, int4)) * s;
        } else {
          x[d] = LoadFloat(cache.type, cache_data, row + d);
        }
      }
      y = x;
      for (int64_t j = 0; j < rotary / 2; ++j) {
        const int64_t pa = ra.rotary_interleaved ? 2 * j : j, pb = ra.rotary_interleaved ? 2 * j + 1 : j + rotary / 2;
        const float c = cos[i * (rotary / 2) + j], s = sin[i * (rotary / 2) + j];
        const float ac = x[pa] * c, bs = x[pb] * s, as = x[pa] * s, bc = x[pb] * c;  // each product rounded
        y[pa] = ac - bs;
        y[pb] = as + bc;
      }
      if (!a.quant_bit) {
        for (int64_t d = 0; d < head_dim; ++d) StoreFloat(cache.type, cache_data, row + d, y[d]);
        continue;
      }
      for (int64_t g = 0; g < groups; ++g) {
        float amax = 0.0f;
        for (int64_t e = 0; e < a.quant_group; ++e) amax = AbsMaxStep(amax, y[g * a.quant_group + e]);
        StoreFloat(scale.type, scale_data, srow + g, GroupScale(amax, qmax));
        const float stored = LoadFloat(scale.type, scale_data, srow + g);
        for (int64_t e = 0; e < a.quant_group; ++e)
          codes[g * a.quant_group + e] = QuantizeValue(y[g * a.quant_group + e], stored, qmax);
      }
      if (int4) {
        auto* bytes = static_cast<uint8_t*>(cache_data) + row / 2;
        for (int64_t d = 0; d < head_dim; d += 2) bytes[d / 2] = Int4Pack(codes[d], codes[d + 1]);
      } else {
        auto* out = static_cast<int8_t*>(cache_data) + row;
        for (int64_t d = 0; d < head_dim; ++d) out[d] = static_cast<int8_t>(codes[d]);
      }
    }
  });
}

void CheckRotaryBuffersApart(const TensorArg* inputs, const void* out_slots, int64_t n) {
  const ByteRange cache = RangeOf("cache", inputs[0]), scale = RangeOf("scale", inputs[1]);
  CheckDisjoint(scale, cache);
  if (out_slots != nullptr) CheckApart({"output slots", out_slots, n * int64_t(sizeof(int64_t))}, {cache, scale});
}

}  // namespace kvcache
