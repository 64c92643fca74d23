"""A ``transformers`` causal LM as one packed dynamic-batching forward: the tokens of every sequence of a
step in one row, each layer's attention through MultiHeadCacheAttention (or the split pair KeyValueCache then
MultiHeadAttention).

It runs the model's own forward, so norms, projections, rotary (partial, per layer type), QK-norm, multipliers,
softcapping, post-norms, parallel residuals and mixture-of-experts blocks are the model's code; only attention is
routed to the ops, through ``transformers``' attention interface. What the packed form cannot express is refused
by :func:`~.structure.decoder_sizes`, from the model's structure.
"""

from __future__ import annotations

import torch

from .cache_settings import CacheSettings
from .packed_attention import PackedStep, stepping
from .structure import decoder_sizes

__all__ = ["CacheSettings", "PackedDecoder", "decoder_sizes"]


class PackedDecoder(torch.nn.Module):
    """``forward(input_ids [T], positions [T], seqstarts [B+1], kvstarts [B+1], cachestarts [B, P],
    start_pos [B], decoding_batches, max_seqlen, max_kvlen, cache[, scale]) -> logits [B, vocab]``: the
    logits of each sequence's last token of this step. ``cache`` (one for all layers, ``layer_idx``
    selects) and ``scale`` are written in place; the first ``decoding_batches`` sequences are decodes.

    It is the model's own forward on one row of all the step's tokens at their explicit positions, with
    ``logits_to_keep`` each sequence's last token (so final norms, logit scaling and softcapping are the model's),
    and every attention routed to the ops (:mod:`.packed_attention`)."""

    def __init__(self, model, cache: CacheSettings):
        super().__init__()
        self.shape = decoder_sizes(model)
        self.cache = cache
        self.model = model

    def forward(self, input_ids, positions, seqstarts, kvstarts, cachestarts, start_pos, decoding_batches,
                max_seqlen, max_kvlen, cache, scale=None):
        inputs = dict(seqstarts=seqstarts, kvstarts=kvstarts, cachestarts=cachestarts, start_pos=start_pos,
                      decoding_batches=decoding_batches, max_seqlen=max_seqlen, max_kvlen=max_kvlen, cache=cache,
                      scale=scale)
        step = PackedStep(inputs=inputs, cache=self.cache, sizes=self.shape)
        with stepping(self.model, step):
            out = self.model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                             logits_to_keep=seqstarts[1:] - 1)
        return out.logits[0]
