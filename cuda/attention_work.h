// The work of the attention CUDA kernels (MultiHeadAttention and MultiHeadCacheAttention), as __host__ __device__
// functions over a block's team of threads.
//
// A block takes one tile (attention_launch.h: query rows x heads of one kv head, over a range of keys) and walks
// its keys in chunks of kAttnThreads:
//   scores  one key per thread: the key row is read once (in place from the cache, dequantized in registers) and
//           dotted with every query vector of the tile, so GQA heads share each loaded key;
//   max     the chunk's max per query vector (a reduction in shared memory), the running max raised and the
//           sums so far rescaled by exp(old max - new max) (online softmax, one pass over the keys), then the
//           chunk's weights once per (query vector, key);
//   values  threads own (key group, up to kVectorGroup query vectors, slice of kSliceElems elements): each value
//           row slice is read once per key group and multiplied into the sums of the vectors the thread owns.
// At the end the key groups' sums are added pairwise, and the block writes its output rows, or, for a long key
// range split over several blocks, its (max, sum, output) records, which MergeThread combines (log-sum-exp merge).
//
// Cooperation goes through a small layer the host runner executes too: team.Each(f) calls f(thread, state) for
// every thread of the block (on the GPU: this thread, with its registers `state`); team.Sync() is the barrier
// between phases; shared memory is the buffer kAShared, reached through the memory policy Mem like every other
// buffer (Mem::Load<T>(buffer, byte_offset), Mem::Store<T>(buffer, byte_offset, value)). Values read outside
// Each are the same for every thread of the block (the tile's fields). Semantics are the CPU kernel's
// (spec/MultiHeadAttention.md): visible keys enter with their weight (0 for a -inf score, so a non-finite value
// still reaches the sums), a NaN max makes the row NaN, a row whose scores are all -inf is exactly zero.
#pragma once

#include <cmath>
#include <cstdint>

#include "attention_launch.h"
#include "kv_cache_access.h"
#include "kv_types.h"

