#include "kv_cpu.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "kv_quant.h"
#include "kv_types.h"

namespace kvcache {
namespace {

constexpr int64_t kRowsPerTask = 64;  // tokens per parallel task: large enough to amortize scheduling

// Code storage per quant_bit: how a row of Dh codes is read and written.
template <int QBits>
struct Codes;
template <>
struct Codes<8> {
  static constexpr float kMax = 127.0f;
  static int8_t* Row(void* cache, int64_t elem) { return static_cast<int8_t*>(cache) + elem; }
  static void Write(int8_t* row, const int32_t* codes, int64_t n) {
    for (int64_t i = 0; i < n; ++i) row[i] = static_cast<int8_t>(codes[i]);
  }
  static void Read(const int8_t* row, int32_t* codes, int64_t n) {
    for (int64_t i = 0; i < n; ++i) codes[i] = row[i];
  }
};
template <>
struct Codes<4> {
  static constexpr float kMax = 7.0f;
  static uint8_t* Row(void* cache, int64_t elem) { return static_cast<uint8_t*>(cache) + elem / 2; }  // Dh even
  static void Write(uint8_t* row, const int32_t* codes, int64_t n) {
    for (int64_t i = 0; i < n / 2; ++i) row[i] = Int4Pack(codes[2 * i], codes[2 * i + 1]);
  }
  static void Read(const uint8_t* row, int32_t* codes, int64_t n) {
    for (int64_t i = 0; i < n / 2; ++i) {
      codes[2 * i] = Int4Low(row[i]);
      codes[2 * i + 1] = Int4High(row[i]);
    }
  }
};

// Sequence of a row in a starts vector (the last b with starts[b] <= row, skipping empty sequences).
int64_t SequenceOf(const int64_t* starts, int64_t batch, int64_t row) {
  return static_cast<int64_t>(std::upper_bound(starts + 1, starts + batch + 1, row) - (starts + 1));
}

template <class T1, class T3, int QBits>
struct Kernel {
  using T = typename T1::Storage;
  const ComputeArgs& args;
  const Attrs& a;
  const CallPlan& p;

  // cache rows of this call's layer, kv half `kv`
  int64_t CacheRow(int kv, int64_t h, int64_t slot) const { return p.cache_rows.Row(a.layer_idx, kv, h, slot); }
  int64_t ScaleRow(int kv, int64_t h, int64_t slot) const { return p.scale_rows.Row(a.layer_idx, kv, h, slot); }

  void StoreRows(int64_t row_begin, int64_t row_end) const {
    const int64_t H = p.heads, D = p.head_dim;
    std::vector<float> x(D);
    std::vector<int32_t> codes(D);
    int64_t b = SequenceOf(p.seqstarts, p.batch, row_begin);
    for (int64_t r = row_begin; r < row_end; ++r) {
      while (r >= p.seqstarts[b + 1]) ++b;
      const int64_t slot = SlotOf(p, a, b, p.start_pos[b] + (r - p.seqstarts[b]));
      for (int kv = 0; kv < 2; ++kv) {
        const T* src = static_cast<const T*>(kv ? args.value : args.key) + r * H * D;
        for (int64_t h = 0; h < H; ++h) {
          if constexpr (QBits == 0) {
            std::memcpy(static_cast<T*>(args.cache) + CacheRow(kv, h, slot), src + h * D, D * sizeof(T));
          } else {
            StoreQuantized(src + h * D, CacheRow(kv, h, slot), ScaleRow(kv, h, slot), x.data(), codes.data());
          }
        }
      }
    }
  }

  void StoreQuantized(const T* src, int64_t cache_row, int64_t scale_row, float* x, int32_t* codes) const {
    const int64_t D = p.head_dim, n = a.quant_group;
    auto* scale = static_cast<typename T3::Storage*>(args.scale) + scale_row;
    for (int64_t d = 0; d < D; ++d) x[d] = T1::ToFloat(src[d]);
    for (int64_t g = 0; g < p.groups; ++g) {
      float amax = 0.0f;
      for (int64_t e = 0; e < n; ++e) amax = AbsMaxStep(amax, x[g * n + e]);
      const auto stored = T3::FromFloat(GroupScale(amax, Codes<QBits>::kMax));
      scale[g] = stored;
      const float s = T3::ToFloat(stored);
      for (int64_t e = 0; e < n; ++e) codes[g * n + e] = QuantizeValue(x[g * n + e], s, Codes<QBits>::kMax);
    }
    Codes<QBits>::Write(Codes<QBits>::Row(args.cache, cache_row), codes, D);
  }

