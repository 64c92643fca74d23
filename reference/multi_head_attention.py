"""The reference of MultiHeadAttention: spec/MultiHeadAttention.md section "Semantics", per sequence, per head."""

import numpy as np

from .dtypes import saturating_cast
from .mha_validate import prepare_attention


def alibi_slope(h: int, num_heads: int) -> np.float32:
    """ALiBi slope of head ``h``: with ``p`` the largest power of two <= num_heads, head ``h < p`` gets
    ``2^(-8 (h + 1) / p)`` and head ``h >= p`` gets ``2^(-4 (2 (h - p) + 1) / p)`` (the ALiBi paper's slopes,
    and its rule for head counts that are not powers of two). The exponent is exact in float64; the float64
    power is rounded once to float32."""
    p = 1 << (num_heads.bit_length() - 1)
    exponent = -8.0 * (h + 1) / p if h < p else -4.0 * (2 * (h - p) + 1) / p
    return np.float32(2.0**exponent)


def alibi_slopes(num_heads: int) -> np.ndarray:
    """:func:`alibi_slope` of every head, float32 ``(num_heads,)``."""
    return np.array([alibi_slope(h, num_heads) for h in range(num_heads)], np.float32)


def visible_keys(kv_len: int, seq_len: int, causal: bool, sliding_window: int) -> np.ndarray:
    """Boolean ``(seq_len, kv_len)``: may query ``i`` see key ``j``? Query ``i`` sits at position
    ``q = kv_len - seq_len + i`` and key ``j`` at ``j``; the causal rule hides ``j > q``, a window ``W``
    hides ``j <= q - W``."""
    q = np.arange(seq_len, dtype=np.int64)[:, None] + (kv_len - seq_len)
    j = np.arange(kv_len, dtype=np.int64)[None, :]
    visible = np.ones((seq_len, kv_len), bool)
    if causal:
        visible &= j <= q
    if sliding_window:
        visible &= (q - j) < sliding_window  # exact: |q - j| < 2^63 as both index rows that exist
    return visible


def relative_positions(kv_len: int, seq_len: int) -> np.ndarray:
    """float32 ``(seq_len, kv_len)`` of ``j - q`` (key position minus query position), rounded once."""
    q = np.arange(seq_len, dtype=np.int64)[:, None] + (kv_len - seq_len)
    return (np.arange(kv_len, dtype=np.int64)[None, :] - q).astype(np.float32)


def mask_block(attn_mask, h: int, rows: slice, cols: slice):
    """The additive mask of one head over one sequence's (queries, keys), as float32."""
    block = attn_mask[h] if attn_mask.ndim == 3 else attn_mask
    return block[rows, cols].astype(np.float32)


def capped(scores, softcap):
    """``softcap * tanh(scores / softcap)`` in float32 (the extension's score cap); the scores as they are for 0.
    The cap is a float32 (an ONNX float attribute): a value that rounds to 0 in float32 is 0, off."""
    cap = np.float32(softcap)
    if not cap:
        return scores
    return (cap * np.tanh(scores / cap)).astype(np.float32)


def attention_rows(q, k, v, scale, biases, visible, softcap=0.0):
    """Softmax attention of float32 rows ``q (n, Dh)`` over ``k, v (m, Dh)``; the scaled scores capped by
    ``softcap`` (0: not), then ``biases``: float32 ``(n, m)`` terms added in order (the mask, then ALiBi).

    Rows with no visible key, or whose visible scores are all -inf, are zeros; a NaN score keeps its row
    live (NaN propagates). Keys outside ``visible`` (the causal and window ranges) never enter the sums, so
    a non-finite value there cannot reach the row; a key hidden by a -inf mask entry enters with weight 0."""
    # IEEE float32 arithmetic defines the result: an overflow to inf, inf - inf, or 0 * inf under a hidden key
    # (computed, then never taken) is a value the spec settles (the rules above), not a fault to warn of.
    with np.errstate(over="ignore", invalid="ignore"):
        scores = capped(np.float32(scale) * (q @ k.T), softcap)  # float32 products and sums
        for bias in biases:
            scores = scores + bias
        scores = np.where(visible, scores, np.float32(-np.inf))
        out = np.zeros((q.shape[0], v.shape[1]), np.float32)
        row_max = scores.max(axis=1, initial=np.float32(-np.inf))
        live = ~np.isneginf(row_max)  # a NaN maximum is live: NaN propagates
        weights = np.exp(scores[live] - row_max[live][:, None])  # exp(-inf) = 0; inf - inf a NaN row
        terms = np.where(visible[live][:, :, None], weights[:, :, None] * v[None, :, :], np.float32(0))
        out[live] = terms.sum(axis=1, dtype=np.float32) / weights.sum(axis=1, dtype=np.float32)[:, None]
    return out


def multi_head_attention(query, key, value, seqstarts, kvstarts, decoding_batches, max_seqlen, max_kvlen,
                         attn_mask=None, *, num_heads, head_dim, is_causal=1, is_alibi=0, num_kv_heads=0,
                         sliding_window=0, softmax_scale=0.0, softcap=0.0):
    """Attention of every sequence's queries over its own keys; returns ``(seqstarts[B], num_heads, head_dim)``
    of query's dtype. ``softcap`` > 0 caps every scaled score as ``softcap * tanh(score / softcap)`` (Gemma 2)
    before the mask and ALiBi are added.

    ``query (seqstarts[B], num_heads, head_dim)``, ``key``/``value (kvstarts[B], num_kv_heads, head_dim)``,
    ``attn_mask`` None, ``(num_heads, seqstarts[B], >= kvstarts[B])`` or ``(seqstarts[B], >= kvstarts[B])``.
    Every input is validated first (:class:`MultiHeadAttentionError`, a ``ValueError``); inputs are never
    written.
    """
    call = prepare_attention(query, key, value, seqstarts, kvstarts, decoding_batches, max_seqlen, max_kvlen,
                             attn_mask, num_heads=num_heads, head_dim=head_dim, is_causal=is_causal, is_alibi=is_alibi,
                             num_kv_heads=num_kv_heads, sliding_window=sliding_window, softmax_scale=softmax_scale,
                             softcap=softcap)
    a, query, key, value, attn_mask, plan = (call.a, call.query, call.key, call.value, call.attn_mask, call.plan)
    out = np.zeros(query.shape, query.dtype)
    group = a.num_heads // a.kv_heads  # query head h reads kv head h // group (repeat-interleave)
    for b in range(len(plan.seq_len)):
        if plan.seq_len[b] == 0:
            continue  # no query, nothing to write
        rows = slice(plan.seq_begin[b], plan.seq_begin[b] + plan.seq_len[b])
        cols = slice(plan.kv_begin[b], plan.kv_begin[b] + plan.kv_len[b])
        visible = visible_keys(plan.kv_len[b], plan.seq_len[b], plan.causal[b], a.sliding_window)
        distance = relative_positions(plan.kv_len[b], plan.seq_len[b]) if a.is_alibi else None
        for h in range(a.num_heads):
            biases = [] if attn_mask is None else [mask_block(attn_mask, h, rows, cols)]
            if a.is_alibi:
                biases.append(alibi_slope(h, a.num_heads) * distance)  # per head: num_heads may be huge when T = 0
            q = query[rows, h, :].astype(np.float32)
            k = key[cols, h // group, :].astype(np.float32)
            v = value[cols, h // group, :].astype(np.float32)
            out[rows, h, :] = saturating_cast(attention_rows(q, k, v, plan.scale, biases, visible, a.softcap),
                                              query.dtype)
    return out
