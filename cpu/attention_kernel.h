// The attention compute shared by MultiHeadAttention (keys and values from packed inputs) and
// MultiHeadCacheAttention (keys and values read in place from the cache): one task per (sequence, chunk of
// query heads[, range of keys]), float32 accumulation, max-subtracted softmax, memory per task O(kvlen *
// head_dim). Where the keys come from is the Source (mha_cpu.cc, mhca_cpu_source.h). Built once per instruction set
// like kv_cpu.cc (KV_CPU_ISA names the namespace).
//
// Decode-shaped sequences (few queries) are computed for all query heads of a kv head at once, so each loaded
// key and value row serves every head of its GQA group; long key ranges of such sequences are split over
// several tasks when there are too few tasks to busy the threads, each task's partial softmax (max, sum,
// unnormalized output) merged afterwards by log-sum-exp. Sequences of many queries (prefill) run as register-tiled
// matrix products over their keys converted once per task (attention_tiles.h).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "kv_cpu.h"
#include "kv_cpu_rows.h"
#include "spec_float_mode.h"
#include "attention_decode_tiles.h"
#include "attention_tiles.h"
#include "kv_types.h"
#include "mha_validate.h"

namespace kvcache {
namespace KV_CPU_ISA {
namespace attention_detail {

using Big = __int128;  // q - sliding_window may leave int64 for a huge window

constexpr int kRows = 4;  // query rows (or heads of a group) computed together: each key row loaded once for all

// The dot products and row updates below read their key or value row as element type E (float32, or a
// float16 / bfloat16 row of the cache converted in registers, exactly); the queries and accumulators are float32.

#if KV_SIMD
// a * b + c: one fused multiply-add where the build has FMA (every vector build of the attention ops).
inline __m256 MulAdd(__m256 a, __m256 b, __m256 c) {
#if defined(__FMA__)
  return _mm256_fmadd_ps(a, b, c);
#else
  return _mm256_add_ps(c, _mm256_mul_ps(a, b));
#endif
}
#endif

// out[r] = sum_d q[r][d] * k[d] in float32 for kRows query rows: per row eight lanes (lane l takes d = l mod 8;
// the vector builds sum alternate blocks of eight apart and add the two), then a fixed reduction tree.
template <class E = kvcache::F32>
inline void Dot4(const float* const* q, const typename E::Storage* k, int64_t n, float* out) {
  float lanes[kRows][8] = {};
  int64_t d = 0;
#if KV_SIMD
  // Two accumulators per row (alternate blocks of eight), added at the end: a decode step's softmax waits on
  // these sums, so the chain of dependent multiply-adds is kept half as long.
  __m256 s[kRows][2];
  for (int r = 0; r < kRows; ++r) s[r][0] = s[r][1] = _mm256_setzero_ps();
  for (; d + 16 <= n; d += 16) {
    const __m256 k0 = LoadFloat8<E>(k + d), k1 = LoadFloat8<E>(k + d + 8);
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      s[r][0] = MulAdd(_mm256_loadu_ps(q[r] + d), k0, s[r][0]);
      s[r][1] = MulAdd(_mm256_loadu_ps(q[r] + d + 8), k1, s[r][1]);
    }
  }
  for (; d + 8 <= n; d += 8) {
    const __m256 kv = LoadFloat8<E>(k + d);
    for (int r = 0; r < kRows; ++r) s[r][0] = MulAdd(_mm256_loadu_ps(q[r] + d), kv, s[r][0]);
  }
  for (int r = 0; r < kRows; ++r) _mm256_storeu_ps(lanes[r], _mm256_add_ps(s[r][0], s[r][1]));
#endif
  for (; d + 8 <= n; d += 8)
    for (int r = 0; r < kRows; ++r)
      for (int l = 0; l < 8; ++l) lanes[r][l] += q[r][d + l] * E::ToFloat(k[d + l]);  // independent lanes
  for (; d < n; ++d)
    for (int r = 0; r < kRows; ++r) lanes[r][d % 8] += q[r][d] * E::ToFloat(k[d]);
  for (int r = 0; r < kRows; ++r) {
    const float* x = lanes[r];
    out[r] = ((x[0] + x[4]) + (x[2] + x[6])) + ((x[1] + x[5]) + (x[3] + x[7]));
  }
}

// sum_d q[d] * k[d] in float32: one row of Dot4 (the same lanes and reduction tree, so the same bits).
template <class E = kvcache::F32>
inline float Dot(const float* q, const typename E::Storage* k, int64_t n) {
  float lanes[8] = {};
  int64_t d = 0;
#if KV_SIMD
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  for (; d + 16 <= n; d += 16) {
    s0 = MulAdd(_mm256_loadu_ps(q + d), LoadFloat8<E>(k + d), s0);
    s1 = MulAdd(_mm256_loadu_ps(q + d + 8), LoadFloat8<E>(k + d + 8), s1);
  }
  for (; d + 8 <= n; d += 8) s0 = MulAdd(_mm256_loadu_ps(q + d), LoadFloat8<E>(k + d), s0);
  _mm256_storeu_ps(lanes, _mm256_add_ps(s0, s1));
#endif
  for (; d + 8 <= n; d += 8)
    for (int l = 0; l < 8; ++l) lanes[l] += q[d + l] * E::ToFloat(k[d + l]);
  for (; d < n; ++d) lanes[d % 8] += q[d] * E::ToFloat(k[d]);
  return ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
}

// acc[r][d] += w[r] * v[d] for kRows rows (one load of v per d).
template <class E = kvcache::F32>
inline void Axpy4(float* const* acc, const float* w, const typename E::Storage* __restrict__ v, int64_t n) {
  float* __restrict__ a0 = acc[0];
  float* __restrict__ a1 = acc[1];
  float* __restrict__ a2 = acc[2];
  float* __restrict__ a3 = acc[3];
  const float w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3];
  int64_t d = 0;
#if KV_SIMD
  const __m256 v0 = _mm256_set1_ps(w0), v1 = _mm256_set1_ps(w1), v2 = _mm256_set1_ps(w2), v3 = _mm256_set1_ps(w3);
  for (; d + 8 <= n; d += 8) {
    const __m256 x = LoadFloat8<E>(v + d);
    _mm256_storeu_ps(a0 + d, _mm256_add_ps(_mm256_loadu_ps(a0 + d), _mm256_mul_ps(v0, x)));
    _mm256_storeu_ps(a1 + d, _mm256_add_ps(_mm256_loadu_ps(a1 + d), _mm256_mul_ps(v1, x)));
    _mm256_storeu_ps(a2 + d, _mm256_add_ps(_mm256_loadu_ps(a2 + d), _mm256_mul_ps(v2, x)));
    _mm256_storeu_ps(a3 + d, _mm256_add_ps(_mm256_loadu_ps(a3 + d), _mm256_mul_ps(v3, x)));
  }
#endif
  for (; d < n; ++d) {
    const float x = E::ToFloat(v[d]);
    a0[d] += w0 * x;
    a1[d] += w1 * x;
    a2[d] += w2 * x;
    a3[d] += w3 * x;
  }
}

// acc[d] += w * v[d]
template <class E = kvcache::F32>
inline void Axpy(float* __restrict__ acc, float w, const typename E::Storage* __restrict__ v, int64_t n) {
  for (int64_t d = 0; d < n; ++d) acc[d] += w * E::ToFloat(v[d]);
}

#if defined(__AVX2__)
// exp(x) of eight floats by Cephes' single-precision exp (range reduction by ln 2 split in two constants, a
// degree-6 polynomial: within 2 ulp of std::exp), exactly 0 below exp's float range (so -inf gives 0, as
// std::exp does) and NaN kept NaN.
inline __m256 Exp8(__m256 in) {
  const __m256 lo = _mm256_set1_ps(-87.33654f), hi = _mm256_set1_ps(88.3762626647949f);
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f), half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
  const __m256 c1 = _mm256_set1_ps(0.693359375f), c2 = _mm256_set1_ps(-2.12194440e-4f);
  const __m256 p0 = _mm256_set1_ps(1.9875691500e-4f), p1 = _mm256_set1_ps(1.3981999507e-3f),
               p2 = _mm256_set1_ps(8.3334519073e-3f), p3 = _mm256_set1_ps(4.1665795894e-2f),
               p4 = _mm256_set1_ps(1.6666665459e-1f), p5 = _mm256_set1_ps(5.0000001201e-1f);
  const __m256 under = _mm256_cmp_ps(in, lo, _CMP_LT_OQ);  // false for NaN
  __m256 v = _mm256_min_ps(hi, _mm256_max_ps(lo, in));     // second operand returned for NaN: NaN stays
  const __m256 fx = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(v, log2e), half));
  v = _mm256_sub_ps(_mm256_sub_ps(v, _mm256_mul_ps(fx, c1)), _mm256_mul_ps(fx, c2));
  const __m256 z = _mm256_mul_ps(v, v);
  __m256 y = _mm256_add_ps(_mm256_mul_ps(p0, v), p1);
  y = _mm256_add_ps(_mm256_mul_ps(y, v), p2);
  y = _mm256_add_ps(_mm256_mul_ps(y, v), p3);
  y = _mm256_add_ps(_mm256_mul_ps(y, v), p4);
  y = _mm256_add_ps(_mm256_mul_ps(y, v), p5);
  y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(y, z), v), one);
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}
#endif

