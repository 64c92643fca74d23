"""Named, seeded MultiHeadCacheAttention conformance cases (names start with ``mhca_``; invalid ones with
``mhca_error_``): a KeyValueCache call of :mod:`.cases` (num_repeat 1) with a query of ``group`` query heads per
kv head and the attention's inputs and attributes. Each is a function of nothing returning a
:class:`~kvcache_op.validation.cases.Case`."""

import zlib

import numpy as np

from .cases import MIXED, Case, Seq, build, deferred, with_empty_scale
from .error_cases import INVALID as CACHE_INVALID
from .error_cases import MORE_INVALID as MORE_CACHE_INVALID
from .error_cases import make_invalid as make_cache_invalid
from .error_cases import mutated

#: The op's inputs, in ppl.pmx's order.
INPUTS = ("query", "current_key", "current_value", "seqstarts", "kvstarts", "cachestarts", "start_pos",
          "decoding_batches", "max_seqlen", "max_kvlen", "cache", "scale", "attn_mask")


def with_query(name, cache_inputs: dict, cache_attributes: dict, *, group=2, decoding=0, is_causal=1, is_alibi=0,
               sliding_window=0, softmax_scale=0.0, softcap=0.0, mask=False) -> Case:
    """The MultiHeadCacheAttention call of a KeyValueCache call: a seeded query of ``group`` heads per kv head
    (current_key's type and sizes; float16 where current_key is not a 3-D float tensor), ``decoding_batches``,
    an additive mask when ``mask`` (rank 2, shared by the heads; ``mask=3``: rank 3, a plane per query head), and
    the attention attributes."""
    rng = np.random.default_rng(zlib.crc32(("query " + name).encode()))
    key = np.asarray(cache_inputs["current_key"])
    tokens, kv_heads, head_dim = key.shape if key.ndim == 3 else (0, 1, 8)
    dtype = key.dtype if key.dtype.kind == "f" or key.dtype.name == "bfloat16" else np.dtype(np.float16)
    inputs = dict(cache_inputs, query=rng.standard_normal((tokens, kv_heads * group, head_dim)).astype(dtype),
                  decoding_batches=np.array(decoding, np.int64), attn_mask=None)
    if mask:
        kv_tokens = int(np.asarray(cache_inputs["kvstarts"])[-1])
        planes = (kv_heads * group,) if mask == 3 else ()
        inputs["attn_mask"] = (rng.standard_normal(planes + (tokens, kv_tokens + 1)) * 0.5).astype(dtype)
    attributes = {**{k: v for k, v in cache_attributes.items() if k != "num_repeat"},
                  "num_heads": kv_heads * group, "head_dim": head_dim, "num_kv_heads": kv_heads, "is_causal": is_causal,
                  "is_alibi": is_alibi, "sliding_window": sliding_window, "softmax_scale": softmax_scale}
    if softcap:  # an extension: written only when set
        attributes["softcap"] = softcap
    return Case(name, {k: inputs.get(k) for k in INPUTS}, attributes)


def build_cache_attention(name, seqs, *, group=2, decoding=0, is_causal=1, is_alibi=0, sliding_window=0,
                          softmax_scale=0.0, softcap=0.0, mask=False, **cache) -> Case:
    """A valid call over ``seqs`` (:class:`~kvcache_op.validation.cases.Seq`), the cache built by
    :func:`~kvcache_op.validation.cases.build` with the ``cache`` keywords."""
    kv = build(name, seqs, **cache)
    return with_query(name, kv.inputs, kv.attributes, group=group, decoding=decoding, is_causal=is_causal,
                      is_alibi=is_alibi, sliding_window=sliding_window, softmax_scale=softmax_scale, softcap=softcap,
                      mask=mask)


DECODES_FIRST = [Seq(5, 1), Seq(2, 1), Seq(0, 4), Seq(3, 3)]  # two decodes, a prefill, a chunk


def _minus_inf_mask(case):
    """The mask's first row all -inf (that query's output row is zeros) and every third entry of the others -inf
    (those keys enter with weight 0)."""
    mask = case.inputs["attn_mask"]
    mask[0, :] = -np.inf
    mask[1:, ::3] = -np.inf
    return case


def _num_kv_heads_zero(case):
    """num_kv_heads 0, the default: as many kv heads as query heads (the call's group is 1)."""
    assert case.attributes["num_heads"] == case.attributes["num_kv_heads"]
    case.attributes["num_kv_heads"] = 0
    return case


