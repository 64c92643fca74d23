"""Every rejection of KeyCacheRotaryShift through ONNX Runtime names only the op's own inputs (cache,
scale, slots, cos, sin) and attributes, never KeyValueCache's (current_key, ...), carries the
reference's message, and leaves the cache and scale unchanged."""

import re

import pytest

from kvcache_op import spec
from kvcache_op.ort_ops import make_session, ortvalue_for
from kvcache_op.reference import INT4, KeyValueCacheError, key_cache_rotary_shift
from kvcache_op.validation.rotary_cases import ERROR_CASES as CASES

KEY_VALUE_CACHE_ONLY = ("current_key", "current_value", "seqstarts", "kvstarts", "cachestarts", "start_pos",
                        "max_seqlen", "max_kvlen")


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
    assert str(reference.value) in message  # the reference's message, word for word
    assert {k: inputs[k].tobytes() for k in before} == before


def test_the_default_rotary_dim_over_an_odd_head_says_what_is_odd():
    """rotary_dim 0 means the whole head: the message says so, rather than that 0 is allowed but was refused."""
    inputs, attrs = CASES["rotary_dim0_odd_head_dim"]()
    message = "rotary_dim = 0 rotates the whole head, R = Dh = 3, which must be even and >= 2"
    with pytest.raises(KeyValueCacheError, match=re.escape(message)):
        key_cache_rotary_shift(**inputs, **attrs)
    assert message in ort_error(inputs, attrs)
