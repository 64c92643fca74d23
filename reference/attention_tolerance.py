"""The error bound of spec/MultiHeadAttention.md section "Tolerance": how far any conforming backend's output
may be from the exact attention of the same inputs, element by element."""

import numpy as np

from .dtypes import BFLOAT16
from .mha_validate import prepare_attention
from .multi_head_attention import alibi_slope, mask_block, relative_positions, visible_keys

#: Unit roundoff u_T (half an ulp of 1) of each output type.
UNIT_ROUNDOFF = {np.dtype(np.float32): 2.0**-24, np.dtype(np.float16): 2.0**-11, BFLOAT16: 2.0**-8}
#: Half the smallest subnormal of each output type: the absolute error of rounding a tiny value.
HALF_SUBNORMAL = {np.dtype(np.float32): 2.0**-150, np.dtype(np.float16): 2.0**-25, BFLOAT16: 2.0**-134}
U32 = 2.0**-24


def attention_error_bound(n, v_max, a_mean, head_dim: int, dtype):
    """The spec's bound on ``|o - o*|`` for output elements whose row has ``n`` effective keys (visible, mask
    not -inf), ``v_max`` = max |v| of those keys in the element's column, ``a_mean`` = the mean over those
    keys, weighted by their exact softmax weights, of ``scale * sum_d |q_d k_d| + |mask| + |alibi|``. Arrays
    broadcast; float64."""
    u, eta = UNIT_ROUNDOFF[np.dtype(dtype)], HALF_SUBNORMAL[np.dtype(dtype)]
    n, v_max, a_mean = (np.asarray(x, np.float64) for x in (n, v_max, a_mean))
    return v_max * (4 * u + 4 * U32 * (n + 4 + (2 * head_dim + 10) * a_mean) + n * eta) + eta


def weighted_sizes(scores, sizes, effective):
    """Per row, the mean of ``sizes`` over the ``effective`` keys weighted by the exact softmax of ``scores``
    (float64); 0 for a row without an effective key (or whose scores are not finite)."""
    scores = np.where(effective, scores, -np.inf)
    top = scores.max(axis=1, initial=-np.inf)
    finite = np.isfinite(top)
    with np.errstate(invalid="ignore", over="ignore"):
        weights = np.where(effective & finite[:, None], np.exp(scores - np.where(finite, top, 0.0)[:, None]), 0.0)
        total = weights.sum(axis=1)
        mean = np.where(total > 0, (weights * np.where(effective, sizes, 0.0)).sum(axis=1) / np.where(total > 0, total, 1),
                        0.0)
    return np.nan_to_num(mean, nan=0.0, posinf=0.0)


#: Scores and sums at or past this size may overflow float32 in one order of the arithmetic and not in another: a
#: quarter of float32's range, room for the rounding of partial sums and a backend's rescaling (such as by log2 e).
FLOAT32_RANGE_LIMIT = 2.0**126


