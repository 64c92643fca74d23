"""The torch front-end on CUDA tensors runs the library's CUDA kernels: KeyValueCache bit-identical to the
reference, on torch's current stream, invalid calls leaving the device cache untouched; both attention ops within
the spec's bound of the naive oracle (MultiHeadCacheAttention's cache bit for bit the naive KeyValueCache's)."""

import numpy as np
import pytest
from hypothesis import given, settings

torch = pytest.importorskip("torch", reason="the torch front-end needs the 'torch' extra: pip install '.[torch]'")

import kvcache_op.torch as kt  # noqa: E402
from invalid_calls import INVALID, make_invalid  # noqa: E402
from ort_helpers import assert_same_bits, copies, reference_result  # noqa: E402
from strategies import COMBINATIONS, calls_for, shift_calls  # noqa: E402
from torch_convert import to_numpy, torch_inputs  # noqa: E402

from kvcache_op.reference import INT4, KeyValueCacheError, key_cache_rotary_shift, rotary_shift_tables  # noqa: E402
from kvcache_op.validation.cases import CASES  # noqa: E402
from kvcache_op.validation.mha_cases import ATTENTION_CASES  # noqa: E402
from kvcache_op.validation.mhca_cases import CASES as MHCA_CASES  # noqa: E402
from test_mha_reference import assert_within, oracle  # noqa: E402
from test_mhca_ort_cpu import naive_oracle  # noqa: E402

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


@given(shift_calls())
@settings(max_examples=40)
def test_rotary_shift_on_cuda_matches_reference(call):
    inputs, attrs = call
    want = copies(inputs)
    want_slots = key_cache_rotary_shift(**want, **attrs)
    tensors = torch_inputs(copies(inputs), device="cuda", index_device="cpu")
    got_slots = kt.key_cache_rotary_shift(**tensors, **attrs)
    torch.cuda.synchronize()
    assert np.array_equal(got_slots.numpy(), want_slots)
    assert to_numpy(tensors["cache"], inputs["cache"]).tobytes() == want["cache"].tobytes()
    if inputs["scale"] is not None:
        assert to_numpy(tensors["scale"], inputs["scale"]).tobytes() == want["scale"].tobytes()


def test_a_quantized_cuda_shift_of_too_long_rows_is_refused_untouched():
    cache = torch.ones(4, 1, 2, 1, 512, dtype=torch.int8, device="cuda")
    scale = torch.ones(4, 1, 2, 1, 64, device="cuda")
    cos, sin = (torch.from_numpy(t) for t in rotary_shift_tables(np.array([1]), 512))
    with pytest.raises(KeyValueCacheError, match="at most 256"):
        kt.key_cache_rotary_shift(cache, scale, torch.tensor([1]), cos, sin, quant_bit=8)
    assert bool((cache == 1).all()) and bool((scale == 1).all())


@pytest.mark.parametrize("name", sorted(ATTENTION_CASES))
def test_cuda_attention_is_within_the_bound_of_the_naive_oracle(name):
    """kvcache_op.torch.multi_head_attention on CUDA tensors runs the library's CUDA kernel."""
    case = ATTENTION_CASES[name]()
    exact, bound = oracle(case)
    tensors = torch_inputs(copies(case.inputs), device="cuda", index_device="cpu")  # index inputs on the host
    out = kt.multi_head_attention(**tensors, **case.attributes)
    assert out.device.type == "cuda"
    got = to_numpy(out, case.inputs["query"])
    assert_within(got, exact, bound, f"CUDA {name}")
    assert np.all(got[bound == 0] == 0)


@pytest.mark.parametrize("name", sorted(MHCA_CASES))
def test_cuda_cache_attention_writes_the_naive_cache_and_is_within_the_bound(name):
    case = MHCA_CASES[name]()
    exact, bound, cache_after, scale_after = naive_oracle(case.inputs, case.attributes)
    tensors = torch_inputs(copies(case.inputs), device="cuda", index_device="cpu")
    out = kt.multi_head_cache_attention(**tensors, **case.attributes)
    assert out.device.type == "cuda"
    assert to_numpy(tensors["cache"], case.inputs["cache"]).tobytes() == cache_after.tobytes()
    if scale_after is not None:
        assert to_numpy(tensors["scale"], case.inputs["scale"]).tobytes() == scale_after.tobytes()
    assert_within(to_numpy(out, case.inputs["query"]), exact, bound, f"CUDA {name}")
