"""The MultiHeadAttention CPU kernel through ONNX Runtime and through the C entry point: within the spec's
bound of the independent float64 oracle, exact zeros for rows without keys, deterministic across thread
counts, every CPU build within the bound; plus the schema and shape inference."""

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx.reference import ReferenceEvaluator

from attention_strategies import attention_calls, copies
from cpu_kernels import CPU_KERNELS, use_cpu_kernel
from kvcache_op import spec
from kvcache_op.capi import c_api
from kvcache_op.ort_ops import make_session, run_model
from kvcache_op.reference import MultiHeadAttention, attention_tolerance, multi_head_attention
from kvcache_op.validation.mha_cases import ATTENTION_CASES, build_attention
from test_mha_reference import assert_within, oracle


def ort_output(case, threads=1):
    model = spec.make_attention_model(case.inputs, **case.attributes)
    session = make_session(model, intra_op_num_threads=threads)
    (out,) = run_model(model, {k: v for k, v in copies(case.inputs).items() if v is not None}, session=session)
    return out


def c_output(case, threads=1):
    return c_api.multi_head_attention(**copies(case.inputs), **case.attributes, num_threads=threads)


@settings(max_examples=2 * settings.default.max_examples)  # twice the profile's: the main property
@given(attention_calls(), st.sampled_from((1, 2)))
def test_ort_is_within_the_bound_of_the_exact_result(case, threads):
    exact, bound = oracle(case)
    got = ort_output(case, threads)
    assert got.dtype == case.inputs["query"].dtype and got.shape == case.inputs["query"].shape
    assert_within(got, exact, bound, "ORT")
    assert np.all(got[bound == 0] == 0), "a row without an effective key must be exactly zero"


@settings(max_examples=settings.default.max_examples)
@given(attention_calls(), st.sampled_from((1, 3)))
def test_c_entry_is_within_the_bound_of_the_exact_result(case, threads):
    exact, bound = oracle(case)
    assert_within(c_output(case, threads), exact, bound, "C entry")


@pytest.mark.parametrize("name", sorted(ATTENTION_CASES))
def test_named_cases_through_ort_are_within_twice_the_bound_of_the_reference(name):
    case = ATTENTION_CASES[name]()
    want = multi_head_attention(**case.inputs, **case.attributes)
    tolerance = 2 * attention_tolerance(**case.inputs, **case.attributes)
    assert_within(ort_output(case, 2), want.astype(np.float64), tolerance, name)


def large_case(t="float16", **kw):
    """Decodes and chunks long enough for many tasks, head_dim 128 (the vector paths), GQA and a window."""
    seqs = [(1, 300), (1, 77), (16, 200), (1, 5), (24, 24), (1, 129)]
    return build_attention("large", seqs, heads=8, kv_heads=2, head_dim=128, decoding=2, t=t, **kw)


@pytest.mark.parametrize("t", ["float32", "float16", "bfloat16"])
def test_large_calls_match_the_reference_and_do_not_depend_on_threads(t):
    case = large_case(t, sliding_window=50, mask=2, is_alibi=1)
    want = multi_head_attention(**case.inputs, **case.attributes)
    tolerance = 2 * attention_tolerance(**case.inputs, **case.attributes)
    one = ort_output(case, 1)
    assert_within(one, want.astype(np.float64), tolerance, "ORT, 1 thread")
    assert ort_output(case, 2).tobytes() == one.tobytes()  # each (sequence, head) is one task: same bits
    assert c_output(case, 4).tobytes() == one.tobytes()  # and the C entry runs the same kernel


