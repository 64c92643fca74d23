"""The framework-neutral C entry points on the CPU: the reference's bits, the reference's errors with
nothing written, and the checks only caller-allocated outputs need."""

import ctypes

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from invalid_calls import INVALID, make_invalid
from ort_helpers import assert_same_bits, copies, reference_result
from strategies import calls, shift_calls

from kvcache_op.capi import c_api
from kvcache_op.reference import KeyValueCacheError, key_cache_rotary_shift
from kvcache_op.validation.cases import Seq, build


def c_api_result(inputs, attrs, threads=1):
    fresh = copies(inputs)
    key, value = c_api.key_value_cache(**fresh, **attrs, num_threads=threads)
    return key, value, fresh["cache"], fresh["scale"]


@given(calls(max_batch=5), st.sampled_from((1, 3)))
def test_c_entry_matches_reference(case, threads):
    assert_same_bits(c_api_result(case.inputs, case.attributes, threads), reference_result(case.inputs, case.attributes))


def test_c_entry_splits_large_batches_over_threads():
    case = build("large", [Seq(i * 3, 40 + i) for i in range(20)], heads=2, head_dim=16, quant_bit=8, num_repeat=2,
                 cache_mode=1, page_size=8, t1="bfloat16")
    want = reference_result(case.inputs, case.attributes)
    assert want[0].shape[0] > 4 * 64  # several 64-token tasks per launch
    assert_same_bits(c_api_result(case.inputs, case.attributes, threads=4), want)


@pytest.mark.parametrize("row", INVALID, ids=[r[0] for r in INVALID])
def test_invalid_call_fails_with_the_reference_message_and_writes_nothing(row):
    inputs, attrs = make_invalid(row)
    before = {k: inputs[k].tobytes() for k in ("cache", "scale") if inputs.get(k) is not None}
    with pytest.raises(KeyValueCacheError, match=row[3]):
        c_api.key_value_cache(**inputs, **attrs)
    assert {k: inputs[k].tobytes() for k in before} == before


@given(shift_calls())
def test_rotary_c_entry_matches_reference(call):
    inputs, attrs = call
    want = copies(inputs)
    want_slots = key_cache_rotary_shift(**want, **attrs)
    got = copies(inputs)
    slots = c_api.key_cache_rotary_shift(**got, **attrs, num_threads=2)
    assert np.array_equal(slots, want_slots)
    assert got["cache"].tobytes() == want["cache"].tobytes()
    if want["scale"] is not None:
        assert got["scale"].tobytes() == want["scale"].tobytes()


# Raw calls: outputs the caller allocates.

def raw_call(case):
    """(buffers, inputs, outputs, output arrays) of a case, for run_key_value_cache."""
    buffers = c_api.HostBuffers()
    inputs = [buffers.tensor(n, case.inputs.get(n), written=n in ("cache", "scale")) for n in c_api.KV_INPUTS]
    shape = c_api.output_shape(inputs, **case.attributes)
    dtype = case.inputs["current_key"].dtype
    outs = [np.zeros(shape, dtype) for _ in range(2)]
    outputs = [c_api.Tensor(c_api.ONNX_TYPES[dtype], shape, o.ctypes.data) for o in outs]
    return buffers, inputs, outputs, outs


def small_case():
    return build("raw", [Seq(2, 3), Seq(0, 2)], heads=2, head_dim=8, num_repeat=2, quant_bit=8, quant_group=4)


def test_output_shape_is_what_the_call_produces():
    case = small_case()
    _, inputs, _, _ = raw_call(case)
    key, _ = reference_result(case.inputs, case.attributes)[:2]
    assert c_api.output_shape(inputs, **case.attributes) == key.shape


