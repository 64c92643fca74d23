"""Fuzzing the ORT CPU op with malformed calls: never a crash; the reference's error (same message)
with the cache and scale byte-for-byte unchanged, or, when the mutation happens to stay valid, the
reference's exact result.

CI runs a small sample; a dedicated run sets ``KVCACHE_FUZZ_EXAMPLES`` (e.g. 10000).
"""

import os

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvcache_op import spec
from kvcache_op.ort_ops import make_session, run_model
from kvcache_op.reference import KeyValueCacheError, key_value_cache
from strategies import calls

I64 = np.iinfo(np.int64)
EXAMPLES = int(os.environ.get("KVCACHE_FUZZ_EXAMPLES", "150"))
INDEX_INPUTS = ("seqstarts", "kvstarts", "start_pos", "cachestarts", "max_seqlen", "max_kvlen")
ATTRIBUTES = ("num_layer", "layer_idx", "quant_bit", "quant_group", "num_repeat", "cache_mode", "cache_layout",
              "page_size")


def nasty_ints(max_t):
    return st.one_of(st.sampled_from([-1, 0, 1, I64.max, I64.min, I64.max - 1, max_t, max_t - 1, max_t + 1, 2**31,
                                      2**32 + 3]),
                     st.integers(-50, 300))


@st.composite
def malformed_calls(draw):
    case = draw(calls(max_batch=3))
    inputs, attrs = dict(case.inputs), dict(case.attributes)
    max_t = inputs["cache"].shape[attrs["cache_layout"]]
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(("index", "index", "index", "attribute", "shape", "scale")))
        if kind == "index":
            name = draw(st.sampled_from(INDEX_INPUTS))
            array = np.array(inputs[name], copy=True)
            if array.size:
                flat = array.reshape(-1)
                flat[draw(st.integers(0, flat.size - 1))] = draw(nasty_ints(max_t))
            inputs[name] = array
        elif kind == "attribute":
            attrs[draw(st.sampled_from(ATTRIBUTES))] = draw(st.sampled_from([-1, 0, 1, 2, 3, 4, 5, 8, 16, 128]))
        elif kind == "shape":
            name = draw(st.sampled_from(("current_key", "current_value", "cache", "seqstarts", "kvstarts",
                                         "start_pos", "cachestarts")))
            array = inputs[name]
            if array.ndim and array.shape[-1] > 0:
                inputs[name] = np.ascontiguousarray(array[..., : draw(st.integers(0, array.shape[-1] - 1))])
        else:
            if inputs["scale"] is None:
                inputs["scale"] = np.ones(inputs["cache"].shape[:-1] + (1,), np.float32)
            else:
                inputs["scale"] = None
    return inputs, attrs


def run_reference(inputs, attrs):
    fresh = {k: (None if v is None else v.copy()) for k, v in inputs.items()}
    try:
        key, value = key_value_cache(**fresh, **attrs)
    except KeyValueCacheError as error:
        return str(error), None
    return None, (key, value, fresh["cache"], fresh["scale"])


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(malformed_calls())
def test_malformed_calls_fail_cleanly_or_match_the_reference(call):
    inputs, attrs = call
    message, want = run_reference(inputs, attrs)
    event("rejected: " + message.split(" ")[0] if message else "valid")
    feeds = {k: v.copy() for k, v in inputs.items() if v is not None}
    before = {k: feeds[k].tobytes() for k in ("cache", "scale") if k in feeds}
    model = spec.make_model(inputs, **attrs)
    try:
        session = make_session(model)
        key, value = run_model(model, feeds, session=session)
    except Exception as error:  # noqa: BLE001 - any ORT failure is inspected below
        assert message is not None, f"ORT failed on a call the reference accepts: {error}"
        assert message in str(error), f"ORT error {error!s} does not carry the reference's message {message!r}"
        assert {k: feeds[k].tobytes() for k in before} == before, "an error left the cache modified"
        return
    assert message is None, f"ORT accepted a call the reference rejects: {message}"
    assert key.tobytes() == want[0].tobytes() and value.tobytes() == want[1].tobytes()
    assert feeds["cache"].tobytes() == want[2].tobytes()
