"""The ORT CUDA EP variants against the reference: KeyValueCache over the hypothesis space of the CPU op,
conformance vectors, multi-step serving, and every error with the device cache unchanged; KeyCacheRotaryShift; the
two attention ops within the spec's bound of the naive oracle, with the device cache bit for bit the naive
KeyValueCache's. Skipped centrally without a GPU."""

import pathlib
import re
import subprocess
import sys

import pytest
from hypothesis import given

from kvcache_op import spec
from kvcache_op.validation.cases import CASES
from invalid_calls import INVALID, make_invalid
from ort_helpers import assert_same_bits, reference_result
from strategies import COMBINATIONS, calls_for, shift_calls
from ort_helpers import copies
from test_mha_reference import assert_within, oracle
from test_mhca_ort_cpu import naive_oracle
from kvcache_op.validation.mha_cases import ATTENTION_CASES
from kvcache_op.validation.mhca_cases import CASES as CACHE_ATTENTION_CASES

pytestmark = pytest.mark.ort_gpu


def cuda_result(inputs, attrs):
    from gpu_support import run_on_cuda

    model = spec.make_model(inputs, **attrs)
    return run_on_cuda(model, {k: v for k, v in inputs.items() if v is not None})


@pytest.mark.parametrize("combo", COMBINATIONS, ids=lambda c: f"q{c[0]}-mode{c[1]}-layout{c[2]}")
def test_cuda_matches_reference(combo):
    @given(calls_for(combo, max_batch=5))
    def check(case):
        assert_same_bits(cuda_result(case.inputs, case.attributes), reference_result(case.inputs, case.attributes))

    check()


@pytest.mark.parametrize("name", list(CASES))
def test_conformance_case_on_cuda(name):
    case = CASES[name]()
    assert_same_bits(cuda_result(case.inputs, case.attributes), reference_result(case.inputs, case.attributes))


@pytest.mark.parametrize("row", [r for r in INVALID if r[0] not in {"seqstarts_int32", "cachestarts_int32",
                                                                     "max_kvlen_float"}], ids=lambda r: r[0])
def test_invalid_input_on_cuda_fails_and_leaves_the_device_cache_unchanged(row):
    inputs, attrs = make_invalid(row)
    try:
        cuda_result(inputs, attrs)
    except Exception as error:  # noqa: BLE001
        assert re.search(row[3], str(error)), str(error)
        if hasattr(error, "cache_after"):
            assert error.cache_after.tobytes() == inputs["cache"].tobytes()
        return
    pytest.fail("the CUDA op accepted an invalid call")


def test_multi_step_serving_on_cuda():
    from scenario import initial_cache, steps

    from kvcache_op.reference import key_value_cache

    attrs = dict(quant_bit=8, quant_group=4, cache_mode=1, cache_layout=3, page_size=4)
    ref_cache, ref_scale = initial_cache(8, "float16", 3, 64, 4, 2, 8, 4)
    gpu_cache, gpu_scale = ref_cache.copy(), ref_scale.copy()
    for inputs in steps(seed=11):
        want = key_value_cache(**inputs, cache=ref_cache, scale=ref_scale, **attrs)
        key, value, gpu_cache, gpu_scale = cuda_result({**inputs, "cache": gpu_cache, "scale": gpu_scale}, attrs)
        assert key.tobytes() == want[0].tobytes() and value.tobytes() == want[1].tobytes()
        assert gpu_cache.tobytes() == ref_cache.tobytes() and gpu_scale.tobytes() == ref_scale.tobytes()


def test_fuzz_on_cuda_in_a_subprocess():
    """Malformed calls on the GPU run in their own process: one illegal access would poison this one."""
    worker = pathlib.Path(__file__).with_name("test_gpu_fuzz_worker.py")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(worker)],
                          cwd=worker.parent, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@given(shift_calls())
def test_rotary_shift_on_the_cuda_ep_matches_reference(call):
    """KeyCacheRotaryShift's CUDA EP kernel: device cache and scale bound, slots and tables on the host."""
    import numpy as np

    from gpu_support import bind_on_cuda, from_device
    from kvcache_op.ort_ops import make_session
    from kvcache_op.reference import key_cache_rotary_shift
    from kvcache_op.spec.rotary_schema import make_rotary_shift_model

    inputs, attrs = call
    want = {k: (None if v is None else np.array(v, copy=True)) for k, v in inputs.items()}
    want_slots = key_cache_rotary_shift(**want, **attrs)
    model = make_rotary_shift_model(inputs, **attrs)
    session = make_session(model, providers=("CUDAExecutionProvider",), disable_cpu_fallback=True)
    binding, device = bind_on_cuda(session, {k: v for k, v in inputs.items() if v is not None}, ("cache", "scale"))
    session.run_with_iobinding(binding)
    assert np.array_equal(from_device(binding.get_outputs()[0], np.int64), want_slots)
    got = tuple(from_device(device[n], np.asarray(inputs[n]).dtype) if n in device else None for n in ("cache", "scale"))
    assert_same_bits(got, (want["cache"], want["scale"]), names=("cache", "scale"))


ATTENTION_DEVICE_INPUTS = ("query", "key", "value", "attn_mask", "current_key", "current_value", "cache", "scale")


def run_attention_on_cuda(model, inputs):
    """An attention model on the CUDA EP (no CPU fallback), data inputs bound as device OrtValues, index inputs from
    the host: (output, cache after, scale after) as host arrays (None where absent)."""
    import numpy as np

    from gpu_support import bind_on_cuda, from_device
    from kvcache_op.ort_ops import make_session

    session = make_session(model, providers=("CUDAExecutionProvider",), disable_cpu_fallback=True)
    binding, device = bind_on_cuda(session, inputs, ATTENTION_DEVICE_INPUTS)
    session.run_with_iobinding(binding)
    out = from_device(binding.get_outputs()[0], np.asarray(inputs["query"]).dtype)
    after = [from_device(device[n], np.asarray(inputs[n]).dtype) if n in device else None for n in ("cache", "scale")]
    return out, *after


@pytest.mark.parametrize("name", sorted(ATTENTION_CASES))
def test_attention_on_the_cuda_ep_is_within_the_bound(name):
    case = ATTENTION_CASES[name]()
    exact, bound = oracle(case)
    model = spec.make_attention_model(case.inputs, **case.attributes)
    out, _, _ = run_attention_on_cuda(model, {k: v for k, v in case.inputs.items() if v is not None})
    assert_within(out, exact, bound, f"CUDA EP {name}")


@pytest.mark.parametrize("name", sorted(CACHE_ATTENTION_CASES))
def test_cache_attention_on_the_cuda_ep_writes_the_naive_cache_and_is_within_the_bound(name):
    case = CACHE_ATTENTION_CASES[name]()
    exact, bound, cache_after, scale_after = naive_oracle(case.inputs, case.attributes)
    model = spec.make_cache_attention_model(copies(case.inputs), **case.attributes)
    out, cache, scale = run_attention_on_cuda(model, {k: v for k, v in case.inputs.items() if v is not None})
    assert cache.tobytes() == cache_after.tobytes()
    if scale_after is not None:
        assert scale.tobytes() == scale_after.tobytes()
    assert_within(out, exact, bound, f"CUDA EP {name}")
