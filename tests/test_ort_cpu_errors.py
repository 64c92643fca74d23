"""Every validity condition through ONNX Runtime: a clear error, and the cache byte-for-byte unchanged; and a
valid call the conditions must not refuse (junk in pages it does not touch)."""

import numpy as np
import pytest

from kvcache_op import spec
from kvcache_op.ort_ops import make_session, run_model
from invalid_calls import INVALID, make_invalid
from ort_helpers import assert_same_bits, ort_result, reference_result

# Wrong dtypes of the index inputs never reach the kernel: the op declares them int64, so ONNX Runtime
# refuses the model when the session is created. Attribute values are refused there too, by the kernel.
AT_SESSION_CREATION = {"seqstarts_int32", "cachestarts_int32", "max_kvlen_float"}
ATTRIBUTE_ROWS = {"num_layer_zero", "layer_idx_too_big", "layer_idx_negative", "quant_bit_unsupported",
                  "quant_group_zero", "num_repeat_zero", "cache_mode_2", "cache_layout_4", "page_size_zero",
                  "num_repeat_heads_overflow"}  # H is static in these models: H * num_repeat is checked then too


@pytest.mark.parametrize("row", INVALID, ids=[r[0] for r in INVALID])
def test_invalid_input_fails_through_ort_and_writes_nothing(row):
    inputs, attrs = make_invalid(row)
    feeds = {k: v for k, v in inputs.items() if v is not None}
    before = {k: feeds[k].tobytes() for k in ("cache", "scale") if k in feeds}
    model = spec.make_model(inputs, **attrs)
    if row[0] in AT_SESSION_CREATION | ATTRIBUTE_ROWS:
        with pytest.raises(Exception) as error:
            make_session(model)
        if row[0] in ATTRIBUTE_ROWS:
            assert error.match(row[3])
        else:  # ONNX Runtime's own type check of the schema, naming the input
            name = row[0].rsplit("_", 1)[0]
            assert error.match(rf"Type Error: Type 'tensor\(\w+\)' of input parameter \({name}\)")
        return
    session = make_session(model)
    with pytest.raises(Exception, match=row[3]):
        run_model(model, feeds, session=session)
    assert {k: feeds[k].tobytes() for k in before} == before


def test_attribute_error_comes_at_session_creation_with_the_reason():
    inputs, attrs = make_invalid(next(r for r in INVALID if r[0] == "cache_layout_4"))
    with pytest.raises(Exception, match="cache_layout must be 0, 1, 2 or 3, got 4"):
        make_session(spec.make_model(inputs, **attrs))


def test_plain_run_with_numpy_feeds_writes_the_callers_cache():
    """CPU EP + InferenceSession.run with C-contiguous numpy arrays: writes land in the caller's array."""
    from kvcache_op.validation.cases import CASES

    case = CASES["int8_layout0"]()
    feeds = {k: v.copy() for k, v in case.inputs.items() if v is not None}
    want = {k: v.copy() for k, v in case.inputs.items()}
    from kvcache_op.reference import key_value_cache

    key, _ = key_value_cache(**want, **case.attributes)
    session = make_session(spec.make_model(case.inputs, **case.attributes))
    got_key, _ = session.run(None, feeds)
    assert got_key.tobytes() == key.tobytes()
    assert feeds["cache"].tobytes() == want["cache"].tobytes()
    assert feeds["scale"].tobytes() == want["scale"].tobytes()


def test_non_contiguous_cache_is_refused_before_running():
    from kvcache_op.validation.cases import CASES

    case = CASES["offset_layout0"]()
    model = spec.make_model(case.inputs, **case.attributes)
    feeds = {k: v for k, v in case.inputs.items() if v is not None}
    feeds["cache"] = np.asfortranarray(feeds["cache"])
    with pytest.raises(ValueError, match="C-contiguous"):
        run_model(model, feeds)


def test_constant_cache_is_refused_at_session_creation():
    """By the library itself (a plain InferenceSession), not only by the project's session helpers."""
    import onnx
    import onnxruntime as ort

    from kvcache_op.ort_ops import session_options
    from kvcache_op.validation.cases import CASES

    case = CASES["offset_layout0"]()
    model = spec.make_model(case.inputs, **case.attributes)
    model.graph.initializer.append(onnx.numpy_helper.from_array(case.inputs["cache"], "cache"))
    del model.graph.input[8]
    with pytest.raises(Exception, match="cache is a constant initializer"):
        ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    with pytest.raises(ValueError, match="is an initializer"):
        make_session(model)


def test_a_minus_one_in_a_page_the_call_does_not_touch_runs_as_the_reference_says():
    """Storing position 4 (page 1) with kvlen 0 never reads page 0's entry: ORT accepts the call and writes
    what the reference writes (slot 0)."""
    current = np.array([[[5, 6]]], np.float32)
    inputs = dict(current_key=current, current_value=-current, seqstarts=np.array([0, 1]), kvstarts=np.array([0, 0]),
                  cachestarts=np.array([[-1, 0]]), start_pos=np.array([4]), max_seqlen=np.array(1),
                  max_kvlen=np.array(0), cache=np.arange(32, dtype=np.float32).reshape(8, 1, 2, 1, 2), scale=None)
    attrs = dict(cache_mode=1, page_size=4)
    want = reference_result(inputs, attrs)
    assert want[2][0, 0, :, 0].tolist() == [[5, 6], [-5, -6]]
    assert_same_bits(ort_result(inputs, attrs), want)


def test_a_minus_one_in_a_page_between_the_loaded_and_the_stored_ones_runs_as_the_reference_says():
    """kvlen 4 loads page 0 and position 8 stores into page 2: page 1, between them, is never read (a loaded page
    count one too many would refuse the call). ORT accepts it and matches the reference."""
    current = np.array([[[5, 6]]], np.float32)
    inputs = dict(current_key=current, current_value=-current, seqstarts=np.array([0, 1]), kvstarts=np.array([0, 4]),
                  cachestarts=np.array([[0, -1, 4]]), start_pos=np.array([8]), max_seqlen=np.array(1),
                  max_kvlen=np.array(4), cache=np.arange(32, dtype=np.float32).reshape(8, 1, 2, 1, 2), scale=None)
    attrs = dict(cache_mode=1, page_size=4)
    want = reference_result(inputs, attrs)
    assert want[2][4, 0, :, 0].tolist() == [[5, 6], [-5, -6]]  # stored at page 2's first slot
    assert want[0][:, 0].tolist() == [[0, 1], [4, 5], [8, 9], [12, 13]]  # keys of slots 0..3
    assert_same_bits(ort_result(inputs, attrs), want)