def _registry():
    cases = {}

    def case(name, seqs, then=None, **kw):
        cases[name] = deferred(build_cache_attention, name, seqs, then=then, **kw)

    case("mhca_offset_float16", MIXED, cache_mode=0, group=1)
    case("mhca_paged_gqa2", MIXED, cache_mode=1, page_size=4)
    case("mhca_paged_int8_layout3", MIXED, cache_mode=1, page_size=4, quant_bit=8, cache_layout=3)
    case("mhca_paged_int4_layout2", MIXED, cache_mode=1, page_size=2, quant_bit=4, cache_layout=2, quant_group=4)
    case("mhca_decoding_batches2", DECODES_FIRST, cache_mode=1, page_size=4, decoding=2, group=3)
    case("mhca_float32_alibi_window2", MIXED, cache_mode=1, page_size=4, t1="float32", is_alibi=1, sliding_window=2)
    case("mhca_bfloat16_mask", MIXED, cache_mode=0, t1="bfloat16", mask=True, softmax_scale=0.5)
    case("mhca_layers3_layer_idx1_layout1", MIXED, num_layer=3, layer_idx=1, cache_mode=1, page_size=3, cache_layout=1)
    case("mhca_not_causal", [Seq(0, 3, kvlen=2), Seq(4, 2)], cache_mode=0, is_causal=0)
    case("mhca_batch0", [], cache_mode=1, page_size=4)
    case("mhca_softcap_int8", MIXED, cache_mode=1, page_size=4, quant_bit=8, softmax_scale=1.5, softcap=2.0)
    case("mhca_float32_int4_scale_float16", MIXED, cache_mode=1, page_size=4, t1="float32", t3="float16", quant_bit=4,
         quant_group=4)
    case("mhca_num_kv_heads0", MIXED, then=_num_kv_heads_zero, cache_mode=1, page_size=4, group=1)
    # ppl.pmx's 13-input export: an empty scale placeholder before the mask.
    case("mhca_empty_scale_mask", MIXED, then=with_empty_scale, cache_mode=1, page_size=4, mask=True)
    case("mhca_unaligned_pages_int8", MIXED, cache_mode=1, page_size=3, aligned_pages=False, quant_bit=8)
    case("mhca_mask_minus_inf", DECODES_FIRST, then=_minus_inf_mask, cache_mode=1, page_size=4, decoding=2, mask=True,
         quant_bit=8)
    case("mhca_mask_per_head_gqa4", DECODES_FIRST, cache_mode=1, page_size=4, decoding=2, group=4, mask=3)
    case("mhca_int4_group16", MIXED, cache_mode=1, page_size=4, quant_bit=4, quant_group=16, head_dim=32)
    return cases


CASES = _registry()


def _base():
    return build_cache_attention("mhca-invalid", DECODES_FIRST, cache_mode=1, page_size=4, decoding=2, mask=True)


def _attribute(name, value):
    return lambda i, a: a.__setitem__(name, value)


#: Invalid calls of the attention's rules: (name, change of the base call, the reference's message).
ATTENTION_INVALID = [
    ("num_heads_zero", _attribute("num_heads", 0), "num_heads must be >= 1, got 0"),
    ("head_dim_negative", _attribute("head_dim", -8), "head_dim must be >= 1, got -8"),
    ("is_causal_2", _attribute("is_causal", 2), "is_causal must be 0 or 1, got 2"),
    ("is_alibi_negative", _attribute("is_alibi", -1), "is_alibi must be 0 or 1, got -1"),
    ("num_kv_heads_not_a_divisor", _attribute("num_kv_heads", 3), r"num_kv_heads must be 0 \(= num_heads\) or divide"),
    ("sliding_window_negative", _attribute("sliding_window", -1), r"sliding_window must be >= 0"),
    ("softmax_scale_nan", _attribute("softmax_scale", float("nan")), "softmax_scale must be finite"),
    ("softcap_negative", _attribute("softcap", -1.0), r"softcap must be finite and >= 0 \(0: off\), got -1"),
    ("query_int8", lambda i, a: i.__setitem__("query", i["query"].astype(np.int8)), "query dtype must be"),
    ("query_heads_differ", lambda i, a: i.__setitem__("query", np.ascontiguousarray(i["query"][:, :1])),
     "query must have shape"),
    ("query_rows_differ", lambda i, a: i.update(query=np.ascontiguousarray(i["query"][1:]), attn_mask=None),
     r"seqstarts\[B=4\] = 9 must equal query.shape\[0\] = 8"),
    ("mask_dtype", lambda i, a: i.__setitem__("attn_mask", i["attn_mask"].astype(np.float32)), "attn_mask dtype must be"),
    ("mask_too_few_columns", lambda i, a: i.__setitem__("attn_mask", np.ascontiguousarray(i["attn_mask"][:, :3])),
     "attn_mask must have shape"),
    ("decoding_batches_above_batch", lambda i, a: i.__setitem__("decoding_batches", np.array(5, np.int64)),
     r"decoding_batches = 5 must be in \[0, B=4\]"),
    ("decoding_batches_int32", lambda i, a: i.__setitem__("decoding_batches", np.array(0, np.int32)),
     "decoding_batches must be an int64 scalar"),
    ("causal_seqlen_exceeds_kvlen", lambda i, a: i.__setitem__("kvstarts", np.append(i["kvstarts"][:-1],
                                                                                     i["kvstarts"][-2] + 2)),
     "sequence 3: seqlen = 3 exceeds kvlen = 2, but the causal mask"),
]


def make_attention_invalid(row):
    """(inputs, attributes) of one invalid attention row; inputs are fresh copies."""
    return mutated(_base(), row[1])


def _cache_rows():
    """KeyValueCache's invalid calls (num_repeat is not an attribute of this op) as calls of this op."""
    return [row for row in CACHE_INVALID + MORE_CACHE_INVALID if not row[0].startswith("num_repeat")]


def error_cases() -> dict:
    """Name -> function of nothing returning the invalid Case: every KeyValueCache rule, then the attention's."""
    cases = {}
    for row in _cache_rows():
        name = f"mhca_error_{row[0]}"
        cases[name] = lambda row=row, name=name: Case(name, *_as_cache_attention(name, *make_cache_invalid(row)),
                                                      expect_error=True)
    for row in ATTENTION_INVALID:
        name = f"mhca_error_{row[0]}"
        cases[name] = lambda row=row, name=name: Case(name, *make_attention_invalid(row), expect_error=True)
    return cases


def _as_cache_attention(name, inputs, attributes):
    call = with_query(name, inputs, attributes, group=1, is_causal=0)
    return call.inputs, call.attributes
