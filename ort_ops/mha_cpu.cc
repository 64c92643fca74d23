// MultiHeadAttention on the CPU, built once per instruction set like kv_cpu.cc (KV_CPU_ISA names the
// namespace; kv_cpu_dispatch.cc picks the build). The builds differ only in summation order inside dot
// products, which the spec's tolerance allows; each is deterministic.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kv_cpu_rows.h"
#include "kv_types.h"
#include "mha_cpu.h"

namespace kvcache {
namespace KV_CPU_ISA {
namespace {

using Big = __int128;  // q - sliding_window may leave int64 for a huge window

// sum_d a[d] * b[d] in float32: eight (or sixteen) independent partial sums, then a fixed reduction tree.
inline float Dot(const float* a, const float* b, int64_t n) {
  int64_t d = 0;
  float total = 0.0f;
#if KV_SIMD
  if (n >= 16) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (; d + 16 <= n; d += 16) {
      s0 = _mm256_add_ps(s0, _mm256_mul_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d)));
      s1 = _mm256_add_ps(s1, _mm256_mul_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8)));
    }
    const __m256 s = _mm256_add_ps(s0, s1);
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    total = _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
  }
#endif
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (; d + 8 <= n; d += 8)
    for (int l = 0; l < 8; ++l) lanes[l] += a[d + l] * b[d + l];  // independent lanes: vectorizable exactly
  for (; d < n; ++d) lanes[0] += a[d] * b[d];
  return total + (((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7])));
}

// acc[d] += p * v[d]
inline void Axpy(float* acc, float p, const float* v, int64_t n) {
  for (int64_t d = 0; d < n; ++d) acc[d] += p * v[d];
}

// Keys or values of one (sequence, kv head) as float32 rows: the input itself for float32, else the rows
// [first, last) converted once per task into scratch.
template <class T1>
struct FloatRows {
  using T = typename T1::Storage;
  FloatRows(const T* base, int64_t stride, int64_t dim) : base(base), stride(stride), dim(dim) {}

  const T* base;   // row j of the sequence at base + j * stride
  int64_t stride;  // elements between consecutive tokens (kv_heads * head_dim)
  int64_t dim;
  int64_t first = 0;
  std::vector<float> scratch;

  void Load(int64_t row_first, int64_t row_last) {
    if constexpr (T1::kElem == Elem::kFloat32) return;
    first = row_first;
    scratch.resize(static_cast<size_t>((row_last - row_first) * dim));
    for (int64_t j = row_first; j < row_last; ++j) ToFloatRow<T1>(base + j * stride, &scratch[(j - first) * dim], dim);
  }
  const float* Row(int64_t j) const {
    if constexpr (T1::kElem == Elem::kFloat32) return base + j * stride;
    return &scratch[(j - first) * dim];
  }
};

template <class T1>
struct Kernel {
  using T = typename T1::Storage;
  const MhaArgs& args;
  const MhaAttrs& a;
  const MhaPlan& p;

  // [lo, hi): the keys query i of a sequence (seqlen S, kvlen K) may see (spec: visible keys).
  void VisibleRange(int64_t b, int64_t S, int64_t K, int64_t i, int64_t* lo, int64_t* hi) const {
    const int64_t q = K - S + i;  // |K - S + i| < tokens + kv_tokens: fits
    *hi = p.causal[b] ? q + 1 : K;
    *lo = 0;
    if (a.sliding_window) *lo = static_cast<int64_t>(std::clamp<Big>(Big(q) - a.sliding_window + 1, 0, K));
  }

