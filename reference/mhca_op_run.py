"""``MultiHeadCacheAttention`` for ``onnx.reference.ReferenceEvaluator(model, new_ops=[MultiHeadCacheAttention])``."""

from onnx.reference.op_run import OpRun

from .multi_head_cache_attention import multi_head_cache_attention

_INT_ATTRIBUTES = ("num_kv_heads", "is_causal", "is_alibi", "sliding_window", "num_layer", "layer_idx", "quant_bit",
                   "quant_group", "cache_mode", "cache_layout", "page_size")


class MultiHeadCacheAttention(OpRun):
    """Runs :func:`multi_head_cache_attention`; the ``cache`` and ``scale`` feeds are written in place (ppl.pmx's
    empty ``scale`` placeholder of an unquantized cache is absent)."""

    op_domain = "opmx.dynamic_batching"

    def _run(self, query, current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, decoding_batches,
             max_seqlen, max_kvlen, cache, scale=None, attn_mask=None, num_heads=None, head_dim=None, softmax_scale=None,
             softcap=None, **given):
        attrs = {k: int(v) for k, v in given.items() if k in _INT_ATTRIBUTES and v is not None}
        for name, value in (("softmax_scale", softmax_scale), ("softcap", softcap)):
            if value is not None:
                attrs[name] = float(value)
        return (multi_head_cache_attention(query, current_key, current_value, seqstarts, kvstarts, cachestarts,
                                           start_pos, decoding_batches, max_seqlen, max_kvlen, cache, scale, attn_mask,
                                           num_heads=num_heads, head_dim=head_dim, **attrs),)
