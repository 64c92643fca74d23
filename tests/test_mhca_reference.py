"""MultiHeadCacheAttention's reference against an oracle written apart from it: the naive KeyValueCache
(tests/naive_reference.py: the cache after the call, bit for bit, and the gathered keys) followed by the naive
float64 attention (tests/naive_attention.py: the exact output and the spec's bound of every element). Invalid
calls, of either op's rules, raise before anything is written."""

import numpy as np
import onnx
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from onnx.reference import ReferenceEvaluator

from kvcache_op import spec
from kvcache_op.reference import (KeyValueCacheError, MultiHeadAttentionError, MultiHeadCacheAttention,
                                  attention_error_bound, multi_head_cache_attention)
from kvcache_op.validation.cases import CASES
from kvcache_op.validation.error_cases import INVALID, make_invalid
from kvcache_op.validation.strategies import calls
from naive_attention import naive_attention
from naive_reference import naive_key_value_cache

INDEX = ("seqstarts", "kvstarts", "cachestarts", "start_pos", "max_seqlen", "max_kvlen")


@st.composite
def cache_attention_calls(draw):
    """A valid call: a KeyValueCache call (num_repeat 1), query heads a multiple of its kv heads, attention
    attributes and an additive mask (none, shared by the heads or a plane per query head; some entries -inf, at
    times a whole row) drawn; returns (inputs, attributes)."""
    case = draw(calls(special_values=False))  # the attention bound does not cover special values
    assume(case.attributes.get("num_repeat", 1) == 1)
    i = dict(case.inputs)
    tokens, kv_heads, head_dim = i["current_key"].shape
    group = draw(st.sampled_from((1, 2, 3)))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    query = rng.standard_normal((tokens, kv_heads * group, head_dim)).astype(i["current_key"].dtype)
    batch = len(i["seqstarts"]) - 1
    seq_len, kv_len = np.diff(i["seqstarts"]), np.diff(i["kvstarts"])
    decoding = draw(st.integers(0, batch))
    causal = draw(st.sampled_from((0, 1)))
    if causal and any(seq_len[b] > 1 and seq_len[b] > kv_len[b] for b in range(decoding, batch)):
        causal = 0  # the causal rule needs each causal sequence's queries among its keys
    attributes = {**{k: v for k, v in case.attributes.items() if k != "num_repeat"},
                  "num_heads": kv_heads * group, "head_dim": head_dim, "num_kv_heads": kv_heads, "is_causal": causal,
                  "is_alibi": draw(st.sampled_from((0, 1))), "sliding_window": draw(st.sampled_from((0, 1, 3))),
                  "softcap": draw(st.sampled_from((0.0, 0.0, 0.7, 4.0)))}
    inputs = dict(query=query, current_key=i["current_key"], current_value=i["current_value"],
                  **{k: i[k] for k in INDEX[:4]}, decoding_batches=np.array(decoding, np.int64),
                  **{k: i[k] for k in INDEX[4:]}, cache=i["cache"], scale=i["scale"])
    rank = draw(st.sampled_from((0, 0, 2, 3)))
    if rank:
        planes = (kv_heads * group,) if rank == 3 else ()
        mask = rng.standard_normal(planes + (tokens, int(i["kvstarts"][-1]) + draw(st.integers(0, 2))))
        mask[rng.random(mask.shape) < draw(st.sampled_from((0.0, 0.2, 0.9)))] = -np.inf
        inputs["attn_mask"] = mask.astype(query.dtype)
    return inputs, attributes


def _split(attributes):
    cache_keys = ("num_layer", "layer_idx", "quant_bit", "quant_group", "cache_mode", "cache_layout", "page_size")
    cache = {k: v for k, v in attributes.items() if k in cache_keys}
    return cache, {k: v for k, v in attributes.items() if k not in cache_keys}


