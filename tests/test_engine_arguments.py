"""The engine checks its arguments before any work: a bad value is a clear TypeError or ValueError naming it, never
a run that goes wrong later (a number of tokens that is not an integer, salts given as one string, a bad salt of a
late arrival, a context past the model's positions, no execution provider, a pool that cannot be allocated)."""

import math

import pytest

pytest.importorskip("torch")  # kvcache_op.hf imports it
pytest.importorskip("transformers")

import hf_models  # noqa: E402
from kvcache_op.serving import Engine  # noqa: E402


@pytest.fixture(scope="module")
def engine():
    return Engine(hf_models.exported("llama"), num_pages=16)


@pytest.mark.parametrize("max_new_tokens, error, message", [
    (math.nan, TypeError, "max_new_tokens must be an integer, got float nan"),
    (2.5, TypeError, "max_new_tokens must be an integer, got float 2.5"),
    (True, TypeError, "max_new_tokens must be an integer, got bool True"),
    ("3", TypeError, "max_new_tokens must be an integer, got str '3'"),
    (0, ValueError, "max_new_tokens must be >= 1, got 0"),
])
def test_max_new_tokens_must_be_a_positive_integer(engine, max_new_tokens, error, message):
    with pytest.raises(error, match=message):
        engine.generate([[1, 2, 3]], max_new_tokens)


def test_salts_are_one_per_prompt_and_checked_before_any_step(engine):
    with pytest.raises(TypeError, match="salts must be a list with one entry per prompt, got str"):
        engine.generate([[1, 2], [3, 4]], 2, salts="ab")
    steps = engine.metrics()["steps"]
    with pytest.raises(TypeError, match=r"salts\[1\]: salt must be None, str or bytes, got int 7"):
        engine.generate([[1, 2], [3, 4]], 2, salts=["a", 7], arrival_steps=[0, 40])
    assert engine.metrics()["steps"] == steps  # refused before the first step ran
    assert engine.generate([[1, 2], [3, 4]], 2, salts=["a", b"b"]) and not engine.manager.requests


@pytest.mark.parametrize("settings, error, message", [
    (dict(num_pages=-1), ValueError, "num_pages, max_batch_tokens and max_running must be >= 1, got -1"),
    (dict(num_pages=2.0), TypeError, "num_pages must be an integer, got float 2.0"),
    (dict(num_pages=10**12), ValueError, r"num_pages=1000000000000 pages of 16 make a cache of .* GiB, more than"),
    (dict(num_pages=8, providers=[]), ValueError, "providers must be a non-empty list"),
    (dict(num_pages=8, max_context=5000), ValueError, r"max_context must be in \[1, the model's max_positions = 1024\]"),
    (dict(num_pages=8, max_batch_tokens=1.5), TypeError, "max_batch_tokens must be an integer"),
    (dict(num_pages=8, max_batch_tokens=0), ValueError, "num_pages, max_batch_tokens and max_running must be >= 1"),
    (dict(num_pages=8, prefix_caching="no"), TypeError, "prefix_caching must be True or False, got str 'no'"),
    (dict(num_pages=8, intra_op_num_threads="x"), TypeError, "intra_op_num_threads must be an integer, got str"),
    (dict(num_pages=8, intra_op_num_threads=-1), ValueError, r"intra_op_num_threads must be >= 0 \(0: ONNX Runtime"),
    (dict(num_pages=8, streaming=(1, 3)), TypeError, r"streaming must be a StreamingPolicy"),
])
def test_engine_settings_are_checked_before_anything_is_allocated(settings, error, message):
    with pytest.raises(error, match=message):
        Engine(hf_models.exported("llama"), **settings)


def test_the_token_budget_defaults_by_device_and_a_given_one_stands(engine):
    """256 tokens a step on the CPU EP; 8192 on a GPU, where a step's host work costs about the same for 256 tokens as
    for thousands (a 64 x 1,000-token prefill was 250 steps of 256)."""
    from kvcache_op.serving.engine import default_batch_tokens

    assert engine.runner.device == ("cpu", 0) and engine.max_batch_tokens == 256
    assert default_batch_tokens("cpu") == 256 and default_batch_tokens("cuda") == 8192
    assert Engine(hf_models.exported("llama"), num_pages=8, max_batch_tokens=40).max_batch_tokens == 40


def test_a_request_that_cannot_fit_the_pool_is_refused_before_any_token():
    """20 prompt tokens + 20 new ones need 3 pages of 16 (the last token is never stored); 2 pages cannot hold it."""
    engine = Engine(hf_models.exported("llama"), num_pages=2)
    streamed = []
    with pytest.raises(ValueError, match=r"prompt 0: 20 tokens \+ max_new_tokens=20 need 3 pages of 16, more than "
                                         r"num_pages=2"):
        engine.generate([list(range(1, 21))], 20, on_token=lambda i, t: streamed.append(t))
    assert streamed == [] and not engine.manager.requests
    assert len(engine.generate([list(range(1, 21))], 13)[0]) == 13  # 32 positions: exactly 2 pages


def test_a_float32_model_on_the_cuda_ep_is_told_not_to_use_tf32():
    """ONNX Runtime's CUDA EP multiplies float32 in TF32 unless told otherwise; a float32 model must not drift."""
    from kvcache_op.serving.ort_runner import exact_float32

    named = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert exact_float32(named, "float32") == [("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"]
    assert exact_float32(named, "float16") == named
    given = [("CUDAExecutionProvider", {"use_tf32": "1"})]
    assert exact_float32(given, "float32") == given  # the caller's options stand