  void GatherRows(int64_t row_begin, int64_t row_end) const {
    const int64_t H = p.heads, D = p.head_dim, R = a.num_repeat;
    // Layouts 0-2 keep a slot's H heads contiguous: one copy per token when nothing is repeated.
    const bool whole_token = QBits == 0 && R == 1 && p.cache_rows.head == D;
    std::vector<int32_t> codes(D);
    int64_t b = SequenceOf(p.kvstarts, p.batch, row_begin);
    for (int64_t r = row_begin; r < row_end; ++r) {
      while (r >= p.kvstarts[b + 1]) ++b;
      const int64_t slot = SlotOf(p, a, b, r - p.kvstarts[b]);
      for (int kv = 0; kv < 2; ++kv) {
        T* out = static_cast<T*>(kv ? args.out_value : args.out_key) + r * H * R * D;
        if (whole_token) {
          std::memcpy(out, static_cast<const T*>(args.cache) + CacheRow(kv, 0, slot), H * D * sizeof(T));
          continue;
        }
        for (int64_t h = 0; h < H; ++h) {
          T* dst = out + h * R * D;
          if constexpr (QBits == 0) {
            std::memcpy(dst, static_cast<const T*>(args.cache) + CacheRow(kv, h, slot), D * sizeof(T));
          } else {
            Dequantize(CacheRow(kv, h, slot), ScaleRow(kv, h, slot), dst, codes.data());
          }
          for (int64_t k = 1; k < R; ++k) std::memcpy(dst + k * D, dst, D * sizeof(T));
        }
      }
    }
  }

  void Dequantize(int64_t cache_row, int64_t scale_row, T* dst, int32_t* codes) const {
    const int64_t n = a.quant_group;
    const auto* scale = static_cast<const typename T3::Storage*>(args.scale) + scale_row;
    Codes<QBits>::Read(Codes<QBits>::Row(args.cache, cache_row), codes, p.head_dim);
    for (int64_t g = 0; g < p.groups; ++g) {
      const float s = T3::ToFloat(scale[g]);
      for (int64_t e = 0; e < n; ++e) dst[g * n + e] = T1::FromFloat(static_cast<float>(codes[g * n + e]) * s);
    }
  }

  void Run(const ParallelFor& parallel_for) const {
    const int64_t store_tasks = (p.tokens + kRowsPerTask - 1) / kRowsPerTask;
    parallel_for(store_tasks, [this](size_t i) {
      StoreRows(int64_t(i) * kRowsPerTask, std::min(p.tokens, int64_t(i + 1) * kRowsPerTask));
    });
    const int64_t gather_tasks = (p.kv_tokens + kRowsPerTask - 1) / kRowsPerTask;
    parallel_for(gather_tasks, [this](size_t i) {
      GatherRows(int64_t(i) * kRowsPerTask, std::min(p.kv_tokens, int64_t(i + 1) * kRowsPerTask));
    });
  }
};

template <class T1, class T3, int QBits>
void Launch(const ComputeArgs& args, const ParallelFor& parallel_for) {
  Kernel<T1, T3, QBits>{args, *args.attrs, *args.plan}.Run(parallel_for);
}

template <class T1>
void DispatchQuant(const ComputeArgs& args, const ParallelFor& pf) {
  const bool f16_scale = args.scale_type == int32_t(Elem::kFloat16);
  switch (args.attrs->quant_bit) {
    case 0: return Launch<T1, F32, 0>(args, pf);
    case 8: return f16_scale ? Launch<T1, F16, 8>(args, pf) : Launch<T1, F32, 8>(args, pf);
    default: return f16_scale ? Launch<T1, F16, 4>(args, pf) : Launch<T1, F32, 4>(args, pf);
  }
}

}  // namespace

void ComputeCpu(const ComputeArgs& args, const ParallelFor& parallel_for) {
  switch (static_cast<Elem>(args.t1)) {
    case Elem::kFloat32: return DispatchQuant<F32>(args, parallel_for);
    case Elem::kFloat16: return DispatchQuant<F16>(args, parallel_for);
    default: return DispatchQuant<BF16>(args, parallel_for);
  }
}

}  // namespace kvcache
