"""``MultiHeadAttention`` for ``onnx.reference.ReferenceEvaluator(model, new_ops=[MultiHeadAttention])``."""

from onnx.reference.op_run import OpRun

from .multi_head_attention import multi_head_attention


class MultiHeadAttention(OpRun):
    """Runs :func:`multi_head_attention` (an absent ``attn_mask`` input is None)."""

    op_domain = "opmx.dynamic_batching"

    def _run(self, query, key, value, seqstarts, kvstarts, decoding_batches, max_seqlen, max_kvlen, attn_mask=None,
             num_heads=None, head_dim=None, is_causal=None, is_alibi=None, num_kv_heads=None, sliding_window=None,
             softmax_scale=None, softcap=None):
        given = dict(is_causal=is_causal, is_alibi=is_alibi, num_kv_heads=num_kv_heads, sliding_window=sliding_window)
        attrs = {k: int(v) for k, v in given.items() if v is not None}
        for name, number in (("softmax_scale", softmax_scale), ("softcap", softcap)):
            if number is not None:
                attrs[name] = float(number)
        return (multi_head_attention(query, key, value, seqstarts, kvstarts, decoding_batches, max_seqlen, max_kvlen,
                                     attn_mask, num_heads=num_heads, head_dim=head_dim, **attrs),)
