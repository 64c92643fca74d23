#include "kv_cpu.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "kv_cpu_rows.h"
#include "kv_quant.h"
#include "kv_types.h"

// Built once per instruction set; KV_CPU_ISA names the namespace (see kv_cpu_dispatch.cc).
namespace kvcache {
namespace KV_CPU_ISA {
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
  // int8 codes are used where they lie.
  static const int8_t* ReadInt8(const int8_t* row, int8_t*, int64_t) { return row; }
};
template <>
struct Codes<4> {
  static constexpr float kMax = 7.0f;
  static uint8_t* Row(void* cache, int64_t elem) { return static_cast<uint8_t*>(cache) + elem / 2; }  // Dh even
  static void Write(uint8_t* row, const int32_t* codes, int64_t n) {
    for (int64_t i = 0; i < n / 2; ++i) row[i] = Int4Pack(codes[2 * i], codes[2 * i + 1]);
  }
  static const int8_t* ReadInt8(const uint8_t* row, int8_t* codes, int64_t n) {
    for (int64_t i = 0; i < n / 2; ++i) {
      codes[2 * i] = static_cast<int8_t>(Int4Low(row[i]));
      codes[2 * i + 1] = static_cast<int8_t>(Int4High(row[i]));
    }
    return codes;
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
  bool stream;  // streaming stores for outputs too large to stay in cache

  // cache rows of this call's layer, kv half `kv`
  int64_t CacheRow(int kv, int64_t h, int64_t slot) const { return p.cache_rows.Row(a.layer_idx, kv, h, slot); }
  int64_t ScaleRow(int kv, int64_t h, int64_t slot) const { return p.scale_rows.Row(a.layer_idx, kv, h, slot); }

  void StoreRows(int64_t row_begin, int64_t row_end) const {
    const int64_t H = p.heads, D = p.head_dim;
    std::vector<float> x(D);
    std::vector<int32_t> codes(D);
    int64_t b = SequenceOf(p.seqstarts.data(), p.batch, row_begin);
    for (int64_t r = row_begin; r < row_end; ++r) {
      while (r >= p.seqstarts[b + 1]) ++b;
      // start_pos >= 0 (validated); the sum may exceed INT64_MAX but not UINT64_MAX.
      const uint64_t pos = static_cast<uint64_t>(p.start_pos[b]) + static_cast<uint64_t>(r - p.seqstarts[b]);
      const int64_t slot = SlotOf(p, a, b, pos);
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
    ToFloatRow<T1>(src, x, D);
    for (int64_t g = 0; g < p.groups; ++g) {
      const auto stored = T3::FromFloat(GroupScale(GroupAbsMax(x + g * n, n), Codes<QBits>::kMax));
      scale[g] = stored;
      QuantizeGroup(x + g * n, T3::ToFloat(stored), Codes<QBits>::kMax, codes + g * n, n);
    }
    Codes<QBits>::Write(Codes<QBits>::Row(args.cache, cache_row), codes, D);
  }

  // Per-task scratch for the dequantized rows.
  struct Scratch {
    std::vector<int8_t> codes;
    std::vector<float> scales;
    std::vector<T> row;
  };

  void GatherRows(int64_t row_begin, int64_t row_end) const {
    const int64_t H = p.heads, D = p.head_dim, R = a.num_repeat;
    // Layouts 0-2 keep a slot's H heads contiguous: one copy per token when nothing is repeated.
    const bool whole_token = QBits == 0 && R == 1 && p.cache_rows.head == D;
    Scratch scratch{std::vector<int8_t>(D), std::vector<float>(p.groups), std::vector<T>(D)};
    int64_t b = SequenceOf(p.kvstarts.data(), p.batch, row_begin);
    for (int64_t r = row_begin; r < row_end; ++r) {
      while (r >= p.kvstarts[b + 1]) ++b;
      const int64_t slot = SlotOf(p, a, b, static_cast<uint64_t>(r - p.kvstarts[b]));
      for (int kv = 0; kv < 2; ++kv) {
        T* out = static_cast<T*>(kv ? args.out_value : args.out_key) + r * p.out_heads * D;
        if (whole_token) {
          StoreRow(out, static_cast<const T*>(args.cache) + CacheRow(kv, 0, slot), H * D * sizeof(T), stream);
          continue;
        }
        for (int64_t h = 0; h < H; ++h) {
          const T* row;
          if constexpr (QBits == 0) {
            row = static_cast<const T*>(args.cache) + CacheRow(kv, h, slot);
          } else {
            Dequantize(CacheRow(kv, h, slot), ScaleRow(kv, h, slot), scratch);
            row = scratch.row.data();
          }
          for (int64_t k = 0; k < R; ++k) StoreRow(out + (h * R + k) * D, row, D * sizeof(T), stream);
        }
      }
    }
    StoreFence();
  }

  void Dequantize(int64_t cache_row, int64_t scale_row, Scratch& s) const {
    ToFloatRow<T3>(static_cast<const typename T3::Storage*>(args.scale) + scale_row, s.scales.data(), p.groups);
    const int8_t* codes = Codes<QBits>::ReadInt8(Codes<QBits>::Row(args.cache, cache_row), s.codes.data(), p.head_dim);
    DequantizeRow<T1>(codes, s.scales.data(), a.quant_group, s.row.data(), p.head_dim);
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

// Outputs (key + value) above this size are written with streaming stores.
constexpr int64_t kStreamOutputBytes = int64_t{32} << 20;

template <class T1, class T3, int QBits>
void Launch(const ComputeArgs& args, const ParallelFor& parallel_for) {
  const CallPlan& p = *args.plan;  // p.out_bytes: one output's size, checked by ValidateCall
  Kernel<T1, T3, QBits>{args, *args.attrs, p, p.out_bytes > kStreamOutputBytes / 2}.Run(parallel_for);
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

}  // namespace KV_CPU_ISA
}  // namespace kvcache