  void Task(int64_t b, int64_t h) const {
    const int64_t D = a.head_dim, H = a.num_heads;
    const int64_t row0 = p.seqstarts[b], S = p.seqstarts[b + 1] - row0;
    const int64_t col0 = p.kvstarts[b], K = p.kvstarts[b + 1] - col0;
    T* out = static_cast<T*>(args.out);
    int64_t lo_first = 0, hi_first = 0, lo_last = 0, hi_last = 0;  // ranges only grow with i
    VisibleRange(b, S, K, 0, &lo_first, &hi_first);
    VisibleRange(b, S, K, S - 1, &lo_last, &hi_last);
    const int64_t kvh = h / p.group, stride = p.kv_heads * D;
    const T* key = static_cast<const T*>(args.key) + col0 * stride + kvh * D;
    const T* value = static_cast<const T*>(args.value) + col0 * stride + kvh * D;
    FloatRows<T1> keys(key, stride, D), values(value, stride, D);
    const int64_t first = std::min(lo_first, hi_last), last = std::max(first, hi_last);
    keys.Load(first, last);
    values.Load(first, last);
    const T* mask = nullptr;
    if (p.mask_rank) mask = static_cast<const T*>(args.mask) + (p.mask_rank == 3 ? h * p.tokens * p.mask_cols : 0);
    const float slope = a.is_alibi ? AlibiSlope(h, a.num_heads) : 0.0f;
    std::vector<float> q(D), acc(D), scores(static_cast<size_t>(last - first));
    for (int64_t i = 0; i < S; ++i) {
      T* dst = out + ((row0 + i) * H + h) * D;
      int64_t lo = 0, hi = 0;
      VisibleRange(b, S, K, i, &lo, &hi);
      if (lo >= hi) {
        std::memset(dst, 0, static_cast<size_t>(D) * sizeof(T));  // no visible key: zeros (+0.0 bits)
        continue;
      }
      ToFloatRow<T1>(static_cast<const T*>(args.query) + ((row0 + i) * H + h) * D, q.data(), D);
      const T* mask_row = mask ? mask + (row0 + i) * p.mask_cols + col0 : nullptr;
      const int64_t qpos = K - S + i;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t j = lo; j < hi; ++j) {
        float s = p.scale * Dot(q.data(), keys.Row(j), D);
        if (mask_row) s = s + T1::ToFloat(mask_row[j]);
        if (a.is_alibi) s = s + slope * static_cast<float>(j - qpos);
        scores[j - first] = s;
        if (s > m || s != s) m = s;  // NaN sticks, as numpy's max
      }
      if (m == -std::numeric_limits<float>::infinity()) {  // every visible score is -inf: zeros
        std::memset(dst, 0, static_cast<size_t>(D) * sizeof(T));
        continue;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      float sum = 0.0f;
      for (int64_t j = lo; j < hi; ++j) {
        const float w = std::exp(scores[j - first] - m);
        sum += w;
        Axpy(acc.data(), w, values.Row(j), D);
      }
      for (int64_t d = 0; d < D; ++d) dst[d] = T1::FromFloat(acc[d] / sum);
    }
  }

  void Run(const ParallelFor& parallel_for) const {
    // Tasks only for sequences with queries: at most tokens * num_heads of them, which fits because the
    // query tensor has that many rows of head_dim >= 1 elements (an empty query may name any num_heads).
    std::vector<int64_t> busy;
    for (int64_t b = 0; b < p.batch; ++b)
      if (p.seqstarts[b + 1] > p.seqstarts[b]) busy.push_back(b);
    const int64_t H = a.num_heads;
    parallel_for(busy.size() * static_cast<size_t>(H),
                 [this, H, &busy](size_t t) { Task(busy[t / static_cast<size_t>(H)], int64_t(t % static_cast<size_t>(H))); });
  }
};

}  // namespace

void MhaComputeCpu(const MhaArgs& args, const ParallelFor& parallel_for) {
  switch (static_cast<Elem>(args.t)) {
    case Elem::kFloat32: return Kernel<F32>{args, *args.attrs, *args.plan}.Run(parallel_for);
    case Elem::kFloat16: return Kernel<F16>{args, *args.attrs, *args.plan}.Run(parallel_for);
    default: return Kernel<BF16>{args, *args.attrs, *args.plan}.Run(parallel_for);
  }
}

}  // namespace KV_CPU_ISA
}  // namespace kvcache