def _head_blocks(call):
    """Per sequence with queries and per query head: (rows, q, k, v, visible, mask, bias), the data float64, ``mask``
    and ``bias`` (ALiBi) float64 ``(queries, keys)`` or None."""
    a, query, key, value, attn_mask, plan = (call.a, call.query, call.key, call.value, call.attn_mask, call.plan)
    group = a.num_heads // a.kv_heads
    for b in range(len(plan.seq_len)):
        if plan.seq_len[b] == 0:
            continue
        rows = slice(plan.seq_begin[b], plan.seq_begin[b] + plan.seq_len[b])
        cols = slice(plan.kv_begin[b], plan.kv_begin[b] + plan.kv_len[b])
        visible = visible_keys(plan.kv_len[b], plan.seq_len[b], plan.causal[b], a.sliding_window)
        distance = relative_positions(plan.kv_len[b], plan.seq_len[b]).astype(np.float64)
        for h in range(a.num_heads):
            mask = None if attn_mask is None else mask_block(attn_mask, h, rows, cols).astype(np.float64)
            bias = float(alibi_slope(h, a.num_heads)) * distance if a.is_alibi else None
            yield (rows, h, query[rows, h, :].astype(np.float64), key[cols, h // group, :].astype(np.float64),
                   value[cols, h // group, :].astype(np.float64), visible, mask, bias)


def attention_tolerance(query, key, value, seqstarts, kvstarts, decoding_batches, max_seqlen, max_kvlen,
                        attn_mask=None, *, num_heads, head_dim, is_causal=1, is_alibi=0, num_kv_heads=0,
                        sliding_window=0, softmax_scale=0.0, softcap=0.0) -> np.ndarray:
    """float64 array of the output's shape: :func:`attention_error_bound` of every element; 0 where the row has
    no effective key (the output is then exactly 0). Validates the call like the reference."""
    call = prepare_attention(query, key, value, seqstarts, kvstarts, decoding_batches, max_seqlen, max_kvlen,
                             attn_mask, num_heads=num_heads, head_dim=head_dim, is_causal=is_causal, is_alibi=is_alibi,
                             num_kv_heads=num_kv_heads, sliding_window=sliding_window, softmax_scale=softmax_scale,
                             softcap=softcap)
    bound = np.zeros(call.query.shape, np.float64)
    cap = float(np.float32(call.a.softcap))
    for rows, h, q, k, v, visible, mask, bias in _head_blocks(call):
        v = np.abs(v)
        with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 in a dot product: a NaN score, its row open
            score = float(call.plan.scale) * (q @ k.T)
            size = float(call.plan.scale) * (np.abs(q) @ np.abs(k).T)
        if cap:  # spec: the dot-product term counts twice under the cap (its own roundings)
            score = cap * np.tanh(score / cap)
            size = 2 * size
        effective = visible.copy()
        if mask is not None:
            effective &= mask != -np.inf
            score = score + np.where(effective, mask, 0.0)
            size += np.abs(np.where(effective, mask, 0.0))
        if bias is not None:
            score = score + bias
            size += np.abs(bias)
        n = effective.sum(axis=1)
        a_mean = weighted_sizes(score, size, effective)
        v_max = np.where(effective[:, :, None], v[None, :, :], 0.0).max(axis=1, initial=0.0)
        element = attention_error_bound(n[:, None], v_max, a_mean[:, None], call.a.head_dim, call.query.dtype)
        bound[rows, h, :] = np.where(n[:, None] > 0, element, 0.0)
    return bound


def attention_exact(query, key, value, seqstarts, kvstarts, decoding_batches, max_seqlen, max_kvlen, attn_mask=None,
                    *, num_heads, head_dim, is_causal=1, is_alibi=0, num_kv_heads=0, sliding_window=0,
                    softmax_scale=0.0, softcap=0.0) -> tuple:
    """``(exact, out_of_range)``: the semantics evaluated in float64 (float64 array of the output's shape; non-finite
    inputs give the non-finite elements the spec's rules give), and a boolean ``(T, num_heads)`` of the rows outside
    float32's range (spec "Tolerance"): for a visible key, ``max(1, scale) * sum_d |q_d k_d|`` plus the positive parts
    of its mask entry and ALiBi bias, or the row's largest score in magnitude, or for a column ``n * V``, reaches
    :data:`FLOAT32_RANGE_LIMIT` (finite inputs only). In such a row float32 arithmetic may overflow in one order and
    not in another. A large negative mask entry alone (a padding key's) does not: its score only goes lower."""
    call = prepare_attention(query, key, value, seqstarts, kvstarts, decoding_batches, max_seqlen, max_kvlen,
                             attn_mask, num_heads=num_heads, head_dim=head_dim, is_causal=is_causal, is_alibi=is_alibi,
                             num_kv_heads=num_kv_heads, sliding_window=sliding_window, softmax_scale=softmax_scale,
                             softcap=softcap)
    exact = np.zeros(call.query.shape, np.float64)
    out_of_range = np.zeros(call.query.shape[:2], bool)
    cap, scale = float(np.float32(call.a.softcap)), float(call.plan.scale)
    finite = (lambda x: np.where(np.isfinite(x), np.abs(x), 0.0))
    with np.errstate(all="ignore"):  # inf - inf, 0 * inf: the values the spec's rules give
        for rows, h, q, k, v, visible, mask, bias in _head_blocks(call):
            score = scale * (q @ k.T)
            size = max(1.0, scale) * (finite(q) @ finite(k).T)
            if cap:
                score = cap * np.tanh(score / cap)
            effective = visible.copy()
            if mask is not None:
                effective &= mask != -np.inf
                score = score + mask
                size = size + np.maximum(np.where(np.isfinite(mask), mask, 0.0), 0.0)
            if bias is not None:
                score = score + bias
                size = size + np.maximum(bias, 0.0)
            score = np.where(visible, score, -np.inf)
            top = np.max(score, axis=1, initial=-np.inf)  # NaN propagates: a NaN score keeps its row live
            live = top != -np.inf
            weights = np.where(visible & live[:, None], np.exp(score - np.where(live, top, 0.0)[:, None]), 0.0)
            terms = np.where(visible[:, :, None], weights[:, :, None] * v[None, :, :], 0.0)
            total = weights.sum(axis=1)
            exact[rows, h, :] = np.where(live[:, None], terms.sum(axis=1) / np.where(live, total, 1.0)[:, None], 0.0)
            n = effective.sum(axis=1)
            v_max = np.where(effective[:, :, None], finite(v)[None, :, :], 0.0).max(axis=1, initial=0.0)
            largest = np.maximum(np.where(visible, size, 0.0).max(axis=1, initial=0.0), finite(top))
            out_of_range[rows, h] = (largest >= FLOAT32_RANGE_LIMIT) | (
                (n[:, None] * v_max).max(axis=1, initial=0.0) >= FLOAT32_RANGE_LIMIT)
    return exact, out_of_range
