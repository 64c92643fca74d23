/* kvcache-op C entry points: run the ops on raw pointers, without ONNX Runtime or torch types.
 *
 * The shared library libkvcache_op_ort.so exports these next to ONNX Runtime's RegisterCustomOps. Each
 * entry runs the same validation as the ONNX Runtime op (spec/<Op>.md "Validity", the reference's
 * messages) and then the same kernels:
 *   - *_cpu:  every pointer is host memory.
 *   - *_cuda: current_key, current_value, cache, scale and the outputs are device memory; the index
 *     inputs (seqstarts, kvstarts, cachestarts, start_pos, max_seqlen, max_kvlen) are HOST memory. They
 *     are copied into library-owned memory before any of their values is checked (so an index array
 *     that aliases the cache cannot change under the kernel), then sent to the device in one copy on
 *     `stream`; the kernels run on `stream` (NULL is the legacy default stream) and the call returns
 *     without waiting for them.
 * On any error nothing has been written: the cache and scale are byte-for-byte unchanged.
 *
 * Tensors are dense and C-contiguous. Element types are ONNX TensorProto numbers (KVCACHE_OP_FLOAT ...).
 * An int4 cache is packed two codes per byte (element 2i in the low nibble), as ONNX stores INT4.
 * Outputs are allocated by the caller with the shape the call produces: (kvstarts[B], H * num_repeat,
 * Dh) of current_key's type (kvcache_op_key_value_cache_output_shape computes it); an output of another
 * shape or type, or one that overlaps a data input (keys, values, query, mask, cache, scale), is refused.
 * Index inputs are copied before anything is written: an output over one changes only the caller's array.
 *
 * Return value: KVCACHE_OP_OK (0), or an error code with a NUL-terminated message written to
 * `message` (truncated to `message_size` bytes; `message` may be NULL). Thread-safe: calls share no state.
 */
#ifndef KVCACHE_OP_H_
#define KVCACHE_OP_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVCACHE_OP_C_API_VERSION 12

#if defined(__GNUC__)
#define KVCACHE_OP_EXPORT __attribute__((visibility("default")))
#else
#define KVCACHE_OP_EXPORT
#endif

/* Return codes. */
#define KVCACHE_OP_OK 0
#define KVCACHE_OP_INVALID_ARGUMENT 1 /* the call breaks the spec's validity rules; nothing written */
#define KVCACHE_OP_RUNTIME_ERROR 2    /* a CUDA or allocation failure */
#define KVCACHE_OP_UNAVAILABLE 3      /* this build has no CUDA kernels */

/* ONNX element types used by the ops. */
#define KVCACHE_OP_FLOAT 1
#define KVCACHE_OP_INT8 3
#define KVCACHE_OP_INT64 7
#define KVCACHE_OP_FLOAT16 10
#define KVCACHE_OP_BFLOAT16 16
#define KVCACHE_OP_INT4 22

#define KVCACHE_OP_MAX_RANK 8

/* A dense, C-contiguous tensor. type == 0 marks an absent optional input (scale); data may be NULL only
 * when the tensor has no elements. */
typedef struct KvcacheTensor {
  int32_t type;                         /* ONNX element type */
  int32_t rank;                         /* 0 .. KVCACHE_OP_MAX_RANK */
  int64_t shape[KVCACHE_OP_MAX_RANK];   /* the first `rank` entries are the dims */
  void* data;
} KvcacheTensor;

/* KeyValueCache attributes; kvcache_op_key_value_cache_defaults fills the spec's defaults. */
typedef struct KvcacheKeyValueCacheAttrs {
  int64_t num_layer, layer_idx, quant_bit, quant_group, num_repeat, cache_mode, cache_layout, page_size;
} KvcacheKeyValueCacheAttrs;

/* KeyCacheRotaryShift attributes; kvcache_op_key_cache_rotary_shift_defaults fills the spec's defaults. */
typedef struct KvcacheRotaryShiftAttrs {
  int64_t num_layer, layer_idx, quant_bit, quant_group, cache_layout, rotary_dim, rotary_interleaved;
} KvcacheRotaryShiftAttrs;

/* MultiHeadAttention attributes; kvcache_op_multi_head_attention_defaults fills the spec's defaults and sets
 * num_heads and head_dim to 0, which the caller must replace (the op has no default for them). */
