#include "mha_validate.h"

#include <cmath>
#include <sstream>
#include <string>

#include "kv_types.h"
#include "spec_float_mode.h"

namespace kvcache {
namespace {

// A float attribute as the reference prints it (Python's "{:g}"; NaN without a sign).
std::string FloatStr(float v) {
  if (std::isnan(v)) return "nan";
  std::ostringstream s;
  s << static_cast<double>(v);  // default format, precision 6: C's %g, as Python's "g"
  return s.str();
}

// Dtypes and shapes of query, key, value and attn_mask.
void CheckData(const MhaAttrs& a, const TensorArg* in) {
  const TensorArg &query = in[0], &key = in[1], &value = in[2], &mask = in[kMhaMaskInput];
  if (!IsT1(query.type)) Fail("query dtype must be float32, float16 or bfloat16, got ", ElemName(query.type));
  if (query.shape.size() != 3 || query.shape[1] != a.num_heads || query.shape[2] != a.head_dim)
    Fail("query must have shape (tokens, num_heads=", a.num_heads, ", head_dim=", a.head_dim, "), got ",
         ShapeStr(query.shape));
  for (auto [name, x] : {std::pair<const char*, const TensorArg*>{"key", &key}, {"value", &value}}) {
    if (x->type != query.type)
      Fail(name, " dtype must be query's (", ElemName(query.type), "), got ", ElemName(x->type));
    if (x->shape.size() != 3 || x->shape[1] != a.KvHeads() || x->shape[2] != a.head_dim)
      Fail(name, " must have shape (kv_tokens, num_kv_heads=", a.KvHeads(), ", head_dim=", a.head_dim, "), got ",
           ShapeStr(x->shape));
  }
  if (value.shape != key.shape) Fail("value shape ", ShapeStr(value.shape), " must equal key shape ", ShapeStr(key.shape));
  if (!mask.present) return;
  const int64_t tokens = query.shape[0], kv_tokens = key.shape[0];
  if (mask.type != query.type)
    Fail("attn_mask dtype must be query's (", ElemName(query.type), "), got ", ElemName(mask.type));
  const size_t rank = mask.shape.size();
  const bool rank3 = rank == 3 && mask.shape[0] == a.num_heads;
  if (!(rank3 || rank == 2) || mask.shape[rank - 2] != tokens || mask.shape[rank - 1] < kv_tokens)
    Fail("attn_mask must have shape (num_heads=", a.num_heads, ", ", tokens, ", >= ", kv_tokens, ") or (", tokens,
         ", >= ", kv_tokens, ") (query tokens, key tokens), got ", ShapeStr(mask.shape));
}

}  // namespace

void CheckMhaAttrs(const MhaAttrs& a) {
  if (a.num_heads < 1) Fail("num_heads must be >= 1, got ", a.num_heads);
  if (a.head_dim < 1) Fail("head_dim must be >= 1, got ", a.head_dim);
  if (a.is_causal != 0 && a.is_causal != 1) Fail("is_causal must be 0 or 1, got ", a.is_causal);
  if (a.is_alibi != 0 && a.is_alibi != 1) Fail("is_alibi must be 0 or 1, got ", a.is_alibi);
  if (a.num_kv_heads < 0 || (a.num_kv_heads && a.num_heads % a.num_kv_heads))
    Fail("num_kv_heads must be 0 (= num_heads) or divide num_heads = ", a.num_heads, ", got ", a.num_kv_heads);
  if (a.sliding_window < 0) Fail("sliding_window must be >= 0 (0: no window), got ", a.sliding_window);
  if (!std::isfinite(a.softmax_scale) || a.softmax_scale < 0)
    Fail("softmax_scale must be finite and >= 0 (0: 1/sqrt(head_dim)), got ", FloatStr(a.softmax_scale));
  if (!std::isfinite(a.softcap) || a.softcap < 0)
    Fail("softcap must be finite and >= 0 (0: off), got ", FloatStr(a.softcap));
}

float AlibiSlope(int64_t h, int64_t num_heads) {
  int64_t p = 1;
  while (p <= num_heads / 2) p *= 2;
  // Exact dyadic exponents (p is a power of two); one rounding of the float64 power to float32.
  const double e = h < p ? -8.0 * double(h + 1) / double(p) : -4.0 * double(2 * (h - p) + 1) / double(p);
  return static_cast<float>(std::pow(2.0, e));
}

MhaPlan ValidateAttention(const MhaAttrs& a, const TensorArg* in) {
  CheckMhaAttrs(a);
  CheckData(a, in);
  MhaPlan p;
  // Each index input is copied right after its type and shape are checked; nothing below reads the
  // caller's index memory again.
  p.seqstarts = IndexVector("seqstarts", in[3], -1);
  if (in[3].shape[0] < 1) Fail("seqstarts must have B + 1 >= 1 elements, got 0");
  p.batch = in[3].shape[0] - 1;
  p.kvstarts = IndexVector("kvstarts", in[4], p.batch + 1);
  const int64_t decoding = IndexScalar("decoding_batches", in[5]);
  const int64_t max_seqlen = IndexScalar("max_seqlen", in[6]);
  const int64_t max_kvlen = IndexScalar("max_kvlen", in[7]);
  p.tokens = in[0].shape[0];
  p.kv_tokens = in[1].shape[0];
  const auto seq_len = Lengths("seqstarts", p.seqstarts, p.batch, "query.shape[0]", &p.tokens);
  const auto kv_len = Lengths("kvstarts", p.kvstarts, p.batch, "key.shape[0]", &p.kv_tokens);
  CheckMax("max_seqlen", "seqlen", max_seqlen, seq_len);
  CheckMax("max_kvlen", "kvlen", max_kvlen, kv_len);
  if (decoding < 0 || decoding > p.batch) Fail("decoding_batches = ", decoding, " must be in [0, B=", p.batch, "]");
  p.causal.resize(p.batch);
  for (int64_t b = 0; b < p.batch; ++b) {
    p.causal[b] = a.is_causal && seq_len[b] > 1 && b >= decoding;
    if (p.causal[b] && seq_len[b] > kv_len[b])
      Fail("sequence ", b, ": seqlen = ", seq_len[b], " exceeds kvlen = ", kv_len[b],
           ", but the causal mask aligns its queries with its last seqlen keys (is_causal=1, b >= decoding_batches = ",
           decoding, ")");
  }
  p.kv_heads = a.KvHeads();
  p.group = a.num_heads / p.kv_heads;
  const TensorArg& mask = in[kMhaMaskInput];
  p.mask_rank = mask.present ? int64_t(mask.shape.size()) : 0;
  p.mask_cols = mask.present ? mask.shape.back() : 0;
  if (a.softmax_scale != 0.0f) {
    p.scale = a.softmax_scale;
  } else {
    const SpecFloatMode spec_mode;  // the spec's rounding, not the caller's (float64 sqrt and division, then float32)
    p.scale = static_cast<float>(1.0 / std::sqrt(double(a.head_dim)));
  }
  return p;
}

}  // namespace kvcache
