"""Run by test_gpu_cuda_ep.py in a subprocess: malformed calls through the CUDA EP."""

import os

import pytest
from hypothesis import HealthCheck, given, settings

from test_ort_cpu_fuzz import malformed_calls, run_reference

pytestmark = pytest.mark.ort_gpu


@settings(max_examples=int(os.environ.get("KVCACHE_FUZZ_EXAMPLES", "300")), deadline=None,
          suppress_health_check=list(HealthCheck))
@given(malformed_calls())
def test_malformed_calls_on_cuda(call):
    from gpu_support import run_on_cuda

    from kvcache_op import spec

    inputs, attrs = call
    message, want = run_reference(inputs, attrs)
    try:
        key, value, cache, _ = run_on_cuda(spec.make_model(inputs, **attrs),
                                           {k: v for k, v in inputs.items() if v is not None})
    except Exception as error:  # noqa: BLE001
        assert message is not None, f"CUDA failed on a call the reference accepts: {error}"
        assert message in str(error)
        if hasattr(error, "cache_after"):
            assert error.cache_after.tobytes() == inputs["cache"].tobytes()
        return
    assert message is None, f"CUDA accepted a call the reference rejects: {message}"
    assert key.tobytes() == want[0].tobytes() and cache.tobytes() == want[2].tobytes()
