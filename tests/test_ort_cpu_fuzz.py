"""Fuzzing the ORT CPU op with malformed calls: never a crash; the reference's error (same message)
with the cache and scale byte-for-byte unchanged, or, when the mutation happens to stay valid, the
reference's exact result.

Two more classes: index inputs that are views INTO the cache (the op must behave as if they were copied
before any write), and sizes past int64 (huge num_repeat, huge kvstarts totals). The reference has no
output-size rule yet and fails with numpy's error there (MemoryError / ValueError); the op must then fail
with its "KeyValueCache output key ..." message, the cache unchanged.

CI runs a small sample; a dedicated run sets ``KVCACHE_FUZZ_EXAMPLES`` (e.g. 10000).
"""

import os

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvcache_op import spec
from kvcache_op.ort_ops import make_session, run_model
from kvcache_op.reference import INT4, KeyValueCacheError, key_value_cache
from ort_helpers import model_for
from strategies import calls

I64 = np.iinfo(np.int64)
EXAMPLES = int(os.environ.get("KVCACHE_FUZZ_EXAMPLES", "150"))
#: The aliasing and size classes run a third as many (each of these examples covers a whole class).
CLASS_EXAMPLES = max(1, EXAMPLES // 3)
#: num_repeat values for which one output row (H * num_repeat * Dh elements of 2+ bytes) is past int64 for
#: every H, Dh >= 1: nothing is ever allocated (an ASan build aborts on a huge operator new instead of throwing).
HUGE_REPEATS = (2**62, 2**62 + 1, 2**62 + 3, 2**63 - 2**32, I64.max - 1, I64.max)
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


def run_reference_any(inputs, attrs):
    """run_reference, with numpy's own failure to allocate an output that is addressable but too large
    as ``("numpy", error)`` (the op then fails with its allocation message)."""
    try:
        return run_reference(inputs, attrs)
    except (MemoryError, ValueError, OverflowError) as error:
        return "numpy", error


def check_against_reference(inputs, attrs, feeds, buffers, want):
    """Runs the op on ``feeds`` and checks it against ``want`` = run_reference_any(inputs, attrs).
    ``buffers``: name -> array whose final bytes must match the reference's cache/scale (or be unchanged)."""
    message, result = want
    before = {k: v.tobytes() for k, v in buffers.items()}
    try:
        session = make_session(model_for(inputs, **attrs), intra_op_num_threads=1)
        key, value = run_model(None, feeds, session=session)
    except Exception as error:  # noqa: BLE001 - any ORT failure is inspected below
        assert message is not None, f"ORT failed on a call the reference accepts: {error}"
        if message == "numpy":
            assert "KeyValueCache output key" in str(error), f"numpy failed with {result!r}, ORT with {error}"
        else:
            assert message in str(error), f"ORT error {error!s} does not carry the reference's message {message!r}"
        assert {k: v.tobytes() for k, v in buffers.items()} == before, "an error left the cache modified"
        return
    assert message is None, f"ORT accepted a call the reference rejects: {message} {result or ''}"
    assert key.tobytes() == result[0].tobytes() and value.tobytes() == result[1].tobytes()
    assert buffers["cache"].tobytes() == result[2].tobytes()
    if "scale" in buffers:
        assert buffers["scale"].tobytes() == result[3].tobytes()


@st.composite
def aliased_calls(draw):
    """A call (valid or malformed) whose index inputs are partly int64 views into the cache's memory,
    holding their values there before the call; the call's own stores may then overwrite them."""
    inputs, attrs = draw(st.one_of(malformed_calls(), calls(max_batch=3).map(lambda c: (dict(c.inputs),
                                                                                            dict(c.attributes)))))
    cache = inputs["cache"]
    if cache.dtype == INT4 or not cache.flags.c_contiguous or cache.nbytes < 8:
        return inputs, attrs, False  # an int4 cache goes through a packed copy: nothing can alias it
    buffer = np.empty(cache.nbytes, np.uint8)
    buffer[:] = cache.reshape(-1).view(np.uint8)
    inputs = dict(inputs, cache=buffer.view(cache.dtype).reshape(cache.shape))
    for name in draw(st.lists(st.sampled_from(INDEX_INPUTS), min_size=1, max_size=4, unique=True)):
        values = np.asarray(inputs[name])
        if values.dtype != np.int64 or values.nbytes > buffer.nbytes:
            continue
        offset = 8 * draw(st.integers(0, (buffer.nbytes - values.nbytes) // 8))
        view = buffer[offset:offset + values.nbytes].view(np.int64).reshape(values.shape)
        view[...] = values  # later views may overlap earlier ones: the call sees whatever the memory holds
        inputs[name] = view
    return inputs, attrs, True


@settings(max_examples=CLASS_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(aliased_calls())
def test_index_inputs_aliasing_the_cache_behave_as_copies(call):
    inputs, attrs, aliased = call
    event("aliased" if aliased else "int4: not aliased")
    want = run_reference_any(inputs, attrs)  # on copies: what the op must do with its index snapshot
    feeds = {k: v for k, v in inputs.items() if v is not None}  # the views themselves, not copies
    if not aliased:
        feeds = {k: v.copy() for k, v in feeds.items()}
    buffers = {k: feeds[k] for k in ("cache", "scale") if k in feeds}
    check_against_reference(inputs, attrs, feeds, buffers, want)


@st.composite
def oversized_calls(draw):
    """Calls whose sizes reach int64's limits: a huge num_repeat, or huge kvstarts totals / max_kvlen."""
    case = draw(calls(max_batch=3))
    inputs, attrs = dict(case.inputs), dict(case.attributes)
    kind = draw(st.sampled_from(("num_repeat", "kv_total", "both")))
    if kind in ("num_repeat", "both"):
        attrs["num_repeat"] = draw(st.sampled_from(HUGE_REPEATS))
    if kind in ("kv_total", "both"):
        huge = draw(st.sampled_from((2**31, 2**40, 2**62, I64.max - 1, I64.max)))
        kvstarts = np.array(inputs["kvstarts"], copy=True)
        if kvstarts.size > 1:
            kvstarts[draw(st.integers(1, kvstarts.size - 1)):] = huge
        inputs["kvstarts"] = kvstarts
        inputs["max_kvlen"] = np.array(draw(st.sampled_from((huge, I64.max))))
        if draw(st.booleans()) and inputs["start_pos"].size:
            inputs["start_pos"] = np.full_like(inputs["start_pos"], draw(st.sampled_from((huge, I64.max))))
    return inputs, attrs


@settings(max_examples=CLASS_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(oversized_calls())
def test_oversized_calls_fail_cleanly_or_match_the_reference(call):
    inputs, attrs = call
    want = run_reference_any(inputs, attrs)
    event("numpy failed" if want[0] == "numpy" else "rejected" if want[0] else "valid")
    feeds = {k: v.copy() for k, v in inputs.items() if v is not None}
    check_against_reference(inputs, attrs, feeds, {k: feeds[k] for k in ("cache", "scale") if k in feeds}, want)