// x[i] = exp(x[i] - m) for i in [0, n), returning their sum (float32): eight at a time by Exp8 where AVX2 is
// built, the rest (and other builds) through std::exp.
inline float ExpShiftedSum(float* x, int64_t n, float m) {
  int64_t i = 0;
  float total = 0.0f;
#if defined(__AVX2__)
  const __m256 shift = _mm256_set1_ps(m);
  __m256 sums = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 y = Exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), shift));
    _mm256_storeu_ps(x + i, y);
    sums = _mm256_add_ps(sums, y);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, sums);
  for (float lane : lanes) total += lane;
#endif
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - m);
    total += x[i];
  }
  return total;
}

// A head's running softmax moved to the higher (or NaN) max m: what was summed against the old max is rescaled by
// exp(old max - m) (0 after -inf; NaN for a NaN max).
inline void RaiseMax(float m, int64_t D, float* top, float* sum, float* acc) {
  const float f = std::exp(*top - m);
  *sum *= f;
  for (int64_t d = 0; d < D; ++d) acc[d] *= f;
  *top = m;
}

// One key's finished scores x[k] of heads k < nh enter their running softmax (max top[k], sum[k], unnormalized
// output acc[k * D ..]): where a head's max rises (or turns NaN) its sum and output so far are rescaled by
// exp(old max - new max), then x[k] becomes the key's weight exp(x[k] - max), 0 while the max is -inf (a
// non-finite value still reaches the sums through it), and is added to the sum. The per-key form of the block
// softmax in DecodeTask, eight heads per vector where AVX2 is built.
inline void OneKeySoftmax(float* x, int64_t nh, int64_t D, float* top, float* sum, float* acc) {
  const float minus_inf = -std::numeric_limits<float>::infinity();
  auto rescale = [&](int64_t k, float m) { RaiseMax(m, D, &top[k], &sum[k], &acc[k * D]); };
  int64_t k = 0;
#if defined(__AVX2__)
  const __m256 none = _mm256_set1_ps(minus_inf);
  for (; k + 8 <= nh; k += 8) {
    const __m256 v = _mm256_loadu_ps(x + k), old = _mm256_loadu_ps(top + k);
    __m256 m = _mm256_max_ps(v, old);
    m = _mm256_blendv_ps(m, v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));        // a NaN score makes the max NaN
    m = _mm256_blendv_ps(m, old, _mm256_cmp_ps(old, old, _CMP_UNORD_Q));  // and a NaN max stays
    int rising = _mm256_movemask_ps(_mm256_cmp_ps(m, old, _CMP_NEQ_UQ));
    if (rising) {
      float ms[8];
      _mm256_storeu_ps(ms, m);
      for (; rising; rising &= rising - 1) {
        const int lane = __builtin_ctz(static_cast<unsigned>(rising));
        rescale(k + lane, ms[lane]);
      }
    }
    const __m256 w = _mm256_andnot_ps(_mm256_cmp_ps(m, none, _CMP_EQ_OQ), Exp8(_mm256_sub_ps(v, m)));
    _mm256_storeu_ps(x + k, w);
    _mm256_storeu_ps(sum + k, _mm256_add_ps(_mm256_loadu_ps(sum + k), w));
  }
#endif
  for (; k < nh; ++k) {
    float m = top[k];
    if ((x[k] > m || x[k] != x[k]) && m == m) m = x[k];  // NaN sticks, as numpy's max
    if (m != top[k]) rescale(k, m);
    x[k] = m == minus_inf ? 0.0f : std::exp(x[k] - m);
    sum[k] += x[k];
  }
}

// x[i] *= scale for i in [0, n), returning their max (NaN if any is NaN, as numpy's max; -inf for n == 0):
// the scores' finishing pass where no softcap, mask or ALiBi applies.
inline float ScaleMax(float* x, int64_t n, float scale) {
  int64_t i = 0;
  float m = -std::numeric_limits<float>::infinity();
  bool nan = false;
#if defined(__AVX2__)
  const __m256 factor = _mm256_set1_ps(scale);
  __m256 top = _mm256_set1_ps(m), unordered = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), factor);
    _mm256_storeu_ps(x + i, v);
    top = _mm256_max_ps(top, v);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, top);
  for (float lane : lanes) m = std::max(m, lane);
  nan = _mm256_movemask_ps(unordered) != 0;
#endif
  for (; i < n; ++i) {
    x[i] *= scale;
    if (x[i] > m) m = x[i];
    nan = nan || x[i] != x[i];
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : m;
}

