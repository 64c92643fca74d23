// The attention ops' C-entry arguments as the validators': shared by the CPU and CUDA entries (and the attention
// host runner), so every path refuses the same calls with the same messages.
#pragma once

#include "kvcache_op.h"
#include "mhca_validate.h"

namespace kvcache {

// Validates a MultiHeadAttention call and its caller-allocated output (query's type and shape, sharing no memory
// with what the kernel reads). Throws KvError before anything is written.
MhaPlan ValidateMhaWithOutput(const KvcacheMultiHeadAttentionAttrs* attrs, const KvcacheTensor* inputs,
                              const KvcacheTensor* output, MhaAttrs* a, TensorArg* in);

// The same for MultiHeadCacheAttention (the output also apart from the cache and scale it writes).
MhcaPlan ValidateMhcaWithOutput(const KvcacheMultiHeadCacheAttentionAttrs* attrs, const KvcacheTensor* inputs,
                                const KvcacheTensor* output, MhcaAttrs* a, TensorArg* in);

}  // namespace kvcache
