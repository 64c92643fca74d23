// CUDA kernels of KeyValueCache: framework-free launchers over raw device pointers.
// The caller has validated every index on the host (kv_validate.h) before calling.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace kvcache {
namespace cuda {

struct Rows {  // element offset of (layer, kv, head, slot) rows: l*layer + kv*kv + h*head + s*slot
  int64_t layer, kv, head, slot;
};

struct Params {
  // attributes
  int64_t layer_idx, quant_group, num_repeat, cache_mode, page_size;
  int64_t out_heads;  // H * num_repeat, checked on the host to fit (as are all output offsets)
  // sizes
  int64_t batch, heads, head_dim, max_p, max_seqlen, max_kvlen;
  Rows cache_rows, scale_rows;
  // device index arrays (copies of the validated host inputs)
  const int64_t* seqstarts;    // [B+1]
  const int64_t* kvstarts;     // [B+1]
  const int64_t* start_pos;    // [B]
  const int64_t* cachestarts;  // [B] (mode 0) or [B, MaxP] (mode 1)
  // device data
  const void* key;    // [seqstarts[B], H, Dh] T1
  const void* value;  // [seqstarts[B], H, Dh] T1
  void* cache;        // rank 5 by layout: T1, int8, or packed int4
  void* scale;        // rank 5, last dim Dh / quant_group: T3 (nullptr without quantization)
  void* out_key;      // [kvstarts[B], H * num_repeat, Dh] T1
  void* out_value;    // [kvstarts[B], H * num_repeat, Dh] T1
};

// Stores then gathers on `stream`. t1 / scale_type are ONNX element types; quant_bit 0, 4 or 8.
cudaError_t LaunchKeyValueCache(const Params& params, int32_t t1, int32_t scale_type, int quant_bit,
                                cudaStream_t stream);

}  // namespace cuda
}  // namespace kvcache
