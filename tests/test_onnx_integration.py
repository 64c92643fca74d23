"""Schema (checker, shape inference) and ReferenceEvaluator running the same models as ORT."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from kvcache_op import spec
from kvcache_op.reference import KeyValueCache, key_value_cache
from kvcache_op.validation.cases import CASES


def copy_inputs(inputs):
    return {k: v.copy() for k, v in inputs.items() if v is not None}


@pytest.mark.parametrize("name", ["offset_layout0", "paged_layout3", "int8_layout2", "int4_layout1",
                                  "t1_bfloat16_int8_scale_float16", "gqa_repeat4_int8_paged", "batch0"])
def test_reference_evaluator_equals_direct_call(name):
    case = CASES[name]()
    model = spec.make_model(case.inputs, **case.attributes)
    onnx.checker.check_model(model, full_check=True)
    feeds = copy_inputs(case.inputs)
    key, value = ReferenceEvaluator(model, new_ops=[KeyValueCache]).run(None, feeds)
    direct = copy_inputs(case.inputs)
    want_key, want_value = key_value_cache(**{**{"scale": None}, **direct}, **case.attributes)
    assert key.tobytes() == want_key.tobytes() and value.tobytes() == want_value.tobytes()
    assert feeds["cache"].tobytes() == direct["cache"].tobytes()  # the evaluator wrote the feed in place
    if "scale" in feeds:
        assert feeds["scale"].tobytes() == direct["scale"].tobytes()


def ppl_style_model(with_scale, quant_bit):
    """A graph as ppl.pmx exports it: its own input names, every attribute written, scalar lengths."""
    names = ["k", "v", "seqstarts", "kvstarts", "cachestarts", "start_pos", "max_seqlen", "max_kvlen", "cache"]
    types = [TensorProto.FLOAT16] * 2 + [TensorProto.INT64] * 6 + [TensorProto.INT8 if quant_bit else TensorProto.FLOAT16]
    shapes = [["tokens", 2, 8]] * 2 + [["B1"], ["B1"], ["B"], ["B"], [], [], [16, 1, 2, 2, 8]]
    if with_scale:
        names.append("scale")
        types.append(TensorProto.FLOAT16)
        shapes.append([16, 1, 2, 2, 1])
    node = helper.make_node("KeyValueCache", names, ["key", "value"], domain="opmx.dynamic_batching",
                            num_layer=1, layer_idx=0, quant_bit=quant_bit, quant_group=8, num_repeat=1,
                            cache_mode=0, cache_layout=0, page_size=128)
    graph = helper.make_graph([node], "ppl", [helper.make_tensor_value_info(n, t, s) for n, t, s in zip(names, types, shapes)],
                              [helper.make_tensor_value_info("key", TensorProto.FLOAT16, ["kv", 2, 8]),
                               helper.make_tensor_value_info("value", TensorProto.FLOAT16, ["kv", 2, 8])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("opmx.dynamic_batching", 1)],
                             ir_version=10)


@pytest.mark.parametrize("with_scale,quant_bit", [(False, 0), (True, 8)])
def test_ppl_pmx_style_graph_loads_checks_and_runs(with_scale, quant_bit):
    model = ppl_style_model(with_scale, quant_bit)
    onnx.checker.check_model(model, full_check=True)
    rng = np.random.default_rng(0)
    feeds = {"k": rng.standard_normal((3, 2, 8)).astype(np.float16), "v": rng.standard_normal((3, 2, 8)).astype(np.float16),
             "seqstarts": np.array([0, 3], np.int64), "kvstarts": np.array([0, 5], np.int64),
             "cachestarts": np.array([4], np.int64), "start_pos": np.array([2], np.int64),
             "max_seqlen": np.array(3, np.int64), "max_kvlen": np.array(5, np.int64),
             "cache": np.zeros((16, 1, 2, 2, 8), np.int8 if quant_bit else np.float16)}
    if with_scale:
        feeds["scale"] = np.zeros((16, 1, 2, 2, 1), np.float16)
    key, _ = ReferenceEvaluator(model, new_ops=[KeyValueCache]).run(None, feeds)
    assert key.shape == (5, 2, 8)
    np.testing.assert_allclose(key[2:].astype(np.float32), feeds["k"].astype(np.float32), atol=0.02 if quant_bit else 0)


def test_schema_is_registered_once_and_describes_the_op():
    spec.register()
    spec.register()  # idempotent: a second registration neither raises nor duplicates
    matches = [s for s in onnx.defs.get_all_schemas_with_history()
               if (s.domain, s.name) == ("opmx.dynamic_batching", "KeyValueCache")]
    assert len(matches) == 1
    schema = onnx.defs.get_schema("KeyValueCache", 1, "opmx.dynamic_batching")
    assert [i.name for i in schema.inputs] == list(spec.INPUTS)
    assert set(schema.attributes) == set(spec.ATTRIBUTE_DEFAULTS)


def test_checker_rejects_a_wrong_attribute_type():
    model = ppl_style_model(False, 0)
    node = model.graph.node[0]
    for attr in node.attribute:
        if attr.name == "num_layer":
            attr.CopyFrom(helper.make_attribute("num_layer", 1.0))
    with pytest.raises(onnx.checker.ValidationError):
        onnx.checker.check_model(model, full_check=True)


@pytest.mark.parametrize("index,elem", [(2, TensorProto.INT32), (0, TensorProto.INT8), (8, TensorProto.DOUBLE)])
def test_strict_shape_inference_rejects_a_wrong_input_type(index, elem):
    model = ppl_style_model(False, 0)
    model.graph.input[index].type.tensor_type.elem_type = elem
    with pytest.raises(onnx.shape_inference.InferenceError, match="unsupported type"):
        onnx.shape_inference.infer_shapes(model, strict_mode=True, check_type=True)


@pytest.mark.parametrize("num_repeat", [1, 3])
def test_shape_inference_gives_dtype_heads_and_constant_kv_tokens(num_repeat):
    model = ppl_style_model(False, 0)
    model.graph.ClearField("output")
    model.graph.output.extend([helper.make_tensor_value_info("key", TensorProto.UNDEFINED, None),
                               helper.make_tensor_value_info("value", TensorProto.UNDEFINED, None)])
    for attr in model.graph.node[0].attribute:
        if attr.name == "num_repeat":
            attr.i = num_repeat
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    out = inferred.graph.output[0].type.tensor_type
    assert out.elem_type == TensorProto.FLOAT16
    assert [d.dim_value for d in out.shape.dim][1:] == [2 * num_repeat, 8]
    assert not out.shape.dim[0].HasField("dim_value")
    # With kvstarts constant, the token count is known too.
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array([0, 4, 11], np.int64), "kvstarts"))
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    assert inferred.graph.output[1].type.tensor_type.shape.dim[0].dim_value == 11
    # A constant kvstarts ending below 0 is an invalid call (refused when run): the count stays unknown, never < 0.
    model.graph.initializer[-1].CopyFrom(onnx.numpy_helper.from_array(np.array([0, 3, -5], np.int64), "kvstarts"))
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    first = inferred.graph.output[1].type.tensor_type.shape.dim[0]
    assert not first.HasField("dim_value") or first.dim_value >= 0, first


def test_make_node_rejects_unknown_attributes():
    with pytest.raises(ValueError, match="unknown KeyValueCache attribute"):
        spec.make_node(num_layers=2)


def _evaluated_case(op: str, name: str, edit):
    """Runs case ``name`` of ``op`` in ReferenceEvaluator with its node edited by ``edit(node)``."""
    from kvcache_op.reference import KeyCacheRotaryShift, MultiHeadAttention, MultiHeadCacheAttention
    from kvcache_op.validation.vectors import ALL_CASES, node_model

    case = ALL_CASES[name]()
    model = node_model(op, case.inputs, case.attributes)
    edit(model.graph.node[0])
    feeds = {k: v.copy() for k, v in case.inputs.items() if v is not None}
    ops = [KeyValueCache, MultiHeadAttention, MultiHeadCacheAttention, KeyCacheRotaryShift]
    return ReferenceEvaluator(model, new_ops=ops).run(None, feeds)


OP_CASES = [("KeyValueCache", "paged_layout3", "page_size"),
            ("MultiHeadCacheAttention", "mhca_paged_gqa2", "page_size"),
            ("MultiHeadAttention", "mha_prefill_causal", "is_causal"),
            ("KeyCacheRotaryShift", "rotary_float16_half_split", "rotary_dim")]


@pytest.mark.parametrize("op, name, attribute", OP_CASES)
def test_reference_evaluator_refuses_an_attribute_the_op_does_not_have(op, name, attribute):
    """A misspelled attribute is an error, as in ONNX Runtime, not the default of the one meant."""
    def misspell(node):
        for attr in node.attribute:
            if attr.name == attribute:
                attr.name = attribute.replace("_", "")
                return
        node.attribute.append(helper.make_attribute(attribute.replace("_", ""), 1))

    from kvcache_op.reference import KeyValueCacheError

    with pytest.raises(KeyValueCacheError, match=rf"{op}: unknown attribute\(s\) \['{attribute.replace('_', '')}'\]"):
        _evaluated_case(op, name, misspell)


@pytest.mark.parametrize("op, name, attribute", OP_CASES)
def test_reference_evaluator_refuses_an_int_attribute_written_as_a_float(op, name, attribute):
    def as_float(node):
        value = next((helper.get_attribute_value(a) for a in node.attribute if a.name == attribute), 1)
        kept = [a for a in node.attribute if a.name != attribute]
        del node.attribute[:]
        node.attribute.extend(kept + [helper.make_attribute(attribute, float(value))])

    from kvcache_op.reference import KeyValueCacheError

    with pytest.raises(KeyValueCacheError, match=f"the attribute {attribute} must be of type INT, the node gives it "
                                                 "as FLOAT"):
        _evaluated_case(op, name, as_float)


def test_reference_evaluator_refuses_a_float_attribute_written_as_an_int():
    def scale_as_int(node):
        node.attribute.append(helper.make_attribute("softmax_scale", 1))

    from kvcache_op.reference import KeyValueCacheError

    with pytest.raises(KeyValueCacheError, match="softmax_scale must be of type FLOAT, the node gives it as INT"):
        _evaluated_case("MultiHeadAttention", "mha_prefill_causal", scale_as_int)
