// MultiHeadAttention on the CPU, built once per instruction set like kv_cpu.cc (KV_CPU_ISA names the
// namespace; kv_cpu_dispatch.cc picks the build). Both run the same scalar code (the compiler may vectorize
// it differently; with -ffp-contract=off and no fast math that changes no result today), so they give the
// same bits; the spec's tolerance would allow them to differ. Each is deterministic.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <limits>
#include <mutex>
#include <vector>

#include "kv_cpu_rows.h"
#include "kv_types.h"
#include "mha_cpu.h"

namespace kvcache {
namespace KV_CPU_ISA {
namespace {

using Big = __int128;  // q - sliding_window may leave int64 for a huge window

constexpr int kRows = 4;  // query rows computed together: each key/value row is loaded once for all four

// out[r] = sum_d q[r][d] * k[d] in float32 for kRows query rows: per row eight independent partial sums
// (lane l takes d = l mod 8), then a fixed reduction tree.
inline void Dot4(const float* const* q, const float* k, int64_t n, float* out) {
  float lanes[kRows][8] = {};
  int64_t d = 0;
#if KV_SIMD
  __m256 s[kRows] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (; d + 8 <= n; d += 8) {
    const __m256 kv = _mm256_loadu_ps(k + d);
    for (int r = 0; r < kRows; ++r) s[r] = _mm256_add_ps(s[r], _mm256_mul_ps(_mm256_loadu_ps(q[r] + d), kv));
  }
  for (int r = 0; r < kRows; ++r) _mm256_storeu_ps(lanes[r], s[r]);
#endif
  for (; d + 8 <= n; d += 8)
    for (int r = 0; r < kRows; ++r)
      for (int l = 0; l < 8; ++l) lanes[r][l] += q[r][d + l] * k[d + l];  // independent lanes: vectorizable
  for (; d < n; ++d)
    for (int r = 0; r < kRows; ++r) lanes[r][d % 8] += q[r][d] * k[d];
  for (int r = 0; r < kRows; ++r) {
    const float* x = lanes[r];
    out[r] = ((x[0] + x[4]) + (x[2] + x[6])) + ((x[1] + x[5]) + (x[3] + x[7]));
  }
}

// sum_d q[d] * k[d] in float32: one row of Dot4 (the same lanes and reduction tree, so the same bits).
inline float Dot(const float* q, const float* k, int64_t n) {
  float lanes[8] = {};
  int64_t d = 0;
#if KV_SIMD
  __m256 s = _mm256_setzero_ps();
  for (; d + 8 <= n; d += 8) s = _mm256_add_ps(s, _mm256_mul_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d)));
  _mm256_storeu_ps(lanes, s);
#endif
  for (; d + 8 <= n; d += 8)
    for (int l = 0; l < 8; ++l) lanes[l] += q[d + l] * k[d + l];
  for (; d < n; ++d) lanes[d % 8] += q[d] * k[d];
  return ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
}

// acc[r][d] += w[r] * v[d] for kRows rows (one load of v per d).
inline void Axpy4(float* const* acc, const float* w, const float* __restrict__ v, int64_t n) {
  float* __restrict__ a0 = acc[0];
  float* __restrict__ a1 = acc[1];
  float* __restrict__ a2 = acc[2];
  float* __restrict__ a3 = acc[3];
  const float w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3];
  for (int64_t d = 0; d < n; ++d) {
    const float x = v[d];
    a0[d] += w0 * x;
    a1[d] += w1 * x;
    a2[d] += w2 * x;
    a3[d] += w3 * x;
  }
}

// acc[d] += w * v[d]
inline void Axpy(float* __restrict__ acc, float w, const float* __restrict__ v, int64_t n) {
  for (int64_t d = 0; d < n; ++d) acc[d] += w * v[d];
}

// Keys or values of one sequence as float32 rows of `width` elements (the segment of a token's row holding
// the kv heads a task reads). With `preload` (a sequence with many queries reads each row many times) all
// rows [first, last) are converted (float32: copied) once per task into contiguous scratch, so the reuse
// runs from cache instead of touching a new page per token. Otherwise rows are streamed: float32 read in
// place, other types converted row by row into one buffer (a decode reads each row once).
template <class T1>
struct FloatRows {
  using T = typename T1::Storage;
  FloatRows(const T* base, int64_t stride, int64_t width) : base(base), stride(stride), width(width) {}

  const T* base;   // row j at base + j * stride
  int64_t stride;  // elements between consecutive tokens (kv_heads * head_dim)
  int64_t width;
  bool preload = false;
  int64_t first = 0;
  std::vector<float> scratch;

