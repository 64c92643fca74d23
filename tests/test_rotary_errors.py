"""Every rejection of KeyCacheRotaryShift through ONNX Runtime names only the op's own inputs (cache,
scale, slots, cos, sin) and attributes, never KeyValueCache's (current_key, ...), carries the
reference's message, and leaves the cache and scale unchanged."""

import re

import numpy as np
import pytest

from kvcache_op import spec
from kvcache_op.ort_ops import make_session, ortvalue_for
from kvcache_op.reference import INT4, KeyValueCacheError, cache_shape, key_cache_rotary_shift, rotary_shift_tables

KEY_VALUE_CACHE_ONLY = ("current_key", "current_value", "seqstarts", "kvstarts", "cachestarts", "start_pos",
                        "max_seqlen", "max_kvlen")


def valid_call(quant_bit=8, heads=2, head_dim=8, max_t=8):
    rng = np.random.default_rng(5)
    if quant_bit:
        cache = rng.integers(-7, 8, cache_shape(0, 1, max_t, heads, head_dim)).astype(np.int8 if quant_bit == 8 else INT4)
        scale = np.full(cache_shape(0, 1, max_t, heads, head_dim // 4), 0.02, np.float32)
    else:
        cache, scale = rng.standard_normal(cache_shape(0, 1, max_t, heads, head_dim)).astype(np.float32), None
    cos, sin = rotary_shift_tables(np.array([1, 2]), head_dim)
    inputs = {"cache": cache, "scale": scale, "slots": np.array([1, 2]), "cos": cos, "sin": sin}
    return inputs, dict(quant_bit=quant_bit, quant_group=4)


def with_(inputs=None, attrs=None, quant_bit=8, **call):
    base, base_attrs = valid_call(quant_bit, **call)
    return {**base, **(inputs or {})}, {**base_attrs, **(attrs or {})}


def zero_heads():
    inputs, attrs = valid_call(0)
    return {**inputs, "cache": np.zeros((8, 1, 2, 0, 8), np.float32)}, attrs


def zero_head_dim():
    inputs, attrs = valid_call(0)
    return {**inputs, "cache": np.zeros((8, 1, 2, 2, 0), np.float32)}, {**attrs, "rotary_dim": 0}


# name -> (inputs, attributes): one per rejection of spec/KeyCacheRotaryShift.md that ORT lets reach the op
# (slots/cos/sin of another dtype are refused by ORT itself: the op declares them int64/float32).
CASES = {
    "num_layer_zero": lambda: with_(attrs={"num_layer": 0}),
    "layer_idx": lambda: with_(attrs={"layer_idx": 1}),
    "quant_bit_3": lambda: with_(attrs={"quant_bit": 3}),
    "quant_group_zero": lambda: with_(attrs={"quant_group": 0}),
    "cache_layout_4": lambda: with_(attrs={"cache_layout": 4}),
    "cache_not_int8": lambda: with_({"cache": valid_call()[0]["cache"].astype(np.float32)}),
    "float_cache_int8": lambda: with_({"cache": valid_call()[0]["cache"]}, {"quant_bit": 0}, quant_bit=0),
    "cache_rank_4": lambda: with_({"cache": valid_call()[0]["cache"][0]}),
    "cache_zero_heads": zero_heads,
    "cache_zero_head_dim": zero_head_dim,
    "cache_kv_axis_3": lambda: with_({"cache": np.zeros((8, 1, 3, 2, 8), np.int8)}),
    "cache_num_layer_2": lambda: with_(attrs={"num_layer": 2}),
    "scale_with_float_cache": lambda: with_({"scale": np.ones(cache_shape(0, 1, 8, 2, 2), np.float32)}, quant_bit=0),
    "quant_group_3": lambda: with_(attrs={"quant_group": 3}),
    "int4_odd_head_dim": lambda: with_({"cache": np.zeros((8, 1, 2, 2, 3), INT4),
                                        "scale": np.ones((8, 1, 2, 2, 3), np.float32)},
                                       {"quant_bit": 4, "quant_group": 1, "rotary_dim": 2}, quant_bit=4),
    "scale_missing": lambda: with_({"scale": None}),
    "scale_float64": lambda: with_({"scale": np.ones(cache_shape(0, 1, 8, 2, 2), np.float64)}),
    "scale_shape": lambda: with_({"scale": np.ones(cache_shape(0, 1, 8, 2, 4), np.float32)}),
    "rotary_dim_odd": lambda: with_(attrs={"rotary_dim": 3}),
    "rotary_dim_too_big": lambda: with_(attrs={"rotary_dim": 10}),
    "interleaved_2": lambda: with_(attrs={"rotary_interleaved": 2}),
    "slots_2d": lambda: with_({"slots": np.array([[1, 2]])}),
    "cos_shape": lambda: with_({"cos": np.ones((2, 3), np.float32)}),
    "sin_shape": lambda: with_({"sin": np.ones((3, 4), np.float32)}),
    "slot_negative": lambda: with_({"slots": np.array([-1, 2])}),
    "slot_past_max_t": lambda: with_({"slots": np.array([1, 8])}),
    "slot_twice": lambda: with_({"slots": np.array([2, 2])}),
}

# The reference still names current_key for a cache with H or Dh of 0 (its cache check runs on a dummy
# key); the op's message names the cache.
OWN_MESSAGE = {"cache_zero_heads": "cache must have H >= 1 and Dh >= 1, got shape (8, 1, 2, 0, 8)",
               "cache_zero_head_dim": "cache must have H >= 1 and Dh >= 1, got shape (8, 1, 2, 2, 0)"}


def ort_error(inputs, attrs):
    """The message ORT fails with (session creation or run), or None when it accepts the call."""
    try:
        session = make_session(spec.make_rotary_shift_model(inputs, **attrs))
        binding = session.io_binding()
        values = {k: ortvalue_for(v) for k, v in inputs.items() if v is not None}
        for name, value in values.items():
            binding.bind_ortvalue_input(name, value)
        binding.bind_output("slots_out", "cpu")
        session.run_with_iobinding(binding)
    except Exception as error:  # noqa: BLE001 - the message is what is checked
        return str(error)
    return None


@pytest.mark.parametrize("name", sorted(CASES))
def test_rotary_rejection_names_only_rotary_inputs(name):
    inputs, attrs = CASES[name]()
    before = {k: inputs[k].tobytes() for k in ("cache", "scale") if inputs.get(k) is not None and inputs[k].dtype != INT4}
    with pytest.raises(KeyValueCacheError) as reference:
        key_cache_rotary_shift(**{k: (None if v is None else v.copy()) for k, v in inputs.items()}, **attrs)
    message = ort_error(inputs, attrs)
    assert message is not None, "ORT accepted a call the reference rejects"
    named = [word for word in KEY_VALUE_CACHE_ONLY if re.search(rf"\b{word}\b", message)]
    assert not named, f"KeyCacheRotaryShift error names {named}: {message}"
    assert OWN_MESSAGE.get(name, str(reference.value)) in message
    assert {k: inputs[k].tobytes() for k in before} == before
