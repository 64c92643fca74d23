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
# Under compute-sanitizer (tools/gpu_check.sh) every launch is many times slower: a few examples each.
settings.register_profile("gpu-sanitize", max_examples=4, deadline=None, suppress_health_check=list(HealthCheck),
                          derandomize=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _gpu_unavailable_reason():
    """Why the kernels cannot be run on a GPU here (through the C entry point), or None when they can."""
    from kvcache_op.capi import c_api
    from kvcache_op.ort_ops import library_available

    if not library_available():
        return "the kvcache-op library is not built"
    if not c_api.has_cuda():
        return "this build of the library has no CUDA kernels (nvcc was not found when it was built)"
    try:
        import gpu_support

        framework = gpu_support.device_framework()
    except Exception as error:  # noqa: BLE001 - any failure to reach a GPU is a reason to skip
        return f"no GPU framework can reach a CUDA device ({type(error).__name__}: {error})"
    if framework is None:
        return "no CUDA device is visible to torch or CuPy (neither is installed, or no GPU)"
    return None


def _ort_gpu_unavailable_reason():
    """Why ONNX Runtime's CUDA EP tests cannot run here, or None."""
    reason = _gpu_unavailable_reason()
    if reason:
        return reason
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return "this onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu: README, GPU section)"
    return None


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU reachable from torch or CuPy and a CUDA build of "
                                       "the library (skipped otherwise, with the reason)")
    config.addinivalue_line("markers", "ort_gpu: a gpu test that also needs onnxruntime-gpu's CUDAExecutionProvider")


def pytest_collection_modifyitems(config, items):
    """The one place GPU tests are skipped, with the reason shown in the summary (-ra)."""
    reasons = {}
    for item in items:
        for marker, find_reason in (("ort_gpu", _ort_gpu_unavailable_reason), ("gpu", _gpu_unavailable_reason)):
            if marker in item.keywords:
                if marker not in reasons:
                    reasons[marker] = find_reason()
                if reasons[marker]:
                    item.add_marker(pytest.mark.skip(reason=f"GPU test skipped: {reasons[marker]}"))
                break


def pytest_terminal_summary(terminalreporter):
    """How much kernel work the CUDA host runners checked in this session (when they ran)."""
    runner = sys.modules.get("cuda_host_runner")
    if runner is not None and runner.CHECKED["launches"]:
        c = runner.CHECKED
        terminalreporter.write_line(
            f"CUDA host runner: {c['launches']} clean launches checked ({c['threads']} threads, "
            f"{c['bytes_written']} bytes written)")
    attention = sys.modules.get("attention_host_runner")
    if attention is not None and attention.CHECKED["launches"]:
        c = attention.CHECKED
        terminalreporter.write_line(
            f"CUDA attention host runner: {c['launches']} clean launches checked ({c['blocks']} blocks, "
            f"{c['split_tiles']} split tiles)")


@pytest.fixture(scope="session")
def all_vectors(tmp_path_factory):
    """Every conformance vector, written once for the session (tests read it; any that changes a case
    copies it first)."""
    from kvcache_op.validation import vectors

    out = tmp_path_factory.mktemp("vectors")
    vectors.write_conformance(out, progress=None)
    return out


@pytest.fixture(scope="session")
def served_checkpoint(tmp_path_factory):
    """(folder, model, tokenizer): the checkpoint folder the server tests serve (made once for the session)."""
    pytest.importorskip("torch")  # kvcache_op.hf imports it
    pytest.importorskip("transformers")
    from kvcache_op.hf import tiny_checkpoint

    folder = tmp_path_factory.mktemp("served-checkpoint")
    model, tokenizer = tiny_checkpoint(folder)
    return folder, model, tokenizer


SERVER_API_KEY = "sk-test-0123456789"


def metric_values(url) -> dict:
    """{(name, labels...): value} of every sample a server's ``/metrics`` shows."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, *sorted(sample.labels.items()))] = sample.value
    return out


def wait_for_metrics(url, ready, what: str, timeout: float = 30.0, poll: float = 0.01) -> dict:
    """The server's :func:`metric_values` once ``ready(values)`` holds; fails naming ``what`` after ``timeout`` s."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        m = metric_values(url)
        if ready(m):
            return m
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {timeout:g} s: {m}")
        time.sleep(poll)


@pytest.fixture(scope="session")
def exported(served_checkpoint, tmp_path_factory):
    """The served checkpoint exported once for the session (the ONNX file's path)."""
    from kvcache_op.export_command import export_checkpoint

    out = tmp_path_factory.mktemp("exported") / "model.onnx"
    export_checkpoint(served_checkpoint[0], out, progress=lambda line: None)
    return out


def copy_checkpoint(folder, target, weights_bytes=None):
    """A copy of the checkpoint ``folder``'s files at ``target`` (made); ``weights_bytes``: only that many bytes of
    its ``model.safetensors`` (a damaged weight file)."""
    target.mkdir()
    for path in folder.iterdir():
        if path.is_file():
            data = path.read_bytes()
            (target / path.name).write_bytes(data[:weights_bytes] if path.name == "model.safetensors" else data)
    return target


def served_app(exported, tokenizer, api_key=None, engine_options=None, **limits):
    """The server's FastAPI app in this process, over a fresh engine on ``exported`` (64 pages unless
    ``engine_options`` say otherwise; the tests find it at ``app.state.engine``) serving as "tiny"; ``limits``:
    ServerLimits fields."""
    from kvcache_op.serving import Engine
    from kvcache_op.serving.server import ServerLimits, create_app
    from kvcache_op.serving.tokenizer import PlainText

    engine = Engine(exported, tokenizer=PlainText(tokenizer), **{"num_pages": 64, **(engine_options or {})})
    app = create_app(engine, tokenizer, model_name="tiny", api_key=api_key, limits=ServerLimits(**limits))
    app.state.engine = engine
    return app


@pytest.fixture(scope="session")
def api_server(served_checkpoint, tmp_path_factory):
    """The base URL of ``kvcache-op serve`` on the served checkpoint folder (exported into a fresh cache folder),
    requiring :data:`SERVER_API_KEY`; one process for the session, stopped at its end."""
    pytest.importorskip("fastapi")
    from kvcache_op.serve_command import ServerProcess

    folder = served_checkpoint[0]
    cache = tmp_path_factory.mktemp("export-cache")
    # Stopped at the session's end; its own limit (--stop-after) only ends one left behind, so it outlasts any
    # order in which the tests that share it run.
    server = ServerProcess(folder, "--api-key", SERVER_API_KEY, "--cache-dir", cache, "--num-pages", 160,
                           "--model-name", "tiny", "--max-tokens-limit", 1000, lifetime=3600)
    try:
        server.start()
    except RuntimeError as error:
        pytest.fail(str(error))
    yield server.url
    server.stop()
