// The attention kernels of MultiHeadAttention and MultiHeadCacheAttention: thin wrappers that hand a block's team
// (this thread and its registers) and its shared memory to the work of attention_work.h, and LaunchRows, which
// launches them for one element type and one kind of key rows. Included only by the instance files CMakeLists.txt
// generates from attention_instance.cu.in, one per element type and row kind, so the kernels compile in parallel
// (one file of all of them took minutes alone on one core). Built with fused multiply-adds: the spec leaves the
// order and rounding of the sums free within its tolerance (only the dequantization is an exact product, ProductRn).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <type_traits>

#include "attention_decode.h"
#include "attention_decode_staged.h"
#include "attention_instances.cuh"
#include "attention_mma.h"
#include "attention_mma_regs.h"
#include "attention_work.h"
#include "launch_errors.h"

namespace kvcache {
namespace cuda {
namespace {

// Global buffers at params.ptr, shared memory at `shared`.
struct AttnDeviceMem {
  const AttnParams& p;
  float* shared;
  __device__ __forceinline__ char* Base(ABuf buf) const {
    return buf == kAShared ? reinterpret_cast<char*>(shared) : static_cast<char*>(p.ptr[buf]);
  }
  template <class T>
  __device__ __forceinline__ T Load(ABuf buf, int64_t offset) const {
    return *reinterpret_cast<const T*>(Base(buf) + offset);
  }
  template <class T>
  __device__ __forceinline__ void Store(ABuf buf, int64_t offset, T value) const {
    *reinterpret_cast<T*>(Base(buf) + offset) = value;
  }
};

// The tensor cores' element type of a T1.
template <class T1>
struct WmmaElem;
template <>
struct WmmaElem<F16> {
  using type = __half;
};
template <>
struct WmmaElem<BF16> {
  using type = __nv_bfloat16;
};

// This thread of the block: Each runs its part of a phase, Sync is the block's barrier, Butterfly exchanges
// registers within the warp (every thread of the block calls it, so every lane of a warp takes part), SyncOr is the
// barrier that votes, MatMul is this thread's lane of its warp's matrix product (attention_mma.h's WarpProduct).
template <class State>
struct DeviceTeam {
  int64_t thread;
  State state;
  template <class F>
  __device__ __forceinline__ void Each(F&& f) {
    f(thread, state);
  }
  __device__ __forceinline__ void Sync() { __syncthreads(); }
  template <class Get, class Op>
  __device__ __forceinline__ void Butterfly(int64_t lo, int64_t hi, Get&& get, Op&& op) {
    auto& a = get(state);
    constexpr int n = std::extent<std::remove_reference_t<decltype(a)>>::value;
    for (int mask = static_cast<int>(lo); mask < hi; mask *= 2) {
      KV_UNROLL
      for (int i = 0; i < n; ++i) a[i] = op(a[i], __shfl_xor_sync(0xffffffffu, a[i], mask));
    }
  }
  // One m16n8k16 product of the warp: c += a b on the fragments get_a(state) (4 words), get_b(state) (2 words),
  // get_c(state) (4 floats).
  template <class T1, class GetA, class GetB, class GetC>
  __device__ __forceinline__ void Mma(GetA&& get_a, GetB&& get_b, GetC&& get_c) {
#if __CUDA_ARCH__ >= 800
    const uint32_t(&a)[4] = get_a(state);
    const uint32_t(&b)[2] = get_b(state);
    float(&c)[4] = get_c(state);
    if constexpr (T1::kElem == Elem::kFloat16) {
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                   "{%0,%1,%2,%3};"
                   : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    } else {
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                   "{%0,%1,%2,%3};"
                   : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
#else
    __trap();
#endif
  }
  // The warp's ldmatrix: Count (2 or 4) 8 x 8 matrices of 16-bit elements read from shared memory. Lane l gives
  // row_byte(thread, state), the shared byte of row l % 8 of matrix l / 8 (16-byte aligned; lanes from 8 Count on
  // give none that is read), and receives in get_r(state)[m] its word of matrix m: row l / 4, columns 2 (l % 4) and
  // 2 (l % 4) + 1 (lower first), or with Trans the same of the matrix transposed (column l / 4, rows 2 (l % 4) and
  // 2 (l % 4) + 1): the words mma.sync's fragments hold.
  template <int Count, bool Trans, class RowByte, class GetR>
  __device__ __forceinline__ void LoadMatrix(AttnDeviceMem& mem, RowByte&& row_byte, GetR&& get_r) {
    static_assert(Count == 2 || Count == 4, "ldmatrix takes 2 or 4 matrices here");
#if __CUDA_ARCH__ >= 750
    uint32_t(&r)[4] = get_r(state);
    const unsigned at =
        static_cast<unsigned>(__cvta_generic_to_shared(mem.Base(kAShared) + row_byte(thread, state)));
    if constexpr (Count == 4 && Trans)
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                   : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(at) : "memory");
    else if constexpr (Count == 4)
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                   : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(at) : "memory");
    else if constexpr (Trans)
      asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];"
                   : "=r"(r[0]), "=r"(r[1]) : "r"(at) : "memory");
    else
      asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];"
                   : "=r"(r[0]), "=r"(r[1]) : "r"(at) : "memory");