typedef struct KvcacheMultiHeadAttentionAttrs {
  int64_t num_heads, head_dim, is_causal, is_alibi, num_kv_heads, sliding_window;
  float softmax_scale; /* 0: 1 / sqrt(head_dim) */
  float softcap;       /* 0: off; else scores capped as softcap * tanh(score / softcap) (C API version 2) */
} KvcacheMultiHeadAttentionAttrs;

/* MultiHeadCacheAttention attributes: KeyValueCache's (no num_repeat: always 1), then MultiHeadAttention's;
 * kvcache_op_multi_head_cache_attention_defaults fills the spec's defaults and
 * sets num_heads and head_dim to 0, which the caller must replace. */
typedef struct KvcacheMultiHeadCacheAttentionAttrs {
  int64_t num_layer, layer_idx, quant_bit, quant_group, cache_mode, cache_layout, page_size;
  int64_t num_heads, head_dim, is_causal, is_alibi, num_kv_heads, sliding_window;
  float softmax_scale; /* 0: 1 / sqrt(head_dim) */
  float softcap;       /* 0: off */
} KvcacheMultiHeadCacheAttentionAttrs;

/* KVCACHE_OP_C_API_VERSION of the library (a caller compiled against another version should refuse it). */
KVCACHE_OP_EXPORT int32_t kvcache_op_c_api_version(void);

/* 1 when the library was built with the CUDA kernels, else 0. */
KVCACHE_OP_EXPORT int32_t kvcache_op_has_cuda(void);

/* The CPU kernel build KeyValueCache's CPU calls run now: "avx512", "avx2" or "generic" (the best one the
   library has and the processor runs, capped by $KVCACHE_OP_CPU_KERNEL). All builds give the same bits. */
KVCACHE_OP_EXPORT const char* kvcache_op_cpu_kernel(void);

/* How KeyValueCache's CPU gathers write outputs too large to stay cached: "stream" (streaming stores, one source
   stream; measured ahead on the AMD EPYCs and the two Intel Xeon models measured with the kernel as it is) unless
   $KVCACHE_OP_STORES names "side-by-side" (streaming stores, several source streams read side by side) or "cached"
   (plain stores). All give the same bits. */
KVCACHE_OP_EXPORT const char* kvcache_op_cpu_stores(void);

/* How KeyValueCache's CPU gathers read a layout-3 quantized cache into outputs that stay cached, chosen per CPU
   vendor by measurement (or by $KVCACHE_OP_CACHED_GATHER): "head-runs" (a head's rows a page run at a time) or
   "tokens" (token by token). Both give the same bits. */
KVCACHE_OP_EXPORT const char* kvcache_op_cpu_cached_gather(void);

/* How many of a token's heads (1-16) KeyValueCache's CPU gathers of a cache of `quant_bit` (0, 4 or 8) read side by
   side into streamed layout-3 outputs, a page run at a time, each slot's heads one output row (a line two heads share
   is then cut in registers rather than held): quantized heads eight on Intel processors running the AVX-512 build
   (measured on an Intel Xeon of model 167) and four elsewhere (measured best on an AMD EPYC), eight unquantized
   (measured best on an AMD EPYC and an Intel Xeon), or $KVCACHE_OP_STREAMED_HEADS for both (a positive count; larger
   ones give 16); -1 for another quant_bit. Every count gives the same bits. (C API version 7: the quant_bit
   argument.) */
KVCACHE_OP_EXPORT int64_t kvcache_op_cpu_streamed_heads(int64_t quant_bit);

/* How many bytes of whole tokens KeyValueCache's CPU gathers of a cache of `cache_layout` and `quant_bit` (0, 4 or
   8) write to each output in turn in token order (a tile's keys, then its values; one token where that is less
   than a token's row), chosen per layout and quantization by measurement (or by $KVCACHE_OP_GATHER_TILE, bytes, for
   all); -1 for a layout outside 0-3 or another quant_bit. Quantized layout-3 gathers in token order go a token at a
   time whatever it says, and streamed gathers that read runs side by side (kvcache_op_cpu_token_streams) take no
   tiles. Every size gives the same bits. (C API version 12: the quant_bit argument; 5: the layout argument.) */
KVCACHE_OP_EXPORT int64_t kvcache_op_cpu_gather_tile_bytes(int64_t cache_layout, int64_t quant_bit);

/* How KeyValueCache's CPU stores write quantized codes whose output rows are not read back from the cache, where
   the AVX-512 build's blocks of 16 groups cover them and they start on a line, chosen by measurement (streamed
   wherever the AVX-512 build runs: measured ahead on AMD and Intel) or by $KVCACHE_OP_CODE_STORES: "stream"
   (streaming stores) or "cached" (plain stores). Other builds always store them plainly; stores-only calls (MultiHeadCacheAttention's,
   which reads the rows at once) too. Both give the same bits. (C API version 6.) */
