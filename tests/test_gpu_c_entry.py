"""The CUDA kernels on a real GPU through the library's C entry point, with device memory from torch or
CuPy (no onnxruntime-gpu needed): the reference's bits for every attribute combination, no byte written
outside the stored slots or the buffers, and invalid calls refused with the device cache unchanged."""

import os

import numpy as np
import pytest
from hypothesis import given

from gpu_support import DeviceBuffer, Stream, device_memory_full
from invalid_calls import INVALID, make_invalid
from ort_helpers import assert_same_bits, copies, reference_result
from strategies import COMBINATIONS, calls_for, shift_calls

from kvcache_op.capi import c_api
from kvcache_op.reference import KeyValueCacheError, key_cache_rotary_shift
from kvcache_op.validation.cases import Seq, build

pytestmark = pytest.mark.gpu

DEVICE_INPUTS = ("current_key", "current_value", "cache", "scale")


def run_on_gpu(inputs, attrs, *, offset=0):
    """Runs a call on the GPU; returns ((key, value, cache, scale) as host arrays, device buffers). Device
    inputs and outputs sit `offset` bytes past a 16-byte boundary between sentinel guards."""
    host = c_api.HostBuffers()
    device = {name: DeviceBuffer(inputs[name], offset=offset) for name in DEVICE_INPUTS if inputs.get(name) is not None}
    tensors = []
    for name in c_api.KV_INPUTS:
        if name in device:
            tensors.append(c_api.Tensor(c_api.onnx_type(device[name].dtype), device[name].shape, device[name].ptr))
        else:
            tensors.append(host.tensor(name, inputs.get(name)))  # index inputs: host memory
    shape = c_api.output_shape(tensors, **attrs)
    dtype = np.asarray(inputs["current_key"]).dtype
    outs = [DeviceBuffer(np.full(shape, 0, dtype), offset=offset) for _ in range(2)]  # sentinel-guarded
    stream = Stream()
    try:
        c_api.run_key_value_cache(tensors, [c_api.Tensor(c_api.onnx_type(dtype), shape, o.ptr) for o in outs],
                                  device="cuda", stream=stream.handle, **attrs)
    finally:
        stream.synchronize()
    result = (outs[0].to_host(), outs[1].to_host(), device["cache"].to_host(),
              device["scale"].to_host() if "scale" in device else None)
    return result, list(device.values()) + outs


def check_against_reference(inputs, attrs, **kw):
    want = reference_result(inputs, attrs)
    got, buffers = run_on_gpu(copies(inputs), attrs, **kw)
    assert_same_bits(got, want)  # the whole cache: nothing but the stored slots changed
    assert all(b.guards_intact() for b in buffers), "a write landed outside a device buffer"


@pytest.mark.parametrize("combo", COMBINATIONS, ids=lambda c: f"q{c[0]}-mode{c[1]}-layout{c[2]}")
def test_gpu_matches_reference(combo):
    @given(calls_for(combo, max_batch=5))
    def check(case):
        check_against_reference(case.inputs, case.attributes)

    check()


@pytest.mark.parametrize("quant_bit,t1,t3", [(0, "float16", "float32"), (0, "bfloat16", "float32"),
                                            (8, "float16", "float16"), (4, "bfloat16", "float32")])
@pytest.mark.parametrize("mode,layout", [(0, 0), (1, 3)])
def test_gpu_decode_and_prefill_batches(quant_bit, t1, t3, mode, layout):
    """Many sequences, many blocks, 16-byte vector units (Dh = 128), GQA, empty sequences."""
    rng = np.random.default_rng(quant_bit + 10 * mode)
    seqs = [Seq(int(rng.integers(0, 300)), int(rng.integers(0, 3))) for _ in range(64)]
    seqs += [Seq(0, 200), Seq(17, 0)]
    case = build("gpu-batch", seqs, heads=4, head_dim=128, quant_bit=quant_bit, quant_group=8, num_repeat=2,
                 cache_mode=mode, cache_layout=layout, page_size=16, t1=t1, t3=t3)
    check_against_reference(case.inputs, case.attributes)


@pytest.mark.parametrize("offset", [2, 4, 8])
def test_gpu_buffers_off_a_16_byte_boundary(offset):
    """Caller views need not be 16-byte aligned: the kernels then use element accesses."""
    case = build("misaligned", [Seq(3, 9), Seq(0, 4)], heads=2, head_dim=64, num_repeat=2, cache_mode=1,
                 page_size=4, t1="float16")
    check_against_reference(case.inputs, case.attributes, offset=offset)


AT_SCHEMA_LEVEL = {"seqstarts_int32", "cachestarts_int32", "max_kvlen_float"}


@pytest.mark.parametrize("row", INVALID, ids=[r[0] for r in INVALID])
def test_invalid_call_on_gpu_fails_and_leaves_the_device_cache_unchanged(row):
    inputs, attrs = make_invalid(row)
    before = {k: np.asarray(inputs[k]).tobytes() for k in ("cache", "scale") if inputs.get(k) is not None}
    host = c_api.HostBuffers()
    device = {n: DeviceBuffer(inputs[n]) for n in DEVICE_INPUTS if inputs.get(n) is not None}
    tensors = [c_api.Tensor(c_api.onnx_type(device[n].dtype), device[n].shape, device[n].ptr) if n in device
               else host.tensor(n, inputs.get(n)) for n in c_api.KV_INPUTS]
    dtype = np.asarray(inputs["current_key"]).dtype
    out = DeviceBuffer(np.zeros(64, np.uint8))
    outputs = [c_api.Tensor(c_api.onnx_type(dtype), (0, 1, 1), out.ptr)] * 2
    with pytest.raises(KeyValueCacheError, match=row[3]):
        c_api.run_key_value_cache(tensors, outputs, device="cuda", **attrs)
    after = {k: device[k].to_host().tobytes() for k in before}
    assert after == before
    assert all(b.guards_intact() for b in device.values())