@pytest.mark.parametrize("wrong,message", [
    (lambda t: c_api.Tensor(t.type, (t.shape[0] + 1,) + t.shape[1:], t.data), r"output key must be float16\(7, 4, 8\)"),
    (lambda t: c_api.Tensor(1, t.shape, t.data), r"the shape this call produces\), got float32\(7, 4, 8\)"),
    (lambda t: c_api.Tensor(t.type, t.shape, 0), "output key has a NULL data pointer"),
])
def test_a_wrong_output_is_refused_before_anything_is_written(wrong, message):
    case = small_case()
    buffers, inputs, outputs, _ = raw_call(case)
    cache, scale = case.inputs["cache"], case.inputs["scale"]
    before = cache.tobytes(), scale.tobytes()
    with pytest.raises(KeyValueCacheError, match=message):
        c_api.run_key_value_cache(inputs, [wrong(outputs[0]), outputs[1]], **case.attributes)
    assert (cache.tobytes(), scale.tobytes()) == before
    del buffers


@pytest.mark.parametrize("target", ["cache", "scale", "out_value", "current_key"])
def test_an_output_sharing_memory_is_refused(target):
    case = small_case()
    buffers, inputs, outputs, outs = raw_call(case)
    cache, scale = case.inputs["cache"], case.inputs["scale"]
    before = cache.tobytes(), scale.tobytes()
    where = {"cache": cache.ctypes.data + 8, "scale": scale.ctypes.data, "out_value": outs[1].ctypes.data + 2,
             "current_key": case.inputs["current_key"].ctypes.data}[target]
    overlapping = c_api.Tensor(outputs[0].type, outputs[0].shape, where)
    with pytest.raises(KeyValueCacheError, match="output key overlaps .*must not share memory"):
        c_api.run_key_value_cache(inputs, [overlapping, outputs[1]], **case.attributes)
    assert (cache.tobytes(), scale.tobytes()) == before
    del buffers


def test_an_input_inside_the_cache_is_refused():
    """current_key read while the cache is written: sharing memory would race on a GPU."""
    case = small_case()
    buffers, inputs, outputs, _ = raw_call(case)
    cache = case.inputs["cache"]
    before = cache.tobytes()
    inputs[0] = c_api.Tensor(inputs[0].type, inputs[0].shape, cache.ctypes.data)
    with pytest.raises(KeyValueCacheError, match="cache overlaps current_key"):
        c_api.run_key_value_cache(inputs, outputs, **case.attributes)
    assert cache.tobytes() == before
    del buffers


def test_a_rotary_scale_sharing_memory_with_the_cache_is_refused():
    """The shift rewrites both: a scale inside the cache would be clobbered by the codes and vice versa."""
    cache = np.zeros((6, 1, 2, 1, 8), np.int8)  # layout 0, one head, Dh 8, group 4: scale (6, 1, 2, 1, 2)
    cache[...] = 3
    before = cache.tobytes()
    slots = np.array([1], np.int64)
    cos, sin = np.ones((1, 4), np.float32), np.zeros((1, 4), np.float32)
    buffers = c_api.HostBuffers()
    inputs = [buffers.tensor("cache", cache, written=True),
              c_api.Tensor(c_api.ONNX_TYPES[np.dtype(np.float32)], (6, 1, 2, 1, 2), cache.ctypes.data),
              buffers.tensor("slots", slots), buffers.tensor("cos", cos), buffers.tensor("sin", sin)]
    out = np.empty(1, np.int64)
    output = c_api.Tensor(c_api.ONNX_TYPES[np.dtype(np.int64)], (1,), out.ctypes.data)
    with pytest.raises(KeyValueCacheError, match="scale overlaps cache"):
        c_api.run_key_cache_rotary_shift(inputs, output, quant_bit=8, quant_group=4)
    assert cache.tobytes() == before
    del buffers


def test_malformed_tensors_are_refused():
    case = small_case()
    buffers, inputs, outputs, _ = raw_call(case)
    bad_rank = list(inputs)
    bad_rank[2] = c_api.Tensor(inputs[2].type, (1,) * 9, inputs[2].data)
    with pytest.raises(KeyValueCacheError, match="rank 9 exceeds"):
        c_api.run_key_value_cache(bad_rank, outputs, **case.attributes)
    missing = list(inputs)
    missing[8] = c_api.ABSENT
    with pytest.raises(KeyValueCacheError, match="cache is required"):
        c_api.run_key_value_cache(missing, outputs, **case.attributes)
    null = list(inputs)
    null[0] = c_api.Tensor(inputs[0].type, inputs[0].shape, 0)
    with pytest.raises(KeyValueCacheError, match="current_key has 80 elements but its data pointer is NULL"):
        c_api.run_key_value_cache(null, outputs, **case.attributes)
    del buffers


