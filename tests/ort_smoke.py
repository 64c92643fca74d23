"""A short tour of the library through ONNX Runtime, for a fresh interpreter with another onnxruntime first
on ``sys.path`` or with the library behind the API fence (``$KVCACHE_OP_LIBRARY`` names what is registered).

It takes every ONNX Runtime path of the library once: registration, shape inference (static and symbolic
heads), the kernel constructor's attribute and constant-initializer checks, calls large enough for ORT's
thread pool, an invalid call, KeyCacheRotaryShift, and MultiHeadAttention. ``main`` prints DONE when all checks passed.
"""

import sys

import numpy as np

DONE = "smoke checks passed"


def _valid_calls():
    """Bit-exact against the reference, cache included: int4 paged and float16 offset, 70 + 2 tokens each
    (more than one parallel task), the second with a symbolic H in the graph."""
    from kvcache_op.ort_ops import make_session, run_model
    from kvcache_op.validation.cases import Seq, build
    from ort_helpers import assert_same_bits, copies, model_for, reference_result

    seqs = [Seq(0, 70), Seq(3, 2)]
    int4 = build("smoke-int4", seqs, cache_mode=1, page_size=4, quant_bit=4, quant_group=4)
    f16 = build("smoke-f16", seqs, num_repeat=2)
    for case, symbolic in ((int4, False), (f16, True)):
        want = reference_result(case.inputs, case.attributes)
        fresh = copies(case.inputs)
        model = model_for(fresh, symbolic_heads=symbolic, **case.attributes)
        session = make_session(model, intra_op_num_threads=2)
        key, value = run_model(model, {k: v for k, v in fresh.items() if v is not None}, session=session)
        assert_same_bits((key, value, fresh["cache"], fresh["scale"]), want)


def _invalid_call():
    """The reference's error, and the cache and scale byte-for-byte unchanged."""
    from kvcache_op import spec
    from kvcache_op.ort_ops import make_session, run_model
    from kvcache_op.reference import key_value_cache
    from invalid_calls import INVALID, make_invalid
    from ort_helpers import copies

    inputs, attrs = make_invalid(next(r for r in INVALID if r[0] == "paged_page_beyond_max_p"))
    try:
        key_value_cache(**copies(inputs), **attrs)
    except ValueError as error:
        message = str(error)
    else:
        raise AssertionError("the reference accepted an invalid call")
    feeds = {k: v for k, v in inputs.items() if v is not None}
    before = feeds["cache"].tobytes()
    model = spec.make_model(inputs, **attrs)
    try:
        run_model(model, feeds, session=make_session(model))
    except Exception as error:  # noqa: BLE001 - ONNX Runtime raises its own exception types
        assert message in str(error), f"ORT said {error!r}, the reference {message!r}"
    else:
        raise AssertionError("ONNX Runtime ran an invalid call")
    assert feeds["cache"].tobytes() == before, "the cache changed"


def _session_creation_errors():
    """A bad attribute and a constant cache are refused by the kernel constructor."""
    import onnx
    import onnxruntime as ort

    from kvcache_op import spec
    from kvcache_op.ort_ops import make_session, session_options
    from kvcache_op.validation.cases import CASES
    from invalid_calls import INVALID, make_invalid

    inputs, attrs = make_invalid(next(r for r in INVALID if r[0] == "cache_layout_4"))
    _expect_error(lambda: make_session(spec.make_model(inputs, **attrs)), "cache_layout must be 0, 1, 2 or 3, got 4")
    case = CASES["offset_layout0"]()
    model = spec.make_model(case.inputs, **case.attributes)
    model.graph.initializer.append(onnx.numpy_helper.from_array(case.inputs["cache"], "cache"))
    del model.graph.input[8]
    _expect_error(lambda: ort.InferenceSession(model.SerializeToString(), session_options(),
                                               providers=["CPUExecutionProvider"]), "cache is a constant initializer")


def _rotary_call():
    from kvcache_op import spec
    from kvcache_op.ort_ops import make_session, ortvalue_for, to_numpy
    from kvcache_op.reference import cache_shape, key_cache_rotary_shift, rotary_shift_tables

    rng = np.random.default_rng(7)
    cache = (rng.standard_normal(cache_shape(0, 1, 8, 2, 8)) * 2).astype(np.float16)
    slots = np.array([3, 1, 6], dtype=np.int64)
    cos, sin = rotary_shift_tables(np.array([5, -2, 9]), 8)
    inputs = {"cache": cache, "scale": None, "slots": slots, "cos": cos, "sin": sin}
    want_cache = cache.copy()
    want_out = key_cache_rotary_shift(want_cache, None, slots, cos, sin)
    session = make_session(spec.make_rotary_shift_model(inputs))
    binding = session.io_binding()
    values = {info.name: ortvalue_for(inputs[info.name]) for info in session.get_inputs()}
    for name, value in values.items():
        binding.bind_ortvalue_input(name, value)
    binding.bind_output("slots_out", "cpu")
    session.run_with_iobinding(binding)
    assert np.array_equal(to_numpy(binding.get_outputs()[0]), want_out)
    assert cache.tobytes() == want_cache.tobytes(), "KeyCacheRotaryShift: the cache differs from the reference"


def _attention_call():
    """MultiHeadAttention: within the spec's bound of the reference (two threads), and an invalid call's message."""
    from kvcache_op import spec
    from kvcache_op.ort_ops import make_session, run_model
    from kvcache_op.reference import attention_tolerance, multi_head_attention
    from kvcache_op.validation.mha_cases import build_attention

    case = build_attention("smoke-mha", [(1, 40), (12, 20)], heads=4, kv_heads=2, decoding=1, mask=3, is_alibi=1,
                           sliding_window=9, softmax_scale=0.25)
    model = spec.make_attention_model(case.inputs, **case.attributes)
    feeds = {k: v for k, v in case.inputs.items() if v is not None}
    (got,) = run_model(model, feeds, session=make_session(model, intra_op_num_threads=2))
    want = multi_head_attention(**case.inputs, **case.attributes).astype(np.float64)
    assert np.all(np.abs(got.astype(np.float64) - want) <= 2 * attention_tolerance(**case.inputs, **case.attributes))
    bad = dict(feeds, decoding_batches=np.array(5, np.int64))
    _expect_error(lambda: run_model(model, bad, session=make_session(model)), "decoding_batches = 5 must be in [0, B=2]")
    _expect_error(lambda: make_session(spec.make_attention_model(case.inputs, **dict(case.attributes, num_kv_heads=3))),
                  "num_kv_heads must be 0 (= num_heads) or divide num_heads = 4, got 3")


def _expect_error(run, message):
    try:
        run()
    except Exception as error:  # noqa: BLE001 - ONNX Runtime raises its own exception types
        assert message in str(error), f"expected {message!r}, got {error!r}"
    else:
        raise AssertionError(f"no error; expected {message!r}")


def main():
    import onnxruntime

    print(f"onnxruntime {onnxruntime.__version__} from {onnxruntime.__file__}")
    _valid_calls()
    _invalid_call()
    _session_creation_errors()
    _rotary_call()
    _attention_call()
    print(DONE)


if __name__ == "__main__":
    sys.exit(main())
