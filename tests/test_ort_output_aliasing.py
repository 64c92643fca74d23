"""A buffer bound through IOBinding (or an OrtValue over the caller's own memory) may point anywhere: the ONNX
Runtime ops refuse an output, or an in-place input, that shares bytes with what they read or write (as the C entry
points do), before anything is written."""

import numpy as np
import pytest

from kvcache_op import spec
from kvcache_op.ort_ops import make_session, ortvalue_for
from kvcache_op.reference import multi_head_attention
from kvcache_op.validation.cases import CASES
from kvcache_op.validation.mha_cases import build_attention
from kvcache_op.validation.rotary_cases import build_rotary
from ort_helpers import copies, reference_result


def bind(session, feeds: dict, outputs: dict):
    """IOBinding with every input as an OrtValue on the feeds' memory and each output (name -> (array whose
    memory it is written into, shape)) bound to a raw pointer."""
    binding = session.io_binding()
    keep = []
    for info in session.get_inputs():
        value = ortvalue_for(feeds[info.name])
        keep.append(value)
        binding.bind_ortvalue_input(info.name, value)
    for name, (memory, shape, dtype) in outputs.items():
        binding.bind_output(name, "cpu", 0, dtype, list(shape), memory.ctypes.data)
    return binding, keep


@pytest.mark.parametrize("target", ["cache", "current_key"])
def test_a_key_output_bound_onto_an_input_is_refused_and_the_cache_kept(target):
    case = CASES["offset_layout0"]()
    feeds = {k: v for k, v in copies(case.inputs).items() if v is not None}
    want_key = reference_result(case.inputs, case.attributes)[0]
    session = make_session(spec.make_model(case.inputs, **case.attributes))
    spare = np.empty_like(want_key)
    binding, keep = bind(session, feeds, {"key": (feeds[target], want_key.shape, want_key.dtype),
                                          "value": (spare, want_key.shape, want_key.dtype)})
    before = feeds["cache"].tobytes(), feeds["current_key"].tobytes()
    with pytest.raises(Exception, match=f"output key overlaps {target}"):
        session.run_with_iobinding(binding)
    assert (feeds["cache"].tobytes(), feeds["current_key"].tobytes()) == before
    del keep


def test_an_attention_output_bound_onto_its_query_is_refused():
    case = build_attention("bound", [(1, 4), (3, 5)], heads=2, head_dim=8, decoding=1, t="float32")
    feeds = {k: v for k, v in copies(case.inputs).items() if v is not None}
    session = make_session(spec.make_attention_model(case.inputs, **case.attributes))
    query = feeds["query"]
    before = query.tobytes()
    binding, keep = bind(session, feeds, {"attention_output": (query, query.shape, query.dtype)})
    with pytest.raises(Exception, match="attention_output overlaps query"):
        session.run_with_iobinding(binding)
    assert query.tobytes() == before
    out = np.empty_like(query)  # a separate buffer runs
    binding, keep2 = bind(session, feeds, {"attention_output": (out, query.shape, query.dtype)})
    session.run_with_iobinding(binding)
    assert np.allclose(out, multi_head_attention(**case.inputs, **case.attributes), atol=1e-5)
    del keep, keep2


def _sharing_one_buffer(cache, scale):
    """Copies of cache and scale in one buffer, the scale's first 16 bytes the cache's last 16; and the buffer."""
    buffer = np.zeros(cache.nbytes - 16 + scale.nbytes, np.uint8)
    shared_cache = buffer[:cache.nbytes].view(cache.dtype).reshape(cache.shape)
    shared_cache[...] = cache
    shared_scale = buffer[cache.nbytes - 16:].view(scale.dtype).reshape(scale.shape)
    shared_scale[...] = scale  # the cache's last 16 bytes now hold scales: what the op may not write through
    return shared_cache, shared_scale, buffer


def _refused(session, feeds, outputs, message, memory):
    binding, keep = bind(session, feeds, outputs)
    before = memory.tobytes()
    with pytest.raises(Exception, match=message):
        session.run_with_iobinding(binding)
    assert memory.tobytes() == before
    del keep


@pytest.mark.parametrize("name", ["current_key", "current_value"])
def test_a_key_value_cache_input_read_from_the_cache_it_writes_is_refused(name):
    """current_key (or current_value) a view of the cache rows the call stores into: each store would read a row an
    earlier one wrote."""
    case = CASES["offset_layout0"]()
    feeds = {k: v for k, v in copies(case.inputs).items() if v is not None}
    view = feeds["cache"].reshape(-1)[:feeds[name].size].reshape(feeds[name].shape)
    view[...] = feeds[name]
    feeds[name] = view
    want_key = reference_result(case.inputs, case.attributes)[0]
    outputs = {n: (np.empty_like(want_key), want_key.shape, want_key.dtype) for n in ("key", "value")}
    session = make_session(spec.make_model(case.inputs, **case.attributes))
    _refused(session, feeds, outputs, f"cache overlaps {name}", feeds["cache"])


def test_a_key_value_cache_scale_sharing_bytes_with_its_cache_is_refused():
    case = CASES["int8_layout0"]()
    feeds = {k: v for k, v in copies(case.inputs).items() if v is not None}
    feeds["cache"], feeds["scale"], buffer = _sharing_one_buffer(feeds["cache"], feeds["scale"])
    want_key = reference_result(case.inputs, case.attributes)[0]
    outputs = {n: (np.empty_like(want_key), want_key.shape, want_key.dtype) for n in ("key", "value")}
    session = make_session(spec.make_model(case.inputs, **case.attributes))
    _refused(session, feeds, outputs, "scale overlaps cache", buffer)


def test_rotary_output_slots_bound_onto_the_cache_are_refused():
    case = build_rotary("bound", t="float32", slots=(1, 4, 7))
    feeds = copies({k: v for k, v in case.inputs.items() if v is not None})
    session = make_session(spec.make_rotary_shift_model(case.inputs, **case.attributes))
    _refused(session, feeds, {"slots_out": (feeds["cache"], (3,), np.int64)}, "output slots overlaps cache",
             feeds["cache"])


def test_a_rotary_scale_sharing_bytes_with_its_cache_is_refused():
    case = build_rotary("shared", quant_bit=8, slots=(9, 0), max_t=10, heads=1, head_dim=8, cache_layout=3)
    feeds = copies(case.inputs)
    feeds["cache"], feeds["scale"], buffer = _sharing_one_buffer(feeds["cache"], feeds["scale"])
    session = make_session(spec.make_rotary_shift_model(case.inputs, **case.attributes))
    _refused(session, feeds, {"slots_out": (np.empty(2, np.int64), (2,), np.int64)}, "scale overlaps cache", buffer)