KVCACHE_OP_EXPORT const char* kvcache_op_cpu_code_stores(void);

/* How many runs of a task's rows KeyValueCache's CPU gathers read side by side into streamed outputs where a
   token's heads are one row in the cache and in the output (layouts 0-2 without repeats, unquantized, the "stream"
   store plan; rows of whole 64-byte vectors at even addresses, in the AVX-512 build, which alone reads runs): a
   token's key row then its value row, 256 bytes of each run's row in turn; 1 reads them one row after another.
   Chosen by measurement (in the AVX-512 build 8 on Intel processors and 4 on AMD processors, 1 elsewhere) or by
   $KVCACHE_OP_TOKEN_STREAMS (a positive count; larger ones give 16). Every count gives the same bits. (C API
   version 8.) */
KVCACHE_OP_EXPORT int64_t kvcache_op_cpu_token_streams(void);

/* How many bytes of a quantized token's codes (from its first head on, with their scales) KeyValueCache's CPU
   gathers in token order ask for ahead of their use where a token's heads lie together in the cache (layouts 0-2),
   for tokens whose codes take row_bytes (every head's), 0 for the whole row: chosen by measurement (on AMD
   processors 0 for rows up to 1024 bytes and 512 for longer ones; 1024 elsewhere, measured on Intel; rounded down
   to whole heads, at least one) or by $KVCACHE_OP_TOKEN_PREFETCH (bytes, a non-negative integer, whatever the row).
   -1 for row_bytes below 1. Every count gives the same bits. (C API version 10; version 9 took no row.) */
KVCACHE_OP_EXPORT int64_t kvcache_op_cpu_token_prefetch_bytes(int64_t row_bytes);

/* Where KeyValueCache's CPU gathers of an unquantized layout-3 cache ask for head rows ahead of their use: "l2"
   (the second-level cache, prefetcht1) or "l1" (the first). Chosen by measurement: "l2" on AMD processors, in
   every build (measured on an AMD EPYC of Zen 4: a slot's head rows share a set of the first level, whose ways the
   rows asked for ahead fill), "l1" elsewhere ("l2" no faster on an Intel Xeon of model 207); or by
   $KVCACHE_OP_HEAD_PREFETCH ("l2" or "l1"). Quantized rows go to the first level whatever it says. Both give the
   same bits. (C API version 11.) */
KVCACHE_OP_EXPORT const char* kvcache_op_cpu_head_prefetch(void);

/* Each fills *attrs with its op's spec defaults; a null attrs is ignored (nothing is written). */
KVCACHE_OP_EXPORT void kvcache_op_key_value_cache_defaults(KvcacheKeyValueCacheAttrs* attrs);
KVCACHE_OP_EXPORT void kvcache_op_key_cache_rotary_shift_defaults(KvcacheRotaryShiftAttrs* attrs);
KVCACHE_OP_EXPORT void kvcache_op_multi_head_attention_defaults(KvcacheMultiHeadAttentionAttrs* attrs);
KVCACHE_OP_EXPORT void kvcache_op_multi_head_cache_attention_defaults(KvcacheMultiHeadCacheAttentionAttrs* attrs);

/* inputs: the op's 10 inputs in order (current_key, current_value, seqstarts, kvstarts, cachestarts,
 * start_pos, max_seqlen, max_kvlen, cache, scale); only index inputs and shapes are read. Validates the
 * call and writes the outputs' shape (kv_tokens, H * num_repeat, Dh) to out_shape[3]. Writes nothing else. */
KVCACHE_OP_EXPORT int32_t kvcache_op_key_value_cache_output_shape(const KvcacheKeyValueCacheAttrs* attrs,
                                                                  const KvcacheTensor inputs[10],
                                                                  int64_t out_shape[3], char* message,
                                                                  size_t message_size);

/* KeyValueCache on host memory: stores, then gathers into outputs[0] (key) and outputs[1] (value).
 * num_threads <= 1 runs on the calling thread; more splits the work over that many threads. */
KVCACHE_OP_EXPORT int32_t kvcache_op_key_value_cache_cpu(const KvcacheKeyValueCacheAttrs* attrs,
                                                         const KvcacheTensor inputs[10],
                                                         const KvcacheTensor outputs[2], int32_t num_threads,
                                                         char* message, size_t message_size);

