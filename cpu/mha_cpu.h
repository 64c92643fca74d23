// CPU compute of a validated MultiHeadAttention call: one task per (sequence, query head), float32
// accumulation, max-subtracted softmax, memory per task O(kvlen * head_dim) (no batch-wide mask or scores).
#pragma once

#include "kv_cpu.h"
#include "mha_validate.h"

namespace kvcache {

struct MhaArgs {
  const MhaAttrs* attrs;
  const MhaPlan* plan;
  int32_t t;          // element type of query, key, value, attn_mask and the output
  const void* query;  // [tokens, num_heads, head_dim]
  const void* key;    // [kv_tokens, kv_heads, head_dim]
  const void* value;  // [kv_tokens, kv_heads, head_dim]
  const void* mask;   // [num_heads, tokens, mask_cols] or [tokens, mask_cols]; nullptr when absent
  void* out;          // [tokens, num_heads, head_dim]
};

// Writes every row of the output (zeros for rows that see no key). The plan must come from
// ValidateAttention on the same inputs. Runs the best build the library has and the processor runs, as
// ComputeCpu does.
void MhaComputeCpu(const MhaArgs& args, const ParallelFor& parallel_for);

}  // namespace kvcache
