"""A deliberately naive float64 transliteration of spec/MultiHeadAttention.md: one (query, key) pair at a
time, the visibility rule written out per pair, Python floats throughout.

It shares no code with kvcache_op.reference (ALiBi slopes come from the ALiBi paper's own recursive
formula, not the reference's closed form). Only valid inputs are given to it. Besides the exact output it
returns, per element, the quantities the spec's error bound is made of (n, V, A).
"""

import math

import numpy as np


def paper_slopes(n):
    """The ALiBi paper's slopes: a geometric sequence starting at 2^(-8/n) for a power of two n; otherwise the
    closest smaller power of two's, then every other slope of twice that many heads."""
    def power_of_2(k):
        start = 2 ** (-(2 ** -(math.log2(k) - 3)))
        return [start * start**i for i in range(k)]

    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + paper_slopes(2 * closest)[0::2][: n - closest]


def naive_attention(query, key, value, seqstarts, kvstarts, decoding_batches, attn_mask=None, *, num_heads, head_dim,
                    is_causal=1, is_alibi=0, num_kv_heads=0, sliding_window=0, softmax_scale=0.0, softcap=0.0):
    """Returns (exact, n, v_max, a_mean): float64 arrays of the output's shape (exact output o*; effective keys of
    the row; max |value| over them in the element's column; their score-term sizes' mean, weighted by the
    exact softmax weights)."""
    tokens = query.shape[0]
    kv_heads = num_kv_heads if num_kv_heads else num_heads
    per_kv = num_heads // kv_heads
    scale = float(np.float32(softmax_scale)) if softmax_scale else float(np.float32(1 / math.sqrt(head_dim)))
    cap = float(np.float32(softcap))  # the cap is exact here: c * tanh(s / c) in float64
    slopes = [float(np.float32(s)) for s in paper_slopes(num_heads)]
    decoding = int(np.asarray(decoding_batches).reshape(()))
    exact = np.zeros((tokens, num_heads, head_dim))
    n_out, v_out, a_out = (np.zeros((tokens, num_heads, head_dim)) for _ in range(3))
    q64, k64, v64 = (np.asarray(x).astype(np.float64) for x in (query, key, value))
    m64 = None if attn_mask is None else np.asarray(attn_mask).astype(np.float64)
    for b in range(len(seqstarts) - 1):
        seqlen = int(seqstarts[b + 1] - seqstarts[b])
        kvlen = int(kvstarts[b + 1] - kvstarts[b])
        causal = bool(is_causal) and seqlen > 1 and b >= decoding
        for h in range(num_heads):
            g = h // per_kv
            for i in range(seqlen):
                t = int(seqstarts[b]) + i
                position = kvlen - seqlen + i
                scores, sizes, keys, masked = [], [], [], []
                for j in range(kvlen):
                    if causal and j > position:
                        continue
                    if sliding_window and j <= position - sliding_window:
                        continue
                    col = int(kvstarts[b]) + j
                    dot = sum(q64[t, h, d] * k64[col, g, d] for d in range(head_dim))
                    size = scale * sum(abs(q64[t, h, d] * k64[col, g, d]) for d in range(head_dim))
                    score = scale * dot
                    if cap:
                        score = cap * math.tanh(score / cap)
                        size *= 2  # the spec's bound counts the dot-product term twice under the cap
                    if m64 is not None:
                        mask = m64[h, t, col] if m64.ndim == 3 else m64[t, col]
                        if mask == -math.inf:
                            masked.append(col)  # weight 0, but in the sums: 0 * inf is NaN (spec)
                            continue  # hidden: not an effective key
                        score += mask
                        size += abs(mask)
                    if is_alibi:
                        bias = slopes[h] * float(np.float32(j - position))
                        score += bias
                        size += abs(bias)
                    scores.append(score)
                    sizes.append(size)
                    keys.append(col)
                if not keys:
                    continue  # no effective key: the row is exactly zero
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                total = sum(weights)
                for d in range(head_dim):
                    exact[t, h, d] = sum(w * v64[c, g, d] for w, c in zip(weights, keys)) / total
                    if any(not math.isfinite(v64[c, g, d]) for c in masked):
                        exact[t, h, d] = math.nan
                    v_out[t, h, d] = max(abs(v64[c, g, d]) for c in keys)
                n_out[t, h, :] = len(keys)
                a_out[t, h, :] = sum(w * a for w, a in zip(weights, sizes)) / total
    return exact, n_out, v_out, a_out