def test_written_arrays_must_be_writable_and_contiguous():
    case = small_case()
    inputs = copies(case.inputs)
    inputs["cache"] = np.asfortranarray(inputs["cache"])
    with pytest.raises(KeyValueCacheError, match="cache must be a writable C-contiguous array"):
        c_api.key_value_cache(**inputs, **case.attributes)


def test_defaults_are_the_specs_and_unknown_attributes_are_refused():
    attrs = c_api.key_value_cache_attributes()
    assert {n: getattr(attrs, n) for n in c_api.KV_ATTRIBUTES} == dict(
        num_layer=1, layer_idx=0, quant_bit=0, quant_group=8, num_repeat=1, cache_mode=0, cache_layout=0,
        page_size=128)
    with pytest.raises(TypeError, match="unknown attribute"):
        c_api.key_value_cache_attributes(quant_bits=8)


def test_message_is_truncated_safely():
    lib = c_api.library()
    case = small_case()
    buffers, inputs, outputs, _ = raw_call(case)
    attrs = c_api.key_value_cache_attributes(quant_bit=5)
    small = ctypes.create_string_buffer(8)
    c_in, c_out = c_api.c_array(inputs, 10, "inputs"), c_api.c_array(outputs, 2, "outputs")
    code = lib.kvcache_op_key_value_cache_cpu(ctypes.byref(attrs), c_in, c_out, 1, small, len(small))
    assert code == c_api.INVALID_ARGUMENT and small.value == b"quant_b"
    assert lib.kvcache_op_key_value_cache_cpu(ctypes.byref(attrs), c_in, c_out, 1, None, 0) == c_api.INVALID_ARGUMENT
    del buffers


def test_cuda_entry_without_a_usable_gpu_fails_cleanly():
    """In a build without CUDA the entry says so; with CUDA but no device it reports the CUDA error. Either
    way nothing is written and nothing crashes."""
    case = small_case()
    buffers, inputs, outputs, _ = raw_call(case)
    cache = case.inputs["cache"]
    before = cache.tobytes()
    if not c_api.has_cuda():
        lib = c_api.library()
        attrs = c_api.key_value_cache_attributes(**case.attributes)
        message = ctypes.create_string_buffer(256)
        c_in, c_out = c_api.c_array(inputs, 10, "inputs"), c_api.c_array(outputs, 2, "outputs")
        code = lib.kvcache_op_key_value_cache_cuda(ctypes.byref(attrs), c_in, c_out, None, message, len(message))
        assert code == c_api.UNAVAILABLE and b"no CUDA kernels" in message.value
    else:
        import gpu_support

        if gpu_support.device_framework() is not None:
            pytest.skip("a GPU is present: the GPU tests cover the CUDA entry")
        with pytest.raises(RuntimeError, match="kvcache-op CUDA"):
            c_api.run_key_value_cache(inputs, outputs, device="cuda", **case.attributes)
    assert cache.tobytes() == before
    del buffers


def test_rotary_cuda_entry_without_a_usable_gpu_fails_cleanly():
    """The rotary CUDA entry too: 'no CUDA kernels' in a build without them, the CUDA error without a GPU."""
    import gpu_support

    if c_api.has_cuda() and gpu_support.device_framework() is not None:
        pytest.skip("a GPU is present: the GPU tests cover the CUDA entry")
    cache = np.ones((4, 1, 2, 1, 8), np.float32)
    cos, sin = np.ones((1, 4), np.float32), np.zeros((1, 4), np.float32)
    buffers = c_api.HostBuffers()
    inputs = [buffers.tensor("cache", cache, written=True), c_api.ABSENT, buffers.tensor("slots", np.array([1])),
              buffers.tensor("cos", cos), buffers.tensor("sin", sin)]
    out = np.zeros(1, np.int64)
    with pytest.raises(RuntimeError, match="kvcache-op CUDA" if c_api.has_cuda() else "no CUDA kernels"):
        c_api.run_key_cache_rotary_shift(inputs, c_api.Tensor(7, (1,), out.ctypes.data), device="cuda")
    assert (cache == 1).all() and not out.any()
    del buffers


