"""The engine's ONNX Runtime runner (serving/ort_runner.py): its one binding serves every step. On the CPU EP the
index inputs are refilled in place and the logits land in a reused buffer; the logits of each step must equal those
of a session bound afresh. A device session copies an input to the device when it is bound, so there every step's
inputs must be bound afresh (a refill would leave the device reading the first step's tokens)."""

import numpy as np
import pytest

pytest.importorskip("torch")  # kvcache_op.hf imports it
pytest.importorskip("transformers")

import hf_models  # noqa: E402
from kvcache_op.manager import KVCacheManager  # noqa: E402
from kvcache_op.serving import ModelRunner  # noqa: E402
from kvcache_op.serving.decoder_io import OUTPUT_NAME  # noqa: E402
from kvcache_op.serving.step_feeds import step_feeds  # noqa: E402


def steps(runner, count: int):
    """Feeds of a prompt's prefill, then ``count`` decodes of two requests (the same shapes step after step)."""
    info = runner.info
    m = KVCacheManager(8, info.page_size, 8, vocab_size=info.vocab_size)
    m.add_request("a", [1, 2, 3])
    m.add_request("b", [4, 5])
    plan = m.schedule({"a": [1, 2, 3], "b": [4, 5]})
    yield step_feeds(plan)
    m.commit(plan)
    for t in range(count):
        plan = m.schedule_decode(["a", "b"], [7 + t, 11 + 2 * t])
        yield step_feeds(plan)
        m.commit(plan)


def fresh_logits(runner, feeds) -> np.ndarray:
    """One step through a binding made for it alone (what the runner did before it kept one)."""
    binding = runner.session.io_binding()
    for name in runner.session_inputs:
        if name == "cache":
            binding.bind_ortvalue_input(name, runner.cache)
        else:
            binding.bind_cpu_input(name, feeds[name])
    binding.bind_output(OUTPUT_NAME, "cpu")
    runner.session.run_with_iobinding(binding)
    return binding.get_outputs()[0].numpy()


def test_every_step_through_the_kept_binding_equals_a_fresh_binding():
    path = hf_models.exported("llama")
    kept, fresh = ModelRunner(path, 8, ["CPUExecutionProvider"]), ModelRunner(path, 8, ["CPUExecutionProvider"])
    for feeds in steps(kept, 5):
        got = kept.run(feeds).copy()
        np.testing.assert_array_equal(got, fresh_logits(fresh, feeds))


def test_a_device_session_binds_every_steps_inputs_afresh(monkeypatch):
    runner = ModelRunner(hf_models.exported("llama"), 8, ["CPUExecutionProvider"])
    runner.device = ("cuda", 0)  # as a device session: the binding is watched, the run stays on the CPU
    bound = []
    real = runner._binding.bind_cpu_input
    monkeypatch.setattr(runner._binding, "bind_cpu_input", lambda name, value: (bound.append((name, value.copy())),
                                                                                real(name, value)))
    for feeds in steps(runner, 3):
        bound.clear()
        runner.run(feeds)
        got = dict(bound)
        assert set(got) == set(runner.session_inputs) - {"cache", "scale"}
        for name, value in got.items():
            np.testing.assert_array_equal(value, feeds[name])
