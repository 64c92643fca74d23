"""An attribute the node sets with the wrong type is an error naming it when the session is created, on every
op: never taken for absent (which would silently run the spec's default)."""

import numpy as np
import onnx
import pytest
from onnx import helper

from kvcache_op import spec
from kvcache_op.ort_ops import make_session, run_model
from kvcache_op.validation.cases import CASES
from kvcache_op.validation.mha_cases import ATTENTION_CASES
from kvcache_op.validation.rotary_cases import CASES as ROTARY_CASES


def _model(op: str):
    if op == "KeyValueCache":
        case = CASES["paged_layout0"]()
        return spec.make_model(case.inputs, **case.attributes), case
    if op == "MultiHeadAttention":
        case = ATTENTION_CASES["mha_sliding_window3"]()
        return spec.make_attention_model(case.inputs, **case.attributes), case
    case = next(iter(ROTARY_CASES.values()))()
    return spec.make_rotary_shift_model(case.inputs, **case.attributes), case


def _with_attribute(model, name, value):
    """A copy of the one-node ``model`` whose attribute ``name`` is ``value`` (added or replaced)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    node = model.graph.node[0]
    kept = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend(kept + [helper.make_attribute(name, value)])
    return model


@pytest.mark.parametrize("op, name, value, expected, got", [
    ("MultiHeadAttention", "sliding_window", 2.0, "INT", "FLOAT"),
    ("MultiHeadAttention", "softmax_scale", 3, "FLOAT", "INT"),
    ("MultiHeadAttention", "num_heads", 4.0, "INT", "FLOAT"),
    ("MultiHeadAttention", "is_causal", "yes", "INT", "STRING"),
    ("KeyValueCache", "page_size", 4.0, "INT", "FLOAT"),
    ("KeyValueCache", "quant_bit", [8], "INT", "INTS"),
    ("KeyValueCache", "page_size", [4.0, 8.0], "INT", "FLOATS"),
    ("MultiHeadAttention", "softmax_scale", [0.5], "FLOAT", "FLOATS"),
    ("MultiHeadAttention", "num_heads", ["a", "b"], "INT", "a list, tensor or graph"),
    ("KeyCacheRotaryShift", "rotary_dim", 4.0, "INT", "FLOAT"),
])
def test_a_wrongly_typed_attribute_is_refused_by_name(op, name, value, expected, got):
    model, _ = _model(op)
    with pytest.raises(Exception) as error:
        make_session(_with_attribute(model, name, value))
    assert f"the attribute {name} must be of type {expected}, the node gives it as {got}" in str(error.value)


def test_the_right_types_still_run():
    model, case = _model("MultiHeadAttention")
    assert case.attributes.get("sliding_window")  # the case sets the window, so the test reads it
    (out,) = run_model(_with_attribute(model, "softmax_scale", 0.5), dict(case.inputs))
    assert out.shape == case.inputs["query"].shape and np.isfinite(out).all()


def test_a_missing_required_attribute_still_says_so():
    model, _ = _model("MultiHeadAttention")
    model = onnx.ModelProto.FromString(model.SerializeToString())
    node = model.graph.node[0]
    kept = [a for a in node.attribute if a.name != "head_dim"]
    del node.attribute[:]
    node.attribute.extend(kept)
    with pytest.raises(Exception, match="MultiHeadAttention needs the attribute head_dim"):
        make_session(model)


@pytest.mark.parametrize("op, name", [("KeyValueCache", "pagesize"), ("MultiHeadAttention", "slidingwindow"),
                                      ("KeyCacheRotaryShift", "rotary_dimension")])
def test_a_misspelt_attribute_is_refused_by_name(op, name):
    """ONNX Runtime cannot list a node's attributes to the kernel: the package's sessions check them against the
    op's schema, so a misspelt attribute is not silently replaced by the default of the one meant."""
    model, _ = _model(op)
    with pytest.raises(ValueError, match=rf"{op} node .*: unknown attribute\(s\) \['{name}'\]"):
        make_session(_with_attribute(model, name, 4))


@pytest.mark.parametrize("version", [None, 0])
def test_a_model_that_does_not_import_the_ops_domain_is_refused_by_name(version):
    """Without the import ONNX Runtime would run it (onnx's checker refuses it); at version 0 it would fail with
    "KeyValueCache(-1) is not a registered function/op"."""
    model, _ = _model("KeyValueCache")
    kept = [entry for entry in model.opset_import if entry.domain != "opmx.dynamic_batching"]
    del model.opset_import[:]
    model.opset_import.extend(kept + ([helper.make_opsetid("opmx.dynamic_batching", version)] if version == 0 else []))
    said = "gives opmx.dynamic_batching version 0" if version == 0 else "lacks opmx.dynamic_batching"
    with pytest.raises(ValueError, match=f"the model's opset_import {said}; import it at version 1"):
        make_session(model)