@pytest.mark.parametrize("t", ["float32", "bfloat16"])
def test_long_decodes_split_over_their_keys_match_the_oracle_whatever_the_threads(t):
    """Two decodes of thousands of keys are too few tasks for the threads: their keys are split into ranges
    whose partial softmaxes are merged (log-sum-exp). The result is the oracle's, and the same bits on any
    number of threads (the split follows the shapes, not the threads)."""
    case = build_attention("split", [(1, 3000), (1, 1500)], heads=8, kv_heads=2, head_dim=64, t=t,
                           sliding_window=2000, mask=2)
    exact, bound = oracle(case)
    one = ort_output(case, 1)
    assert_within(one, exact, bound, "ORT, 1 thread")
    assert ort_output(case, 2).tobytes() == one.tobytes()


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@settings(max_examples=settings.default.max_examples, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # the build is the same for every example
@given(case=attention_calls(max_batch=3, max_kvlen=48, max_seqlen=40, head_dims=(1, 5, 16, 20, 33, 40)))
def test_prefill_tiles_on_every_build_are_within_the_bound_of_the_exact_result(monkeypatch, kernel, case):
    """Sequences of many queries run as tiled products: several tiles of query rows, the causal edge and window
    starts handled row by row, head dims and key counts that are not whole tiles, masks, ALiBi and softcap."""
    use_cpu_kernel(monkeypatch, kernel)
    exact, bound = oracle(case)
    got = c_output(case, 2)
    assert_within(got, exact, bound, f"{kernel} build")
    assert np.all(got[bound == 0] == 0), "a row without an effective key must be exactly zero"


@st.composite
def tiled_decodes(draw):
    """Decoding sequences of 0-100 keys (blocks of keys and ragged last blocks) with query heads per kv head that are
    not powers of two (3, 5, 6, 7, 9, 12: tiles of 8, 4, 2 and 1 heads), head dims of 1 to 8 vectors (8, 16, 48, 80, 128,
    and 20, which has no tiles), windows, masks, ALiBi and softcap."""
    heads, kv_heads = draw(st.sampled_from(((9, 1), (12, 1), (14, 2), (10, 2), (7, 1), (6, 2), (3, 3), (5, 5), (16, 2))))
    seqs = [(1, draw(st.integers(0, 100))) for _ in range(draw(st.integers(1, 3)))]
    return build_attention(
        "tiled-decode", seqs, heads=heads, kv_heads=kv_heads, head_dim=draw(st.sampled_from((8, 16, 48, 80, 128, 20))),
        t=draw(st.sampled_from(("float32", "float16", "bfloat16"))), decoding=len(seqs),
        is_alibi=draw(st.integers(0, 1)), sliding_window=draw(st.sampled_from((0, 0, 7, 40))),
        softcap=draw(st.sampled_from((0.0, 0.0, 5.0))), mask=draw(st.sampled_from((None, None, 2, 3))),
        mask_neg_inf=draw(st.sampled_from((0.0, 0.3))), seed=draw(st.integers(0, 2**32 - 1)))


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@settings(max_examples=settings.default.max_examples, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # the build is the same for every example
@given(case=tiled_decodes())
def test_decode_tiles_on_every_build_are_within_the_bound_of_the_exact_result(monkeypatch, kernel, case):
    """Decode steps run in blocks of keys, each block's dot products and value rows computed in register tiles of
    up to 8 query heads of one kv head: every head count, head dim and ragged key count lands within the bound."""
    use_cpu_kernel(monkeypatch, kernel)
    exact, bound = oracle(case)
    got = c_output(case, 2)
    assert_within(got, exact, bound, f"{kernel} build")
    assert np.all(got[bound == 0] == 0), "a row without an effective key must be exactly zero"


@pytest.mark.parametrize("kernel", CPU_KERNELS)
def test_every_build_is_within_the_bound_and_deterministic(monkeypatch, kernel):
    use_cpu_kernel(monkeypatch, kernel)
    case = large_case("float16", mask=3)
    want = multi_head_attention(**case.inputs, **case.attributes)
    tolerance = 2 * attention_tolerance(**case.inputs, **case.attributes)
    got = c_output(case)
    assert_within(got, want.astype(np.float64), tolerance, f"{kernel} build")
    assert c_output(case, 2).tobytes() == got.tobytes()


def test_conformance_vectors_run_through_ort(tmp_path):
    from kvcache_op.validation import vectors
    from kvcache_op.validation.validate import compare_case

    vectors.write_conformance(tmp_path, list(ATTENTION_CASES), progress=None)
    failures = {name: compare_case(tmp_path / vectors.folder_name(name), "ort") for name in ATTENTION_CASES}
    assert {k: v for k, v in failures.items() if v} == {}


def test_the_kits_fuzz_with_infinities_and_nans_finds_no_disagreement_with_ort():
    """The kit's fuzz draws attention calls holding infinities and NaNs (one in three): ONNX Runtime's kernel gives
    non-finite elements where the reference does, and the rest within the bound."""
    from kvcache_op.validation import fuzz, load_backend

    result = fuzz(load_backend("ort"), examples=150, seed=5, ops=["MultiHeadAttention"], kinds=("valid",),
                  tolerance="spec")
    assert result.failure is None, result.failure


@pytest.mark.parametrize("name", ["mha_mixed_decode_chunk_prefill", "mha_mask_rank3_float32", "mha_alibi_heads6_gqa",
                                  "mha_batch0", "mha_gqa_group4_bfloat16"])
def test_schema_checks_and_reference_evaluator_runs_the_same_model(name):
    case = ATTENTION_CASES[name]()
    model = spec.make_attention_model(case.inputs, **case.attributes)
    onnx.checker.check_model(model, full_check=True)
    feeds = {k: v for k, v in case.inputs.items() if v is not None}
    (got,) = ReferenceEvaluator(model, new_ops=[MultiHeadAttention]).run(None, feeds)
    assert got.tobytes() == multi_head_attention(**case.inputs, **case.attributes).tobytes()


def test_shape_inference_gives_query_type_and_shape():
    case = ATTENTION_CASES["mha_mqa"]()
    model = spec.make_attention_model(case.inputs, **case.attributes)
    model.graph.output[0].type.tensor_type.ClearField("shape")  # nothing declared: inference must say it
    model.graph.output[0].type.tensor_type.elem_type = 0
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    value = {v.name: v for v in list(inferred.graph.value_info) + list(inferred.graph.output)}["attention_output"]
    dims = value.type.tensor_type.shape.dim
    assert value.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    assert [d.dim_param or d.dim_value for d in dims] == ["query_d0", 4, 8]
    session = make_session(spec.make_attention_model(case.inputs, **case.attributes))
    assert session.get_outputs()[0].shape[1:] == [4, 8] and session.get_outputs()[0].type == "tensor(float16)"


def test_schema_requires_num_heads_and_head_dim_and_refuses_unknown_attributes():
    case = ATTENTION_CASES["mha_mqa"]()
    with pytest.raises(ValueError, match="needs attribute"):
        spec.make_attention_model(case.inputs, head_dim=8)
    with pytest.raises(ValueError, match="unknown MultiHeadAttention attribute"):
        spec.make_attention_model(case.inputs, num_heads=4, head_dim=8, window=3)
    node = spec.make_attention_model(case.inputs, **case.attributes).graph.node[0]
    names = [a.name for a in node.attribute]
    assert "sliding_window" not in names and "softmax_scale" not in names  # a default node is ppl's
    assert {"num_heads", "head_dim", "is_causal", "is_alibi", "num_kv_heads"} <= set(names)


def test_a_ppl_style_graph_without_the_extensions_runs():
    """ppl.pmx's node: inputs by its names, attributes num_heads/head_dim/is_causal/is_alibi/num_kv_heads only."""
    from onnx import TensorProto, helper

    names = ["q", "k", "v", "seqstarts", "kvstarts", "decoding_batches", "max_seqlen", "max_kvlen"]
    node = helper.make_node("MultiHeadAttention", names, ["o"], domain="opmx.dynamic_batching", num_heads=2,
                            head_dim=8, is_causal=1, is_alibi=0, num_kv_heads=1)
    types = [TensorProto.FLOAT16] * 3 + [TensorProto.INT64] * 5
    shapes = [["t", 2, 8], ["kv", 1, 8], ["kv", 1, 8], ["b1"], ["b1"], [1], [], []]
    graph = helper.make_graph([node], "ppl", [helper.make_tensor_value_info(n, t, s) for n, t, s in zip(names, types, shapes)],
                              [helper.make_tensor_value_info("o", TensorProto.FLOAT16, ["t", 2, 8])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("opmx.dynamic_batching", 1)], ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    case = build_attention("ppl", [(1, 4), (3, 3)], heads=2, kv_heads=1, decoding=1)
    feeds = dict(zip(names, [case.inputs[n] for n in ("query", "key", "value", "seqstarts", "kvstarts")] +
                     [np.array([1], np.int64), case.inputs["max_seqlen"], case.inputs["max_kvlen"]]))
    (got,) = make_session(model).run(None, feeds)
    exact, bound = oracle(case)
    assert_within(got, exact, bound, "ppl-style graph")



def test_run_model_copies_inputs_that_are_only_read_whatever_their_order():
    """A Fortran-ordered key or a transposed query is only read by MultiHeadAttention: run_model copies it
    (as the C entry point accepts it) and the answer is the reference's."""
    case = ATTENTION_CASES["mha_sliding_window3"]()
    model = spec.make_attention_model(case.inputs, **case.attributes)
    inputs = dict(case.inputs)
    inputs["key"] = np.asfortranarray(inputs["key"])
    inputs["query"] = np.ascontiguousarray(inputs["query"].transpose(1, 0, 2)).transpose(1, 0, 2)
    assert not inputs["key"].flags.c_contiguous and not inputs["query"].flags.c_contiguous
    (got,) = run_model(model, inputs)
    want = multi_head_attention(**case.inputs, **case.attributes)
    assert np.all(np.abs(got.astype(np.float64) - want) <= attention_tolerance(**case.inputs, **case.attributes))
