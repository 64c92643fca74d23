// Runs a validated KeyValueCache (or KeyCacheRotaryShift) call on the GPU: launch limits, one
// host-to-device copy of the index snapshots into scratch, the kernels — all on the caller's stream.
// Shared by the ONNX Runtime CUDA kernel and the C entry points, so all launch exactly the same way.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "attention_params.h"
#include "kv_cuda_params.h"
#include "kv_validate.h"
#include "mhca_validate.h"
#include "rotary_shift.h"

namespace kvcache {
namespace cuda {

// Device scratch in stream order: Alloc's memory may be used by work enqueued on the stream afterwards,
// and Free may be called as soon as that work is enqueued (no other stream may have the block before that work is
// done: the CUDA runtime's cudaMallocAsync / cudaFreeAsync, ONNX Runtime's scratch tied to its compute stream).
struct DeviceScratch {
  virtual void* Alloc(size_t bytes) = 0;
  virtual void Free(void* data) = 0;
  virtual ~DeviceScratch() = default;
};

// Throws KvError (op names the op) when `stream` is being captured into a CUDA graph, before anything is enqueued:
// every call copies its validated plan (index snapshots, tiles) from host memory and sizes its launches by it, so a
// pageable copy cannot be captured, and a graph replayed on the next step would store to the captured step's slots.
// Each Run*Validated below calls it after its host-side checks (alignment, launch limits: refused by name without a
// GPU) and before its first CUDA call.
void RefuseGraphCapture(cudaStream_t stream, const char* op);

// Throws KvError when the call cannot be launched (CheckLaunchable) and std::runtime_error for a CUDA
// failure. `plan` must come from ValidateCall on the call whose device buffers are `t`; `t1` and
// `scale_type` are the ONNX types of current_key and scale. Returns after enqueueing, without waiting.
void RunValidated(const Attrs& a, const CallPlan& plan, int32_t t1, int32_t scale_type, const DeviceTensors& t,
                  cudaStream_t stream, DeviceScratch& scratch);

// The same for KeyCacheRotaryShift: `plan` from ValidateRotaryShift on the call whose device cache and
// scale (null without quantization) are given; cache_type / scale_type are their ONNX types. `slots_out`, when not
// null, is device memory that receives the slots as given (the CUDA EP's output), copied before the rotation: a copy
// that failed after it would fail the call with the cache already rotated.
void RunRotaryValidated(const RotaryAttrs& a, const RotaryPlan& plan, int32_t cache_type, int32_t scale_type,
                        void* cache, void* scale, cudaStream_t stream, DeviceScratch& scratch,
                        int64_t* slots_out = nullptr);

// MultiHeadAttention: `plan` from ValidateAttention on the call whose device buffers are `t` (key and value set,
// cache and scale null); t is the ONNX type of query. Throws KvError before anything is enqueued when the call
// cannot be launched (PlanAttention), std::runtime_error for a CUDA failure.
void RunAttentionValidated(const MhaAttrs& a, const MhaPlan& plan, int32_t t, const AttnTensors& tensors,
                           cudaStream_t stream, DeviceScratch& scratch);

// MultiHeadCacheAttention: KeyValueCache's stores of current_key / current_value (`key`, `value`) into the cache,
// then the attention reading the cache in place. `plan` from ValidateCacheAttention; `tensors` name the query,
// cache, scale (null without quantization), attn_mask and output. Both launches are planned and checked before
// either is enqueued.
void RunCacheAttentionValidated(const MhcaAttrs& a, const MhcaPlan& plan, int32_t t1, int32_t scale_type,
                                const void* key, const void* value, const AttnTensors& tensors, cudaStream_t stream,
                                DeviceScratch& scratch);

}  // namespace cuda
}  // namespace kvcache
