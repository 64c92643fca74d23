"""``MultiHeadCacheAttention`` for ``onnx.reference.ReferenceEvaluator(model, new_ops=[MultiHeadCacheAttention])``."""

from onnx.reference.op_run import OpRun

from .multi_head_cache_attention import multi_head_cache_attention
from .op_attributes import node_attributes


class MultiHeadCacheAttention(OpRun):
    """Runs :func:`multi_head_cache_attention`; the ``cache`` and ``scale`` feeds are written in place (ppl.pmx's
    empty ``scale`` placeholder of an unquantized cache is absent)."""

    op_domain = "opmx.dynamic_batching"

    def _run(self, query, current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, decoding_batches,
             max_seqlen, max_kvlen, cache, scale=None, attn_mask=None, **given):
        attrs = node_attributes(multi_head_cache_attention, "MultiHeadCacheAttention", given)
        return (multi_head_cache_attention(query, current_key, current_value, seqstarts, kvstarts, cachestarts,
                                           start_pos, decoding_batches, max_seqlen, max_kvlen, cache, scale, attn_mask,
                                           **attrs),)
