"""MultiHeadAttention's C entry point: the checks only a caller-allocated output needs, the defaults, index
inputs read once (even from memory the op writes), and malformed calls fuzzed against the reference (the
same message with the output untouched, or a result within the bound)."""

import ctypes
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from attention_strategies import attention_calls, copies
from kvcache_op.capi import c_api
from kvcache_op.reference import MultiHeadAttentionError, attention_tolerance, multi_head_attention
from kvcache_op.validation.mha_cases import build_attention
from test_mha_reference import assert_within

I64 = np.iinfo(np.int64)
EXAMPLES = int(os.environ.get("KVCACHE_FUZZ_EXAMPLES", "150"))


def raw_call(case):
    """(buffers, inputs, output Tensor, output array prefilled with 0x7B bytes)."""
    buffers = c_api.HostBuffers()
    inputs = [buffers.tensor(n, case.inputs.get(n)) for n in c_api.MHA_INPUTS]
    query = case.inputs["query"]
    out = np.full(query.nbytes, 0x7B, np.uint8).view(query.dtype).reshape(query.shape)
    return buffers, inputs, c_api.Tensor(c_api.onnx_type(query.dtype), query.shape, out.ctypes.data), out


def small_case():
    return build_attention("c", [(1, 4), (3, 5)], heads=4, kv_heads=2, decoding=1, mask=2)


@pytest.mark.parametrize("wrong,message", [
    (lambda t: c_api.Tensor(t.type, (t.shape[0] + 1,) + t.shape[1:], t.data),
     r"output attention_output must be float16\(4, 4, 8\) \(the shape this call produces\), got float16\(5, 4, 8\)"),
    (lambda t: c_api.Tensor(1, t.shape, t.data), r"must be float16\(4, 4, 8\) .*got float32\(4, 4, 8\)"),
    (lambda t: c_api.Tensor(t.type, t.shape, 0), "output attention_output has a NULL data pointer"),
])
def test_a_wrong_output_is_refused_and_not_written(wrong, message):
    buffers, inputs, output, out = raw_call(small_case())
    with pytest.raises(MultiHeadAttentionError, match=message):
        c_api.run_multi_head_attention(inputs, wrong(output), num_heads=4, head_dim=8, num_kv_heads=2)
    assert np.all(out.reshape(-1).view(np.uint8) == 0x7B)
    del buffers


@pytest.mark.parametrize("target", ["query", "key", "value", "attn_mask"])
def test_an_output_sharing_memory_with_an_input_is_refused(target):
    case = small_case()
    # The target in a buffer of its own with room after it, so the output two bytes in overlaps the target and
    # nothing else (the inputs' own allocations may lie anywhere, another one within reach of the output).
    target_bytes, output_bytes = case.inputs[target].nbytes, case.inputs["query"].nbytes
    holder = np.zeros(target_bytes + output_bytes, np.uint8)
    case.inputs[target] = holder[:target_bytes].view(case.inputs[target].dtype).reshape(case.inputs[target].shape)
    case.inputs[target][...] = small_case().inputs[target]
    buffers, inputs, output, _ = raw_call(case)
    source = case.inputs[target]
    before = source.tobytes()
    overlapping = c_api.Tensor(output.type, output.shape, source.ctypes.data + 2)
    with pytest.raises(MultiHeadAttentionError, match=f"output attention_output overlaps {target}"):
        c_api.run_multi_head_attention(inputs, overlapping, num_heads=4, head_dim=8, num_kv_heads=2)
    assert source.tobytes() == before
    del buffers


def test_missing_required_inputs_and_null_pointers_are_refused():
    buffers, inputs, output, out = raw_call(small_case())
    missing = list(inputs)
    missing[1] = c_api.ABSENT
    with pytest.raises(MultiHeadAttentionError, match="key is required"):
        c_api.run_multi_head_attention(missing, output, num_heads=4, head_dim=8, num_kv_heads=2)
    null = list(inputs)
    null[3] = c_api.Tensor(inputs[3].type, inputs[3].shape, 0)
    with pytest.raises(MultiHeadAttentionError, match="seqstarts has 3 elements but its data pointer is NULL"):
        c_api.run_multi_head_attention(null, output, num_heads=4, head_dim=8, num_kv_heads=2)
    assert np.all(out.reshape(-1).view(np.uint8) == 0x7B)
    del buffers


def test_defaults_are_the_specs_and_the_required_attributes_must_be_given():
    attrs = c_api.multi_head_attention_attributes()
    assert {n: getattr(attrs, n) for n in c_api.MHA_ATTRIBUTES} == dict(
        num_heads=0, head_dim=0, is_causal=1, is_alibi=0, num_kv_heads=0, sliding_window=0, softmax_scale=0.0,
        softcap=0.0)
    case = small_case()
    with pytest.raises(MultiHeadAttentionError, match="num_heads must be >= 1, got 0"):
        c_api.multi_head_attention(**case.inputs, head_dim=8)
    with pytest.raises(TypeError, match="unknown attribute"):
        c_api.multi_head_attention_attributes(window=3)
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda', got 'tpu'"):
        c_api.run_multi_head_attention([], None, device="tpu", num_heads=1, head_dim=1)


