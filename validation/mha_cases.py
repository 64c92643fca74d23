"""Named, seeded MultiHeadAttention conformance cases (names start with ``mha_``). Each is a function of
nothing that returns a :class:`~kvcache_op.validation.cases.Case`; the expected output and its tolerance are what
the reference and the spec's bound give (validation/vectors.py)."""

import zlib

import numpy as np

from .cases import _T1, Case


def build_attention(name, seqs, *, heads=2, kv_heads=0, head_dim=8, t="float16", decoding=0, is_causal=1,
                    is_alibi=0, sliding_window=0, softmax_scale=0.0, softcap=0.0, mask=None, mask_extra_cols=0,
                    mask_neg_inf=0.0, scalar_max=True, extra_max=0, seed=None) -> Case:
    """A call over ``seqs`` = [(seqlen, kvlen), ...]. ``mask``: None, 2 or 3 (its rank); ``mask_extra_cols``
    columns past ``kvstarts[B]`` (never read); ``mask_neg_inf``: the fraction of mask entries set to -inf.
    Random data comes from ``seed`` (default: derived from ``name``)."""
    rng = np.random.default_rng(zlib.crc32(name.encode()) if seed is None else seed)
    dtype = _T1[t]
    seqlens, kvlens = [s for s, _ in seqs], [k for _, k in seqs]
    tokens, kv_tokens, kv = sum(seqlens), sum(kvlens), kv_heads or heads

    def scalar(v):
        return np.array(v, np.int64) if scalar_max else np.array([v], np.int64)

    inputs = {
        "query": rng.standard_normal((tokens, heads, head_dim)).astype(dtype),
        "key": rng.standard_normal((kv_tokens, kv, head_dim)).astype(dtype),
        "value": (rng.standard_normal((kv_tokens, kv, head_dim)) * 2).astype(dtype),
        "seqstarts": np.concatenate([[0], np.cumsum(seqlens)]).astype(np.int64),
        "kvstarts": np.concatenate([[0], np.cumsum(kvlens)]).astype(np.int64),
        "decoding_batches": scalar(decoding),
        "max_seqlen": scalar(max(seqlens, default=0) + extra_max),
        "max_kvlen": scalar(max(kvlens, default=0) + extra_max),
        "attn_mask": None,
    }
    if mask:
        shape = ((heads,) if mask == 3 else ()) + (tokens, kv_tokens + mask_extra_cols)
        values = rng.standard_normal(shape)
        values[rng.random(shape) < mask_neg_inf] = -np.inf
        inputs["attn_mask"] = values.astype(dtype)
    attributes = dict(num_heads=heads, head_dim=head_dim, is_causal=is_causal, is_alibi=is_alibi,
                      num_kv_heads=kv_heads, sliding_window=sliding_window, softmax_scale=softmax_scale)
    if softcap:  # an extension: written only when set, so the other cases stay ppl's nodes
        attributes["softcap"] = softcap
    return Case(name, inputs, attributes)


def fully_masked_rows() -> Case:
    """Rows whose mask is all -inf, a sequence without keys, and a window that hides everything: zeros."""
    case = build_attention("mha_fully_masked_rows", [(2, 4), (1, 0), (3, 5)], decoding=0, mask=2)
    case.inputs["attn_mask"][0, :] = -np.inf  # every key of query 0 of sequence 0
    case.inputs["attn_mask"][4, 4:9] = -np.inf  # every key of query 1 of sequence 2
    return case


MIXED = [(1, 7), (1, 3), (4, 9), (5, 5)]  # two decodes, a chunk of a chunked prefill, a first prefill


def hidden_keys_not_finite() -> Case:
    """Values of keys no query sees (before a 2-key window) are an infinity and a NaN: a hidden key never enters a
    row, so every output stays finite (a weight of 0 would let inf * 0 = NaN through)."""
    case = build_attention("mha_hidden_keys_not_finite", [(2, 4), (1, 6)], decoding=1, sliding_window=2, t="float32")
    case.inputs["value"][0, 0, 0] = np.inf  # key 0 of sequence 0: outside the window of both its queries
    case.inputs["value"][4, 1, 3] = np.nan  # key 0 of sequence 1: outside its decode query's window
    return case


def live_values_not_finite() -> Case:
    """An infinity and a NaN in values that live keys read: each reaches its rows (which elements, and whether NaN
    or an infinity, the spec leaves open; compare holds a backend to "non-finite somewhere in the row")."""
    case = build_attention("mha_live_values_not_finite", MIXED, decoding=2, t="float32")
    case.inputs["value"][3, 0, 2] = np.inf  # key 3 of sequence 0 (7 keys): its decode query sees it
    case.inputs["value"][13, 1, 5] = np.nan  # key 3 of sequence 2 (9 keys): its chunk's queries see it
    return case


def masked_key_value_infinite() -> Case:
    """A key whose mask entry is -inf has weight 0 but stays in the sums: an infinity in its value makes the row
    non-finite (0 * inf), where a backend that skips masked keys gives a finite row."""
    case = build_attention("mha_masked_key_value_infinite", [(1, 5), (2, 4)], decoding=1, mask=2, t="float32")
    case.inputs["attn_mask"][0, 1] = -np.inf
    case.inputs["value"][1, 0, 0] = np.inf  # key 1 of sequence 0, masked for its only query
    return case


SPLIT_KEYS = 2048  # keys enough that a backend splits a short chunk's keys into ranges (the project's CPU kernel
#                    splits 2-4 queries over 512 keys and more, in ranges of 256 or more)
HIDDEN_KEYS = 1536  # the first keys of each sequence, hidden by -inf: more than a whole range of such a split