  void Prepare(bool all_rows, int64_t row_first, int64_t row_last) {
    preload = all_rows;
    first = row_first;
    if (!preload) {
      if constexpr (T1::kElem != Elem::kFloat32) scratch.resize(static_cast<size_t>(width));
      return;
    }
    scratch.resize(static_cast<size_t>((row_last - row_first) * width));
    for (int64_t j = row_first; j < row_last; ++j) ToFloatRow<T1>(base + j * stride, &scratch[(j - first) * width], width);
  }
  const float* Row(int64_t j) {
    if (preload) return &scratch[(j - first) * width];
    if constexpr (T1::kElem == Elem::kFloat32) return base + j * stride;
    ToFloatRow<T1>(base + j * stride, scratch.data(), width);
    return scratch.data();
  }
};

// Sequences with at most this many queries are computed for several heads at once, streaming each token's
// key/value row (all its heads, contiguous) once per query: reading one head's rows alone would touch a new
// page per token. Longer sequences reuse each row many times and run one task per head.
constexpr int64_t kStreamQueries = 4;
// Streamed sequences are split into head chunks until there are about this many tasks (parallelism).
constexpr int64_t kMinStreamTasks = 16;
// A chunk holds at most this many scores (rows x heads x keys, float32: 16 MiB): a task's memory stays
// O(kvlen) whatever num_heads is.
constexpr int64_t kMaxChunkScores = int64_t{1} << 22;

struct TaskRange {
  int64_t b, h0, h1;  // sequence b, query heads [h0, h1)
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

