"""Hypothesis strategies for valid MultiHeadAttention calls over every attribute value the spec allows:
GQA, causal on/off, decoding sequences (with seqlen > 1 too), windows, masks of both ranks with -inf
entries and unread columns, ALiBi, empty sequences and kvlen 0, all three dtypes."""

from hypothesis import strategies as st

from kvcache_op.spec.mha_cases import build_attention

DTYPES = ("float32", "float16", "bfloat16")


@st.composite
def attention_calls(draw, dtypes=DTYPES, max_batch=4, max_kvlen=12, head_dims=(1, 2, 3, 4, 8, 16)):
    """A valid call: a spec.cases.Case (inputs + attributes)."""
    heads = draw(st.sampled_from((1, 2, 3, 4, 6)))
    kv_heads = draw(st.sampled_from([0] + [k for k in (1, 2, 3, 6) if heads % k == 0]))
    batch = draw(st.integers(0, max_batch))
    decoding = draw(st.integers(0, batch))
    is_causal = draw(st.sampled_from((1, 1, 0)))
    seqs = []
    for b in range(batch):
        kvlen = draw(st.integers(0, max_kvlen))
        seqlen = draw(st.integers(0, 5))
        if is_causal and b >= decoding and seqlen > 1 and seqlen > kvlen:
            kvlen = seqlen + draw(st.integers(0, 3))  # the causal rule needs seqlen <= kvlen
        seqs.append((seqlen, kvlen))
    mask = draw(st.sampled_from((None, None, 2, 3)))
    return build_attention(
        "hypothesis", seqs, heads=heads, kv_heads=kv_heads, head_dim=draw(st.sampled_from(head_dims)),
        t=draw(st.sampled_from(dtypes)), decoding=decoding, is_causal=is_causal, is_alibi=draw(st.integers(0, 1)),
        sliding_window=draw(st.sampled_from((0, 0, 1, 2, 3, 5, 100))),
        softmax_scale=draw(st.sampled_from((0.0, 0.0, 0.05, 0.3, 1.0))), mask=mask,
        mask_extra_cols=draw(st.integers(0, 2)), mask_neg_inf=draw(st.sampled_from((0.0, 0.3, 0.9))),
        scalar_max=draw(st.booleans()), extra_max=draw(st.integers(0, 2)), seed=draw(st.integers(0, 2**32 - 1)),
    )


def copies(inputs: dict) -> dict:
    """Fresh copies of a case's inputs (None stays None)."""
    return {k: (None if v is None else v.copy()) for k, v in inputs.items()}