/* KeyValueCache on a CUDA device (see the file comment for which pointers are device memory). `stream`
 * is a cudaStream_t. Device scratch for the index copy comes from cudaMallocAsync on `stream`. */
KVCACHE_OP_EXPORT int32_t kvcache_op_key_value_cache_cuda(const KvcacheKeyValueCacheAttrs* attrs,
                                                          const KvcacheTensor inputs[10],
                                                          const KvcacheTensor outputs[2], void* stream,
                                                          char* message, size_t message_size);

/* KeyCacheRotaryShift on host memory. inputs: cache, scale (type 0 when absent), slots, cos, sin.
 * output: receives the slots as given ([N] int64); NULL to skip it. */
KVCACHE_OP_EXPORT int32_t kvcache_op_key_cache_rotary_shift_cpu(const KvcacheRotaryShiftAttrs* attrs,
                                                                const KvcacheTensor inputs[5],
                                                                const KvcacheTensor* output, int32_t num_threads,
                                                                char* message, size_t message_size);

/* KeyCacheRotaryShift on a CUDA device: cache and scale are device memory; slots, cos, sin and output
 * (the slots' copy, NULL to skip it) host memory. The rotation is enqueued on `stream` (a cudaStream_t);
 * output is written once it is enqueued. Quantized caches need Dh <= 256 on the GPU. */
KVCACHE_OP_EXPORT int32_t kvcache_op_key_cache_rotary_shift_cuda(const KvcacheRotaryShiftAttrs* attrs,
                                                                 const KvcacheTensor inputs[5],
                                                                 const KvcacheTensor* output, void* stream,
                                                                 char* message, size_t message_size);

/* MultiHeadAttention on host memory (spec/MultiHeadAttention.md). inputs: the op's 9 inputs in order (query,
 * key, value, seqstarts, kvstarts, decoding_batches, max_seqlen, max_kvlen, attn_mask); attn_mask has type
 * 0 when absent. output: caller-allocated, query's type and shape, sharing no memory with query, key, value
 * or attn_mask; on an error it is not written. num_threads as for KeyValueCache. */
KVCACHE_OP_EXPORT int32_t kvcache_op_multi_head_attention_cpu(const KvcacheMultiHeadAttentionAttrs* attrs,
                                                              const KvcacheTensor inputs[9],
                                                              const KvcacheTensor* output, int32_t num_threads,
                                                              char* message, size_t message_size);

/* MultiHeadCacheAttention on host memory (spec/MultiHeadCacheAttention.md). inputs: the op's 13 inputs in order
 * (query, current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, decoding_batches, max_seqlen,
 * max_kvlen, cache, scale, attn_mask); scale and attn_mask have type 0 when absent. Stores this step's keys and
 * values into cache (and scale) in place, then writes the attention to output: caller-allocated, query's type
 * and shape, sharing no memory with any input. On an error nothing is written. num_threads as for
 * KeyValueCache. */
KVCACHE_OP_EXPORT int32_t kvcache_op_multi_head_cache_attention_cpu(const KvcacheMultiHeadCacheAttentionAttrs* attrs,
                                                                    const KvcacheTensor inputs[13],
                                                                    const KvcacheTensor* output, int32_t num_threads,
                                                                    char* message, size_t message_size);

/* The two attention ops on a CUDA device (C API version 4): query, key, value / current_key, current_value,
 * cache, scale, attn_mask and the output are device memory; the index inputs are host memory, validated on the
 * host before anything is enqueued. The work (for MultiHeadCacheAttention: the stores, then the attention) is
 * enqueued on `stream` (a cudaStream_t); device scratch comes from cudaMallocAsync on it. A build without CUDA
 * returns KVCACHE_OP_UNAVAILABLE. */
KVCACHE_OP_EXPORT int32_t kvcache_op_multi_head_attention_cuda(const KvcacheMultiHeadAttentionAttrs* attrs,
                                                               const KvcacheTensor inputs[9],
                                                               const KvcacheTensor* output, void* stream,
                                                               char* message, size_t message_size);
KVCACHE_OP_EXPORT int32_t kvcache_op_multi_head_cache_attention_cuda(const KvcacheMultiHeadCacheAttentionAttrs* attrs,
                                                                     const KvcacheTensor inputs[13],
                                                                     const KvcacheTensor* output, void* stream,
                                                                     char* message, size_t message_size);

#ifdef __cplusplus
}
#endif

#endif /* KVCACHE_OP_H_ */