def masked_key_range_value_not_finite() -> Case:
    """A decode, a chunk of 2 and one of 4 queries over long contexts whose first keys are all hidden by a -inf
    mask, among them a key with an infinite or NaN value: a backend that splits the keys computes a range with no
    finite score apart, and that range must still carry 0 * inf = NaN into the merged row's column."""
    case = build_attention("mha_masked_key_range_value_not_finite", [(1, SPLIT_KEYS), (2, SPLIT_KEYS), (4, SPLIT_KEYS)],
                           heads=1, head_dim=4, decoding=1, mask=2, t="float32")
    for b, special in enumerate((np.inf, np.nan, -np.inf)):
        first = b * SPLIT_KEYS
        case.inputs["attn_mask"][:, first:first + HIDDEN_KEYS] = -np.inf
        case.inputs["value"][first + 10 + 300 * b, 0, b] = special
    return case


def query_infinite(softcap=0.0) -> Case:
    """An infinity in a query: its scores are infinite, so its row is not finite; with a softcap the cap takes an
    infinite score to +-softcap, and the row is finite."""
    name = "mha_softcap_query_infinite" if softcap else "mha_query_infinite"
    case = build_attention(name, [(1, 6), (3, 3)], decoding=1, softcap=softcap, t="float32")
    case.inputs["query"][0, 1, 4] = np.inf  # the decode query, head 1
    case.inputs["query"][2, 0, 0] = -np.inf  # the prefill's second query, head 0
    return case


SATURATING_KEYS = 27  # 1/27 rounded to float16 is above it: 27 such weights sum to 1 + 1.25 * 2^-12


def saturating_float16() -> Case:
    """Values of +-65504 (float16's largest) under equal scores: the output is 65504, and a backend whose normalized
    weights are rounded to float16 (allowed) reaches 65504 * 1.0003 = 65524 in float32, which must saturate to 65504,
    not round to an infinity."""
    case = build_attention("mha_saturating_float16", [(1, SATURATING_KEYS)], decoding=1)
    case.inputs["query"][:] = 0  # every score 0: equal weights
    case.inputs["value"][:, 0, :] = np.float16(65504)
    case.inputs["value"][:, 1, :] = np.float16(-65504)
    return case


def _registry():
    cases = {}

    def case(name, seqs, **kw):
        cases[name] = lambda: build_attention(name, seqs, **kw)

    case("mha_prefill_causal", [(5, 5), (3, 3)])
    case("mha_decode_batch_float32", [(1, k) for k in (1, 4, 9, 2, 16, 6)], decoding=6, t="float32")
    case("mha_mixed_decode_chunk_prefill", MIXED, decoding=2)
    case("mha_mixed_bfloat16", MIXED, decoding=2, t="bfloat16")
    case("mha_gqa_group4_bfloat16", MIXED, heads=8, kv_heads=2, decoding=2, t="bfloat16")
    case("mha_mqa", MIXED, heads=4, kv_heads=1, decoding=2)
    case("mha_not_causal_float32", MIXED, is_causal=0, decoding=1, t="float32")
    case("mha_decoding_sequence_seqlen3", [(3, 6), (2, 4)], decoding=1)
    case("mha_mask_rank2", MIXED, decoding=2, mask=2, mask_extra_cols=3, mask_neg_inf=0.2)
    case("mha_mask_rank3_float32", MIXED, decoding=2, mask=3, mask_extra_cols=1, mask_neg_inf=0.2, t="float32")
    case("mha_mask_not_causal", MIXED, is_causal=0, mask=3, heads=4, kv_heads=2)
    case("mha_sliding_window3", MIXED, decoding=2, sliding_window=3)
    case("mha_sliding_window1_float32", MIXED, decoding=2, sliding_window=1, t="float32")
    case("mha_sliding_window_longer_than_keys", MIXED, decoding=2, sliding_window=64)
    case("mha_alibi_heads8_float32", MIXED, heads=8, decoding=2, is_alibi=1, t="float32")
    case("mha_alibi_heads6_gqa", MIXED, heads=6, kv_heads=3, decoding=2, is_alibi=1)
    case("mha_alibi_window_mask_bfloat16", MIXED, heads=4, decoding=2, is_alibi=1, sliding_window=4, mask=2,
         t="bfloat16")
    case("mha_softmax_scale", MIXED, decoding=2, softmax_scale=0.125)
    case("mha_softcap", MIXED, decoding=2, softmax_scale=2.0, softcap=1.5, mask=2, t="float32")
    case("mha_empty_sequences", [(0, 3), (2, 2), (0, 0), (1, 0), (3, 4)], decoding=0)
    case("mha_batch0", [], t="float32")
    case("mha_max_len_shape1", MIXED, decoding=2, scalar_max=False, extra_max=4)
    case("mha_head_dim128", [(1, 40), (6, 30)], heads=4, kv_heads=2, head_dim=128, decoding=1)
    cases["mha_fully_masked_rows"] = fully_masked_rows
    cases["mha_hidden_keys_not_finite"] = hidden_keys_not_finite
    cases["mha_live_values_not_finite"] = live_values_not_finite
    cases["mha_masked_key_value_infinite"] = masked_key_value_infinite
    cases["mha_masked_key_range_value_not_finite"] = masked_key_range_value_not_finite
    cases["mha_query_infinite"] = query_infinite
    cases["mha_softcap_query_infinite"] = lambda: query_infinite(softcap=4.0)
    cases["mha_saturating_float16"] = saturating_float16
    return cases


ATTENTION_CASES = _registry()