// Sequences with at most this many queries are computed for several heads at once, streaming each key/value
// row (the chunk's kv heads) once per query block; longer sequences reuse each row many times and run one task
// per head as tiled matrix products (PrefillTask).
constexpr int64_t kStreamQueries = 4;
// Decode-shaped sequences are split into key ranges until there are about this many tasks.
constexpr int64_t kMinStreamTasks = 16;
// A split key range holds at least this many keys: fewer would cost more in merging than they save.
constexpr int64_t kMinSplitKeys = 256;
// Decode with tiles (attention_decode_tiles.h) attends over blocks of kDecodeBlock keys, asking for the next
// block's rows while it computes one (measured on one core, blocks of 32 keys against 16: decode B=64 kv1024 8/2
// heads float16 head_dim 32 5.7 against 6.8 ms, head_dim 64 4.0 against 4.4, 128 the same; B=1 16,384 keys 0.68
// against 0.79; float32 8.0 against 8.6; an int8 cache 5.4 against 4.9; without the prefetch, head_dim 64 takes
// 13.2 ms). Without tiles (the portable build, head dims that are not whole
// vectors) it attends key by key where a slot's key and value rows lie together, else in blocks of kKeyBlock keys
// (measured: 8-10 ms for blocks of 1 to 16, 18 ms for 32-key blocks read in two passes), and leaves the reads to
// the hardware prefetchers (asking for rows 4 keys ahead measured 7-14% slower there).
constexpr int64_t kDecodeBlock = 32, kKeyBlock = 8, kLongRowBytes = 512;
// Decode tiles over rows of at least kPartRowBytes (a kv head's row as computed) run a block's dot products in
// parts of a few keys, asking for each part's share of the next block as the part starts: a whole block's
// prefetches asked in one burst (512 lines at 8/2 heads head_dim 128 float16) are more than one core keeps in
// flight, so the loads and the arithmetic barely overlapped. Measured on one core (AMD EPYC Zen 5), decode B=64
// kv1024 8/2 heads head_dim 128 float16 from memory: 5.56 ms in one burst, 4.00 in parts of 8 keys; the same
// arithmetic over cached pages 2.57 against 2.79. Shorter rows (head_dim 32 float32, the served small model)
// keep the one burst: their blocks ask for a quarter of the lines. The AVX2 build takes parts of 4 keys: on the
// machine it was measured on (AMD EPYC Zen 3, 32 KB first-level cache, no AVX-512; both builds side by side in one
// process), decode B=64 kv1024 8/2 heads float16 from memory took 0.74-0.85x the time of parts of 8, an int8
// cache 0.80-0.84x, B=1 16,384 keys 0.79x, the same arithmetic over cached pages 1.00x, 32/8 heads 0.98-1.06x;
// parts of 2 lost up to 17% at 32/8 heads. The AVX-512 build keeps 8, as measured on Zen 5 above.
constexpr int64_t kPartRowBytes = 256, kDecodePart = KV_AVX512 ? 8 : 4;
#if KV_DECODE_TILES
constexpr int64_t kDecodeWidth = DecodeVector::kWidth;  // head_dim a multiple of it runs the decode tiles
static_assert(kDecodeBlock % DecodeVector::kAccs == 0 && kDecodeBlock % kDecodePart == 0,
              "a block is a whole number of parts and of the longest key tiles (DecodePart takes the longest "
              "where it exceeds kDecodePart)");
#else
constexpr int64_t kDecodeWidth = 1;
#endif
// A chunk holds at most this many scores (rows x heads x keys, float32: 16 MiB): a task's memory stays
// O(kvlen) whatever num_heads is.
constexpr int64_t kMaxChunkScores = int64_t{1} << 22;

struct TaskRange {
  int64_t b, h0, h1;     // sequence b, query heads [h0, h1)
  int64_t j0, j1;        // keys [j0, j1) of the sequence (all of them when not split)
  int64_t partial = -1;  // split tasks: the first float of their partial results; -1 writes the output
  int64_t hidden = -1;   // split tasks under a mask: the first of their rows' flags "the mask hides every key"
};

// The tasks of one split (sequence, head chunk): merged into the output once all have run.
struct MergeRange {
  int64_t b, h0, h1, first_task, parts;
};

}  // namespace attention_detail

using namespace attention_detail;

// The attention of a validated call. Source::Open(kv, b, kv0, kv1) gives a reader of sequence b's keys (kv 0)
// or values (kv 1), kv heads [kv0, kv1), key indices 0 .. kvlen - 1 of that sequence.
template <class T1, class Source>
struct AttentionKernel {
  using T = typename T1::Storage;
  const kvcache::MhaAttrs& a;
  const kvcache::MhaPlan& p;
  const Source& source;
  const void* query;  // [tokens, num_heads, head_dim]
  const void* mask;   // nullptr when absent
  void* out;          // [tokens, num_heads, head_dim]
  float* partials = nullptr;
  const char* hidden_rows = nullptr;  // per split (row, head): the mask hides every key the row sees

  // A scaled score under the softcap extension: softcap * tanh(s / softcap) in float32; as it is when off.
  float Capped(float s) const { return a.softcap != 0.0f ? a.softcap * std::tanh(s / a.softcap) : s; }

  // The score of a raw dot product (spec order): scaled, softcapped, plus the attn_mask entry of query row `row`
  // at column `col` for head `head`, plus ALiBi's slope * (key position - query position) = slope * distance.
  float Score(float dot, int64_t head, float slope, int64_t row, int64_t col, int64_t distance) const {
    float s = Capped(p.scale * dot);
    if (p.mask_rank) s = s + T1::ToFloat(MaskRow(head, row)[col]);
    if (a.is_alibi) s = s + slope * static_cast<float>(distance);
    return s;
  }