#else
    __trap();
#endif
  }
  // This thread's asynchronous copy of 16 bytes at `byte` of `buf` to `shared_byte` of shared memory (both 16-byte
  // aligned); Commit closes this thread's group of copies; WaitSync<N> waits until at most its N latest groups are
  // in flight, then is the block's barrier (so every thread's landed copies are seen). Below sm_80 (no cp.async)
  // the copy is made at once.
  __device__ __forceinline__ void CopyAsync16(AttnDeviceMem& mem, int64_t shared_byte, ABuf buf, int64_t byte) {
    const char* from = mem.Base(buf) + byte;
    char* to = mem.Base(kAShared) + shared_byte;
#if __CUDA_ARCH__ >= 800
    const unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(to));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(at), "l"(from) : "memory");
#else
    *reinterpret_cast<uint4*>(to) = *reinterpret_cast<const uint4*>(from);
#endif
  }
  __device__ __forceinline__ void Commit() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
  }
  template <int N>
  __device__ __forceinline__ void WaitSync() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
    __syncthreads();
  }
  template <class Get>
  __device__ __forceinline__ bool SyncOr(Get&& get) {
    return __syncthreads_or(get(state) != 0) != 0;
  }
  template <class T1, bool BCols, bool Accumulate>
  __device__ __forceinline__ void MatMul(AttnDeviceMem& mem, const WarpProduct& m) {
#if __CUDA_ARCH__ >= 800  // bfloat16 fragments are sm_80's; the planner sends no tile here below sm_80
    namespace wmma = nvcuda::wmma;
    using E = typename WmmaElem<T1>::type;
    using BLayout = std::conditional_t<BCols, wmma::col_major, wmma::row_major>;
    constexpr int F = kMmaFrag, depth = kMmaMaxProductDepth / kMmaFrag;
    const int64_t warp = thread / kWarp;
    char* base = mem.Base(kAShared);
    const E* a = reinterpret_cast<const E*>(base + m.a + warp * m.a_warp);
    const E* b = reinterpret_cast<const E*>(base + m.b);
    float* c = reinterpret_cast<float*>(base + m.c + warp * m.c_warp);
    const unsigned lda = static_cast<unsigned>(m.lda), ldb = static_cast<unsigned>(m.ldb),
                   ldc = static_cast<unsigned>(m.ldc);
    wmma::fragment<wmma::matrix_a, F, F, F, E, wmma::row_major> af[depth];  // A's fragments, loaded once
    KV_UNROLL
    for (int i = 0; i < depth; ++i)
      if (i * F < m.k) wmma::load_matrix_sync(af[i], a + i * F, lda);
    for (int64_t j = 0; j < m.n; j += F) {
      wmma::fragment<wmma::accumulator, F, F, F, float> acc;
      if constexpr (Accumulate)
        wmma::load_matrix_sync(acc, c + j, ldc, wmma::mem_row_major);
      else
        wmma::fill_fragment(acc, 0.0f);
      KV_UNROLL
      for (int i = 0; i < depth; ++i) {
        if (i * F >= m.k) continue;
        wmma::fragment<wmma::matrix_b, F, F, F, E, BLayout> bf;
        wmma::load_matrix_sync(bf, BCols ? b + j * ldb + i * F : b + int64_t(i) * F * ldb + j, ldb);
        wmma::mma_sync(acc, af[i], bf, acc);
      }
      wmma::store_matrix_sync(c + j, acc, ldc, wmma::mem_row_major);
    }
#else
    __trap();
#endif
  }
};

