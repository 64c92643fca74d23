"""The reference of MultiHeadCacheAttention (spec/MultiHeadCacheAttention.md): KeyValueCache with num_repeat 1,
then MultiHeadAttention over the keys and values it gathered. Every rule of both ops is checked before the
cache is written, so an invalid call leaves ``cache`` and ``scale`` byte-for-byte unchanged."""

import numpy as np

from .key_value_cache import key_value_cache
from .mha_validate import MultiHeadAttentionError, prepare_attention
from .multi_head_attention import multi_head_attention
from .validate import Attributes, effective_scale, validate_call


def _copy(x):
    """An owned copy of an input (None stays None)."""
    return None if x is None else np.array(x, copy=True)


def multi_head_cache_attention(query, current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos,
                               decoding_batches, max_seqlen, max_kvlen, cache, scale=None, attn_mask=None, *,
                               num_heads, head_dim, num_kv_heads=0, is_causal=1, is_alibi=0, softmax_scale=0.0,
                               sliding_window=0, softcap=0.0, num_layer=1, layer_idx=0, quant_bit=0, quant_group=8,
                               cache_mode=0, cache_layout=0, page_size=128):
    """Stores this step's keys and values into ``cache`` (and ``scale``) **in place**, as KeyValueCache does,
    then attends every sequence's queries over its cached keys, as MultiHeadAttention does; returns
    ``(seqstarts[B], num_heads, head_dim)`` of ``query``'s dtype.

    ``query (T, num_heads, head_dim)``; ``current_key``/``current_value (T, Hkv, head_dim)`` with ``Hkv``
    ``num_kv_heads`` (or ``num_heads`` when 0); the index inputs, ``cache``, ``scale`` and the cache attributes
    as for :func:`~kvcache_op.reference.key_value_cache` (``num_repeat`` is 1: the attention repeats the kv heads
    itself); ``decoding_batches``, ``attn_mask`` and the attention attributes as for
    :func:`~kvcache_op.reference.multi_head_attention`. An invalid call raises
    :class:`~kvcache_op.reference.KeyValueCacheError` (:class:`MultiHeadAttentionError` for the attention's
    rules) and writes nothing."""
    attention = dict(num_heads=num_heads, head_dim=head_dim, is_causal=is_causal, is_alibi=is_alibi,
                     num_kv_heads=num_kv_heads, sliding_window=sliding_window, softmax_scale=softmax_scale,
                     softcap=softcap)
    cache_attrs = dict(num_layer=num_layer, layer_idx=layer_idx, quant_bit=quant_bit, quant_group=quant_group,
                       num_repeat=1, cache_mode=cache_mode, cache_layout=cache_layout, page_size=page_size)
    # The call on copies (spec: the index inputs are read once, and the reference works on values): the stores below
    # must not change what the attention then reads, whatever memory the inputs share with the cache.
    query, current_key, current_value, attn_mask = (_copy(x) for x in (query, current_key, current_value, attn_mask))
    seqstarts, kvstarts, cachestarts, start_pos, decoding_batches, max_seqlen, max_kvlen = (
        _copy(x) for x in (seqstarts, kvstarts, cachestarts, start_pos, decoding_batches, max_seqlen, max_kvlen))
    # 1. Every rule of KeyValueCache, then every rule of MultiHeadAttention on keys of the shape and type the
    #    gather would give (not gathered yet: nothing is written before the whole call is known valid).
    plan = validate_call(current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen,
                         max_kvlen, cache, effective_scale(scale, quant_bit),
                         Attributes(**{k: int(v) for k, v in cache_attrs.items()}))
    gathered = (plan.kv_begin[-1] + plan.kv_len[-1] if plan.seq_len else 0,) + current_key.shape[1:]
    placeholder = np.broadcast_to(np.zeros((), current_key.dtype), gathered)
    prepare_attention(query, placeholder, placeholder, seqstarts, kvstarts, decoding_batches, max_seqlen, max_kvlen,
                      attn_mask, **attention)
    # 2. The composition.
    key, value = key_value_cache(current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos,
                                 max_seqlen, max_kvlen, cache, scale, **cache_attrs)
    return multi_head_attention(query, key, value, seqstarts, kvstarts, decoding_batches, max_seqlen, max_kvlen,
                                attn_mask, **attention)


def cache_attention_tolerance(query, current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos,
                              decoding_batches, max_seqlen, max_kvlen, cache, scale=None, attn_mask=None, *,
                              num_heads, head_dim, num_kv_heads=0, is_causal=1, is_alibi=0, softmax_scale=0.0,
                              sliding_window=0, softcap=0.0, num_layer=1, layer_idx=0, quant_bit=0, quant_group=8,
                              cache_mode=0, cache_layout=0, page_size=128) -> np.ndarray:
    """The spec's bound of every output element (spec/MultiHeadCacheAttention.md "Tolerance"): MultiHeadAttention's
    bound over the keys and values the call gathers. Works on copies: ``cache`` and ``scale`` stay as given."""
    from .attention_tolerance import attention_tolerance

    key, value = key_value_cache(current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen,
                                 max_kvlen, _copy(cache), _copy(scale), num_layer=num_layer, layer_idx=layer_idx,
                                 quant_bit=quant_bit, quant_group=quant_group, num_repeat=1, cache_mode=cache_mode,
                                 cache_layout=cache_layout, page_size=page_size)
    return attention_tolerance(query, key, value, seqstarts, kvstarts, decoding_batches, max_seqlen, max_kvlen,
                               attn_mask, num_heads=num_heads, head_dim=head_dim, is_causal=is_causal,
                               is_alibi=is_alibi, num_kv_heads=num_kv_heads, sliding_window=sliding_window,
                               softmax_scale=softmax_scale, softcap=softcap)


__all__ = ["cache_attention_tolerance", "multi_head_cache_attention"]
