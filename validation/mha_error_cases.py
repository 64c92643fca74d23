"""Every validity condition of spec/MultiHeadAttention.md, as (id, mutation, expected message) rows over one
small valid call. Shared by the reference, ONNX Runtime and C-entry error tests, so each is held to the
same list, and written as conformance cases ``mha_error_<id>`` (expected outcome: an error). A mutation
takes (inputs, attributes) and changes them in place."""

import numpy as np

from .error_cases import _both, _item, _set, mutated
from .mha_cases import build_attention

I64_MAX = np.iinfo(np.int64).max


def base():
    """Two decodes and a causal chunk, GQA 4 -> 2 heads, float16, with a rank-3 mask (one unread column)."""
    return build_attention("mha-invalid", [(1, 5), (1, 2), (3, 4)], heads=4, kv_heads=2, head_dim=8, decoding=2,
                           mask=3, mask_extra_cols=1)


def _with(key, fn):
    """Replaces an input by fn(input) (a contiguous copy)."""
    def mutate(i, a):
        i[key] = None if fn(i[key]) is None else np.ascontiguousarray(fn(i[key]))
    return mutate


INVALID = [
    # attributes (ONNX Runtime: at session creation)
    ("num_heads_zero", _set("num_heads", 0), "num_heads must be >= 1, got 0"),
    ("head_dim_negative", _set("head_dim", -8), "head_dim must be >= 1, got -8"),
    ("is_causal_2", _set("is_causal", 2), "is_causal must be 0 or 1, got 2"),
    ("is_alibi_negative", _set("is_alibi", -1), "is_alibi must be 0 or 1, got -1"),
    ("num_kv_heads_not_a_divisor", _set("num_kv_heads", 3),
     r"num_kv_heads must be 0 \(= num_heads\) or divide num_heads = 4, got 3"),
    ("num_kv_heads_negative", _set("num_kv_heads", -2), "num_kv_heads must be 0 .* got -2"),
    ("sliding_window_negative", _set("sliding_window", -1), r"sliding_window must be >= 0 \(0: no window\), got -1"),
    ("softmax_scale_negative", _set("softmax_scale", -0.5),
     r"softmax_scale must be finite and >= 0 \(0: 1/sqrt\(head_dim\)\), got -0.5"),
    ("softmax_scale_inf", _set("softmax_scale", float("inf")), "softmax_scale must be finite .* got inf"),
    ("softmax_scale_nan", _set("softmax_scale", float("nan")), "softmax_scale must be finite .* got nan"),
    # softcap is written only when set, so the base call has none: set as an attribute
    ("softcap_negative", lambda i, a: a.__setitem__("softcap", -2.0), r"softcap must be finite and >= 0 \(0: off\), got -2"),
    ("softcap_inf", lambda i, a: a.__setitem__("softcap", float("inf")), "softcap must be finite .* got inf"),
    # query, key, value, attn_mask
    ("query_int8", _with("query", lambda x: x.astype(np.int8)), "query dtype must be float32, float16 or bfloat16, got int8"),
    ("query_rank2", _with("query", lambda x: x[:, 0]), r"query must have shape \(tokens, num_heads=4, head_dim=8\), got \(5, 8\)"),
    ("query_heads_differ", _set("num_heads", 2), r"query must have shape \(tokens, num_heads=2, head_dim=8\), got \(5, 4, 8\)"),
    ("query_head_dim_differs", _with("query", lambda x: x[..., :4]), r"query must have shape .*got \(5, 4, 4\)"),
    ("key_dtype", _with("key", lambda x: x.astype(np.float32)), r"key dtype must be query's \(float16\), got float32"),
    ("key_heads_differ", _set("num_kv_heads", 1), r"key must have shape \(kv_tokens, num_kv_heads=1, head_dim=8\), got \(11, 2, 8\)"),
    ("key_rank4", _with("key", lambda x: x[None]), r"key must have shape .*got \(1, 11, 2, 8\)"),
    ("value_dtype", _with("value", lambda x: x.astype(np.float32)), r"value dtype must be query's \(float16\)"),
    ("value_rows_differ", _with("value", lambda x: x[:-1]), r"value shape \(10, 2, 8\) must equal key shape \(11, 2, 8\)"),
    ("mask_dtype", _with("attn_mask", lambda x: x.astype(np.float32)), r"attn_mask dtype must be query's \(float16\), got float32"),
    ("mask_rank4", _with("attn_mask", lambda x: x[None]),
     r"attn_mask must have shape \(num_heads=4, 5, >= 11\) or \(5, >= 11\) \(query tokens, key tokens\), got \(1, 4, 5, 12\)"),
    ("mask_rank3_heads_differ", _with("attn_mask", lambda x: x[:2]), r"attn_mask must have shape .*got \(2, 5, 12\)"),
    ("mask_rows_differ", _with("attn_mask", lambda x: x[:, :4]), r"attn_mask must have shape .*got \(4, 4, 12\)"),
    ("mask_too_few_columns", _with("attn_mask", lambda x: x[0, :, :10]), r"attn_mask must have shape .*got \(5, 10\)"),
    # index inputs
    ("seqstarts_int32", _with("seqstarts", lambda x: x.astype(np.int32)), "seqstarts must be int64, got int32"),
    ("seqstarts_2d", _with("seqstarts", lambda x: x[None]), r"seqstarts must be 1-D, got shape \(1, 4\)"),
    ("seqstarts_empty", _with("seqstarts", lambda x: x[:0]), r"seqstarts must have B \+ 1 >= 1 elements, got 0"),
    ("kvstarts_length", _with("kvstarts", lambda x: x[:-1]), r"kvstarts must have shape \(4,\), got \(3,\)"),
    ("decoding_batches_int32", _with("decoding_batches", lambda x: x.astype(np.int32)),
     "decoding_batches must be an int64 scalar, got int32"),
    ("decoding_batches_shape2", _set("decoding_batches", np.array([1, 1], np.int64)),
     r"decoding_batches must be a scalar or shape \(1,\), got shape \(2,\)"),
    ("max_seqlen_float", _set("max_seqlen", np.array(3.0)), "max_seqlen must be an int64 scalar, got float64"),
    ("max_kvlen_shape2", _set("max_kvlen", np.array([[5]], np.int64)), r"max_kvlen must be a scalar or shape \(1,\)"),
    ("seqstarts_not_zero", _item("seqstarts", 0, 1), r"seqstarts\[0\] must be 0, got 1"),
    ("seqstarts_decreasing", _item("seqstarts", 2, 0),
     r"seqstarts must be non-decreasing: seqstarts\[2\] = 0 < seqstarts\[1\] = 1"),
    ("seqstarts_total", _item("seqstarts", 3, 4), r"seqstarts\[B=3\] = 4 must equal query.shape\[0\] = 5"),
    ("seqstarts_int64_max", _item("seqstarts", 3, I64_MAX), r"seqstarts\[B=3\] = 9223372036854775807 must equal"),
    ("kvstarts_not_zero", _item("kvstarts", 0, -1), r"kvstarts\[0\] must be 0, got -1"),
    ("kvstarts_decreasing", _item("kvstarts", 1, 9), r"kvstarts must be non-decreasing: kvstarts\[2\] = 7 < kvstarts\[1\] = 9"),
    ("kvstarts_total", _item("kvstarts", 3, 12), r"kvstarts\[B=3\] = 12 must equal key.shape\[0\] = 11"),
    ("kvstarts_int64_max", _item("kvstarts", 3, I64_MAX), r"kvstarts\[B=3\] = 9223372036854775807 must equal key"),
    ("max_seqlen_too_small", _set("max_seqlen", np.array(2, np.int64)),
     "max_seqlen = 2 is smaller than seqlen of sequence 2 = 3"),
    ("max_kvlen_too_small", _set("max_kvlen", np.array([4], np.int64)),
     "max_kvlen = 4 is smaller than kvlen of sequence 0 = 5"),
    ("decoding_batches_negative", _set("decoding_batches", np.array(-1, np.int64)),
     r"decoding_batches = -1 must be in \[0, B=3\]"),
    ("decoding_batches_above_batch", _set("decoding_batches", np.array([4], np.int64)),
     r"decoding_batches = 4 must be in \[0, B=3\]"),
    ("decoding_batches_int64_max", _set("decoding_batches", np.array(I64_MAX, np.int64)),
     r"decoding_batches = 9223372036854775807 must be in \[0, B=3\]"),
    # the causal rule needs seqlen <= kvlen: sequence 2 keeps 3 queries over 2 keys
    ("causal_seqlen_exceeds_kvlen", _both(_item("kvstarts", 3, 9), _with("key", lambda x: x[:9]),
                                          _with("value", lambda x: x[:9]), _with("attn_mask", lambda x: x[..., :9])),
     r"sequence 2: seqlen = 3 exceeds kvlen = 2, but the causal mask aligns its queries with its last seqlen "
     r"keys \(is_causal=1, b >= decoding_batches = 2\)"),
]


def make_invalid(row):
    """(inputs, attributes) of one invalid row; inputs are fresh copies."""
    return mutated(base(), row[1])
