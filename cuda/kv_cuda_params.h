// From a validated call to the CUDA kernels' Params: the index snapshots packed for one host-to-device
// copy, the launch limits checked, the buffers named. Host code without CUDA headers, so the host
// runner builds exactly the Params the GPU path launches with.
#pragma once

#include <cstdint>
#include <vector>

#include "kv_cache_work.h"
#include "kv_validate.h"

namespace kvcache {
namespace cuda {

// Whether a pointer is 16-byte aligned (a 16-byte access there does not fault).
inline bool Aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// The plan's index snapshots in one array: seqstarts, kvstarts, start_pos, cachestarts.
std::vector<int64_t> PackIndices(const CallPlan& plan);

// Throws KvError when the call's grids exceed what one launch can run (B > 65535 sequences, or
// sequences of 2^34 tokens or more) or a block's work counter would not fit. Called before anything
// is written, so such a call fails with the cache unchanged.
void CheckLaunchable(const CallPlan& plan);

// The device buffers of a call (inputs 0, 1, 8, 9 and the two outputs); scale may be null.
struct DeviceTensors {
  const void* key;
  const void* value;
  void* cache;
  void* scale;
  void* out_key;
  void* out_value;
};

// Params for a validated call whose packed indices (PackIndices) are at `indices` on the device.
Params MakeParams(const Attrs& a, const CallPlan& plan, const int64_t* indices, const DeviceTensors& t);

}  // namespace cuda
}  // namespace kvcache
