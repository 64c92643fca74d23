"""ppl.pmx exports an unquantized cache with an empty ``kv_scale`` tensor as the tenth input. The spec
treats a zero-element scale with ``quant_bit == 0`` as absent: every backend runs such a call exactly as
one without a scale, and still refuses a non-empty scale (or an empty one when quantizing)."""

import numpy as np
import onnx
import pytest
from onnx import helper

from kvcache_op import spec
from kvcache_op.capi import c_api
from kvcache_op.ort_ops import make_session, run_model
from kvcache_op.reference import KeyValueCacheError, key_cache_rotary_shift, key_value_cache, rotary_shift_tables
from kvcache_op.validation.cases import CASES
from ort_helpers import assert_same_bits, copies, reference_result

EMPTY_SCALES = [np.zeros(0, np.float16), np.zeros((0,), np.float32), np.zeros((2, 0, 3), np.float32)]
UNQUANTIZED = ["offset_layout0", "paged_layout3", "gqa_repeat2", "t1_bfloat16", "batch0", "decode_batch_paged"]


def _with_scale(inputs, scale):
    fresh = copies(inputs)
    fresh["scale"] = scale
    return fresh


def _model_with_scale_input(case, scale):
    """The case's model with ``scale`` as a graph input feeding the node's tenth input."""
    inputs = dict(case.inputs, scale=scale)
    return spec.make_model(inputs, **case.attributes)


@pytest.mark.parametrize("name", UNQUANTIZED)
@pytest.mark.parametrize("scale", EMPTY_SCALES, ids=lambda s: f"{s.dtype}{s.shape}")
def test_reference_and_c_entry_treat_an_empty_scale_as_absent(name, scale):
    case = CASES[name]()
    want = reference_result(case.inputs, case.attributes)
    fresh = _with_scale(case.inputs, scale)
    got = key_value_cache(**fresh, **case.attributes)
    assert_same_bits((*got, fresh["cache"]), want[:3])
    fresh = _with_scale(case.inputs, scale)
    got = c_api.key_value_cache(**fresh, **case.attributes)
    assert_same_bits((*got, fresh["cache"]), want[:3])


@pytest.mark.parametrize("name", UNQUANTIZED)
def test_ort_runs_a_graph_whose_tenth_input_is_an_empty_scale(name):
    case = CASES[name]()
    want = reference_result(case.inputs, case.attributes)
    scale = np.zeros(0, np.float16)
    model = _model_with_scale_input(case, scale)
    assert model.graph.node[0].input[9] == "scale"
    fresh = _with_scale(case.inputs, scale)
    key, value = run_model(model, {k: v for k, v in fresh.items()})
    assert_same_bits((key, value, fresh["cache"]), want[:3])


def test_ort_accepts_a_constant_empty_scale_when_unquantized():
    """With quant_bit 0 the scale is never written, so a constant placeholder is not an in-place input."""
    case = CASES["offset_layout0"]()
    want = reference_result(case.inputs, case.attributes)
    model = spec.make_model(case.inputs, **case.attributes)
    model.graph.node[0].input.append("empty_scale")
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.zeros(0, np.float32), "empty_scale"))
    fresh = copies(case.inputs)
    key, value = run_model(model, {k: v for k, v in fresh.items() if v is not None})
    assert_same_bits((key, value, fresh["cache"]), want[:3])


@pytest.mark.parametrize("scale", [np.zeros(1, np.float32), np.zeros((1, 2), np.float16)])
def test_a_non_empty_scale_without_quantization_is_still_an_error(scale):
    case = CASES["offset_layout0"]()
    fresh = _with_scale(case.inputs, scale)
    before = fresh["cache"].tobytes()
    with pytest.raises(KeyValueCacheError, match="scale must be absent when quant_bit is 0"):
        key_value_cache(**fresh, **case.attributes)
    with pytest.raises(KeyValueCacheError, match="scale must be absent when quant_bit is 0"):
        c_api.key_value_cache(**fresh, **case.attributes)
    session = make_session(_model_with_scale_input(case, scale))
    with pytest.raises(Exception, match="scale must be absent when quant_bit is 0"):
        run_model(None, fresh, session=session)
    assert fresh["cache"].tobytes() == before


def test_an_empty_scale_is_an_error_when_quantizing():
    case = CASES["int8_layout0"]()
    fresh = _with_scale(case.inputs, np.zeros(0, np.float32))
    before = fresh["cache"].tobytes()
    for backend in (key_value_cache, c_api.key_value_cache):
        with pytest.raises(KeyValueCacheError, match="scale shape must be"):
            backend(**fresh, **case.attributes)
    assert fresh["cache"].tobytes() == before


def test_rotary_shift_treats_an_empty_scale_as_absent():
    rng = np.random.default_rng(3)
    cache = rng.standard_normal((5, 1, 2, 2, 4)).astype(np.float32)  # layout 0: (MaxT, L, 2, H, Dh)
    slots = np.array([0, 3], np.int64)
    cos, sin = rotary_shift_tables(np.array([2, -1]), 4)
    want = cache.copy()
    key_cache_rotary_shift(want, None, slots, cos, sin)
    for backend in (key_cache_rotary_shift, c_api.key_cache_rotary_shift):
        got = cache.copy()
        backend(got, np.zeros(0, np.float16), slots, cos, sin)
        assert got.tobytes() == want.tobytes()
        with pytest.raises(KeyValueCacheError, match="scale must be absent"):
            backend(cache.copy(), np.zeros(2, np.float16), slots, cos, sin)


def test_graph_rules_let_an_unquantized_scale_come_from_anywhere():
    from kvcache_op.ort_ops.graph_rules import in_place_inputs

    case = CASES["offset_layout0"]()
    model = spec.make_model(case.inputs, **case.attributes)
    model.graph.node[0].input.append("computed_scale")
    model.graph.node.insert(0, helper.make_node("Constant", [], ["computed_scale"],
                                                value=onnx.numpy_helper.from_array(np.zeros(0, np.float32))))
    assert in_place_inputs(model) == {"cache"}
    quantized = CASES["int8_layout0"]()
    model = spec.make_model(quantized.inputs, **quantized.attributes)
    model.graph.node[0].input[9] = "computed_scale"
    model.graph.node.insert(0, helper.make_node("Identity", ["scale"], ["computed_scale"]))
    with pytest.raises(ValueError, match="computed by another node"):
        in_place_inputs(model)
