"""Every validity condition of MultiHeadAttention through the reference, ONNX Runtime and the C entry point:
the spec's message, and the output buffer (pre-filled with a sentinel, bound by the caller) untouched."""

import numpy as np
import pytest

from kvcache_op import spec
from kvcache_op.capi import c_api
from kvcache_op.ort_ops import make_session, ortvalue_for
from kvcache_op.reference import MultiHeadAttentionError, multi_head_attention
from mha_invalid_calls import INVALID, base, make_invalid

# The op declares the index inputs int64, so ONNX Runtime refuses these models when the session is created.
TYPED_AT_SESSION_CREATION = {"seqstarts_int32", "decoding_batches_int32", "max_seqlen_float"}
# The attribute rows come first (up to the first data row): refused by the kernel's constructor.
ATTRIBUTE_ROWS = {r[0] for r in INVALID[:[r[0] for r in INVALID].index("query_int8")]}
SENTINEL = 0x7B  # bytes 0x7B7B...: float16 60768.0, no attention output here


def sentinel_output(inputs):
    """An output buffer of query's dtype (what the model declares) and the op's output shape, every byte
    SENTINEL."""
    query = np.asarray(inputs["query"])
    shape = query.shape if query.ndim == 3 else (query.shape[0], 4, 8)
    return np.full(int(np.prod(shape)) * query.dtype.itemsize, SENTINEL, np.uint8).view(query.dtype).reshape(shape)


def untouched(out) -> bool:
    return bool(np.all(out.reshape(-1).view(np.uint8) == SENTINEL))


@pytest.mark.parametrize("row", INVALID, ids=[r[0] for r in INVALID])
def test_reference_raises_the_message(row):
    inputs, attrs = make_invalid(row)
    with pytest.raises(MultiHeadAttentionError, match=row[2]):
        multi_head_attention(**inputs, **attrs)


@pytest.mark.parametrize("row", INVALID, ids=[r[0] for r in INVALID])
def test_c_entry_raises_the_message_and_leaves_the_output(row):
    inputs, attrs = make_invalid(row)
    buffers = c_api.HostBuffers()
    tensors = [buffers.tensor(name, inputs.get(name)) for name in c_api.MHA_INPUTS]
    out = sentinel_output(inputs)
    output = c_api.Tensor(c_api.onnx_type(out.dtype), out.shape, out.ctypes.data)
    if inputs["query"].shape == out.shape and inputs["query"].dtype == out.dtype:
        with pytest.raises(MultiHeadAttentionError, match=row[2]):
            c_api.run_multi_head_attention(tensors, output, num_threads=2, **attrs)
    else:  # the output cannot match a malformed query: the input's own error must still come first
        with pytest.raises(MultiHeadAttentionError, match=row[2]):
            c_api.run_multi_head_attention(tensors, output, **attrs)
    assert untouched(out)


def run_bound(session, inputs, out):
    """Runs with IOBinding: inputs as OrtValues, the output bound to ``out``'s memory."""
    binding = session.io_binding()
    keep = []
    for info in session.get_inputs():
        value = ortvalue_for(np.ascontiguousarray(inputs[info.name]))
        keep.append(value)
        binding.bind_ortvalue_input(info.name, value)
    binding.bind_output("attention_output", "cpu", 0, out.dtype, list(out.shape), out.ctypes.data)
    session.run_with_iobinding(binding)


@pytest.mark.parametrize("row", INVALID, ids=[r[0] for r in INVALID])
def test_ort_raises_the_message_and_leaves_the_output(row):
    inputs, attrs = make_invalid(row)
    model = spec.make_attention_model(inputs, **attrs)
    if row[0] in TYPED_AT_SESSION_CREATION | ATTRIBUTE_ROWS:
        with pytest.raises(Exception) as error:
            make_session(model)
        if row[0] in ATTRIBUTE_ROWS:
            assert error.match(row[2])
        else:  # ONNX Runtime's own type check of the schema, naming the input
            name = row[0].rsplit("_", 1)[0]
            assert error.match(rf"Type Error: Type 'tensor\(\w+\)' of input parameter \({name}\)")
        return
    session = make_session(model)
    out = sentinel_output(inputs)
    with pytest.raises(Exception, match=row[2]):
        run_bound(session, {k: v for k, v in inputs.items() if v is not None}, out)
    assert untouched(out)


def test_the_valid_base_call_writes_the_bound_output():
    """The error tests' harness does see a successful run: the sentinel is replaced by the reference's values."""
    case = base()
    inputs = {k: v for k, v in case.inputs.items() if v is not None}
    out = sentinel_output(inputs)
    run_bound(make_session(spec.make_attention_model(case.inputs, **case.attributes)), inputs, out)
    want = multi_head_attention(**case.inputs, **case.attributes)
    assert not np.any(out.view(np.uint16) == 0x7B7B)
    assert np.allclose(out.astype(np.float32), want.astype(np.float32), atol=1e-2)


def test_ort_attribute_and_shape_errors_name_the_reason_at_session_creation():
    case = base()
    model = spec.make_attention_model(case.inputs, **case.attributes)
    for attribute in model.graph.node[0].attribute:
        if attribute.name == "num_heads":
            model.graph.node[0].attribute.remove(attribute)
            break
    with pytest.raises(Exception, match="MultiHeadAttention needs the attribute num_heads"):
        make_session(model)
    with pytest.raises(TypeError):
        multi_head_attention(**case.inputs, head_dim=8)
