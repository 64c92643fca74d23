// Kernels of KeyValueCache. Arithmetic is the spec's: float32, the stored scale used to quantize,
// round to nearest even everywhere, no contraction (built with -fmad=false, no fast math). The
// conversions and quantization helpers are the same functions the CPU kernel uses.
#include "kv_cache_impl.cuh"

#include "kv_quant.h"
#include "kv_types.h"

namespace kvcache {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kTokensPerBlock = 8;
constexpr int kVec = 8;  // elements per thread unit when Dh % 8 == 0 (16-byte fp16 accesses)

// pos is unsigned: start_pos[b] + i may exceed INT64_MAX; the page index and the slot fit (validated).
__device__ __forceinline__ int64_t SlotOf(const Params& p, int64_t b, uint64_t pos) {
  if (p.cache_mode == 0) return p.cachestarts[b] + static_cast<int64_t>(pos);
  const uint64_t page_size = static_cast<uint64_t>(p.page_size);
  return p.cachestarts[b * p.max_p + static_cast<int64_t>(pos / page_size)] + static_cast<int64_t>(pos % page_size);
}

template <int QBits>
struct Codes;
template <>
struct Codes<8> {
  static constexpr float kMax = 127.0f;
  __device__ static int32_t Get(const void* cache, int64_t elem) { return static_cast<const int8_t*>(cache)[elem]; }
  // Writes codes[0..n) at element elem (n even for int4; any n here).
  __device__ static void Put(void* cache, int64_t elem, const int32_t* codes, int64_t n) {
    for (int64_t i = 0; i < n; ++i) static_cast<int8_t*>(cache)[elem + i] = static_cast<int8_t>(codes[i]);
  }
};
template <>
struct Codes<4> {
  static constexpr float kMax = 7.0f;
  __device__ static int32_t Get(const void* cache, int64_t elem) {
    const uint8_t byte = static_cast<const uint8_t*>(cache)[elem / 2];
    return (elem & 1) ? Int4High(byte) : Int4Low(byte);
  }
  __device__ static void Put(void* cache, int64_t elem, const int32_t* codes, int64_t n) {  // elem, n even
    for (int64_t i = 0; i < n; i += 2) static_cast<uint8_t*>(cache)[(elem + i) / 2] = Int4Pack(codes[i], codes[i + 1]);
  }
};

template <class T1>
__device__ __forceinline__ void CopyUnit(const typename T1::Storage* src, typename T1::Storage* dst, int n) {
  using T = typename T1::Storage;
  if (n == kVec && (kVec * sizeof(T)) % 16 == 0) {
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
#pragma unroll
    for (int k = 0; k < int(kVec * sizeof(T) / 16); ++k) d[k] = s[k];
    return;
  }
  for (int i = 0; i < n; ++i) dst[i] = src[i];
}

// One block: kTokensPerBlock tokens of sequence blockIdx.y. A thread unit is `unit` elements of one
// (token, kv, head) row; with quantization a unit is whole groups (pairs of groups for odd int4 groups,
// so no two threads share a packed byte).
template <class T1, class T3, int QBits>
__global__ void StoreKernel(Params p, int64_t unit) {
  using T = typename T1::Storage;
  const int64_t b = blockIdx.y;
  const int64_t begin = p.seqstarts[b], seqlen = p.seqstarts[b + 1] - begin;
  const int64_t units = p.head_dim / unit;
  const int64_t work = kTokensPerBlock * 2 * p.heads * units;
  for (int64_t w = threadIdx.x; w < work; w += blockDim.x) {
    const int64_t u = w % units;
    int64_t rest = w / units;
    const int64_t h = rest % p.heads;
    rest /= p.heads;
    const int kv = static_cast<int>(rest % 2);
    const int64_t i = blockIdx.x * kTokensPerBlock + rest / 2;
    if (i >= seqlen) continue;
    const int64_t slot = SlotOf(p, b, static_cast<uint64_t>(p.start_pos[b]) + static_cast<uint64_t>(i));
    const T* src = static_cast<const T*>(kv ? p.value : p.key) + ((begin + i) * p.heads + h) * p.head_dim + u * unit;
    const int64_t row = p.cache_rows.layer * p.layer_idx + p.cache_rows.kv * kv + p.cache_rows.head * h +
                        p.cache_rows.slot * slot;
    if constexpr (QBits == 0) {
      CopyUnit<T1>(src, static_cast<T*>(p.cache) + row + u * unit, static_cast<int>(unit));
    } else {
      const int64_t n = p.quant_group;
      const int64_t srow = p.scale_rows.layer * p.layer_idx + p.scale_rows.kv * kv + p.scale_rows.head * h +
                           p.scale_rows.slot * slot;
      auto* scale = static_cast<typename T3::Storage*>(p.scale) + srow + (u * unit) / n;
      int32_t codes[2];  // written two at a time (int4 bytes)
      int filled = 0;
      for (int64_t g = 0; g < unit / n; ++g) {
        float amax = 0.0f;
        for (int64_t e = 0; e < n; ++e) amax = AbsMaxStep(amax, T1::ToFloat(src[g * n + e]));
        const auto stored = T3::FromFloat(GroupScale(amax, Codes<QBits>::kMax));
        scale[g] = stored;
        const float s = T3::ToFloat(stored);
        for (int64_t e = 0; e < n; ++e) {
          codes[filled++] = QuantizeValue(T1::ToFloat(src[g * n + e]), s, Codes<QBits>::kMax);
          if (filled == 2) {
            Codes<QBits>::Put(p.cache, row + u * unit + g * n + e - 1, codes, 2);
            filled = 0;
          }
        }
      }
      if (filled) Codes<QBits>::Put(p.cache, row + u * unit + unit - 1, codes, 1);  // int8 with odd unit
    }
  }
}

// One block: kTokensPerBlock output rows of sequence blockIdx.y; a thread unit is `unit` elements of one
// (row, kv, output head) — consecutive threads write consecutive 16-byte pieces of the output.
template <class T1, class T3, int QBits>
__global__ void GatherKernel(Params p, int64_t unit) {
  using T = typename T1::Storage;
  const int64_t b = blockIdx.y;
  const int64_t begin = p.kvstarts[b], kvlen = p.kvstarts[b + 1] - begin;
  const int64_t out_heads = p.out_heads;
  const int64_t units = p.head_dim / unit;
  const int64_t work = kTokensPerBlock * 2 * out_heads * units;
  for (int64_t w = threadIdx.x; w < work; w += blockDim.x) {
    const int64_t u = w % units;
    int64_t rest = w / units;
    const int64_t j = rest % out_heads;
    rest /= out_heads;
    const int kv = static_cast<int>(rest % 2);
    const int64_t t = blockIdx.x * kTokensPerBlock + rest / 2;
    if (t >= kvlen) continue;
    const int64_t h = j / p.num_repeat;
    const int64_t slot = SlotOf(p, b, static_cast<uint64_t>(t));
    const int64_t row = p.cache_rows.layer * p.layer_idx + p.cache_rows.kv * kv + p.cache_rows.head * h +
                        p.cache_rows.slot * slot;
    T* dst = static_cast<T*>(kv ? p.out_value : p.out_key) + ((begin + t) * out_heads + j) * p.head_dim + u * unit;
    if constexpr (QBits == 0) {
      CopyUnit<T1>(static_cast<const T*>(p.cache) + row + u * unit, dst, static_cast<int>(unit));
    } else {
      const int64_t srow = p.scale_rows.layer * p.layer_idx + p.scale_rows.kv * kv + p.scale_rows.head * h +
                           p.scale_rows.slot * slot;
      const auto* scale = static_cast<const typename T3::Storage*>(p.scale) + srow;
      alignas(16) T out[kVec];
      for (int64_t e = 0; e < unit; ++e) {
        const int64_t d = u * unit + e;
        const float v = __fmul_rn(static_cast<float>(Codes<QBits>::Get(p.cache, row + d)),
                                  T3::ToFloat(scale[d / p.quant_group]));
        out[e] = T1::FromFloat(v);
      }
      CopyUnit<T1>(out, dst, static_cast<int>(unit));
    }
  }
}

template <class T1, class T3, int QBits>
cudaError_t Launch(const Params& p, cudaStream_t stream) {
  // Thread units: 8 elements when Dh allows (vector accesses); quantized stores work in whole groups.
  const int64_t gather_unit = p.head_dim % kVec == 0 ? kVec : 1;
  int64_t store_unit = gather_unit;
  if (QBits != 0) store_unit = (QBits == 4 && p.quant_group % 2) ? 2 * p.quant_group : p.quant_group;
  if (p.batch > 0 && p.max_seqlen > 0) {
    const dim3 grid(static_cast<unsigned>((p.max_seqlen + kTokensPerBlock - 1) / kTokensPerBlock),
                    static_cast<unsigned>(p.batch));
    StoreKernel<T1, T3, QBits><<<grid, kThreads, 0, stream>>>(p, store_unit);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  if (p.batch > 0 && p.max_kvlen > 0) {
    const dim3 grid(static_cast<unsigned>((p.max_kvlen + kTokensPerBlock - 1) / kTokensPerBlock),
                    static_cast<unsigned>(p.batch));
    GatherKernel<T1, T3, QBits><<<grid, kThreads, 0, stream>>>(p, gather_unit);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

template <class T1>
cudaError_t DispatchQuant(const Params& p, int32_t scale_type, int quant_bit, cudaStream_t stream) {
  const bool f16_scale = scale_type == int32_t(Elem::kFloat16);
  switch (quant_bit) {
    case 0: return Launch<T1, F32, 0>(p, stream);
    case 8: return f16_scale ? Launch<T1, F16, 8>(p, stream) : Launch<T1, F32, 8>(p, stream);
    default: return f16_scale ? Launch<T1, F16, 4>(p, stream) : Launch<T1, F32, 4>(p, stream);
  }
}

}  // namespace

cudaError_t LaunchKeyValueCache(const Params& p, int32_t t1, int32_t scale_type, int quant_bit, cudaStream_t stream) {
  switch (static_cast<Elem>(t1)) {
    case Elem::kFloat32: return DispatchQuant<F32>(p, scale_type, quant_bit, stream);
    case Elem::kFloat16: return DispatchQuant<F16>(p, scale_type, quant_bit, stream);
    default: return DispatchQuant<BF16>(p, scale_type, quant_bit, stream);
  }
}

}  // namespace cuda
}  // namespace kvcache