  // x[i] = Score(x[i], ..., col + i, distance + i) for i < n, returning their max (NaN sticks, as numpy's max;
  // -inf for n <= 0); a vector pass where no softcap, mask or ALiBi applies.
  float FinishScores(float* x, int64_t n, int64_t head, float slope, int64_t row, int64_t col,
                     int64_t distance) const {
    if (a.softcap == 0.0f && !p.mask_rank && !a.is_alibi) return ScaleMax(x, n, p.scale);
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) {
      x[i] = Score(x[i], head, slope, row, col + i, distance + i);
      if (x[i] > m || x[i] != x[i]) m = x[i];
    }
    return m;
  }

  // [lo, hi): the keys query i of a sequence (seqlen S, kvlen K) may see (spec: visible keys).
  void VisibleRange(int64_t b, int64_t S, int64_t K, int64_t i, int64_t* lo, int64_t* hi) const {
    const int64_t q = K - S + i;  // |K - S + i| < tokens + kv_tokens: fits
    *hi = p.causal[b] ? q + 1 : K;
    *lo = 0;
    if (a.sliding_window) *lo = static_cast<int64_t>(std::clamp<Big>(Big(q) - a.sliding_window + 1, 0, K));
  }

  // Whether the mask hides (-inf) every key query i of sequence b sees for head h.
  bool MaskHidesRow(int64_t b, int64_t S, int64_t K, int64_t i, int64_t h) const {
    if (!p.mask_rank) return false;
    int64_t lo = 0, hi = 0;
    VisibleRange(b, S, K, i, &lo, &hi);
    const T* row = MaskRow(h, p.seqstarts[b] + i) + p.kvstarts[b];
    for (int64_t j = lo; j < hi; ++j)
      if (T1::ToFloat(row[j]) != -std::numeric_limits<float>::infinity()) return false;
    return true;
  }

  // Floats of one split task's partial results: per (row, head) its max, its sum, then head_dim of output.
  int64_t PartialFloats(int64_t S, int64_t nh) const { return std::min<int64_t>(kRows, S) * nh * (a.head_dim + 2); }

  // Every output row of query heads [h0, h1) of sequence b over keys [j0, j1), kRows query rows at a time. The
  // visible ranges of consecutive queries only move forward, so a block's keys are [lo of its first row, hi of
  // its last); a key outside one row's own range is computed for the block but never used for that row.
  void Task(const TaskRange& task) const {
    const int64_t D = a.head_dim, H = a.num_heads, G = p.group, b = task.b, h0 = task.h0, nh = task.h1 - task.h0;
    const int64_t row0 = p.seqstarts[b], S = p.seqstarts[b + 1] - row0;
    const int64_t col0 = p.kvstarts[b], K = p.kvstarts[b + 1] - col0;
    const int64_t kv0 = h0 / G, kv1 = (task.h1 - 1) / G + 1;
    auto visible = [&](int64_t i, int64_t* lo, int64_t* hi) {
      VisibleRange(b, S, K, i, lo, hi);
      *lo = std::max(*lo, task.j0);
      *hi = std::max(*lo, std::min(*hi, task.j1));
    };
    int64_t first = 0, hi_first = 0, lo_last = 0, last = 0;
    visible(0, &first, &hi_first);
    visible(S - 1, &lo_last, &last);
    last = std::max(first, last);
    const int64_t span = last - first;
    typename Source::Reader keys = source.Open(0, b, kv0, kv1), values = source.Open(1, b, kv0, kv1);
    // Per (row r of the block, head k): query, accumulator, scores over [first, last), max, sum. Rows beyond
    // S are read as copies of the last row but never stored, so scores need only min(kRows, S) rows.
    const int64_t block = std::min<int64_t>(kRows, S);
    std::vector<float> q(kRows * nh * D), acc(kRows * nh * D), scores(block * nh * span), top(kRows * nh),
        sum(kRows * nh), slope(nh);
    std::vector<char> enters(kRows * nh);
    for (int64_t k = 0; k < nh; ++k) slope[k] = a.is_alibi ? kvcache::AlibiSlope(h0 + k, H) : 0.0f;
    const float minus_inf = -std::numeric_limits<float>::infinity();
    // Heads k .. k + 3 of the chunk read the same kv head (a GQA group of 4 or more): one pass over its key
    // row serves the four.
    auto shared4 = [&](int64_t k) { return k + kRows <= nh && (h0 + k) / G == (h0 + k + kRows - 1) / G; };
    for (int64_t i0 = 0; i0 < S; i0 += kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows, S - i0));
      int64_t lo[kRows], hi[kRows], qpos[kRows];
      for (int r = 0; r < kRows; ++r) {
        const int64_t i = i0 + std::min(r, rows - 1);  // missing rows repeat the last one (never written)
        visible(i, &lo[r], &hi[r]);
        qpos[r] = K - S + i;
      }
      T* out_rows = static_cast<T*>(out) + ((row0 + i0) * H + h0) * D;
      if (task.partial < 0)
        for (int r = 0; r < rows; ++r)  // rows that see no key stay zero (+0.0)
          std::memset(out_rows + r * H * D, 0, static_cast<size_t>(nh * D) * sizeof(T));
      std::fill(top.begin(), top.end(), minus_inf);
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(sum.begin(), sum.end(), 0.0f);
      if (lo[0] < hi[rows - 1]) {
        for (int r = 0; r < kRows; ++r)  // the chunk's heads are contiguous in a query row
          ToFloatRow<T1>(static_cast<const T*>(query) + ((row0 + i0 + std::min(r, rows - 1)) * H + h0) * D,
                         &q[r * nh * D], nh * D);
        // A raw dot product goes to its row's scores; finishing them (scale, softcap, mask, ALiBi), their max
        // and their exponentials is one pass per (row, head) over its visible keys afterwards.
        auto take = [&](int r, int64_t k, int64_t j, float dot) { scores[(r * nh + k) * span + (j - first)] = dot; };
        for (int64_t j = lo[0]; j < hi[rows - 1]; ++j) {
          const float* key = keys.Row(j);
          for (int64_t k = 0; k < nh;) {
            const float* kr = key + ((h0 + k) / G - kv0) * D;
            float dots[kRows];
            if (rows == 1 && shared4(k)) {  // a decode row, four heads of one group
              const float* qs[kRows] = {&q[k * D], &q[(k + 1) * D], &q[(k + 2) * D], &q[(k + 3) * D]};
              Dot4(qs, kr, D, dots);
              for (int r = 0; r < kRows; ++r) take(0, k + r, j, dots[r]);
              k += kRows;
              continue;
            }
            if (rows == 1) {
              dots[0] = Dot(&q[k * D], kr, D);
            } else {
              const float* qs[kRows] = {&q[k * D], &q[(nh + k) * D], &q[(2 * nh + k) * D], &q[(3 * nh + k) * D]};
              Dot4(qs, kr, D, dots);
            }
            for (int r = 0; r < rows; ++r) take(r, k, j, dots[r]);
            ++k;
          }
        }
        for (int r = 0; r < rows; ++r)
          for (int64_t k = 0; k < nh; ++k) {
            float* row = &scores[(r * nh + k) * span];  // key j at row[j - first]
            const float m = top[r * nh + k] = FinishScores(row + (lo[r] - first), hi[r] - lo[r], h0 + k, slope[k],
                                                           row0 + i0 + r, col0 + lo[r], lo[r] - qpos[r]);
            if (m != minus_inf) sum[r * nh + k] = ExpShiftedSum(row + (lo[r] - first), hi[r] - lo[r], m);
          }
        // exp(score - max) of row r, head k at key j (computed above); 0 where the key is hidden or the row is all
        // -inf.
        auto weight = [&](int r, int64_t k, int64_t j) {
          if (j < lo[r] || j >= hi[r] || top[r * nh + k] == minus_inf) return 0.0f;
          return scores[(r * nh + k) * span + (j - first)];
        };
        // Whether row r's keys enter its sums. A row whose scores are all -inf is zero when the task holds its whole
        // key range; in a split task it is one part of a row whose other parts may not be, and its visible keys
        // still enter with weight 0, so that an infinite or NaN value among them makes the merged row NaN, as in
        // one pass. Unless the mask hides every key the row sees (a padding row): the merge zeroes it whatever its
        // parts hold (a NaN score elsewhere makes it NaN there), so its values need not be read.
        for (int r = 0; r < rows; ++r)
          for (int64_t k = 0; k < nh; ++k)
            enters[r * nh + k] = top[r * nh + k] != minus_inf ||
                                 (task.partial >= 0 && !(task.hidden >= 0 && hidden_rows[task.hidden + r * nh + k]));
        auto seen = [&](int r, int64_t k, int64_t j) { return j >= lo[r] && j < hi[r] && enters[r * nh + k]; };
        for (int64_t j = lo[0]; j < hi[rows - 1]; ++j) {
          const float* value = values.Row(j);
          for (int64_t k = 0; k < nh;) {
            const float* v = value + ((h0 + k) / G - kv0) * D;
            if (rows == 1 && shared4(k)) {
              float w[kRows];
              bool all = true;
              for (int r = 0; r < kRows; ++r) {
                all = all && seen(0, k + r, j);
                w[r] = weight(0, k + r, j);
              }
              if (all) {
                float* accs[kRows] = {&acc[k * D], &acc[(k + 1) * D], &acc[(k + 2) * D], &acc[(k + 3) * D]};
                Axpy4(accs, w, v, D);
              } else {  // only the heads that see this key: 0 * an infinite value would be NaN
                for (int r = 0; r < kRows; ++r)
                  if (seen(0, k + r, j)) Axpy(&acc[(k + r) * D], w[r], v, D);
              }
              k += kRows;
              continue;
            }
            float w[kRows] = {0.0f, 0.0f, 0.0f, 0.0f};
            int used = 0;
            for (int r = 0; r < rows; ++r) {
              used += seen(r, k, j);
              w[r] = weight(r, k, j);
            }
            if (used == kRows) {
              float* accs[kRows] = {&acc[k * D], &acc[(nh + k) * D], &acc[(2 * nh + k) * D], &acc[(3 * nh + k) * D]};
              Axpy4(accs, w, v, D);
            } else {
              for (int r = 0; r < rows; ++r)
                if (seen(r, k, j)) Axpy(&acc[(r * nh + k) * D], w[r], v, D);
            }
            ++k;
          }
        }
      }
      if (task.partial >= 0) {  // a split task: its rows are the sequence's (S <= kRows, one block)
        float* part = partials + task.partial;
        for (int r = 0; r < rows; ++r)
          for (int64_t k = 0; k < nh; ++k) {
            float* cell = part + (r * nh + k) * (D + 2);
            cell[0] = top[r * nh + k];
            cell[1] = sum[r * nh + k];
            std::memcpy(cell + 2, &acc[(r * nh + k) * D], static_cast<size_t>(D) * sizeof(float));
          }
        continue;
      }
      for (int r = 0; r < rows; ++r)
        for (int64_t k = 0; k < nh; ++k)
          if (top[r * nh + k] != minus_inf)
            for (int64_t d = 0; d < D; ++d)
              out_rows[r * H * D + k * D + d] = SaturatingFromFloat<T1>(acc[(r * nh + k) * D + d] / sum[r * nh + k]);
    }
  }

  // Task() for a sequence with more than kStreamQueries queries (a prefill or a long chunk), one query head
  // (task.h0), never split. Its kv head's keys [first, last) are converted once into transposed panels and its
  // values into rows, both zero-padded to whole tiles; then per tile of kTileRows query rows: the scores as
  // one tiled product over the key panels the tile sees, finished and exponentiated row by row as in Task(),
  // and the output as a second tiled product over the keys every row of the tile sees, the few keys only some
  // rows see (the causal edge, a window's start) added row by row. Hidden keys never enter a row, so a
  // non-finite value there cannot reach it; visible keys enter with their weight, as in Task().
  void PrefillTask(const TaskRange& task) const {
    const int64_t D = a.head_dim, H = a.num_heads, h = task.h0, kvh = h / p.group, b = task.b;
    const int64_t row0 = p.seqstarts[b], S = p.seqstarts[b + 1] - row0;
    const int64_t col0 = p.kvstarts[b], K = p.kvstarts[b + 1] - col0;
    const float minus_inf = -std::numeric_limits<float>::infinity();
    const float slope = a.is_alibi ? kvcache::AlibiSlope(h, H) : 0.0f;
    int64_t first = 0, last = 0, unused = 0;
    VisibleRange(b, S, K, 0, &first, &unused);
    VisibleRange(b, S, K, S - 1, &unused, &last);
    last = std::max(first, last);
    const int64_t span = last - first, ldk = TileColumns(span), ldv = TileColumns(D);
    // Keys in panels of kTileCols, each panel D rows of kTileCols keys (contiguous, so transposing a key writes
    // within one panel: a whole-span stride would alias in the cache): key j = first + pc + c of panel pc at
    // keys_t[pc * D + d * kTileCols + c]. values[(j - first) * ldv + d]. Padding stays zero.
    std::vector<float> keys_t(static_cast<size_t>(D * ldk)), values(static_cast<size_t>(span * ldv)),
        row(static_cast<size_t>(D));
    {
      typename Source::Reader keys = source.Open(0, b, kvh, kvh + 1), vals = source.Open(1, b, kvh, kvh + 1);
      for (int64_t j = 0; j < span; ++j) {
        keys.CopyRow(first + j, row.data());
        float* panel = &keys_t[(j - j % kTileCols) * D + j % kTileCols];
        for (int64_t d = 0; d < D; ++d) panel[d * kTileCols] = row[d];
        vals.CopyRow(first + j, &values[j * ldv]);
      }
    }
    std::vector<float> q(static_cast<size_t>(kTileRows * D)), scores(static_cast<size_t>(kTileRows * ldk)),
        acc(static_cast<size_t>(kTileRows * ldv));
    for (int64_t i0 = 0; i0 < S; i0 += kTileRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kTileRows, S - i0));
      int64_t lo[kTileRows], hi[kTileRows];
      float top[kTileRows], sum[kTileRows];
      for (int r = 0; r < kTileRows; ++r) {  // rows beyond S repeat the last one (computed, never stored)
        const int64_t i = i0 + std::min(r, rows - 1);
        VisibleRange(b, S, K, i, &lo[r], &hi[r]);
        ToFloatRow<T1>(static_cast<const T*>(query) + ((row0 + i) * H + h) * D, &q[r * D], D);
      }
      T* out_rows = static_cast<T*>(out) + ((row0 + i0) * H + h) * D;
      for (int r = 0; r < rows; ++r)  // rows that see no key stay zero (+0.0)
        std::memset(out_rows + r * H * D, 0, static_cast<size_t>(D) * sizeof(T));
      if (lo[0] >= hi[rows - 1]) continue;
      // The scores of the key panels covering [lo of the first row, hi of the last).
      const int64_t p_end = TileColumns(hi[rows - 1] - first);
      for (int64_t pc = (lo[0] - first) / kTileCols * kTileCols; pc < p_end; pc += kTileCols)
        TileProduct(q.data(), D, &keys_t[pc * D], kTileCols, D, &scores[pc], ldk);
      for (int r = 0; r < rows; ++r) {
        float* x = &scores[r * ldk];  // key j at x[j - first]
        const int64_t qpos = K - S + i0 + r;
        const float m = top[r] = FinishScores(x + (lo[r] - first), hi[r] - lo[r], h, slope, row0 + i0 + r,
                                              col0 + lo[r], lo[r] - qpos);
        sum[r] = m == minus_inf ? 0.0f : ExpShiftedSum(x + (lo[r] - first), hi[r] - lo[r], m);
      }
      // Keys [g0, g1) are seen by every row of the tile (ranges only move forward with the row); a row whose
      // scores are all -inf is left zero whatever its weights.
      const int64_t g0 = lo[rows - 1], g1 = std::max(g0, hi[0]);
      if (g1 > g0)
        for (int64_t d0 = 0; d0 < ldv; d0 += kTileCols)
          TileProduct(&scores[g0 - first], ldk, &values[(g0 - first) * ldv + d0], ldv, g1 - g0, &acc[d0], ldv);
      else
        std::fill(acc.begin(), acc.end(), 0.0f);
      for (int r = 0; r < rows; ++r) {
        if (top[r] == minus_inf) continue;
        float* o = &acc[r * ldv];
        const float* w = &scores[r * ldk];
        for (int64_t j = lo[r]; j < std::min(hi[r], g0); ++j) Axpy(o, w[j - first], &values[(j - first) * ldv], D);
        for (int64_t j = std::max(lo[r], g1); j < hi[r]; ++j) Axpy(o, w[j - first], &values[(j - first) * ldv], D);
        for (int64_t d = 0; d < D; ++d) out_rows[r * H * D + d] = SaturatingFromFloat<T1>(o[d] / sum[r]);
      }
    }
  }

  // Task() for a sequence of one query (a decode step), the shape that serving runs most. Rows are read as
  // T1 (Reader::RawAt: in place, or dequantized to T1 as KeyValueCache's gather would give them; the tiles read
  // codes in groups of 8 straight from the cache and dequantize them so in registers, ForTiles) and converted in
  // registers. One pass over the visible keys in blocks: the block's scores from its key rows (each row serving
  // every query head of its kv head), the running max raised and the sums so far rescaled by exp(old max - new
  // max), then the block's value rows. With decode tiles (head_dim whole vectors) the blocks are kDecodeBlock keys
  // and both halves run as register tiles (TileDots, TileValues); without them, key by key where a slot's key and
  // value rows lie together (one sequential stream; the heads' softmax steps side by side, OneKeySoftmax), else
  // blocks of kKeyBlock. The same
  // semantics as Task(): visible keys enter with their weight (0 for a -inf score, so a non-finite value there
  // still reaches the sums), a NaN max makes the row NaN, a row whose scores are all -inf stays zero.
  void DecodeTask(const TaskRange& task) const {
    const int64_t D = a.head_dim, H = a.num_heads, G = p.group, b = task.b, h0 = task.h0, nh = task.h1 - task.h0;
    const int64_t row = p.seqstarts[b], col0 = p.kvstarts[b], K = p.kvstarts[b + 1] - col0;
    const int64_t kv0 = h0 / G, kv1 = (task.h1 - 1) / G + 1;
    int64_t lo = 0, hi = 0;
    VisibleRange(b, 1, K, 0, &lo, &hi);
    lo = std::max(lo, task.j0);
    hi = std::max(lo, std::min(hi, task.j1));
    const int64_t span = hi - lo, qpos = K - 1;
    const float minus_inf = -std::numeric_limits<float>::infinity();
    // Where a slot's key and value rows lie together and are long, key by key: one sequential stream over the
    // cache (blocks of keys, then their values, read each key row at the slot stride, and at large power-of-two
    // strides a block's rows compete for the same cache sets: measured, decode B=64 kv1024 8/2 heads head_dim
    // 128 float32 8.5 ms key by key, 13 ms in blocks of 8, with the per-key dot products and row updates).
    const bool by_key = source.KeyValueTogether() && (kv1 - kv0) * D * int64_t(sizeof(T)) >= kLongRowBytes;
    // With decode tiles (head_dim whole vectors), every layout and head count. Measured on one core (AMD EPYC Zen
    // 5, AVX-512), decode B=64 kv1024 8/2 heads against the per-key form: float16 head_dim 128 5.4 against 7.6 ms,
    // 64 (B=128) 4.0 against 9.5, 32 (B=256) 5.7 against 14.1; 32/8 heads 20 against 40; an int8 cache 5.4 against
    // 8.5; B=1 16,384 keys 0.68 against 1.84; float32 head_dim 128 8.0 against 7.4 (layout 3: 7.9 against 7.1),
    // the one shape measured slower.
    const bool tiles = KV_DECODE_TILES && D % kDecodeWidth == 0;
    const int64_t block = tiles ? kDecodeBlock : by_key ? 1 : kKeyBlock;
    std::vector<float> q(nh * D), acc(nh * D, 0.0f), w(nh * block), top(nh, minus_inf), sum(nh, 0.0f),
        slope(nh);
    for (int64_t k = 0; k < nh; ++k) slope[k] = a.is_alibi ? kvcache::AlibiSlope(h0 + k, H) : 0.0f;
    auto shared4 = [&](int64_t k) { return k + kRows <= nh && (h0 + k) / G == (h0 + k + kRows - 1) / G; };
    if (span > 0) {
      ToFloatRow<T1>(static_cast<const T*>(query) + (row * H + h0) * D, q.data(), nh * D);
      typename Source::Reader keys = source.Open(0, b, kv0, kv1), values = source.Open(1, b, kv0, kv1);
      std::vector<int64_t> slots(static_cast<size_t>(span));
      keys.Slots(lo, hi, slots.data());
      auto prefetch = [&](int64_t i) {
        if (i < span) {
          keys.Prefetch(slots[i]);
          values.Prefetch(slots[i]);
        }
      };
      // x[k * stride] = the dot product of head k's query with its kv head's row of `key`.
      auto key_dots = [&](const T* key, float* x, int64_t stride) {
        for (int64_t k = 0; k < nh;) {
          const T* kr = key + ((h0 + k) / G - kv0) * D;
          if (shared4(k)) {
            const float* qs[kRows] = {&q[k * D], &q[(k + 1) * D], &q[(k + 2) * D], &q[(k + 3) * D]};
            float dots[kRows];
            Dot4<T1>(qs, kr, D, dots);
            for (int r = 0; r < kRows; ++r) x[(k + r) * stride] = dots[r];
            k += kRows;
          } else {
            x[k * stride] = Dot<T1>(&q[k * D], kr, D);
            ++k;
          }
        }
      };
      const int64_t part = tiles ? DecodePart(h0, nh) : block;
      if (tiles)
        for (int64_t i = 0; i < block; ++i) prefetch(i);
      for (int64_t j0 = lo; j0 < hi; j0 += block) {
        const int64_t n = std::min(block, hi - j0);
        if (tiles) {  // the next block's rows asked for while this one is computed, part by part
          for (int64_t p0 = 0; p0 < n; p0 += part) {
            const int64_t m = std::min(part, n - p0);
            for (int64_t i = 0; i < m; ++i) prefetch(j0 - lo + block + p0 + i);
            TileDots(keys, &slots[j0 - lo + p0], m, q.data(), w.data() + p0, h0, nh, kv0);
          }
        } else {
          for (int64_t i = 0; i < n; ++i) {  // raw dot products: w[k * block + i] for head k, key j0 + i
            key_dots(keys.RawAt(slots[j0 - lo + i]), &w[i], block);
          }
        }
        if (block == 1) {  // key by key: the heads' softmax steps side by side
          for (int64_t k = 0; k < nh; ++k) w[k] = Score(w[k], h0 + k, slope[k], row, col0 + j0, j0 - qpos);
          OneKeySoftmax(w.data(), nh, D, top.data(), sum.data(), acc.data());
        } else {
          for (int64_t k = 0; k < nh; ++k) {
            float* x = &w[k * block];
            float m = FinishScores(x, n, h0 + k, slope[k], row, col0 + j0, j0 - qpos);
            if (top[k] != top[k] || (m == m && m < top[k])) m = top[k];  // the running max; NaN sticks
            if (m == minus_inf) {  // nothing but -inf so far: weight 0, which still lets a non-finite value through
              std::fill(x, x + n, 0.0f);
              continue;
            }
            if (m != top[k]) RaiseMax(m, D, &top[k], &sum[k], &acc[k * D]);
            sum[k] += ExpShiftedSum(x, n, m);
          }
        }
        if (tiles) {
          TileValues(values, &slots[j0 - lo], n, w.data(), acc.data(), h0, nh, kv0);
          continue;
        }
        const T* rows[kDecodeBlock];
        values.RawRows(&slots[j0 - lo], n, rows);
        for (int64_t k = 0; k < nh;) {
          const int64_t offset = ((h0 + k) / G - kv0) * D;
          const T* heads_rows[kDecodeBlock];
          for (int64_t i = 0; i < n; ++i) heads_rows[i] = rows[i] + offset;
          if (shared4(k)) {
            const float* ws[kRows] = {&w[k * block], &w[(k + 1) * block], &w[(k + 2) * block], &w[(k + 3) * block]};
            float* accs[kRows] = {&acc[k * D], &acc[(k + 1) * D], &acc[(k + 2) * D], &acc[(k + 3) * D]};
            for (int64_t i = 0; i < n; ++i) {
              const float wi[kRows] = {ws[0][i], ws[1][i], ws[2][i], ws[3][i]};
              Axpy4<T1>(accs, wi, heads_rows[i], D);
            }
            k += kRows;
          } else {
            for (int64_t i = 0; i < n; ++i) Axpy<T1>(&acc[k * D], w[k * block + i], heads_rows[i], D);
            ++k;
          }
        }
      }
    }
    if (task.partial >= 0) {
      for (int64_t k = 0; k < nh; ++k) {
        float* cell = partials + task.partial + k * (D + 2);
        cell[0] = top[k];
        cell[1] = sum[k];
        std::memcpy(cell + 2, &acc[k * D], static_cast<size_t>(D) * sizeof(float));
      }
      return;
    }
    T* out_row = static_cast<T*>(out) + (row * H + h0) * D;
    for (int64_t k = 0; k < nh; ++k)
      for (int64_t d = 0; d < D; ++d)
        out_row[k * D + d] = top[k] == minus_inf ? T1::FromFloat(0.0f) : SaturatingFromFloat<T1>(acc[k * D + d] / sum[k]);
  }

