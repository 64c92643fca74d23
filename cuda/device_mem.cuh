// The kernels' memory policy on the GPU: plain device memory, a buffer's base pointer (params.ptr) plus a
// byte offset. The host runner's policy traces the same accesses instead (tests/host_runner).
#pragma once

#include <cstdint>

#include "kv_cache_work.h"

namespace kvcache {
namespace cuda {

template <class P>
struct DeviceMem {
  const P& p;
  template <class T>
  __device__ __forceinline__ T Load(Buf buf, int64_t offset) const {
    return *reinterpret_cast<const T*>(static_cast<const char*>(p.ptr[buf]) + offset);
  }
  template <class T>
  __device__ __forceinline__ void Store(Buf buf, int64_t offset, T value) const {
    *reinterpret_cast<T*>(static_cast<char*>(p.ptr[buf]) + offset) = value;
  }
};

}  // namespace cuda
}  // namespace kvcache