@pytest.mark.parametrize("op", ["MultiHeadAttention", "MultiHeadCacheAttention"])
def test_attention_cuda_entries_without_a_usable_gpu_fail_cleanly(op):
    """The attention ops' CUDA entries: 'no CUDA kernels' in a build without them, the CUDA error without a GPU;
    the output and the cache unchanged either way."""
    import gpu_support
    from ort_helpers import copies

    from kvcache_op.validation.mha_cases import ATTENTION_CASES
    from kvcache_op.validation.mhca_cases import CASES as CACHE_ATTENTION_CASES

    if c_api.has_cuda() and gpu_support.device_framework() is not None:
        pytest.skip("a GPU is present: the GPU tests cover the CUDA entries")
    mha = op == "MultiHeadAttention"
    case = ATTENTION_CASES["mha_softcap"]() if mha else CACHE_ATTENTION_CASES["mhca_paged_int8_layout3"]()
    inputs = copies(case.inputs)
    buffers = c_api.HostBuffers()
    tensors = [buffers.tensor(n, inputs.get(n), written=n in ("cache", "scale"))
               for n in (c_api.MHA_INPUTS if mha else c_api.MHCA_INPUTS)]
    out = np.zeros_like(inputs["query"])
    cache_before = None if mha else inputs["cache"].tobytes()
    run = c_api.run_multi_head_attention if mha else c_api.run_multi_head_cache_attention
    with pytest.raises(RuntimeError, match="kvcache-op CUDA" if c_api.has_cuda() else "no CUDA kernels"):
        run(tensors, c_api.Tensor(c_api.onnx_type(out.dtype), out.shape, out.ctypes.data), device="cuda",
            **case.attributes)
    assert not out.view(np.uint8).any()
    if not mha:
        assert inputs["cache"].tobytes() == cache_before
    del buffers


def _misaligned(tensor: c_api.Tensor, array: np.ndarray, keep: list) -> c_api.Tensor:
    """``tensor`` with its bytes copied 2 bytes past a 4-byte boundary (a float32 view off its alignment)."""
    raw = np.zeros(array.nbytes + 8, np.uint8)
    raw[2:2 + array.nbytes] = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
    keep.append(raw)
    return c_api.Tensor(tensor.type, tensor.shape, raw.ctypes.data + 2)


@pytest.mark.skipif(not c_api.has_cuda(), reason="a build without CUDA kernels answers 'no CUDA kernels' first")
@pytest.mark.parametrize("op", ["KeyValueCache", "MultiHeadAttention", "MultiHeadCacheAttention"])
def test_cuda_entries_refuse_a_pointer_off_its_element_alignment(op):
    """The kernels read float32 elements 4 bytes at a time: a device pointer 2 bytes off would fault on the GPU,
    so the call is refused by name before anything is enqueued (no GPU needed to see it), the cache untouched."""
    from ort_helpers import copies

    from kvcache_op.validation.mha_cases import ATTENTION_CASES
    from kvcache_op.validation.mhca_cases import CASES as CACHE_ATTENTION_CASES

    keep = []
    if op == "KeyValueCache":
        case = build("aligned", [Seq(2, 3)], heads=2, head_dim=8, t1="float32")
        buffers, inputs, outputs, _ = raw_call(case)
        inputs[0] = _misaligned(inputs[0], case.inputs["current_key"], keep)
        before = case.inputs["cache"].tobytes()
        with pytest.raises(KeyValueCacheError, match="current_key must be aligned to its 4-byte elements on CUDA"):
            c_api.run_key_value_cache(inputs, outputs, device="cuda", **case.attributes)
        assert case.inputs["cache"].tobytes() == before
        return
    mha = op == "MultiHeadAttention"
    case = ATTENTION_CASES["mha_decode_batch_float32"]() if mha else CACHE_ATTENTION_CASES["mhca_float32_alibi_window2"]()
    inputs = copies(case.inputs)
    buffers = c_api.HostBuffers()
    tensors = [buffers.tensor(n, inputs.get(n), written=n in ("cache", "scale"))
               for n in (c_api.MHA_INPUTS if mha else c_api.MHCA_INPUTS)]
    tensors[0] = _misaligned(tensors[0], inputs["query"], keep)
    out = np.zeros_like(inputs["query"])
    before = None if mha else inputs["cache"].tobytes()
    run = c_api.run_multi_head_attention if mha else c_api.run_multi_head_cache_attention
    with pytest.raises(KeyValueCacheError, match="query must be aligned to its 4-byte elements on CUDA"):
        run(tensors, c_api.Tensor(c_api.onnx_type(out.dtype), out.shape, out.ctypes.data), device="cuda",
            **case.attributes)
    assert not out.view(np.uint8).any()
    if not mha:
        assert inputs["cache"].tobytes() == before
    del buffers


