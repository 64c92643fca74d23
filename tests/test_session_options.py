"""``make_session`` hands ONNX Runtime what it was asked for: the thread count, the switch that keeps every op off
the CPU fallback, the extra config entries; and the int4 tensors it binds hold every code, an odd count included."""

import numpy as np
import pytest

from kvcache_op import spec
from kvcache_op.ort_ops import make_session, session_options
from kvcache_op.ort_ops.session import int4_ortvalue, packed_view, to_numpy
from kvcache_op.reference.dtypes import INT4
from kvcache_op.validation.cases import CASES


def _model():
    case = CASES["offset_layout0"]()
    return spec.make_model(case.inputs, **case.attributes)


def test_the_thread_count_and_config_entries_reach_the_session():
    assert session_options(3).intra_op_num_threads == 3
    options = make_session(_model(), intra_op_num_threads=2,
                           config={"session.intra_op.allow_spinning": "0"}).get_session_options()
    assert options.intra_op_num_threads == 2
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    with pytest.raises(Exception, match="does not have configuration with key"):  # off unless asked for
        make_session(_model()).get_session_options().get_session_config_entry("session.disable_cpu_ep_fallback")


def test_the_cpu_fallback_switch_reaches_onnx_runtime():
    """ONNX Runtime refuses the switch beside an explicit CPU provider: proof that it was set."""
    with pytest.raises(Exception, match="disabled fallback to the CPU EP"):
        make_session(_model(), disable_cpu_fallback=True)


@pytest.mark.parametrize("count", [1, 2, 3, 7])
def test_an_int4_tensor_holds_every_code(count):
    codes = (np.arange(count) % 16 - 8).astype(np.int8)
    value = int4_ortvalue(codes.astype(INT4))
    assert packed_view(value).size == (count + 1) // 2
    np.testing.assert_array_equal(to_numpy(value).astype(np.int8), codes)
