// MultiHeadCacheAttention's attention on the CPU for one element type T1 (MhcaAttend): the shared attention
// kernel (attention_kernel.h) reading keys and values straight from the cache. Included by the files
// CMakeLists.txt generates from mhca_cpu_instance.cc.in, one per T1, so each instruction set's build of these
// kernels compiles in three parallel parts; mhca_cpu.cc dispatches to them.
#pragma once

#include <cstring>
#include <vector>

#include "attention_kernel.h"
#include "kv_cpu_codes.h"
#include "kv_cpu_quant_rows.h"
#include "kv_cpu_type_dispatch.h"
#include "mhca_cpu_attend.h"

namespace kvcache {
namespace KV_CPU_ISA {
namespace {

// Cached keys (kv 0) and values (kv 1): key j of sequence b is position j, at slot SlotOf(b, j).
template <class T1, class T3, int QBits>
struct CacheSource {
  using T = typename T1::Storage;
  using S = typename T3::Storage;
  using C = Codes<QBits>;
  using ScaleType = T3;
  static constexpr int kQuantBits = QBits;
  const Attrs& a;
  const CallPlan& p;
  const void* cache;
  const void* scale;

  int64_t CacheRow(int kv, int64_t h, int64_t slot) const { return p.cache_rows.Row(a.layer_idx, kv, h, slot); }
  // The first of the G scales of that row.
  const S* Scales(int kv, int64_t h, int64_t slot) const {
    return static_cast<const S*>(scale) + p.scale_rows.Row(a.layer_idx, kv, h, slot);
  }
  // Whether a slot's heads lie together (layouts 0-2): a task may then read several kv heads as one row.
  bool HeadsTogether() const { return p.cache_rows.head == p.head_dim; }
  // Whether a slot's key and value rows lie together (layouts 0-1): decode then reads them key by key, one
  // stream (measured: blocks of keys, then their values, run at half the speed there).
  bool KeyValueTogether() const { return p.cache_rows.KeyValueTogether(); }

  struct Reader {
    const CacheSource& s;
    int kv;
    int64_t b, kv0, nkv;
    bool adjacent;             // the chunk's heads lie together in a slot (layouts 0-2, or one head)
    std::vector<float> row;    // a converted row
    std::vector<T> dequantized;
    std::vector<float> x, scales, sf;
    std::vector<int32_t> codes;

