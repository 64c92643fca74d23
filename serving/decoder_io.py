"""The graph inputs and output of a decoder exported by ``kvcache_op.hf`` (what the engine feeds and reads)."""

# The graph's inputs, in order; "scale" only when the cache is quantized.
INPUT_NAMES = ("input_ids", "positions", "seqstarts", "kvstarts", "cachestarts", "start_pos", "decoding_batches",
               "max_seqlen", "max_kvlen", "cache", "scale")
OUTPUT_NAME = "logits"