template <class T1, class Rows>
__global__ void __launch_bounds__(kAttnThreads, 2) TileKernel(AttnParams p) {
  __shared__ __align__(16) float shared[kSharedWords];  // 16-byte and int64 accesses
  AttnDeviceMem mem{p, shared};
  DeviceTeam<AttnThread> team{threadIdx.x, {}};
  AttentionTile<T1>(p, Rows{}, mem, team, blockIdx.x);
}

template <class T1, class Rows>
__global__ void __launch_bounds__(kDecodeThreads, 4) DecodeKernel(AttnParams p) {
  __shared__ __align__(16) float shared[kDecodeSharedWords];
  AttnDeviceMem mem{p, shared};
  DeviceTeam<DecodeThread> team{threadIdx.x, {}};
  DecodeTile<T1>(p, Rows{}, mem, team, blockIdx.x);
}

// Six blocks a multiprocessor for float16 rows (80 registers); codes take four (dequantizing needs up to 128
// registers: at five blocks' 96, int8 rows spill 64 bytes, checked with -Xptxas -v for sm_90). The second form
// (Heads: every head's query slice and sums in each thread) takes four too, up to 128 registers.
template <class T1, class Rows, bool Heads>
__global__ void __launch_bounds__(kStagedThreads, Heads || Rows::kQBits ? 4 : 6) StagedDecodeKernel(AttnParams p) {
  __shared__ __align__(16) float shared[kStagedSharedWords];
  AttnDeviceMem mem{p, shared};
  if constexpr (Heads) {
    DeviceTeam<StagedHeadsThread> team{threadIdx.x, {}};
    StagedHeadsTile<T1>(p, Rows{}, mem, team, blockIdx.x);
  } else {
    DeviceTeam<StagedThread> team{threadIdx.x, {}};
    StagedDecodeTile<T1>(p, Rows{}, mem, team, blockIdx.x);
  }
}

template <class T1, class Rows>
__global__ void __launch_bounds__(kMmaThreads, 2) MmaKernel(AttnParams p) {
  extern __shared__ __align__(128) float mma_shared[];  // kMmaSharedBytes, above the 48 KB of a static array
  AttnDeviceMem mem{p, mma_shared};
  DeviceTeam<MmaThread> team{threadIdx.x, {}};
  MmaTile<T1>(p, Rows{}, mem, team, blockIdx.x);
}

template <class T1, class Rows>
__global__ void __launch_bounds__(kMmaThreads, 2) MmaRegKernel(AttnParams p) {
  extern __shared__ __align__(128) float mma_reg_shared[];  // kMmaRegSharedBytes
  AttnDeviceMem mem{p, mma_reg_shared};
  DeviceTeam<MmaRegThread> team{threadIdx.x, {}};
  MmaRegTile<T1>(p, Rows{}, mem, team, blockIdx.x);
}

template <class T1>
__global__ void __launch_bounds__(kAttnThreads) MergeKernel(AttnParams p) {
  AttnDeviceMem mem{p, nullptr};
  MergeThread<T1>(p, mem, blockIdx.x, threadIdx.x);
}

}  // namespace

// The tensor-core kernel of a call's tiles in its form, and the dynamic shared memory it asks for; no kernel for rows
// that have none in that form (the planner gives float32 calls no tensor-core tiles, and quantized rows the first
// form only). The second form is instantiated for rows stored as T1 only: for every kind of rows it took the
// kernels minutes longer to compile.
struct MmaLaunch {
  void (*kernel)(AttnParams) = nullptr;
  int64_t bytes = 0;
};