@settings(deadline=None)
@given(cache_attention_calls())
def test_the_reference_is_the_naive_cache_then_the_exact_attention_within_its_bound(call):
    inputs, attributes = call
    cache_attrs, attention = _split(attributes)
    key, value, cache_after, scale_after = naive_key_value_cache(
        inputs["current_key"], inputs["current_value"], inputs["seqstarts"], inputs["kvstarts"],
        inputs["cachestarts"], inputs["start_pos"], inputs["cache"], inputs["scale"], **cache_attrs)
    exact, n, v_max, a_mean = naive_attention(inputs["query"], key, value, inputs["seqstarts"], inputs["kvstarts"],
                                              inputs["decoding_batches"], inputs.get("attn_mask"), **attention)
    bound = np.where(n > 0, attention_error_bound(n, v_max, a_mean, attention["head_dim"], inputs["query"].dtype), 0.0)
    given_inputs = {k: (None if v is None else v.copy()) for k, v in inputs.items()}
    out = multi_head_cache_attention(**given_inputs, **attributes)
    assert out.dtype == inputs["query"].dtype and out.shape == inputs["query"].shape
    assert given_inputs["cache"].tobytes() == cache_after.tobytes()
    if scale_after is not None:
        assert given_inputs["scale"].tobytes() == scale_after.tobytes()
    error = np.abs(out.astype(np.float64) - exact)
    assert np.all(error <= bound), float(np.max(error - bound))


def _valid(name="page_size16_int8_layout3"):
    case = CASES[name]()
    i = case.inputs
    heads = i["current_key"].shape[1]
    query = np.random.default_rng(0).standard_normal((i["current_key"].shape[0], 2 * heads,
                                                      i["current_key"].shape[2])).astype(i["current_key"].dtype)
    inputs = dict(query=query, current_key=i["current_key"], current_value=i["current_value"],
                  **{k: i[k] for k in INDEX[:4]}, decoding_batches=np.array(0, np.int64),
                  **{k: i[k] for k in INDEX[4:]}, cache=i["cache"], scale=i["scale"])
    attributes = {**{k: v for k, v in case.attributes.items() if k != "num_repeat"}, "num_heads": 2 * heads,
                  "head_dim": i["current_key"].shape[2], "num_kv_heads": heads, "is_causal": 0}
    return inputs, attributes


@pytest.mark.parametrize("row", [r for r in INVALID if not r[0].startswith("num_repeat")],  # MHCA has no num_repeat
                         ids=lambda r: r[0])
def test_every_invalid_cache_call_raises_its_message_and_writes_nothing(row):
    inputs, attributes = make_invalid(row)
    attributes = {k: v for k, v in attributes.items() if k != "num_repeat"}
    key = inputs["current_key"]
    heads = key.shape[1] if getattr(key, "ndim", 0) == 3 else 1
    head_dim = key.shape[2] if getattr(key, "ndim", 0) == 3 else 1
    tokens = key.shape[0] if getattr(key, "ndim", 0) >= 1 else 0
    query = np.zeros((tokens, heads, head_dim), key.dtype if np.asarray(key).dtype.kind == "f" else np.float32)
    before = {k: np.asarray(inputs[k]).tobytes() for k in ("cache", "scale") if inputs.get(k) is not None}
    with pytest.raises(KeyValueCacheError, match=row[3]):
        multi_head_cache_attention(query, decoding_batches=np.array(0, np.int64), num_heads=max(heads, 1),
                                   head_dim=max(head_dim, 1), is_causal=0, **inputs, **attributes)
    assert {k: np.asarray(inputs[k]).tobytes() for k in before} == before