def test_message_is_truncated_safely_and_null_attrs_refused():
    lib = c_api.library()
    buffers, inputs, output, _ = raw_call(small_case())
    attrs = c_api.multi_head_attention_attributes(num_heads=4, head_dim=8, is_causal=7)
    small = ctypes.create_string_buffer(6)
    code = lib.kvcache_op_multi_head_attention_cpu(ctypes.byref(attrs), c_api.c_array(inputs, 9, "inputs"),
                                                   ctypes.byref(output.to_c()), 1, small, len(small))
    assert code == c_api.INVALID_ARGUMENT and small.value == b"is_ca"
    message = ctypes.create_string_buffer(256)
    c_in = c_api.c_array(inputs, 9, "inputs")
    code = lib.kvcache_op_multi_head_attention_cpu(None, c_in, ctypes.byref(output.to_c()), 1, message, 256)
    assert code == c_api.INVALID_ARGUMENT
    assert b"attrs and inputs must not be NULL" in message.value
    del buffers


def test_index_inputs_inside_the_output_buffer_are_read_before_it_is_written():
    """seqstarts and kvstarts live in the output's memory, which the kernel overwrites: the call behaves as if
    they had been copied first (spec: index inputs are read once)."""
    case = build_attention("alias", [(3, 6), (5, 5), (1, 9)], heads=2, head_dim=16, t="float32", decoding=0)
    want = multi_head_attention(**case.inputs, **case.attributes)
    tolerance = 2 * attention_tolerance(**case.inputs, **case.attributes)
    query = case.inputs["query"]
    out = np.zeros(query.shape, query.dtype)
    flat = out.reshape(-1).view(np.int64)
    flat[:4] = case.inputs["seqstarts"]
    flat[8:12] = case.inputs["kvstarts"]
    buffers = c_api.HostBuffers()
    inputs = [buffers.tensor(n, case.inputs.get(n)) for n in c_api.MHA_INPUTS]
    inputs[3] = c_api.Tensor(7, (4,), flat[:4].ctypes.data)
    inputs[4] = c_api.Tensor(7, (4,), flat[8:12].ctypes.data)
    c_api.run_multi_head_attention(inputs, c_api.Tensor(1, query.shape, out.ctypes.data), num_threads=2,
                                   **case.attributes)
    assert_within(out, want.astype(np.float64), tolerance, "aliased index inputs")
    del buffers


def nasty_ints():
    return st.one_of(st.sampled_from([-1, 0, 1, 2, 3, I64.max, I64.min, I64.max - 1, 2**31, 2**32 + 3, 2**62]),
                     st.integers(-5, 40))


ATTRIBUTES = ("num_heads", "head_dim", "is_causal", "is_alibi", "num_kv_heads", "sliding_window")


@st.composite
def malformed_attention_calls(draw):
    case = draw(attention_calls(max_batch=3))
    inputs, attrs = dict(case.inputs), dict(case.attributes)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(("index", "index", "index", "attribute", "shape", "mask")))
        if kind == "index":
            name = draw(st.sampled_from(("seqstarts", "kvstarts", "decoding_batches", "max_seqlen", "max_kvlen")))
            array = np.array(inputs[name], copy=True)
            if array.size:
                array.reshape(-1)[draw(st.integers(0, array.size - 1))] = draw(nasty_ints())
            inputs[name] = array
        elif kind == "attribute":
            attrs[draw(st.sampled_from(ATTRIBUTES))] = draw(st.sampled_from([-1, 0, 1, 2, 3, 4, 6, 2**40, I64.max]))
        elif kind == "shape":
            name = draw(st.sampled_from(("query", "key", "value", "seqstarts", "kvstarts")))
            array = inputs[name]
            if array.ndim and array.shape[0] > 0:
                inputs[name] = np.ascontiguousarray(array[: draw(st.integers(0, array.shape[0] - 1))])
        elif inputs["attn_mask"] is None:
            tokens, kv_tokens = inputs["query"].shape[0], inputs["key"].shape[0]
            inputs["attn_mask"] = np.zeros((tokens, max(0, kv_tokens + draw(st.integers(-1, 1)))), inputs["query"].dtype)
        else:
            inputs["attn_mask"] = None
    return inputs, attrs


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(malformed_attention_calls())
def test_malformed_calls_fail_with_the_reference_message_or_stay_within_the_bound(call):
    inputs, attrs = call
    try:
        want = multi_head_attention(**copies(inputs), **attrs)
        message = None
    except MultiHeadAttentionError as error:
        message, want = str(error), None
    event("rejected: " + message.split(" ")[0] if message else "valid")
    buffers, tensors, output, out = raw_call(type("C", (), {"inputs": inputs})())
    try:
        c_api.run_multi_head_attention(tensors, output, num_threads=2, **attrs)
    except MultiHeadAttentionError as error:
        assert message is not None, f"the C entry failed on a call the reference accepts: {error}"
        assert str(error) == message
        assert np.all(out.reshape(-1).view(np.uint8) == 0x7B), "an error wrote the output"
        return
    assert message is None, f"the C entry accepted a call the reference rejects: {message}"
    tolerance = 2 * attention_tolerance(**inputs, **attrs)
    assert_within(out, want.astype(np.float64), tolerance, "fuzzed valid call")
    del buffers


def test_an_empty_query_may_name_any_number_of_heads():
    """T = 0 with num_heads = 2^40 (and ALiBi): nothing is sized by num_heads, the output is empty."""
    heads = 2**40
    empty = np.zeros((0, heads, 1), np.float32)
    args = dict(seqstarts=np.array([0, 0, 0]), kvstarts=np.array([0, 0, 0]), decoding_batches=np.array(0),
                max_seqlen=np.array(0), max_kvlen=np.array(0))
    for run in (multi_head_attention, c_api.multi_head_attention):
        out = run(empty, empty, empty, **args, num_heads=heads, head_dim=1, is_alibi=1)
        assert out.shape == (0, heads, 1)