namespace kvcache {
namespace cuda {

// What a thread keeps across chunks: its slice of up to kVectorGroup query vectors' output sums, and their weight
// sums (one value row slice, once loaded, serves every vector of the group).
struct AttnThread {
  float acc[kVectorGroup][kSliceElems];
  float weights[kVectorGroup];
};

KV_HD float MinusInf() { return -INFINITY; }

// Fully unrolled on the GPU (register arrays must be indexed by constants there); a no-op on the host.
#if defined(__CUDACC__)
#define KV_UNROLL _Pragma("unroll")
#else
#define KV_UNROLL
#endif

// The weight slot of a key the query does not see (a weight is otherwise >= 0 or NaN).
constexpr float kHidden = -1.0f;
// Reads a thread keeps in flight: slices of its key row in the score phase, value rows in the value phase.
constexpr int64_t kKeyLoads = 2, kValueLoads = 2;

// A float32 product rounded once (never fused into an add): the spec's dequantization.
KV_HD float ProductRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// A T1 storage value as float (exact).
template <class T1>
KV_HD float ElemToFloat(typename T1::Storage v) {
#if defined(__CUDA_ARCH__)
  if constexpr (T1::kElem == Elem::kFloat16) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
    return f;
  }
#endif
  return T1::ToFloat(v);
}

// x rounded to T1 (round to nearest even), as a float: the value KeyValueCache's gather would give. The GPU's
// conversion instruction rounds every value but NaN as the portable one does, and a NaN stays a NaN (its payload,
// which attention never shows, may differ).
template <class T1>
KV_HD float RoundToT1(float x) {
#if defined(__CUDA_ARCH__)
  if constexpr (T1::kElem == Elem::kFloat16) {
    uint16_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return ElemToFloat<T1>(h);
  }
#endif
  return T1::ToFloat(T1::FromFloat(x));
}

// numpy's max step: NaN sticks.
KV_HD float MaxStep(float m, float x) { return (x > m || x != x) && m == m ? x : m; }

// The combinations team.Butterfly exchanges with.
struct AddOp {
  KV_HD float operator()(float a, float b) const { return a + b; }
};
struct MaxOp {
  KV_HD float operator()(float a, float b) const { return MaxStep(a, b); }
};

template <class Mem>
KV_HD int64_t IndexWord(Mem& mem, int64_t i) {
  return mem.template Load<int64_t>(kAIndex, 8 * i);
}
template <class Mem>
KV_HD float SharedAt(Mem& mem, int64_t word) {
  return mem.template Load<float>(kAShared, 4 * word);
}
template <class Mem>
KV_HD void SharedPut(Mem& mem, int64_t word, float v) {
  mem.template Store<float>(kAShared, 4 * word, v);
}
// Four shared words from a multiple-of-4 word: one 16-byte load (a broadcast when a warp reads one address).
template <class Mem>
KV_HD void SharedFour(Mem& mem, int64_t word, float* out) {
  const Vec16 w = mem.template Load<Vec16>(kAShared, 4 * word);
  for (int i = 0; i < 4; ++i) out[i] = BitsFloat(w.w[i]);
}

// [lo, hi): the keys query i of a sequence (seqlen S, kvlen K) may see under a sliding window W (0: none) (spec:
// visible keys). |K - S + i| fits.
KV_HD void VisibleKeys(int64_t window, bool causal, int64_t S, int64_t K, int64_t i, int64_t* lo, int64_t* hi) {
  const int64_t q = K - S + i;
  *hi = causal ? q + 1 : K;
  int64_t first = 0;
  if (window && q >= window) first = q - window + 1;  // q - W + 1 <= K: no overflow
  *lo = first < K ? first : K;
}

// The score of a visible key: the query's dot product with the key, scaled, soft-capped, plus the mask's entry
// (query token `token`, key column `col`) and the ALiBi bias (key position minus query position: `distance`), in
// the spec's order.
template <class T1, class Mem>
KV_HD float ScoreOf(const AttnParams& p, Mem& mem, float dot, int64_t head, int64_t token, int64_t col,
                    int64_t distance) {
  using T = typename T1::Storage;
  float sc = p.scale * dot;
  if (p.softcap != 0.0f) sc = p.softcap * tanhf(sc / p.softcap);
  if (p.mask_rank) {
    const int64_t plane = p.mask_rank == 3 ? head * p.tokens : 0;
    const int64_t at = (plane + token) * p.mask_cols + col;
    sc = sc + ElemToFloat<T1>(mem.template Load<T>(kAMask, at * int64_t(sizeof(T))));
  }
  if (p.alibi) {
    const float slope = BitsFloat(static_cast<uint32_t>(IndexWord(mem, SlopesAt(p) + head)));
    sc = sc + slope * static_cast<float>(distance);
  }
  return sc;
}

// The factor a part's sums enter a combination with the largest max `top`: exp(m - top), 1 where they are equal
// (both -inf too: nothing but -inf scores so far), NaN where either is NaN (the row is NaN, as in one pass).
KV_HD float RescaleFactor(float m, float top) { return m == top ? 1.0f : expf(m - top); }

// Eight (or n < 8) elements d0.. of a row, as floats, from T1 storage at element offset `elem` of `buf`. Not
// KeyValueCache's LoadEight: that one converts float16 portably, keeping NaN payloads for its bit-exact copies;
// attention shows no payload, so the GPU's conversion instruction does here.
template <class T1, class Mem>
KV_HD void LoadRowT1(const AttnParams& p, Mem& mem, int buf, int64_t elem, int64_t d0, int64_t n,
                     float (&v)[kSliceElems]) {
  using T = typename T1::Storage;
  const ABuf b = static_cast<ABuf>(buf);
  if (p.vector_rows && n == kSliceElems) {
    for (int k = 0; k < int(kSliceElems * sizeof(T) / 16); ++k) {
      const Vec16 w = mem.template Load<Vec16>(b, (elem + d0) * int64_t(sizeof(T)) + 16 * k);
      for (int i = 0; i < 4; ++i) {
        if constexpr (sizeof(T) == 2) {
          v[8 * k + 2 * i] = ElemToFloat<T1>(static_cast<uint16_t>(w.w[i] & 0xffffu));
          v[8 * k + 2 * i + 1] = ElemToFloat<T1>(static_cast<uint16_t>(w.w[i] >> 16));
        } else {
          v[4 * k + i] = BitsFloat(w.w[i]);
        }
      }
    }
    return;
  }
  for (int64_t e = 0; e < kSliceElems; ++e)
    v[e] = e < n ? ElemToFloat<T1>(mem.template Load<T>(b, (elem + d0 + e) * int64_t(sizeof(T)))) : 0.0f;
}

// Tile record `index` of kATiles (the tile kernel's first, then the decode kernel's, then the tensor-core kernel's).
template <class Mem>
KV_HD Tile TileAt(Mem& mem, int64_t index) {
  auto word = [&](int64_t k) { return mem.template Load<int64_t>(kATiles, 8 * (index * kTileWords + k)); };
  return Tile{word(0), word(1), word(2), word(3), word(4), word(5), word(6), word(7)};
}

// Sequence b of the call: its first query token and query rows, its first key column and keys, whether it is causal.
struct SeqSpan {
  int64_t seq0, S, col0, K;
  bool causal;
};
template <class Mem>
KV_HD SeqSpan SeqAt(const AttnParams& p, Mem& mem, int64_t b) {
  const int64_t seq0 = IndexWord(mem, b), col0 = IndexWord(mem, KvstartsAt(p) + b);
  return SeqSpan{seq0, IndexWord(mem, b + 1) - seq0, col0, IndexWord(mem, KvstartsAt(p) + b + 1) - col0,
                 IndexWord(mem, CausalAt(p) + b) != 0};
}

// Where a key or value row starts: the element offset of its first element and, quantized, of its first scale.
struct RowAt {
  int64_t elem, scale;
};

// MultiHeadAttention's keys and values: packed rows [kv_tokens, Hkv, Dh] of T1.
template <class T1>
struct PackedRows {
  static constexpr bool kStoredAsT1 = true;  // LoadVec16 copies eight elements as they are
  static constexpr int kQBits = 0;
  using Scale = T1;  // no scales (named so the kernels compile one body for every kind of rows)
  // Where key (and value) j of the sequence whose first key is col0 lies: its token.
  template <class Mem>
  KV_HD int64_t Where(const AttnParams&, Mem&, int64_t, int64_t col0, int64_t j) const {
    return col0 + j;
  }
  KV_HD RowAt At(const AttnParams& p, int, int64_t g, int64_t token) const {
    return RowAt{(token * p.kv_heads + g) * p.head_dim, 0};
  }
  KV_HD ABuf BufferOf(int kv) const { return kv ? kAValue : kAKey; }  // the buffer of a key (0) or value (1) row
  template <class Mem>
  KV_HD void Load(const AttnParams& p, Mem& mem, int kv, const RowAt& r, int64_t d0, int64_t n,
                  float (&v)[kSliceElems]) const {
    LoadRowT1<T1>(p, mem, kv ? kAValue : kAKey, r.elem, d0, n, v);
  }
  // Eight elements [d0, d0 + 8) of a 16-byte aligned row, as stored (16 bytes of float16 / bfloat16).
  template <class Mem>
  KV_HD Vec16 LoadVec16(Mem& mem, int kv, const RowAt& r, int64_t d0) const {
    return mem.template Load<Vec16>(kv ? kAValue : kAKey, (r.elem + d0) * int64_t(sizeof(typename T1::Storage)));
  }
};

// Eight elements of a quantized row from their codes (a word of LoadEightCodes) and their group's scale, exactly as
// KeyValueCache's gather gives them: each code times the scale, rounded once to float, then to T1.
template <int QBits, class T1>
KV_HD void DequantizeEight(uint64_t word, float scale, float (&v)[kVec]) {
  int32_t code[kVec];
  UnpackEightCodes<QBits>(word, code);
  for (int e = 0; e < kVec; ++e) v[e] = RoundToT1<T1>(ProductRn(static_cast<float>(code[e]), scale));
}

// MultiHeadCacheAttention's keys and values, read in place from the cache: key j of sequence b is position j, at
// its slot (offset or paged); quantized rows dequantized exactly as KeyValueCache's gather gives them.
template <class T1, class T3, int QBits>
struct CacheRows {
  static constexpr bool kStoredAsT1 = QBits == 0;
  static constexpr int kQBits = QBits;  // 0: rows of T1; 8 or 4: codes, with a scale of T3 per quant_group elements
  using Scale = T3;
  // Where key (and value) j of sequence b lies: its slot.
  template <class Mem>
  KV_HD int64_t Where(const AttnParams& p, Mem& mem, int64_t b, int64_t, int64_t j) const {
    if (p.cache_mode == 0) return IndexWord(mem, CachestartsAt(p) + b) + j;
    // A 64-bit division is a long instruction sequence on the GPU; keys and page sizes almost always fit 32 bits.
    const bool narrow = (j >> 31) == 0 && (p.page_size >> 31) == 0;
    const int64_t page = narrow ? int32_t(j) / int32_t(p.page_size) : j / p.page_size;
    return IndexWord(mem, CachestartsAt(p) + b * p.max_p + page) + (j - page * p.page_size);
  }
  KV_HD RowAt At(const AttnParams& p, int kv, int64_t g, int64_t slot) const {
    return RowAt{p.cache_rows.layer * p.layer_idx + p.cache_rows.kv * kv + p.cache_rows.head * g +
                     p.cache_rows.slot * slot,
                 p.scale_rows.layer * p.layer_idx + p.scale_rows.kv * kv + p.scale_rows.head * g +
                     p.scale_rows.slot * slot};
  }
  KV_HD ABuf BufferOf(int) const { return kACache; }  // the buffer of a key or value row
  template <class Mem>
  KV_HD void Load(const AttnParams& p, Mem& mem, int, const RowAt& r, int64_t d0, int64_t n,
                  float (&v)[kSliceElems]) const {
    if constexpr (QBits == 0) {
      LoadRowT1<T1>(p, mem, kACache, r.elem, d0, n, v);
    } else {
      using S = typename T3::Storage;
      // Element and group indices within a row fit in 32 bits (head_dim <= kMaxCudaHeadDim): cheaper divisions.
      const int32_t group_size = static_cast<int32_t>(p.quant_group);
      if (p.vector_rows && n == kSliceElems) {  // 8 codes of one group: one load, one scale
        const int64_t group = static_cast<int32_t>(d0) / group_size;
        const float s = T3::ToFloat(mem.template Load<S>(kAScale, (r.scale + group) * int64_t(sizeof(S))));
        DequantizeEight<QBits, T1>(LoadEightCodes<QBits>(mem, r.elem + d0, kACache), s, v);
        return;
      }
      for (int64_t e = 0; e < kSliceElems; ++e) {
        if (e >= n) {
          v[e] = 0.0f;
          continue;
        }
        const int32_t d = static_cast<int32_t>(d0 + e);
        const float s = T3::ToFloat(mem.template Load<S>(kAScale, (r.scale + d / group_size) * int64_t(sizeof(S))));
        v[e] = RoundToT1<T1>(ProductRn(static_cast<float>(Codes<QBits>::Get(mem, r.elem + d, kACache)), s));
      }
    }
  }
  template <class Mem>
  KV_HD Vec16 LoadVec16(Mem& mem, int, const RowAt& r, int64_t d0) const {
    return mem.template Load<Vec16>(kACache, (r.elem + d0) * int64_t(sizeof(typename T1::Storage)));
  }
};

// Everything block `tile_index` of the attention launch does, over its team of kAttnThreads threads.
template <class T1, class Rows, class Team, class Mem>
KV_HD void AttentionTile(const AttnParams& p, const Rows& rows_of, Mem& mem, Team& team, int64_t tile_index) {
  using T = typename T1::Storage;
  constexpr int64_t NT = kAttnThreads;
  const Tile tile = TileAt(mem, tile_index);
  const int64_t b = tile.b, row0 = tile.row0, rows = tile.rows, head0 = tile.head0, heads = tile.heads,
                key0 = tile.key0, key1 = tile.key1, partial = tile.partial;
  const int64_t D = p.head_dim, H = p.num_heads, Q = rows * heads, slices = p.slices;
  // The value phase: threads own (key group, group of kVectorGroup query vectors, slice); `groups` key groups
  // (>= 1: the planner's tiles fit) share the chunk's keys.
  const int64_t vector_groups = (Q + kVectorGroup - 1) / kVectorGroup, lanes = vector_groups * slices;
  const int64_t groups = NT / lanes;
  const SeqSpan seq = SeqAt(p, mem, b);
  const int64_t seq0 = seq.seq0, S = seq.S, col0 = seq.col0, K = seq.K;
  const bool causal = seq.causal;
  const int64_t g = head0 / p.group;
  // Query vector qi (< kMaxTileQueries) is head head_of(qi) of row row_of(qi); its visible keys are in shared memory.
  auto row_of = [&](int64_t qi) { return row0 + static_cast<int32_t>(qi) / static_cast<int32_t>(heads); };
  auto head_of = [&](int64_t qi) { return head0 + static_cast<int32_t>(qi) % static_cast<int32_t>(heads); };
  auto visible = [&](int64_t qi, int64_t j) {
    return j >= mem.template Load<int64_t>(kAShared, 8 * (kSmemVisible / 2 + 2 * qi)) &&
           j < mem.template Load<int64_t>(kAShared, 8 * (kSmemVisible / 2 + 2 * qi + 1));
  };

  team.Each([&](int64_t t, AttnThread& s) {
    for (int64_t i = t; i < Q * D; i += NT) {
      const int64_t qi = i / D, d = i % D;
      const int64_t at = ((seq0 + row_of(qi)) * H + head_of(qi)) * D + d;
      SharedPut(mem, kSmemQueries + i, ElemToFloat<T1>(mem.template Load<T>(kAQuery, at * int64_t(sizeof(T)))));
    }
    if (t < Q) {
      SharedPut(mem, kSmemMax + t, MinusInf());
      int64_t lo, hi;
      VisibleKeys(p.sliding_window, causal, S, K, row_of(t), &lo, &hi);
      mem.template Store<int64_t>(kAShared, 8 * (kSmemVisible / 2 + 2 * t), lo);
      mem.template Store<int64_t>(kAShared, 8 * (kSmemVisible / 2 + 2 * t + 1), hi);
    }
    for (int64_t c = 0; c < kVectorGroup; ++c) {
      for (int64_t e = 0; e < kSliceElems; ++e) s.acc[c][e] = 0.0f;
      s.weights[c] = 0.0f;
    }
  });
  team.Sync();

  const int64_t parts = NT / Q;  // threads reducing one query vector's chunk max
  for (int64_t c0 = key0; c0 < key1; c0 += NT) {
    const int64_t n = key1 - c0 < NT ? key1 - c0 : NT;
    team.Each([&](int64_t t, AttnThread&) {  // scores of key c0 + t
      if (t >= n) return;
      const int64_t j = c0 + t;
      const int64_t where = rows_of.Where(p, mem, b, col0, j);
      mem.template Store<int64_t>(kAShared, 8 * (kSmemRows / 2 + t), where);  // for the value phase
      const RowAt row = rows_of.At(p, 0, g, where);
      float dot[kMaxTileQueries];
      KV_UNROLL
      for (int64_t qi = 0; qi < kMaxTileQueries; ++qi) dot[qi] = 0.0f;
      // kKeyLoads slices of the row loaded before any is used: that many reads in flight per thread.
      for (int64_t d0 = 0; d0 < D; d0 += kKeyLoads * kSliceElems) {
        float k[kKeyLoads][kSliceElems];
        KV_UNROLL
        for (int64_t u = 0; u < kKeyLoads; ++u) {
          const int64_t at = d0 + u * kSliceElems, m = D - at < kSliceElems ? D - at : kSliceElems;
          if (m > 0) rows_of.Load(p, mem, 0, row, at, m, k[u]);
        }
        KV_UNROLL
        for (int64_t u = 0; u < kKeyLoads; ++u) {
          const int64_t at = d0 + u * kSliceElems, m = D - at < kSliceElems ? D - at : kSliceElems;
          KV_UNROLL
          for (int64_t qi = 0; qi < kMaxTileQueries; ++qi) {
            if (qi >= Q || m <= 0) continue;
            float q[kSliceElems];
            if (m == kSliceElems && D % 4 == 0) {  // 16-byte aligned shared words
              SharedFour(mem, kSmemQueries + qi * D + at, q);
              SharedFour(mem, kSmemQueries + qi * D + at + 4, q + 4);
            } else {
              for (int64_t e = 0; e < kSliceElems; ++e)
                q[e] = e < m ? SharedAt(mem, kSmemQueries + qi * D + at + e) : 0.0f;
            }
            for (int64_t e = 0; e < kSliceElems; ++e) dot[qi] += q[e] * k[u][e];
          }
        }
      }
      KV_UNROLL
      for (int64_t qi = 0; qi < kMaxTileQueries; ++qi) {
        if (qi >= Q) continue;
        const float sc = visible(qi, j) ? ScoreOf<T1>(p, mem, dot[qi], head_of(qi), seq0 + row_of(qi), col0 + j,
                                                      j - (K - S + row_of(qi)))
                                        : MinusInf();
        SharedPut(mem, kSmemScores + qi * NT + t, sc);
      }
    });
    team.Sync();
    team.Each([&](int64_t t, AttnThread&) {  // partial maxima
      if (t >= Q * parts) return;
      const int64_t qi = t / parts;
      float m = MinusInf();
      for (int64_t k = t % parts; k < n; k += parts) m = MaxStep(m, SharedAt(mem, kSmemScores + qi * NT + k));
      SharedPut(mem, kSmemReduce + t, m);
    });
    team.Sync();
    team.Each([&](int64_t t, AttnThread&) {  // the running max, and the factor the sums so far are rescaled by
      if (t >= Q) return;
      const float old = SharedAt(mem, kSmemMax + t);
      float m = old;
      for (int64_t k = 0; k < parts; ++k) m = MaxStep(m, SharedAt(mem, kSmemReduce + t * parts + k));
      SharedPut(mem, kSmemMax + t, m);
      SharedPut(mem, kSmemRescale + t, RescaleFactor(old, m));  // 0 after -inf; NaN for a NaN max
    });
    team.Sync();
    team.Each([&](int64_t t, AttnThread&) {  // the chunk's weights, once per (query vector, key), in place
      if (t >= n) return;
      for (int64_t qi = 0; qi < Q; ++qi) {
        const float m = SharedAt(mem, kSmemMax + qi), sc = SharedAt(mem, kSmemScores + qi * NT + t);
        // Hidden keys never enter, whatever their values hold (kHidden); nothing but -inf so far: weight 0, which
        // still lets a non-finite value through.
        const float w = !visible(qi, c0 + t) ? kHidden : m == MinusInf() ? 0.0f : expf(sc - m);
        SharedPut(mem, kSmemScores + qi * NT + t, w);
      }
    });
    team.Sync();
    team.Each([&](int64_t t, AttnThread& s) {  // the value rows into the sums
      if (t >= groups * lanes) return;
      const int64_t kg = t / lanes, q0 = (t % lanes) / slices * kVectorGroup, d0 = (t % slices) * kSliceElems;
      const int64_t width = D - d0 < kSliceElems ? D - d0 : kSliceElems;
      KV_UNROLL
      for (int64_t c = 0; c < kVectorGroup; ++c) {
        const float f = q0 + c < Q ? SharedAt(mem, kSmemRescale + q0 + c) : 1.0f;
        if (f != 1.0f) {
          for (int64_t e = 0; e < kSliceElems; ++e) s.acc[c][e] *= f;
          s.weights[c] *= f;
        }
      }
      // kValueLoads keys at a time: their rows read before any is used.
      for (int64_t k0 = kg; k0 < n; k0 += kValueLoads * groups) {
        float w[kValueLoads][kVectorGroup], v[kValueLoads][kSliceElems];
        KV_UNROLL
        for (int64_t u = 0; u < kValueLoads; ++u) {
          const int64_t k = k0 + u * groups;
          bool any = false;
          KV_UNROLL
          for (int64_t c = 0; c < kVectorGroup; ++c) {
            w[u][c] = k < n && q0 + c < Q ? SharedAt(mem, kSmemScores + (q0 + c) * NT + k) : kHidden;
            any = any || w[u][c] != kHidden;
          }
          if (any) {
            const int64_t where = mem.template Load<int64_t>(kAShared, 8 * (kSmemRows / 2 + k));
            rows_of.Load(p, mem, 1, rows_of.At(p, 1, g, where), d0, width, v[u]);
          }
        }
        KV_UNROLL
        for (int64_t u = 0; u < kValueLoads; ++u) {
          KV_UNROLL
          for (int64_t c = 0; c < kVectorGroup; ++c) {
            if (w[u][c] != kHidden) {  // hidden keys never enter, whatever their values hold
              s.weights[c] += w[u][c];
              for (int64_t e = 0; e < kSliceElems; ++e) s.acc[c][e] += w[u][c] * v[u][e];
            }
          }
        }
      }
    });
    team.Sync();
  }

  // The key groups' sums added pairwise (a tree of log2(groups) steps) into group 0, through the scores' words
  // (free now: groups / 2 x Q x Dh <= threads x kMaxTileQueries words) and the reduction's (groups / 2 x Q <=
  // 2 x threads words: groups <= threads / ceil(Q / 4)).
  for (int64_t step = 1; step < groups; step *= 2) {
    team.Each([&](int64_t t, AttnThread& s) {
      const int64_t kg = t / lanes;
      if (t >= groups * lanes || kg % (2 * step) != step) return;
      const int64_t q0 = (t % lanes) / slices * kVectorGroup, d0 = (t % slices) * kSliceElems, slot = kg / (2 * step);
      for (int64_t c = 0; c < kVectorGroup && q0 + c < Q; ++c) {
        for (int64_t e = 0; e < kSliceElems && d0 + e < D; ++e)
          SharedPut(mem, kSmemScores + (slot * Q + q0 + c) * D + d0 + e, s.acc[c][e]);
        if (d0 == 0) SharedPut(mem, kSmemReduce + slot * Q + q0 + c, s.weights[c]);
      }
    });
    team.Sync();
    team.Each([&](int64_t t, AttnThread& s) {
      const int64_t kg = t / lanes;
      if (t >= groups * lanes || kg % (2 * step) != 0 || kg + step >= groups) return;
      const int64_t q0 = (t % lanes) / slices * kVectorGroup, d0 = (t % slices) * kSliceElems, slot = kg / (2 * step);
      for (int64_t c = 0; c < kVectorGroup && q0 + c < Q; ++c) {
        for (int64_t e = 0; e < kSliceElems && d0 + e < D; ++e)
          s.acc[c][e] += SharedAt(mem, kSmemScores + (slot * Q + q0 + c) * D + d0 + e);
        s.weights[c] += SharedAt(mem, kSmemReduce + slot * Q + q0 + c);
      }
    });
    team.Sync();
  }
  team.Each([&](int64_t t, AttnThread& s) {  // group 0: the output rows, or the part's records
    if (t >= lanes) return;
    const int64_t q0 = t / slices * kVectorGroup, d0 = (t % slices) * kSliceElems;
    for (int64_t c = 0; c < kVectorGroup && q0 + c < Q; ++c) {
      const int64_t qi = q0 + c;
      const float m = SharedAt(mem, kSmemMax + qi);
      if (partial >= 0) {
        const int64_t record = (partial + qi) * (D + 2);
        if (d0 == 0) {
          mem.template Store<float>(kAPartials, 4 * record, m);
          mem.template Store<float>(kAPartials, 4 * (record + 1), s.weights[c]);
        }
        for (int64_t e = 0; e < kSliceElems && d0 + e < D; ++e)
          mem.template Store<float>(kAPartials, 4 * (record + 2 + d0 + e), s.acc[c][e]);
        continue;
      }
      const int64_t at = ((seq0 + row_of(qi)) * H + head_of(qi)) * D + d0;
      for (int64_t e = 0; e < kSliceElems && d0 + e < D; ++e) {
        const float o = m == MinusInf() ? 0.0f : s.acc[c][e] / s.weights[c];
        mem.template Store<T>(kAOut, (at + e) * int64_t(sizeof(T)), SaturatingFromFloat<T1>(o));
      }
    }
  });
}

// Parts of one query vector's attention (each its max, weight sum and output sum) combined by log-sum-exp: each
// part's sums rescaled by RescaleFactor(its max, the largest). A part whose scores are all -inf enters with factor 0
// (exp(-inf - top)): its sums are 0, but a non-finite value under a -inf score still makes the row NaN, as in one
// pass; a NaN or +inf max makes the output NaN.
struct Combined {
  float top, total, acc;
  // The output element: the sums' ratio, or exactly 0 where no key has a score above -inf.
  KV_HD float Output() const { return top == MinusInf() ? 0.0f : acc / total; }
};
// part(k, 0): part k's max; part(k, 1): its weight sum; part(k, 2): its output sum (of the element combined).
template <class Part>
KV_HD Combined CombineParts(int64_t parts, Part&& part) {
  Combined c{MinusInf(), 0.0f, 0.0f};
  for (int64_t k = 0; k < parts; ++k) c.top = MaxStep(c.top, part(k, 0));
  for (int64_t k = 0; k < parts; ++k) {
    const float f = RescaleFactor(part(k, 0), c.top);
    c.total += f * part(k, 1);
    c.acc += f * part(k, 2);
  }
  return c;
}

// Thread `thread` of merge block `merge_index`: output elements thread, thread + kAttnThreads, ... of the merge's
// query vectors, from its parts' records: each part's sum and output rescaled by exp(its max - the overall max).
// A NaN or +inf max makes the output NaN (as in one pass), a part whose scores are all -inf enters with factor 0
// (a NaN it summed still shows), and no part seeing a key leaves the row zero.
template <class T1, class Mem>
KV_HD void MergeThread(const AttnParams& p, Mem& mem, int64_t merge_index, int64_t thread) {
  using T = typename T1::Storage;
  auto word = [&](int64_t k) {
    return mem.template Load<int64_t>(kATiles,
                                      8 * ((p.tiles + p.decode_tiles + p.mma_tiles) * kTileWords +
                                         merge_index * kMergeWords + k));
  };
  const int64_t b = word(0), row0 = word(1), rows = word(2), head0 = word(3), heads = word(4), first = word(5),
                parts = word(6);
  const int64_t D = p.head_dim, H = p.num_heads, Q = rows * heads, seq0 = IndexWord(mem, b);
  auto rec = [&](int64_t part, int64_t qi, int64_t k) {
    return mem.template Load<float>(kAPartials, 4 * ((first + part * Q + qi) * (D + 2) + k));
  };
  for (int64_t i = thread; i < Q * D; i += kAttnThreads) {
    const int64_t qi = i / D, d = i % D;
    const Combined c = CombineParts(parts, [&](int64_t k, int64_t field) { return rec(k, qi, field < 2 ? field : 2 + d); });
    const int64_t at = ((seq0 + row0 + qi / heads) * H + head0 + qi % heads) * D + d;
    mem.template Store<T>(kAOut, at * int64_t(sizeof(T)), SaturatingFromFloat<T1>(c.Output()));
  }
}

}  // namespace cuda
}  // namespace kvcache
