"""An output bound through IOBinding may point at any memory: the ONNX Runtime ops refuse one that shares
bytes with what they read or write (as the C entry points do), before anything is written."""

import numpy as np
import pytest

from kvcache_op import spec
from kvcache_op.ort_ops import make_session, ortvalue_for
from kvcache_op.reference import multi_head_attention
from kvcache_op.validation.cases import CASES
from kvcache_op.validation.mha_cases import build_attention
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