  // Every output row of query heads [h0, h1) of sequence b, kRows query rows at a time. The visible ranges
  // of consecutive queries only move forward, so a block's keys are [lo of its first row, hi of its last);
  // a key outside one row's own range is computed for the block but never used for that row.
  void Task(const TaskRange& task) const {
    const int64_t D = a.head_dim, H = a.num_heads, G = p.group, b = task.b, h0 = task.h0, nh = task.h1 - task.h0;
    const int64_t row0 = p.seqstarts[b], S = p.seqstarts[b + 1] - row0;
    const int64_t col0 = p.kvstarts[b], K = p.kvstarts[b + 1] - col0;
    const int64_t kv0 = h0 / G, kv1 = (task.h1 - 1) / G + 1, stride = p.kv_heads * D;
    int64_t first = 0, hi_first = 0, lo_last = 0, last = 0;
    VisibleRange(b, S, K, 0, &first, &hi_first);
    VisibleRange(b, S, K, S - 1, &lo_last, &last);
    last = std::max(first, last);
    const int64_t span = last - first;
    const size_t offset = static_cast<size_t>(col0 * stride + kv0 * D);
    FloatRows<T1> keys(static_cast<const T*>(args.key) + offset, stride, (kv1 - kv0) * D);
    FloatRows<T1> values(static_cast<const T*>(args.value) + offset, stride, (kv1 - kv0) * D);
    keys.Prepare(S > kStreamQueries, first, last);
    values.Prepare(S > kStreamQueries, first, last);
    // Per (row r of the block, head k): query, accumulator, scores over [first, last), max, sum. Rows beyond
    // S are read as copies of the last row but never stored, so scores need only min(kRows, S) rows.
    const int64_t block = std::min<int64_t>(kRows, S);
    std::vector<float> q(kRows * nh * D), acc(kRows * nh * D), scores(block * nh * span), top(kRows * nh),
        sum(kRows * nh), slope(nh);
    for (int64_t k = 0; k < nh; ++k) slope[k] = a.is_alibi ? AlibiSlope(h0 + k, H) : 0.0f;
    const float minus_inf = -std::numeric_limits<float>::infinity();
    for (int64_t i0 = 0; i0 < S; i0 += kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows, S - i0));
      int64_t lo[kRows], hi[kRows], qpos[kRows];
      for (int r = 0; r < kRows; ++r) {
        const int64_t i = i0 + std::min(r, rows - 1);  // missing rows repeat the last one (never written)
        VisibleRange(b, S, K, i, &lo[r], &hi[r]);
        qpos[r] = K - S + i;
        hi[r] = std::max(lo[r], hi[r]);
      }
      T* out = static_cast<T*>(args.out) + ((row0 + i0) * H + h0) * D;
      for (int r = 0; r < rows; ++r)  // rows that see no key stay zero (+0.0)
        std::memset(out + r * H * D, 0, static_cast<size_t>(nh * D) * sizeof(T));
      if (lo[0] >= hi[rows - 1]) continue;
      for (int r = 0; r < kRows; ++r)  // the chunk's heads are contiguous in a query row
        ToFloatRow<T1>(static_cast<const T*>(args.query) + ((row0 + i0 + std::min(r, rows - 1)) * H + h0) * D,
                       &q[r * nh * D], nh * D);
      std::fill(top.begin(), top.end(), minus_inf);
      for (int64_t j = lo[0]; j < hi[rows - 1]; ++j) {
        const float* key = keys.Row(j);
        for (int64_t k = 0; k < nh; ++k) {
          const float* qs[kRows] = {&q[k * D], &q[(nh + k) * D], &q[(2 * nh + k) * D], &q[(3 * nh + k) * D]};
          float dots[kRows];
          if (rows == 1)  // a decode: one query row
            dots[0] = Dot(qs[0], key + ((h0 + k) / G - kv0) * D, D);
          else
            Dot4(qs, key + ((h0 + k) / G - kv0) * D, D, dots);
          for (int r = 0; r < rows; ++r) {
            if (j < lo[r] || j >= hi[r]) continue;
            float s = p.scale * dots[r];
            if (p.mask_rank) s = s + T1::ToFloat(MaskRow(h0 + k, row0 + i0 + r)[col0 + j]);
            if (a.is_alibi) s = s + slope[k] * static_cast<float>(j - qpos[r]);
            scores[(r * nh + k) * span + (j - first)] = s;
            float& m = top[r * nh + k];
            if (s > m || s != s) m = s;  // NaN sticks, as numpy's max
          }
        }
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(sum.begin(), sum.end(), 0.0f);
      for (int64_t j = lo[0]; j < hi[rows - 1]; ++j) {
        const float* value = values.Row(j);
        for (int64_t k = 0; k < nh; ++k) {
          const float* v = value + ((h0 + k) / G - kv0) * D;
          float w[kRows] = {0.0f, 0.0f, 0.0f, 0.0f};
          int used = 0;
          for (int r = 0; r < rows; ++r) {
            const float m = top[r * nh + k];
            if (j < lo[r] || j >= hi[r] || m == minus_inf) continue;  // not visible, or the row is all -inf
            w[r] = std::exp(scores[(r * nh + k) * span + (j - first)] - m);
            sum[r * nh + k] += w[r];
            ++used;
          }
          if (used == kRows) {
            float* accs[kRows] = {&acc[k * D], &acc[(nh + k) * D], &acc[(2 * nh + k) * D], &acc[(3 * nh + k) * D]};
            Axpy4(accs, w, v, D);
          } else {  // only the rows that see this key: 0 * an infinite value would be NaN
            for (int r = 0; r < rows; ++r)
              if (j >= lo[r] && j < hi[r] && top[r * nh + k] != minus_inf) Axpy(&acc[(r * nh + k) * D], w[r], v, D);
          }
        }
      }
      for (int r = 0; r < rows; ++r)
        for (int64_t k = 0; k < nh; ++k)
          if (top[r * nh + k] != minus_inf)
            for (int64_t d = 0; d < D; ++d)
              out[r * H * D + k * D + d] = T1::FromFloat(acc[(r * nh + k) * D + d] / sum[r * nh + k]);
    }
  }

  // attn_mask row of query row `row` for head h (the rank-2 mask is shared by all heads).
  const T* MaskRow(int64_t h, int64_t row) const {
    const int64_t plane = p.mask_rank == 3 ? h * p.tokens : 0;  // < the mask's element count: fits
    return static_cast<const T*>(args.mask) + (plane + row) * p.mask_cols;
  }

  void Run(const ParallelFor& parallel_for) const {
    // Only sequences with queries get tasks: at most tokens * num_heads of them, which fits because the query
    // tensor has that many rows of head_dim >= 1 elements (an empty query may name any num_heads).
    const int64_t H = a.num_heads;
    int64_t streamed = 0;
    for (int64_t b = 0; b < p.batch; ++b) {
      const int64_t S = p.seqstarts[b + 1] - p.seqstarts[b];
      streamed += S > 0 && S <= kStreamQueries;
    }
    const int64_t chunks = std::clamp<int64_t>(streamed ? (kMinStreamTasks + streamed - 1) / streamed : 1, 1, H);
    const int64_t chunk = (H + chunks - 1) / chunks;
    std::vector<TaskRange> tasks;
    for (int64_t b = 0; b < p.batch; ++b) {
      const int64_t S = p.seqstarts[b + 1] - p.seqstarts[b], K = p.kvstarts[b + 1] - p.kvstarts[b];
      if (S == 0) continue;
      const int64_t rows_keys = K >= kMaxChunkScores ? kMaxChunkScores : std::max<int64_t>(1, std::min<int64_t>(kRows, S) * K);
      const int64_t step = S <= kStreamQueries ? std::clamp<int64_t>(kMaxChunkScores / rows_keys, 1, chunk) : 1;
      for (int64_t h = 0; h < H; h += step) tasks.push_back({b, h, std::min(H, h + step)});
    }
    // A task's exception (an allocation failure) must not unwind through the thread pool: the first one is
    // kept and rethrown here, after every task has returned.
    std::mutex failure_lock;
    std::exception_ptr failure;
    parallel_for(tasks.size(), [&](size_t t) {
      try {
        Task(tasks[t]);
      } catch (...) {
        std::lock_guard<std::mutex> hold(failure_lock);
        if (!failure) failure = std::current_exception();
      }
    });
    if (failure) std::rethrow_exception(failure);
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