def test_the_header_is_installed_with_the_library():
    import pathlib

    import kvcache_op

    installed = pathlib.Path(kvcache_op.__file__).parent / "include" / "kvcache_op.h"
    source = pathlib.Path(__file__).resolve().parent.parent / "capi" / "kvcache_op.h"
    assert installed.read_text() == source.read_text()
    assert f"#define KVCACHE_OP_C_API_VERSION {c_api.C_API_VERSION}" in installed.read_text()


def test_a_library_of_another_version_is_refused_by_its_version_before_any_function_is_bound(tmp_path):
    """A library of an older C API lacks functions this binding names: the error is the version, not a missing
    symbol."""
    from native_build import build_library

    source = tmp_path / "old_version.cc"
    source.write_text('extern "C" int kvcache_op_c_api_version(void) { return 2; }\n')
    old = build_library("old_version", [source], [], ["-O1", "-fPIC", "-shared"], tmp_path / "build")
    with pytest.raises(RuntimeError, match=f"has C API version 2; this binding speaks version {c_api.C_API_VERSION}"):
        c_api.library(str(old))


# The numpy wrapper passes an int4 array packed, and a read input that is not C-contiguous as a copy: the C entry
# points never see the caller's memory for those, so the wrapper checks them apart itself.
_H, _DH, _GROUP, _MAX_T = 1, 8, 8, 4
_CACHE_SHAPE, _SCALE_SHAPE = (_MAX_T, 1, 2, _H, _DH), (_MAX_T, 1, 2, _H, 1)
_ONE_TOKEN = dict(seqstarts=np.array([0, 1]), kvstarts=np.array([0, 1]), cachestarts=np.array([0]),
                  start_pos=np.array([0]), max_seqlen=np.array(1), max_kvlen=np.array(1))


def _cache_over(buffer, dtype):
    """A layout-0 cache of ``dtype`` over the first bytes of the uint8 ``buffer``."""
    return buffer[:int(np.prod(_CACHE_SHAPE))].view(dtype).reshape(_CACHE_SHAPE)


def _scale_inside(buffer):
    return buffer[16:16 + 4 * int(np.prod(_SCALE_SHAPE))].view(np.float32).reshape(_SCALE_SHAPE)


def _kv_call(buffer, dtype, quant_bit):
    key = buffer[32:32 + 4 * _DH].view(np.float32).reshape(1, _H, _DH)  # a key row read from the cache's bytes
    return lambda: c_api.key_value_cache(key, np.ones((1, _H, _DH), np.float32), **_ONE_TOKEN,
                                         cache=_cache_over(buffer, dtype), scale=np.ones(_SCALE_SHAPE, np.float32),
                                         quant_bit=quant_bit, quant_group=_GROUP)


def _mhca_call(buffer, dtype, quant_bit):
    row = np.ones((1, _H, _DH), np.float32)
    return lambda: c_api.multi_head_cache_attention(
        row, row, row, _ONE_TOKEN["seqstarts"], _ONE_TOKEN["kvstarts"], _ONE_TOKEN["cachestarts"],
        _ONE_TOKEN["start_pos"], np.array(0), _ONE_TOKEN["max_seqlen"], _ONE_TOKEN["max_kvlen"],
        _cache_over(buffer, dtype), _scale_inside(buffer), quant_bit=quant_bit, quant_group=_GROUP, num_heads=_H,
        head_dim=_DH)


