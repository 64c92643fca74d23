"""``MultiHeadAttention`` for ``onnx.reference.ReferenceEvaluator(model, new_ops=[MultiHeadAttention])``."""

from onnx.reference.op_run import OpRun

from .multi_head_attention import multi_head_attention
from .op_attributes import node_attributes


class MultiHeadAttention(OpRun):
    """Runs :func:`multi_head_attention` (an absent ``attn_mask`` input is None)."""

    op_domain = "opmx.dynamic_batching"

    def _run(self, query, key, value, seqstarts, kvstarts, decoding_batches, max_seqlen, max_kvlen, attn_mask=None,
             **given):
        return (multi_head_attention(query, key, value, seqstarts, kvstarts, decoding_batches, max_seqlen, max_kvlen,
                                     attn_mask, **node_attributes(multi_head_attention, "MultiHeadAttention", given)),)