@pytest.mark.parametrize("change, message", [
    (lambda i, a: a.update(num_heads=3), r"num_kv_heads must be 0 \(= num_heads\) or divide num_heads = 3"),
    (lambda i, a: i.update(decoding_batches=np.array(9, np.int64)), "decoding_batches = 9 must be in"),
    (lambda i, a: i.update(query=i["query"][:, :, :-1]), "query"),
    (lambda i, a: i.update(attn_mask=np.zeros((1, 1), i["query"].dtype)), "attn_mask must have shape"),
    (lambda i, a: a.update(sliding_window=-1), "sliding_window"),
    (lambda i, a: a.update(softcap=-30.0), r"softcap must be finite and >= 0 \(0: off\), got -30"),
    (lambda i, a: a.update(softcap=float("nan")), "softcap must be finite and >= 0"),
])
def test_an_invalid_attention_rule_raises_before_the_cache_is_written(change, message):
    inputs, attributes = _valid()
    change(inputs, attributes)
    before = inputs["cache"].tobytes(), inputs["scale"].tobytes()
    with pytest.raises(MultiHeadAttentionError, match=message):
        multi_head_cache_attention(**inputs, **attributes)
    assert (inputs["cache"].tobytes(), inputs["scale"].tobytes()) == before


@pytest.mark.parametrize("with_mask", [False, True])
def test_the_schema_checks_and_reference_evaluator_runs_the_node_writing_the_cache(with_mask):
    """A one-node model passes onnx's full check with the schema (output typed and shaped like query); ppl.pmx
    writes 12 inputs with a scale, 13 with a mask; the cache is written in place."""
    inputs, attributes = _valid()
    if with_mask:
        inputs["attn_mask"] = np.zeros((inputs["query"].shape[0], int(inputs["kvstarts"][-1])), inputs["query"].dtype)
    model = spec.make_cache_attention_model(inputs, **attributes)
    assert len(model.graph.node[0].input) == (13 if with_mask else 12)
    onnx.checker.check_model(model, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    output = inferred.graph.output[0].type.tensor_type
    assert [d.dim_value for d in output.shape.dim][1:] == list(inputs["query"].shape[1:])
    feeds = {k: v.copy() for k, v in inputs.items()}
    (got,) = ReferenceEvaluator(model, new_ops=[MultiHeadCacheAttention]).run(None, feeds)
    fresh = {k: v.copy() for k, v in inputs.items()}
    want = multi_head_cache_attention(**fresh, **attributes)
    assert got.tobytes() == want.tobytes()
    assert feeds["cache"].tobytes() == fresh["cache"].tobytes() != inputs["cache"].tobytes()


def test_node_attributes_write_the_extensions_only_when_set_and_refuse_unknown_ones():
    from kvcache_op.spec.mhca_schema import cache_attention_node_attributes

    node = cache_attention_node_attributes(dict(num_heads=4, head_dim=8))
    assert "softcap" not in node and "sliding_window" not in node and node["page_size"] == 128
    assert "num_repeat" not in node
    with pytest.raises(ValueError, match="unknown MultiHeadCacheAttention attribute"):
        cache_attention_node_attributes(dict(num_heads=4, head_dim=8, num_repeat=2))


def test_the_kit_validates_and_fuzzes_the_op(all_vectors, monkeypatch):
    """A backend whose stores come after its loads passes no valid MultiHeadCacheAttention case but the empty
    batch, and fuzzing finds it; ONNX Runtime's kernel passes every case."""
    import pathlib

    from kvcache_op.validation import fuzz, load_backend, validate

    monkeypatch.chdir(pathlib.Path(__file__).parent)
    report = validate(all_vectors, "planted_backends:cache_attention_loads_first", cases=["mhca_*"], isolate=False)
    failed = {r.name for r in report.results if r.status == "FAIL"}
    valid = {r.name for r in report.results if r.kind == "valid"}
    assert valid - {"mhca_batch0"} <= failed and "mhca_batch0" not in failed
    assert not failed - valid  # its invalid calls are refused as they should be
    backend = load_backend("planted_backends:cache_attention_loads_first", isolate=False)
    result = fuzz(backend, examples=60, seed=0, kinds=("valid",))
    assert result.failure is not None and result.failure[0].op == "MultiHeadCacheAttention"
    ran = validate(all_vectors, "ort", cases=["mhca_*"], isolate=False)
    assert {r.status for r in ran.results} == {"ok"} and len(ran.results) >= 90
