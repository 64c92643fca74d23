// MultiHeadAttention on the CPU: the shared attention kernel (attention_kernel.h) over keys and values from the
// op's packed key and value inputs. Built once per instruction set like kv_cpu.cc (KV_CPU_ISA names the
// namespace; kv_cpu_dispatch.cc picks the build). Each build is deterministic; builds may differ in the
// summation order of dot products, within the spec's tolerance.
#include "mha_cpu.h"

#include <vector>

#include "attention_kernel.h"

namespace kvcache {
namespace KV_CPU_ISA {
namespace {

// Keys and values from the packed inputs: token kvstarts[b] + j of sequence b, kv heads [kv0, kv1) (contiguous
// in a token's row).
template <class T1>
struct PackedSource {
  using T = typename T1::Storage;
  using ScaleType = T1;  // no codes: rows are read as stored
  static constexpr int kQuantBits = 0;
  const MhaPlan& p;
  const T* key;
  const T* value;
  int64_t head_dim;

  struct Reader {
    const T* base;   // row j at base + j * stride
    int64_t stride;  // elements between consecutive tokens (kv_heads * head_dim)
    int64_t width;
    std::vector<float> row;
    // float32 rows are read in place; other types converted into `row`.
    const float* Row(int64_t j) {
      if constexpr (T1::kElem == Elem::kFloat32) return base + j * stride;
      ToFloatRow<T1>(base + j * stride, row.data(), width);
      return row.data();
    }
    void CopyRow(int64_t j, float* dst) const { ToFloatRow<T1>(base + j * stride, dst, width); }
    // The decode path's addressing: key j is at "slot" j of a sequential input, which the hardware prefetchers
    // follow by themselves.
    void Slots(int64_t lo, int64_t hi, int64_t* slots) const {
      for (int64_t j = lo; j < hi; ++j) slots[j - lo] = j;
    }
    void Prefetch(int64_t) const {}
    const T* RawAt(int64_t j) const { return base + j * stride; }
    void RawRows(const int64_t* slots, int64_t n, const T** rows) const {
      for (int64_t i = 0; i < n; ++i) rows[i] = base + slots[i] * stride;
    }
  };
  bool HeadsTogether() const { return true; }
  bool KeyValueTogether() const { return false; }
  Reader Open(int kv, int64_t b, int64_t kv0, int64_t kv1) const {
    const int64_t stride = p.kv_heads * head_dim, width = (kv1 - kv0) * head_dim;
    const T* base = (kv ? value : key) + p.kvstarts[b] * stride + kv0 * head_dim;
    return Reader{base, stride, width, std::vector<float>(T1::kElem == Elem::kFloat32 ? 0 : size_t(width))};
  }
};

template <class T1>
void Launch(const MhaArgs& args, const ParallelFor& parallel_for) {
  using T = typename T1::Storage;
  const PackedSource<T1> source{*args.plan, static_cast<const T*>(args.key), static_cast<const T*>(args.value),
                                args.attrs->head_dim};
  AttentionKernel<T1, PackedSource<T1>>{*args.attrs, *args.plan, source, args.query, args.mask, args.out}.Run(
      parallel_for);
}

}  // namespace

void MhaComputeCpu(const MhaArgs& args, const ParallelFor& parallel_for) {
  switch (static_cast<Elem>(args.t)) {
    case Elem::kFloat32: return Launch<F32>(args, parallel_for);
    case Elem::kFloat16: return Launch<F16>(args, parallel_for);
    default: return Launch<BF16>(args, parallel_for);
  }
}

}  // namespace KV_CPU_ISA
}  // namespace kvcache
