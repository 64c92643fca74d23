"""Shared test configuration: hypothesis profiles and the one place GPU tests are skipped.

Profiles (``HYPOTHESIS_PROFILE``): ``ci`` (default, bounded time), ``dev`` (quick), ``long``
(dedicated runs: many more examples).
"""

import os
import sys
import pathlib

import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, str(pathlib.Path(__file__).parent))  # tests' own helpers (naive reference, strategies)

settings.register_profile("ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                          derandomize=True)
settings.register_profile("dev", max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _gpu_unavailable_reason():
    """Why GPU tests cannot run here, or None when they can."""
    try:
        import onnxruntime as ort
    except ImportError:
        return "onnxruntime is not installed"
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return "this onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu on a machine with a GPU)"
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device is visible"
    except Exception as error:  # noqa: BLE001 - any failure to reach a GPU is a reason to skip
        return f"CuPy cannot reach a CUDA device ({type(error).__name__}: {error})"
    return None


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU, onnxruntime-gpu and CuPy (skipped otherwise)")


def pytest_collection_modifyitems(config, items):
    """The one place GPU tests are skipped, with the reason shown in the summary (-ra)."""
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    reason = _gpu_unavailable_reason()
    if reason:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=f"GPU test skipped: {reason}"))


def pytest_terminal_summary(terminalreporter):
    """How much kernel work the CUDA host runner checked in this session (when it ran)."""
    runner = sys.modules.get("cuda_host_runner")
    if runner is not None and runner.CHECKED["launches"]:
        c = runner.CHECKED
        terminalreporter.write_line(
            f"CUDA host runner: {c['launches']} clean launches checked ({c['threads']} threads, "
            f"{c['bytes_written']} bytes written)")
