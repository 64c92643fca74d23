// Host-side validation of a MultiHeadAttention call: every condition of spec/MultiHeadAttention.md
// "Validity", in its order, before the output is written. Messages match the numpy reference's.
#pragma once

#include <cstdint>
#include <vector>

#include "kv_validate.h"

namespace kvcache {

constexpr size_t kMhaNumInputs = 9;  // query, key, value, seqstarts, kvstarts, decoding_batches, max_seqlen,
                                     // max_kvlen, attn_mask (optional)
constexpr size_t kMhaMaskInput = 8;

struct MhaAttrs {
  int64_t num_heads = 0, head_dim = 0;  // required: 0 is refused
  int64_t is_causal = 1, is_alibi = 0, num_kv_heads = 0, sliding_window = 0;
  float softmax_scale = 0.0f;  // 0: 1 / sqrt(head_dim)
  float softcap = 0.0f;        // extension: scores capped as softcap * tanh(s / softcap); 0 off
  int64_t KvHeads() const { return num_kv_heads ? num_kv_heads : num_heads; }
};

// Throws KvError for an attribute value the spec does not allow.
void CheckMhaAttrs(const MhaAttrs& a);

// ALiBi slope of head h of num_heads (spec: 2^(-8(h+1)/p), then 2^(-4(2(h-p)+1)/p) past the largest power
// of two p <= num_heads), a float64 power rounded once to float32. Computed per head: an empty query may
// name any num_heads, so nothing is ever sized by it.
float AlibiSlope(int64_t h, int64_t num_heads);

// Everything the kernel needs about a validated call. The index inputs are owned copies, taken before any
// of their values is checked (spec: index inputs are read once).
struct MhaPlan {
  int64_t batch = 0, tokens = 0, kv_tokens = 0;
  int64_t kv_heads = 0, group = 1;  // query head h reads kv head h / group
  int64_t mask_rank = 0;            // 0 (no attn_mask), 2 or 3
  int64_t mask_cols = 0;            // attn_mask's last dim (>= kv_tokens)
  float scale = 0.0f;               // the score scale
  std::vector<int64_t> seqstarts, kvstarts;  // [B+1]
  std::vector<uint8_t> causal;               // [B]: is_causal, seqlen > 1 and b >= decoding_batches
};

// inputs: the op's 9 inputs in order (attn_mask may be absent). Throws KvError; returns the plan.
MhaPlan ValidateAttention(const MhaAttrs& a, const TensorArg* inputs);

}  // namespace kvcache