def _rotary_call(buffer, dtype, quant_bit):
    cache = _cache_over(buffer, dtype)
    cache[...] = 3
    return lambda: c_api.key_cache_rotary_shift(cache, _scale_inside(buffer), np.array([1]),
                                                np.zeros((1, _DH // 2), np.float32),
                                                np.ones((1, _DH // 2), np.float32), quant_bit=quant_bit,
                                                quant_group=_GROUP)


@pytest.mark.parametrize("quant_bit", [8, 4])
@pytest.mark.parametrize("make, message", [(_kv_call, "cache overlaps current_key"),
                                           (_mhca_call, "scale overlaps cache"),
                                           (_rotary_call, "scale overlaps cache")],
                         ids=["kv-key-in-cache", "mhca-scale-in-cache", "rotary-scale-in-cache"])
def test_buffers_sharing_memory_are_refused_for_int4_caches_too(make, message, quant_bit):
    from kvcache_op.reference.dtypes import INT4

    buffer = np.zeros(int(np.prod(_CACHE_SHAPE)) + 64, np.uint8)
    call = make(buffer, INT4 if quant_bit == 4 else np.int8, quant_bit)
    before = buffer.tobytes()
    with pytest.raises(KeyValueCacheError, match=message):
        call()
    assert buffer.tobytes() == before


def test_a_non_contiguous_input_over_the_cache_is_refused_as_a_contiguous_one_is():
    for flip in (False, True):
        cache = np.zeros(_CACHE_SHAPE, np.float32)
        row = cache[3, 0, 0, 0][::-1] if flip else cache[3, 0, 0, 0]  # slot 3's key row, the same bytes
        with pytest.raises(KeyValueCacheError, match="cache overlaps current_key"):
            c_api.key_value_cache(row.reshape(1, _H, _DH), np.ones((1, _H, _DH), np.float32), **_ONE_TOKEN,
                                  cache=cache)
        assert not cache.any()


def test_calls_on_two_layers_of_one_int4_array_from_two_threads_both_land():
    """The wrapper writes back only the codes its call changed: a whole-array write-back lost the other layer's."""
    import threading

    from kvcache_op.reference.dtypes import INT4

    tokens, layers = 1024, 2
    rng = np.random.default_rng(0)
    keys = [rng.standard_normal((tokens, 4, 64)).astype(np.float16) for _ in range(layers)]
    index = dict(seqstarts=np.array([0, tokens]), kvstarts=np.array([0, tokens]), cachestarts=np.array([0]),
                 start_pos=np.array([0]), max_seqlen=np.array(tokens), max_kvlen=np.array(tokens))
    for _ in range(3):
        cache = np.zeros((tokens, layers, 2, 4, 64), INT4)
        scale = np.zeros((tokens, layers, 2, 4, 8), np.float32)
        barrier = threading.Barrier(layers)

        def store(layer):
            barrier.wait()
            c_api.key_value_cache(keys[layer], keys[layer], **index, cache=cache, scale=scale, num_layer=layers,
                                  layer_idx=layer, quant_bit=4, quant_group=8)

        threads = [threading.Thread(target=store, args=(layer,)) for layer in range(layers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for layer in range(layers):
            alone = np.zeros_like(cache)
            c_api.key_value_cache(keys[layer], keys[layer], **index, cache=alone, scale=np.zeros_like(scale),
                                  num_layer=layers, layer_idx=layer, quant_bit=4, quant_group=8)
            assert np.array_equal(cache[:, layer].astype(np.int8), alone[:, layer].astype(np.int8))


@pytest.mark.parametrize("name, value", [("quant_bit", 8.5), ("cache_mode", 0.5), ("cache_layout", "0"),
                                         ("quant_group", 4.0)])
def test_attributes_that_are_not_integers_are_refused_not_truncated(name, value):
    case = small_case()
    inputs = copies(case.inputs)
    with pytest.raises(KeyValueCacheError, match=f"^{name} must be an integer, got {value!r}$"):
        c_api.key_value_cache(**inputs, **{**case.attributes, name: value})
    assert inputs["cache"].tobytes() == case.inputs["cache"].tobytes()


def test_integer_attributes_may_be_numpy_ints_and_0d_arrays_as_in_the_reference():
    case = small_case()
    given = {**case.attributes, "quant_group": np.array(case.attributes["quant_group"]), "num_layer": np.int32(1)}
    assert_same_bits(c_api_result(case.inputs, given), reference_result(case.inputs, given))


def test_wrapper_errors_name_the_input_and_are_the_ops_class():
    from kvcache_op.reference import MultiHeadAttentionError

    case = small_case()
    inputs = copies(case.inputs)
    inputs["seqstarts"] = inputs["seqstarts"].reshape((-1,) + (1,) * 8)
    with pytest.raises(KeyValueCacheError, match="^seqstarts has rank 9, more than the C entry points' 8$"):
        c_api.key_value_cache(**inputs, **case.attributes)
    inputs = copies(case.inputs)
    inputs["current_key"] = inputs["current_key"].astype(inputs["current_key"].dtype.newbyteorder(">"))
    with pytest.raises(KeyValueCacheError, match="^current_key has dtype >.*not in this machine's byte order"):
        c_api.key_value_cache(**inputs, **case.attributes)
    query = np.ones((2, 1, 8) + (1,) * 6, np.float32)
    with pytest.raises(MultiHeadAttentionError, match="^query has rank 9"):
        c_api.multi_head_attention(query, query, query, np.array([0, 2]), np.array([0, 2]), 0, 2, 2, num_heads=1,
                                   head_dim=8)


def _reference_error(function, inputs, attributes) -> str:
    with pytest.raises(KeyValueCacheError) as raised:
        function(**copies(inputs), **attributes)
    return str(raised.value)


def test_every_invalid_cache_attention_call_gets_the_references_message_and_writes_nothing():
    from kvcache_op.reference import multi_head_cache_attention
    from kvcache_op.validation.mhca_cases import error_cases

    for name, make in error_cases().items():
        case = make()
        want = _reference_error(multi_head_cache_attention, case.inputs, case.attributes)
        inputs = copies(case.inputs)
        before = {k: inputs[k].tobytes() for k in ("cache", "scale") if inputs.get(k) is not None}
        with pytest.raises(KeyValueCacheError) as raised:
            c_api.multi_head_cache_attention(**inputs, **case.attributes)
        assert str(raised.value) == want, name
        assert {k: inputs[k].tobytes() for k in before} == before, name


def test_a_cache_attention_call_breaking_a_cache_rule_and_an_attention_attribute_names_the_cache_rule():
    """The spec's order: every rule of KeyValueCache before any of the attention's, attributes included (the C
    entry checked the attention's attributes first)."""
    from kvcache_op.reference import multi_head_cache_attention
    from kvcache_op.validation.mhca_cases import CASES

    case = CASES["mhca_paged_int8_layout3"]()
    inputs = dict(case.inputs, cache=case.inputs["cache"].astype(np.float16))
    attributes = {**case.attributes, "is_causal": 2}
    want = _reference_error(multi_head_cache_attention, inputs, attributes)
    assert want.startswith("cache dtype must be int8")
    with pytest.raises(KeyValueCacheError, match="^cache dtype must be int8"):
        c_api.multi_head_cache_attention(**copies(inputs), **attributes)


@pytest.mark.parametrize("change", ["one short", "one more", "an array for a Tensor"])
def test_a_list_of_the_wrong_length_is_refused_before_the_library_reads_it(change):
    """The C entry points read every one of the op's 10 input and 2 output descriptors: a list one short would have
    them read past its end (a descriptor of whatever bytes lie there). The wrapper refuses it, nothing written."""
    case = small_case()
    buffers, inputs, outputs, outs = raw_call(case)
    cache_before = case.inputs["cache"].tobytes()
    if change == "one short":
        inputs = inputs[:9]  # scale left out instead of passed as ABSENT: the natural slip
    elif change == "one more":
        outputs = outputs + [c_api.ABSENT]
    else:
        inputs = inputs[:8] + [case.inputs["cache"]] + inputs[9:]
    message = "must be Tensor objects, got ndarray" if change == "an array for a Tensor" else "must be (10|2) Tensor"
    with pytest.raises(KeyValueCacheError, match=message):
        c_api.run_key_value_cache(inputs, outputs, **case.attributes)
    if change == "one short":
        with pytest.raises(KeyValueCacheError, match="KeyValueCache's inputs must be 10 Tensor objects.*got 9"):
            c_api.output_shape(inputs, **case.attributes)
    assert case.inputs["cache"].tobytes() == cache_before
    assert all(not o.any() for o in outs)
    del buffers


def test_rotary_shift_lists_are_counted_too():
    cache = np.zeros((4, 1, 2, 1, 4), np.float32)
    buffers = c_api.HostBuffers()
    inputs = [buffers.tensor("cache", cache, written=True), c_api.ABSENT,
              buffers.tensor("slots", np.array([1], np.int64)), buffers.tensor("cos", np.ones((1, 2), np.float32))]
    out = np.zeros(1, np.int64)
    with pytest.raises(KeyValueCacheError, match="KeyCacheRotaryShift's inputs must be 5 Tensor objects.*got 4"):
        c_api.run_key_cache_rotary_shift(inputs, c_api.Tensor(c_api.ONNX_TYPES[np.dtype(np.int64)], (1,),
                                                                 out.ctypes.data))
    with pytest.raises(KeyValueCacheError, match="KeyCacheRotaryShift's output must be a Tensor, got ndarray"):
        c_api.run_key_cache_rotary_shift(inputs + [buffers.tensor("sin", np.zeros((1, 2), np.float32))], out)
    del buffers


def test_the_defaults_functions_ignore_a_null_struct():
    """Every other entry point refuses a NULL pointer with a message; these have no message to give, so they write
    nothing (in a process of its own: before, a NULL crashed it)."""
    import subprocess
    import sys

    code = ("from kvcache_op.capi import c_api\nlib = c_api.library()\n"
            "for name in ('key_value_cache', 'key_cache_rotary_shift', 'multi_head_attention',"
            " 'multi_head_cache_attention'):\n    getattr(lib, f'kvcache_op_{name}_defaults')(None)\nprint('done')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr[-2000:]


@pytest.mark.parametrize("op", ["KeyValueCache", "MultiHeadCacheAttention"])
@pytest.mark.parametrize("log2_columns", [60, 61])
def test_a_page_table_of_more_than_2_to_the_63_bytes_is_refused_by_its_size(op, log2_columns):
    """A (B, MaxP) table whose element count fits in int64 but whose bytes do not (no memory could hold it, but a
    C caller can describe it): a row's address would wrap. It is refused by its size, before any of it is read,
    and the cache is unchanged."""
    from kvcache_op.validation.mhca_cases import with_query

    case = build("huge-table", [Seq(0, 3), Seq(0, 2)], heads=1, head_dim=8, t1="float32", cache_mode=1, page_size=2,
                 spare_pages=0)
    if op == "MultiHeadCacheAttention":
        case = with_query("huge-table", case.inputs, case.attributes, group=1)
    names = c_api.MHCA_INPUTS if op == "MultiHeadCacheAttention" else c_api.KV_INPUTS
    buffers = c_api.HostBuffers()
    inputs = [buffers.tensor(n, case.inputs.get(n), written=n in ("cache", "scale")) for n in names]
    table = inputs[names.index("cachestarts")]
    inputs[names.index("cachestarts")] = c_api.Tensor(table.type, (2, 2 ** log2_columns), table.data)
    before = case.inputs["cache"].copy()
    message = rf"an index input has more than 2\^63 - 1 bytes, shape \(2, {2 ** log2_columns}\)"
    with pytest.raises(KeyValueCacheError, match=message):
        if op == "MultiHeadCacheAttention":
            out = np.zeros(case.inputs["query"].shape, np.float32)
            c_api.run_multi_head_cache_attention(inputs, c_api.Tensor(1, out.shape, out.ctypes.data), **case.attributes)
        else:
            shape = (int(case.inputs["kvstarts"][-1]), 1, 8)
            outs = [np.zeros(shape, np.float32) for _ in range(2)]
            c_api.run_key_value_cache(inputs, [c_api.Tensor(1, shape, o.ctypes.data) for o in outs], **case.attributes)
    assert case.inputs["cache"].tobytes() == before.tobytes()
    del buffers