#if KV_DECODE_TILES
  // fn(k, rows, heads) for every decode tile of the chunk's heads [0, nh) (query heads h0 ..) over a block's n
  // slots: runs of heads sharing a kv head, cut into powers of two of at most kMaxTileHeads (heads: an
  // std::integral_constant of the tile's head count, from head k); rows: slot i's row of that kv head, read
  // through `reader` as codes dequantized in registers (CodeRows: quantized rows in groups of 8), else as T1
  // rows in place or in its block buffer (StoredRows).
  template <class Reader, class Fn>
  void ForTiles(Reader& reader, const int64_t* slots, int64_t n, int64_t h0, int64_t nh, int64_t kv0, Fn&& fn) const {
    if constexpr (Source::kQuantBits != 0) {
      if (reader.CodesInRegisters()) {
        CodeRows<T1, typename Source::ScaleType, Source::kQuantBits, kDecodeBlock> rows;
        int64_t filled = -1;  // the kv head whose rows `rows` holds
        ForRuns(h0, nh, [&](int64_t k, int64_t kvh, auto heads) {
          if (kvh != filled) reader.CodeRowsOf(slots, n, kvh, &rows);
          filled = kvh;
          fn(k, rows, heads);
        });
        return;
      }
    }
    const T* rows[kDecodeBlock];
    reader.RawRows(slots, n, rows);
    StoredRows<T1, kDecodeBlock> heads_rows;
    ForRuns(h0, nh, [&](int64_t k, int64_t kvh, auto heads) {
      for (int64_t i = 0; i < n; ++i) heads_rows.rows[i] = rows[i] + (kvh - kv0) * a.head_dim;
      fn(k, heads_rows, heads);
    });
  }

  // fn(k, kv head, heads) for the runs of ForTiles.
  template <class Fn>
  void ForRuns(int64_t h0, int64_t nh, Fn&& fn) const {
    for (int64_t k = 0; k < nh;) {
      const int64_t kvh = (h0 + k) / p.group, end = std::min(nh, (kvh + 1) * p.group - h0);
      const int gs = FloorPow2(end - k, kMaxTileHeads);
      WithTileHeads(gs, [&](auto heads) { fn(k, kvh, heads); });
      k += gs;
    }
  }
