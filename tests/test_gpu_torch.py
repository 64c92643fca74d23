"""The torch front-end on CUDA tensors runs the library's CUDA kernel, bit-identical to the reference,
on torch's current stream; invalid calls leave the device cache untouched."""

import numpy as np
import pytest
from hypothesis import given, settings

torch = pytest.importorskip("torch", reason="the torch front-end needs the 'torch' extra: pip install '.[torch]'")

import kvcache_op.torch as kt  # noqa: E402
from invalid_calls import INVALID, make_invalid  # noqa: E402
from ort_helpers import assert_same_bits, copies, reference_result  # noqa: E402
from strategies import COMBINATIONS, calls_for  # noqa: E402
from torch_convert import to_numpy, torch_inputs  # noqa: E402

from kvcache_op.reference import INT4, KeyValueCacheError  # noqa: E402
from kvcache_op.spec.cases import CASES  # noqa: E402

pytestmark = pytest.mark.gpu


def cuda_result(inputs, attrs, index_device="cpu"):
    tensors = torch_inputs(inputs, device="cuda", index_device=index_device)
    key, value = kt.key_value_cache(**tensors, **attrs)
    torch.cuda.synchronize()
    like = np.asarray(inputs["current_key"]).dtype
    return (to_numpy(key, np.empty(tuple(key.shape), like)), to_numpy(value, np.empty(tuple(value.shape), like)),
            to_numpy(tensors["cache"], inputs["cache"]), to_numpy(tensors["scale"], inputs["scale"]))


@pytest.mark.parametrize("combo", COMBINATIONS, ids=lambda c: f"q{c[0]}-mode{c[1]}-layout{c[2]}")
def test_cuda_op_matches_reference(combo):
    @given(calls_for(combo, max_batch=5))
    @settings(max_examples=25)
    def check(case):
        for index_device in ("cpu", "cuda"):
            got = cuda_result(copies(case.inputs), case.attributes, index_device)
            assert_same_bits(got, reference_result(case.inputs, case.attributes))

    check()


def test_cuda_op_runs_on_the_current_stream():
    """The inputs are produced on a side stream after a long sleep: an op launched on any other stream
    would read them before they exist."""
    case = CASES["decode_batch_int8_gqa"]()
    want = reference_result(case.inputs, case.attributes)
    host = torch_inputs(copies(case.inputs), device="cpu")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # cycles: well over the time the host takes to enqueue the rest
        tensors = {k: (v.to("cuda", non_blocking=True) if k in ("current_key", "current_value", "cache", "scale")
                       else v) for k, v in host.items()}
        key, _ = kt.key_value_cache(**tensors, **case.attributes)
        key_copy = key.clone()
    stream.synchronize()
    assert to_numpy(key_copy, want[0]).tobytes() == want[0].tobytes()


@pytest.mark.parametrize("row", INVALID[::3], ids=[r[0] for r in INVALID[::3]])
def test_invalid_cuda_call_raises_and_leaves_the_device_cache_untouched(row):
    inputs, attrs = make_invalid(row)
    if inputs.get("cache") is not None and np.asarray(inputs["cache"]).dtype == INT4 and inputs["cache"].shape[-1] % 2:
        pytest.skip("an int4 cache with an odd last dim has no packed torch form")
    tensors = torch_inputs(copies(inputs), device="cuda", index_device="cpu")
    before = {k: tensors[k].clone() for k in ("cache", "scale") if tensors.get(k) is not None}
    with pytest.raises(KeyValueCacheError, match=row[3]):
        kt.key_value_cache(**tensors, **attrs)
    torch.cuda.synchronize()
    for name, tensor in before.items():
        assert torch.equal(tensors[name].view(torch.uint8), tensor.view(torch.uint8)), f"{name} was written"


def test_mixed_devices_are_refused():
    case = CASES["offset_layout0"]()
    tensors = torch_inputs(copies(case.inputs), device="cuda")
    tensors["cache"] = tensors["cache"].cpu()
    with pytest.raises(KeyValueCacheError, match="must be on one device"):
        kt.key_value_cache(**tensors, **case.attributes)


def test_rotary_shift_on_a_cuda_cache_says_it_has_no_kernel():
    cache = torch.zeros(4, 1, 2, 1, 4, device="cuda")
    slots = torch.tensor([0, 2])
    cos = torch.ones(2, 2)
    with pytest.raises(NotImplementedError, match="no CUDA kernel"):
        kt.key_cache_rotary_shift(cache, None, slots, cos, cos)
    assert not cache.any()
