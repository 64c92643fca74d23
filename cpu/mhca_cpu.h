// CPU compute of a validated MultiHeadCacheAttention call: this step's keys and values stored into the cache
// (KeyValueCache's stores, bit for bit), then the attention reading every sequence's keys and values in place
// from the cache, dequantized row by row, never gathered into a packed copy.
#pragma once

#include "kv_cpu.h"
#include "mhca_validate.h"

namespace kvcache {

struct MhcaArgs {
  const MhcaAttrs* attrs;
  const MhcaPlan* plan;
  int32_t t1;          // element type of query, current_key/value, attn_mask and the output
  int32_t scale_type;  // element type of scale (quant_bit != 0)
  const void* query;   // [tokens, num_heads, head_dim]
  const void* key;     // [tokens, kv_heads, head_dim]
  const void* value;   // [tokens, kv_heads, head_dim]
  void* cache;         // written in place
  void* scale;         // written in place; nullptr without quantization
  const void* mask;    // nullptr when absent
  void* out;           // [tokens, num_heads, head_dim]
};

// Stores, then attends. The plan must come from ValidateCacheAttention on the same inputs. Picks the best
// build as MhaComputeCpu does.
void MhcaComputeCpu(const MhcaArgs& args, const ParallelFor& parallel_for);

}  // namespace kvcache