// LaunchRows, MmaLaunchOf and MmaPtxVersionOf reach the kernels of the including file's anonymous namespace
// (kernels of internal linkage: each generated file registers its own). So each of their specializations is
// instantiated in exactly one file, its attention_instance.cu.in instance, and no two files define the same one.
template <class T1, class Rows>
MmaLaunch MmaLaunchOf(const AttnParams& p) {
  if constexpr (sizeof(typename T1::Storage) == 2) {
    if (p.mma_form != 2) return {MmaKernel<T1, Rows>, kMmaSharedBytes};
    if constexpr (Rows::kStoredAsT1) return {MmaRegKernel<T1, Rows>, kMmaRegSharedBytes};
  }
  return {};
}

template <class T1, class Rows>
cudaError_t LaunchRows(const AttnParams& p, cudaStream_t stream, AttnStep step) {
  const MmaLaunch mma = p.mma_tiles > 0 ? MmaLaunchOf<T1, Rows>(p) : MmaLaunch{};
  if (p.mma_tiles > 0 && mma.kernel == nullptr) return cudaErrorInvalidValue;
  if (step == AttnStep::kPrepare) {
    // Granted on every call: the attribute is per device, and a call is cheap beside a prefill.
    if (mma.kernel == nullptr) return cudaSuccess;
    const cudaError_t e =
        cudaFuncSetAttribute(mma.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(mma.bytes));
    if (e != cudaSuccess) DropError();
    return e;
  }
  // Grid sizes were checked on the host (PlanAttention): below 2^31 blocks each.
  if (p.tiles > 0)
    if (cudaError_t e = Launched([&] {
          TileKernel<T1, Rows><<<static_cast<unsigned>(p.tiles), kAttnThreads, 0, stream>>>(p);
        });
        e != cudaSuccess)
      return e;
  if (p.decode_tiles > 0 && (p.decode_form == 2 || p.decode_form == 3)) {
    if constexpr (kStagedRows<T1, Rows>) {
      if (cudaError_t e = Launched([&] {
            const unsigned blocks = static_cast<unsigned>(p.decode_tiles);
            if (p.decode_form == 3)
              StagedDecodeKernel<T1, Rows, true><<<blocks, kStagedThreads, 0, stream>>>(p);
            else
              StagedDecodeKernel<T1, Rows, false><<<blocks, kStagedThreads, 0, stream>>>(p);
          });
          e != cudaSuccess)
        return e;
    } else {
      return cudaErrorInvalidValue;  // the planner gives these rows the first form (StagedRowsFit)
    }
  } else if (p.decode_tiles > 0) {
    if (cudaError_t e = Launched([&] {
          DecodeKernel<T1, Rows><<<static_cast<unsigned>(p.decode_tiles), kDecodeThreads, 0, stream>>>(p);
        });
        e != cudaSuccess)
      return e;
  }
  if (mma.kernel != nullptr)
    if (cudaError_t e = Launched([&] {
          mma.kernel<<<static_cast<unsigned>(p.mma_tiles), kMmaThreads, static_cast<size_t>(mma.bytes), stream>>>(p);
        });
        e != cudaSuccess)
      return e;
  if (p.merges > 0)
    if (cudaError_t e = Launched([&] {
          MergeKernel<T1><<<static_cast<unsigned>(p.merges), kAttnThreads, 0, stream>>>(p);
        });
        e != cudaSuccess)
      return e;
  return cudaSuccess;
}


template <class T1, class Rows>
cudaError_t MmaPtxVersionOf(int* version) {
  if constexpr (sizeof(typename T1::Storage) == 2 && Rows::kStoredAsT1) {
    cudaFuncAttributes first{}, second{};
    if (cudaError_t e = cudaFuncGetAttributes(&first, MmaKernel<T1, Rows>); e != cudaSuccess) return e;
    if (cudaError_t e = cudaFuncGetAttributes(&second, MmaRegKernel<T1, Rows>); e != cudaSuccess) return e;
    *version = first.ptxVersion < second.ptxVersion ? first.ptxVersion : second.ptxVersion;
    return cudaSuccess;
  } else {
    return cudaErrorInvalidValue;  // no tensor-core kernels for these rows
  }
}

}  // namespace cuda
}  // namespace kvcache