class RepeatableCall:
    """A KeyValueCache call through the C entry on device buffers, run (and refused) as often as a test needs."""

    def __init__(self, case):
        self.inputs, self.attrs = case.inputs, case.attributes
        self.want = reference_result(copies(self.inputs), self.attrs)
        self.host = c_api.HostBuffers()
        self.device = {n: DeviceBuffer(self.inputs[n]) for n in DEVICE_INPUTS if self.inputs.get(n) is not None}
        self.tensors = [c_api.Tensor(c_api.onnx_type(self.device[n].dtype), self.device[n].shape, self.device[n].ptr)
                        if n in self.device else self.host.tensor(n, self.inputs.get(n)) for n in c_api.KV_INPUTS]
        shape = c_api.output_shape(self.tensors, **self.attrs)
        dtype = np.asarray(self.inputs["current_key"]).dtype
        self.outs = [DeviceBuffer(np.zeros(shape, dtype)) for _ in range(2)]
        self.outputs = [c_api.Tensor(c_api.onnx_type(dtype), shape, o.ptr) for o in self.outs]
        self.stream = Stream()
        self.before = self.device["cache"].to_host().tobytes()

    def run(self):
        c_api.run_key_value_cache(self.tensors, self.outputs, device="cuda", stream=self.stream.handle, **self.attrs)

    def check_unchanged_then_runs(self):
        """The cache as it was given (what was refused wrote nothing), then a call that gives the reference's bits
        (no error of the refused call left behind), every guard intact."""
        self.stream.synchronize()
        assert self.device["cache"].to_host().tobytes() == self.before
        self.run()
        self.stream.synchronize()
        got = (self.outs[0].to_host(), self.outs[1].to_host(), self.device["cache"].to_host(), None)
        assert_same_bits(got, self.want)
        assert all(b.guards_intact() for b in list(self.device.values()) + self.outs)


@pytest.mark.skipif(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1,
                    reason="fills the device's memory: runs only where no other test process shares the GPU")
def test_a_call_refused_for_want_of_device_memory_leaves_no_error_for_the_next_call():
    """A call whose device scratch cannot be had (its 2 MiB of index words, the device full) is refused with the
    cache unchanged, and the next call runs and gives the reference's bits: the failed allocation's error is not read
    again as the next call's launch error, which would report a failure with that call's stores done."""
    call = RepeatableCall(build("scratch refused", [Seq(3, 1)] * 64, cache_mode=1, page_size=16, max_pages=4096))
    with device_memory_full():
        with pytest.raises(RuntimeError, match="allocating scratch"):  # a CUDA failure, not an invalid call
            call.run()
    call.check_unchanged_then_runs()


def test_a_call_on_a_stream_being_captured_into_a_cuda_graph_is_refused_with_the_cache_unchanged():
    """A call copies its validated indices from host memory and sizes its launches by them, so a captured graph
    would replay the captured step's slots: it is refused during capture, with nothing enqueued and the cache
    unchanged, and runs as usual outside capture."""
    call = RepeatableCall(build("captured", [Seq(3, 1), Seq(0, 4)], cache_mode=1, page_size=4))
    with call.stream.capturing():
        with pytest.raises(KeyValueCacheError, match="cannot be captured into a CUDA graph"):
            call.run()
    call.check_unchanged_then_runs()


@given(shift_calls())
def test_gpu_rotary_shift_matches_reference(call):
    """KeyCacheRotaryShift's kernel: the reference's bits in the whole cache and scale, guards intact."""
    inputs, attrs = call
    want = copies(inputs)
    want_slots = key_cache_rotary_shift(**want, **attrs)
    host = c_api.HostBuffers()
    device = {name: DeviceBuffer(inputs[name]) for name in ("cache", "scale") if inputs.get(name) is not None}
    tensors = [c_api.Tensor(c_api.onnx_type(device["cache"].dtype), device["cache"].shape, device["cache"].ptr),
               c_api.Tensor(c_api.onnx_type(device["scale"].dtype), device["scale"].shape, device["scale"].ptr)
               if "scale" in device else c_api.ABSENT,
               host.tensor("slots", inputs["slots"]), host.tensor("cos", inputs["cos"]), host.tensor("sin", inputs["sin"])]
    out = np.zeros(len(inputs["slots"]), np.int64)
    stream = Stream()
    try:
        c_api.run_key_cache_rotary_shift(tensors, c_api.Tensor(7, out.shape, out.ctypes.data), device="cuda",
                                         stream=stream.handle, **attrs)
    finally:
        stream.synchronize()
    assert np.array_equal(out, want_slots)
    got = (device["cache"].to_host(), device["scale"].to_host() if "scale" in device else None)
    assert_same_bits(got, (want["cache"], want["scale"]), names=("cache", "scale"))
    assert all(b.guards_intact() for b in device.values()), "a write landed outside a device buffer"