#endif

  // The keys of a block's part (DecodeTask, kPartRowBytes): kDecodePart, or more where a head run tiles fewer
  // heads. A part is a whole number of every run's key tiles (kAccs / heads keys, the last one padded past the
  // part's keys), so no tile writes a score past its block's row of w; the whole block where rows are short.
  int64_t DecodePart(int64_t h0, int64_t nh) const {
#if KV_DECODE_TILES
    if (a.head_dim * int64_t(sizeof(T)) < kPartRowBytes) return kDecodeBlock;
    int64_t part = kDecodePart;
    ForRuns(h0, nh, [&](int64_t, int64_t, auto heads) {
      part = std::max<int64_t>(part, DecodeVector::kAccs / decltype(heads)::value);
    });
    return part;
#else
    (void)h0, (void)nh;
    return kDecodeBlock;
#endif
  }

  // (TileDots and TileValues stay out of line: inlined, they slowed DecodeTask's per-key form by 8%.)
  // w[k * kDecodeBlock + i] = head k's query row (q[k * head_dim ..]) . key i of the block (the n <= kDecodeBlock
  // slots), for every head of the chunk, tile by tile.
  template <class Reader>
  __attribute__((noinline)) void TileDots(Reader& keys, const int64_t* slots, int64_t n, const float* q, float* w,
                                          int64_t h0, int64_t nh, int64_t kv0) const {
#if KV_DECODE_TILES
    ForTiles(keys, slots, n, h0, nh, kv0, [&](int64_t k, const auto& rows, auto heads) {
      constexpr int GS = decltype(heads)::value;
      const float* qs[GS];
      for (int h = 0; h < GS; ++h) qs[h] = q + (k + h) * a.head_dim;
      DotsBlockOf<GS>(qs, rows, n, a.head_dim, w + k * kDecodeBlock, kDecodeBlock);
    });
#else
    (void)keys, (void)slots, (void)n, (void)q, (void)w, (void)h0, (void)nh, (void)kv0;
#endif
  }

  // acc[k * head_dim + d] += sum_i w[k * kDecodeBlock + i] * value i of the block [d], every head k of the chunk.
  template <class Reader>
  __attribute__((noinline)) void TileValues(Reader& values, const int64_t* slots, int64_t n, const float* w,
                                            float* acc, int64_t h0, int64_t nh, int64_t kv0) const {
#if KV_DECODE_TILES
    ForTiles(values, slots, n, h0, nh, kv0, [&](int64_t k, const auto& rows, auto heads) {
      constexpr int GS = decltype(heads)::value;
      float* accs[GS];
      for (int h = 0; h < GS; ++h) accs[h] = acc + (k + h) * a.head_dim;
      AxpyBlockOf<GS>(accs, w + k * kDecodeBlock, kDecodeBlock, rows, n, a.head_dim);
    });
#else
    (void)values, (void)slots, (void)n, (void)w, (void)acc, (void)h0, (void)nh, (void)kv0;
#endif
  }

  // The output rows of one split (sequence, head chunk) from its tasks' partial results: each part's sum and
  // output rescaled by exp(its max - the overall max). A NaN max (a NaN score) makes the output NaN, an
  // infinite one too (as in one pass: exp(inf - inf)); a part whose scores are all -inf enters with factor 0 (a NaN
  // it summed still shows); no part seeing a key leaves the row zero.
  void Merge(const MergeRange& m, const std::vector<TaskRange>& tasks) const {
    const int64_t D = a.head_dim, H = a.num_heads, nh = m.h1 - m.h0;
    const int64_t row0 = p.seqstarts[m.b], S = p.seqstarts[m.b + 1] - row0;
    const float minus_inf = -std::numeric_limits<float>::infinity();
    std::vector<float> acc(static_cast<size_t>(D));
    for (int64_t r = 0; r < S; ++r)
      for (int64_t k = 0; k < nh; ++k) {
        auto cell = [&](int64_t t) { return partials + tasks[m.first_task + t].partial + (r * nh + k) * (D + 2); };
        float top = minus_inf;
        for (int64_t t = 0; t < m.parts; ++t)
          if (cell(t)[0] > top || cell(t)[0] != cell(t)[0]) top = cell(t)[0];
        T* o = static_cast<T*>(out) + ((row0 + r) * H + m.h0 + k) * D;
        if (top == minus_inf) {
          std::memset(o, 0, static_cast<size_t>(D) * sizeof(T));
          continue;
        }
        float total = 0.0f;
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t t = 0; t < m.parts; ++t) {
          // A part whose scores are all -inf enters with factor exp(-inf - top) = 0: its sums are 0, but a
          // non-finite value under a -inf score still makes the row NaN, as in one pass.
          const float* c = cell(t);
          const float f = std::exp(c[0] - top);
          total += f * c[1];
          for (int64_t d = 0; d < D; ++d) acc[d] += f * c[2 + d];
        }
        for (int64_t d = 0; d < D; ++d) o[d] = SaturatingFromFloat<T1>(acc[d] / total);
      }
  }

  // attn_mask row of query row `row` for head h (the rank-2 mask is shared by all heads).
  const T* MaskRow(int64_t h, int64_t row) const {
    const int64_t plane = p.mask_rank == 3 ? h * p.tokens : 0;  // < the mask's element count: fits
    return static_cast<const T*>(mask) + (plane + row) * p.mask_cols;
  }

  void Run(const kvcache::ParallelFor& parallel_for) {
    // Only sequences with queries get tasks: at most tokens * num_heads chunks of them, which fits because the
    // query tensor has that many rows of head_dim >= 1 elements (an empty query may name any num_heads).
    const int64_t H = a.num_heads, G = p.group;
    // Decode-shaped sequences: where a slot's heads lie together, one task reads all of them (whole slot rows,
    // one stream over the cache) and long key ranges are split for parallelism instead; where they lie apart
    // (layout 3), one kv head's group per task, its rows read in place. Measured, decode float16 B=4 kv4096
    // 32/8 heads: 9.5-10 ms reading whole slots, 29-30 ms in chunks of two kv heads; B=1 kv16384 8/2: 1.8 ms
    // against 2.9-6.3 ms.
    const int64_t chunk = source.HeadsTogether() ? H : G;
    auto head_step = [&](int64_t S, int64_t keys) {
      const int64_t rows_keys = keys >= kMaxChunkScores ? kMaxChunkScores : std::max<int64_t>(1, std::min<int64_t>(kRows, S) * keys);
      return S <= kStreamQueries ? std::clamp<int64_t>(kMaxChunkScores / rows_keys, 1, chunk) : int64_t{1};
    };
    int64_t unsplit = 0;
    for (int64_t b = 0; b < p.batch; ++b) {
      const int64_t S = p.seqstarts[b + 1] - p.seqstarts[b], K = p.kvstarts[b + 1] - p.kvstarts[b];
      if (S > 0) unsplit += (H + head_step(S, K) - 1) / head_step(S, K);
    }
    // Too few tasks for the threads: decode-shaped sequences with long key ranges are split over their keys.
    const int64_t want_parts = unsplit > 0 && unsplit < kMinStreamTasks ? (kMinStreamTasks + unsplit - 1) / unsplit : 1;
    std::vector<TaskRange> tasks;
    std::vector<MergeRange> merges;
    std::vector<char> hidden;  // MaskHidesRow of every split (row, head), once for all the split's tasks
    int64_t partial_floats = 0;
    for (int64_t b = 0; b < p.batch; ++b) {
      const int64_t S = p.seqstarts[b + 1] - p.seqstarts[b], K = p.kvstarts[b + 1] - p.kvstarts[b];
      if (S == 0) continue;
      const int64_t parts = S <= kStreamQueries ? std::clamp<int64_t>(K / kMinSplitKeys, 1, want_parts) : 1;
      const int64_t part_keys = (K + parts - 1) / parts, split = K ? (K + part_keys - 1) / part_keys : 1;
      const int64_t step = head_step(S, part_keys);
      for (int64_t h = 0; h < H; h += step) {
        const int64_t h1 = std::min(H, h + step);
        if (split == 1) {
          tasks.push_back({b, h, h1, 0, K});
          continue;
        }
        merges.push_back({b, h, h1, static_cast<int64_t>(tasks.size()), split});
        const int64_t flags = p.mask_rank ? static_cast<int64_t>(hidden.size()) : -1;
        if (p.mask_rank)  // S <= kStreamQueries rows: a live row's scan stops at its first key not -inf
          for (int64_t r = 0; r < S; ++r)
            for (int64_t k = h; k < h1; ++k) hidden.push_back(MaskHidesRow(b, S, K, r, k));
        for (int64_t j = 0; j < K; j += part_keys) {
          tasks.push_back({b, h, h1, j, std::min(K, j + part_keys), partial_floats, flags});
          partial_floats += PartialFloats(S, h1 - h);
        }
      }
    }
    std::vector<float> partial_store(static_cast<size_t>(partial_floats));
    partials = partial_store.data();
    hidden_rows = hidden.data();
    // Each task reads subnormal scales and scores as they are, whatever the caller's float mode. A task's exception
    // (an allocation failure) is the ParallelFor's to keep and rethrow once every task has returned (kv_cpu.h), so a
    // failed pass ends the call before the merges.
    parallel_for(tasks.size(), [&](size_t t) {
      const SpecFloatMode spec_mode;
      const TaskRange& task = tasks[t];
      const int64_t queries = p.seqstarts[task.b + 1] - p.seqstarts[task.b];
      queries == 1 ? DecodeTask(task) : queries > kStreamQueries ? PrefillTask(task) : Task(task);
    });
    parallel_for(merges.size(), [&](size_t m) {
      const SpecFloatMode spec_mode;
      Merge(merges[m], tasks);
    });
  }
};

}  // namespace KV_CPU_ISA
}  // namespace kvcache
