"""Fuzzing the ORT KeyCacheRotaryShift with malformed calls, index inputs aliasing the cache and
int64 extremes: never a crash; the reference's error (same message) with the cache and scale unchanged,
or the reference's exact result on copies of slots/cos/sin.

CI runs a small sample; a dedicated run sets ``KVCACHE_FUZZ_EXAMPLES`` (e.g. 10000).
"""

import os

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvcache_op import spec
from kvcache_op.ort_ops import make_session, ortvalue_for, to_numpy
from kvcache_op.reference import INT4, KeyValueCacheError, key_cache_rotary_shift
from kvcache_op.reference.validate import Attributes, check_attributes
from strategies import shift_calls

I64 = np.iinfo(np.int64)
EXAMPLES = max(1, int(os.environ.get("KVCACHE_FUZZ_EXAMPLES", "150")) // 2)
NASTY = (-1, 0, 1, 2, 3, 7, 8, 16, I64.max, I64.min, I64.max - 1, 2**31, 2**32 + 3, 2**62, -(2**62))
ATTRIBUTES = ("num_layer", "layer_idx", "quant_bit", "quant_group", "cache_layout", "rotary_dim", "rotary_interleaved")


@st.composite
def fuzzed_calls(draw):
    """(inputs, attrs, aliased): a valid call with 0-3 mutations, and maybe slots/cos/sin placed in the cache."""
    inputs, attrs = draw(shift_calls())
    inputs = dict(inputs)
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(("slot", "slot", "attribute", "table", "scale")))
        if kind == "slot" and inputs["slots"].size:
            slots = inputs["slots"].copy()
            slots[draw(st.integers(0, slots.size - 1))] = draw(st.one_of(st.sampled_from(NASTY), st.integers(-3, 20)))
            inputs["slots"] = slots
        elif kind == "attribute":
            attrs[draw(st.sampled_from(ATTRIBUTES))] = draw(st.sampled_from(NASTY))
        elif kind == "table":
            name = draw(st.sampled_from(("cos", "sin")))
            if inputs[name].shape[1]:
                inputs[name] = np.ascontiguousarray(inputs[name][:, : draw(st.integers(0, inputs[name].shape[1] - 1))])
        else:
            inputs["scale"] = None if inputs["scale"] is not None else np.ones(inputs["cache"].shape[:-1] + (1,), np.float32)
    aliased = False
    cache = inputs["cache"]
    if cache.dtype != INT4 and cache.nbytes >= 8 and draw(st.booleans()):
        buffer = np.empty(cache.nbytes, np.uint8)
        buffer[:] = cache.reshape(-1).view(np.uint8)
        inputs["cache"] = buffer.view(cache.dtype).reshape(cache.shape)
        for name in draw(st.lists(st.sampled_from(("slots", "cos", "sin")), min_size=1, max_size=3, unique=True)):
            values = inputs[name]
            if values.nbytes > buffer.nbytes:
                continue
            offset = 8 * draw(st.integers(0, (buffer.nbytes - values.nbytes) // 8))
            view = buffer[offset:offset + values.nbytes].view(values.dtype).reshape(values.shape)
            view[...] = values
            inputs[name] = view
            aliased = True
    return inputs, attrs, aliased


def run_reference(inputs, attrs):
    fresh = {k: (None if v is None else v.copy()) for k, v in inputs.items()}
    try:
        out = key_cache_rotary_shift(**fresh, **attrs)
    except KeyValueCacheError as error:
        return str(error), None
    return None, (out, fresh["cache"], fresh["scale"])


def attribute_error(attrs):
    """The reference's message for the attributes alone (what the op reports when the session is created:
    the reference checks rotary_interleaved only after the cache), or None."""
    try:
        check_attributes(Attributes(**{k: v for k, v in attrs.items() if not k.startswith("rotary")}))
    except KeyValueCacheError as error:
        return str(error)
    interleaved = attrs.get("rotary_interleaved", 0)
    return None if interleaved in (0, 1) else f"rotary_interleaved must be 0 or 1, got {interleaved}"


def run_ort(inputs, attrs):
    """Runs the op on the caller's arrays themselves (views stay views); returns the output slots."""
    try:
        session = make_session(spec.make_rotary_shift_model(inputs, **attrs), intra_op_num_threads=1)
    except Exception as error:  # noqa: BLE001 - marked as a session-creation failure
        raise SessionCreationError(str(error)) from error
    binding = session.io_binding()
    values = {k: ortvalue_for(v) for k, v in inputs.items() if v is not None}
    for name, value in values.items():
        binding.bind_ortvalue_input(name, value)
    binding.bind_output("slots_out", "cpu")
    try:
        session.run_with_iobinding(binding)
    finally:
        for name, value in values.items():  # int4 caches live in a packed copy
            if value.data_type() == "tensor(int4)":
                inputs[name][...] = to_numpy(value)
    return to_numpy(binding.get_outputs()[0])


class SessionCreationError(Exception):
    pass


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(fuzzed_calls())
def test_fuzzed_rotary_calls_fail_cleanly_or_match_the_reference(call):
    inputs, attrs, aliased = call
    message, want = run_reference(inputs, attrs)
    event(("aliased, " if aliased else "") + ("rejected: " + message.split(" ")[0] if message else "valid"))
    if message and "current_key" in message:
        message = message.replace("current_key", "cache")  # the reference's dummy-key wording; the op names the cache
        message = message[: message.index("got shape")]
    before = {k: inputs[k].tobytes() for k in ("cache", "scale") if inputs.get(k) is not None}
    try:
        out = run_ort(inputs, attrs)
    except Exception as error:  # noqa: BLE001 - any ORT failure is inspected below
        if isinstance(error, SessionCreationError) and message is not None:
            message = attribute_error(attrs)  # attribute errors come first, when the session is created
        assert message is not None, f"ORT failed on a call the reference accepts: {error}"
        assert message in str(error), f"ORT error {error!s} does not carry the reference's message {message!r}"
        assert {k: inputs[k].tobytes() for k in before} == before, "an error left the cache modified"
        return
    assert message is None, f"ORT accepted a call the reference rejects: {message}"
    assert out.tobytes() == want[0].tobytes()
    assert same_bits_but_nan_payloads(inputs["cache"], want[1])
    if want[2] is not None:
        assert same_bits_but_nan_payloads(inputs["scale"], want[2])


def same_bits_but_nan_payloads(got, want):
    """Bit-identical, except that a NaN may be any NaN (the spec leaves NaN payloads unspecified; aliased
    slots/cos/sin planted in a float cache can make NaNs there)."""
    if want.dtype.kind not in "fV" and want.dtype.name != "bfloat16":
        return got.tobytes() == want.tobytes()
    nan = np.isnan(want.astype(np.float32))
    return np.array_equal(np.isnan(got.astype(np.float32)), nan) and got[~nan].tobytes() == want[~nan].tobytes()