    // Slots of keys [lo, hi): one division per page.
    void Slots(int64_t lo, int64_t hi, int64_t* slots) const {
      ForEachSlotRun(s.p, s.a, b, static_cast<uint64_t>(lo), hi - lo, [&](int64_t i, int64_t slot, int64_t n) {
        for (int64_t k = 0; k < n; ++k) slots[i + k] = slot + k;
      });
    }
    // Asks for the rows (and scales) of `slot` ahead of their use: a sequence's rows lie on pages scattered over
    // the cache, and in layouts 0-2 a head's rows are strided, so the hardware prefetchers lose the stream.
    void Prefetch(int64_t slot) const {
      const int64_t heads = adjacent ? nkv : 1;
      for (int64_t h = 0; h < (adjacent ? 1 : nkv); ++h) {
        const int64_t offset = s.CacheRow(kv, kv0 + h, slot);
        const char* row;
        int64_t bytes;
        if constexpr (QBits == 0) {
          row = reinterpret_cast<const char*>(static_cast<const T*>(s.cache) + offset);
          bytes = heads * s.p.head_dim * int64_t(sizeof(T));
        } else {
          row = reinterpret_cast<const char*>(C::Row(s.cache, offset));
          bytes = heads * s.p.head_dim * QBits / 8;
          PrefetchBytes(s.Scales(kv, kv0 + h, slot), heads * s.p.groups * int64_t(sizeof(S)));
        }
        PrefetchBytes(row, bytes);
      }
    }
    // The chunk's heads of `slot` as T1 values into dst: copied, or dequantized exactly as KeyValueCache's gather
    // gives them.
    void FillRaw(int64_t slot, T* dst) {
      const int64_t D = s.p.head_dim;
      if constexpr (QBits == 0) {
        for (int64_t h = 0; h < nkv; ++h)
          std::memcpy(dst + h * D, static_cast<const T*>(s.cache) + s.CacheRow(kv, kv0 + h, slot),
                      static_cast<size_t>(D) * sizeof(T));
      } else {
        const RowScratch scratch{x.data(), scales.data(), codes.data(), sf.data()};
        const int64_t heads = adjacent ? nkv : 1;
        for (int64_t h = 0; h < (adjacent ? 1 : nkv); ++h) {
          const S* row_scales = s.Scales(kv, kv0 + h, slot);
          DequantizeRow<T1, T3, QBits>(C::Row(s.cache, s.CacheRow(kv, kv0 + h, slot)), row_scales, heads * D,
                                       s.a.quant_group, heads * s.p.groups, dst + h * D, scratch);
        }
      }
    }
    // The T1 rows of `n` slots (n <= kDecodeBlock): in place where a slot's heads lie together unquantized, else
    // filled into the reader's block buffer.
    void RawRows(const int64_t* slots, int64_t n, const T** rows) {
      for (int64_t i = 0; i < n; ++i) {
        if (QBits == 0 && adjacent) {
          rows[i] = static_cast<const T*>(s.cache) + s.CacheRow(kv, kv0, slots[i]);
          continue;
        }
        T* dst = &dequantized[i * nkv * s.p.head_dim];
        FillRaw(slots[i], dst);
        rows[i] = dst;
      }
    }
    // Whether the decode tiles read this reader's rows as codes, dequantized in registers (CodeRows): quantized
    // rows in groups of 8. Other group sizes are dequantized into the block buffer (RawRows).
    bool CodesInRegisters() const { return QBits != 0 && s.a.quant_group == 8; }
    // rows->codes[i] and rows->scales[i]: kv head kvh's codes and first group scale of slot slots[i], i < n.
    template <class Rows>
    void CodeRowsOf(const int64_t* slots, int64_t n, int64_t kvh, Rows* rows) const {
      for (int64_t i = 0; i < n; ++i) {
        rows->codes[i] = C::Row(s.cache, s.CacheRow(kv, kvh, slots[i]));
        rows->scales[i] = s.Scales(kv, kvh, slots[i]);
      }
    }
    const T* RawAt(int64_t slot) {
      const T* row;
      RawRows(&slot, 1, &row);
      return row;
    }
    const float* RowAt(int64_t slot) {
      if constexpr (QBits == 0 && T1::kElem == Elem::kFloat32)
        if (adjacent) return static_cast<const float*>(s.cache) + s.CacheRow(kv, kv0, slot);
      CopyRowAt(slot, row.data());
      return row.data();
    }
    // The chunk's heads of `slot` as float32: its T1 values (RawAt) converted.
    void CopyRowAt(int64_t slot, float* dst) { ToFloatRow<T1>(RawAt(slot), dst, nkv * s.p.head_dim); }
    void CopyRow(int64_t j, float* dst) { CopyRowAt(SlotOf(s.p, s.a, b, static_cast<uint64_t>(j)), dst); }
    const float* Row(int64_t j) { return RowAt(SlotOf(s.p, s.a, b, static_cast<uint64_t>(j))); }
  };

  Reader Open(int kv, int64_t b, int64_t kv0, int64_t kv1) const {
    const int64_t nkv = kv1 - kv0;
    const auto width = static_cast<size_t>(nkv * p.head_dim), groups = static_cast<size_t>(nkv * p.groups);
    const bool quantized = QBits != 0, adjacent = nkv == 1 || p.cache_rows.head == p.head_dim;
    return Reader{*this, kv, b, kv0, nkv, adjacent,
                  std::vector<float>(width),
                  std::vector<T>(quantized || !adjacent ? width * kDecodeBlock : 0),  // RawRows' block of rows
                  std::vector<float>(quantized ? width : 0),
                  std::vector<float>(quantized ? width : 0),
                  std::vector<float>(quantized ? groups + 8 : 0),
                  std::vector<int32_t>(quantized ? width : 0)};
  }
};

template <class T1, class T3, int QBits>
struct Launch {
  static void Run(const MhcaArgs& args, const ParallelFor& parallel_for) {
    const MhcaPlan& plan = *args.plan;
    const CacheSource<T1, T3, QBits> source{args.attrs->cache, plan.cache, args.cache, args.scale};
    AttentionKernel<T1, CacheSource<T1, T3, QBits>>{args.attrs->attention, plan.attention, source, args.query,
                                                    args.mask, args.out}
        .Run(parallel_for);
  }
};

}  // namespace

// Reaches the sources of the including file's anonymous namespace: each specialization is instantiated in exactly
// one file (per instruction set), its mhca_cpu_instance.cc.in instance.
template <class T1>
void MhcaAttend(const MhcaArgs& args, const ParallelFor& parallel_for) {
  DispatchQuantTypes<Launch, T1>(args.attrs->cache.quant_bit, args.scale_type, args, parallel_for);
}

}  // namespace KV_CPU_ISA
}  // namespace kvcache
