"""The engine's ONNX Runtime runner (serving/ort_runner.py): its one binding serves every step. On the CPU EP the
index inputs are refilled in place and the logits land in a reused buffer; the logits of each step must equal those
of a session bound afresh. A device session copies an input to the device when it is bound, so there every step's
inputs must be bound afresh (a refill would leave the device reading the first step's tokens). A greedy step's tokens
come from the graph (numpy's argmax of the logits), and on a device without its logits crossing to the host, but
where the graph's token is outside the vocabulary. A sampled step's tokens come from the sampling graph over the
step's logits (the host sampler's tokens for the same uniforms), and on a device its logits stay there too."""

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto

pytest.importorskip("torch")  # kvcache_op.hf imports it
pytest.importorskip("transformers")

import hf_models  # noqa: E402
from kvcache_op.manager import KVCacheManager  # noqa: E402
from kvcache_op.ort_ops import make_session  # noqa: E402
from kvcache_op.serving import ModelRunner  # noqa: E402
from kvcache_op.serving.ort_runner import device_providers  # noqa: E402
from kvcache_op.serving.decoder_io import OUTPUT_NAME  # noqa: E402
from kvcache_op.serving.next_decode_graph import GREEDY_TOKENS  # noqa: E402
from kvcache_op.serving.sampler_graph import SORT_WIDTH, sampler_feeds  # noqa: E402
from kvcache_op.serving.sampling import SamplingParams  # noqa: E402
from sampling_batches import host_tokens  # noqa: E402
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


def one_request_step(runner):
    """The feeds of a one-row step (another manager's prompt): a step of another shape than :func:`steps`'."""
    m = KVCacheManager(8, runner.info.page_size, 8, vocab_size=runner.info.vocab_size)
    m.add_request("c", [3, 1, 4, 1, 5])
    return step_feeds(m.schedule({"c": [3, 1, 4, 1, 5]}))


def test_greedy_steps_give_the_argmax_of_the_logits_and_leave_the_same_cache():
    """Greedy and logits steps interleaved on one runner, rows changing from two to one and back: each greedy step's
    tokens are numpy's argmax of the logits a second runner makes for the same step, each logits step's logits
    equal its, and the caches stay equal."""
    path = hf_models.exported("llama")
    mixed, plain = ModelRunner(path, 8, ["CPUExecutionProvider"]), ModelRunner(path, 8, ["CPUExecutionProvider"])
    all_feeds = list(steps(mixed, 3))
    all_feeds[2:2] = [one_request_step(mixed)]
    for k, feeds in enumerate(all_feeds + all_feeds[::-1]):
        logits = plain.run(feeds).copy()
        if k % 2:
            np.testing.assert_array_equal(mixed.run(feeds), logits)
        else:
            tokens = mixed.run_greedy(feeds)
            assert tokens.dtype == np.int64 and np.array_equal(tokens, np.argmax(logits, axis=1)), k
        np.testing.assert_array_equal(mixed.cache.numpy(), plain.cache.numpy())
    assert mixed.host_chosen_rows == 0 and mixed.device_logit_rows == 0


def as_device_session(runner, monkeypatch) -> list:
    """``runner`` as a device session over its CPU session: outputs it asks for on "cuda" are made on the CPU; returns
    the list of (output, device kind) it asks for."""
    runner.device = ("cuda", 0)
    # its other sessions (the sampling graph, the key shift) on the CPU EP too, where a device's would keep every node
    # on the device
    monkeypatch.setattr(runner, "_session_beside", lambda model: make_session(model, ["CPUExecutionProvider"]))
    asked, real = [], runner._binding.bind_output

    def bind_output(name, device_type="cpu", device_id=0, *rest):
        asked.append((name, device_type))
        return real(name, "cpu", 0, *rest)
    monkeypatch.setattr(runner._binding, "bind_output", bind_output)
    return asked


def test_a_device_sessions_greedy_step_brings_back_its_tokens_and_leaves_its_logits(monkeypatch):
    path = hf_models.exported("llama")
    runner, plain = ModelRunner(path, 8, ["CPUExecutionProvider"]), ModelRunner(path, 8, ["CPUExecutionProvider"])
    asked = as_device_session(runner, monkeypatch)
    for feeds in steps(runner, 3):
        asked.clear()
        tokens = runner.run_greedy(feeds)
        assert asked == [(OUTPUT_NAME, "cuda"), (GREEDY_TOKENS, "cpu")]
        assert np.array_equal(tokens, np.argmax(plain.run(feeds), axis=1))
    assert runner.device_logit_rows == 0 and runner.host_chosen_rows == 0
    asked.clear()
    np.testing.assert_array_equal(runner.run(feeds), plain.run(feeds))  # a step whose logits are read: they cross
    assert asked == [(OUTPUT_NAME, "cpu")] and runner.device_logit_rows == 2


@pytest.mark.parametrize("sentinel", [2**31 - 1, -1])
def test_a_token_outside_the_vocabulary_is_chosen_again_from_its_logits(monkeypatch, sentinel):
    """ONNX Runtime's CUDA ArgMax gives INT32_MAX for a row of -inf: such a row's token is the host's argmax of the
    row's logits (copied from the device for it), the other rows keep the graph's."""
    path = hf_models.exported("llama")
    runner, plain = ModelRunner(path, 8, ["CPUExecutionProvider"]), ModelRunner(path, 8, ["CPUExecutionProvider"])
    as_device_session(runner, monkeypatch)
    real = runner._binding.get_outputs

    def get_outputs():
        logits, tokens = real()
        wrong = tokens.numpy().copy()
        wrong[1] = sentinel
        return [logits, ort.OrtValue.ortvalue_from_numpy(wrong)]
    monkeypatch.setattr(runner._binding, "get_outputs", get_outputs)
    feeds = next(steps(runner, 0))
    tokens = runner.run_greedy(feeds)
    assert np.array_equal(tokens, np.argmax(plain.run(feeds), axis=1))
    assert runner.host_chosen_rows == 1 and runner.device_logit_rows == 2


def test_the_engines_greedy_requests_never_read_logits_and_get_the_same_tokens(monkeypatch):
    """Plain greedy requests (one step at a time, so every step is a runner call) go through ``run_greedy`` alone;
    their tokens equal those of requests that read their logits (logprobs asked for, the host's argmax)."""
    from kvcache_op.serving import Engine, SamplingParams

    path = hf_models.exported("llama")
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16] * 3]
    host = Engine(path, num_pages=16, decode_steps=1)
    with_logits = host.generate(prompts, 12, params=SamplingParams(max_tokens=12, logprobs=0))
    engine = Engine(path, num_pages=16, decode_steps=1)

    def no_logits(*args):
        raise AssertionError("a greedy step read its logits")
    monkeypatch.setattr(engine.runner, "run", no_logits)
    assert engine.generate(prompts, 12) == with_logits


@pytest.mark.parametrize("device", ["cpu", "emulated device"])
@pytest.mark.parametrize("sort", ["least", "one token"])
def test_sampled_steps_draw_the_host_samplers_tokens_from_the_steps_logits(monkeypatch, device, sort):
    """Sampled and greedy rows, the row count changing: each step's tokens are the host sampler's over the logits a
    second runner makes for the step, from the same uniforms; on a device no row of logits is copied, but those of
    rows the graph leaves incomplete (a sort of one token: every top-p and top-k row), drawn on the host."""
    path = hf_models.exported("llama")
    runner, plain = ModelRunner(path, 8, ["CPUExecutionProvider"]), ModelRunner(path, 8, ["CPUExecutionProvider"])
    asked = as_device_session(runner, monkeypatch) if device != "cpu" else []
    assert not plain.graph_sampling  # on the CPU EP the host samples; the graph, where asked, as here
    all_feeds = list(steps(runner, 4))
    all_feeds[2:2] = [one_request_step(runner)]
    pool = [SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=1.3, top_k=5, min_p=0.05),
            SamplingParams(), SamplingParams(temperature=2.0)]
    rng, drawn_on_host = np.random.default_rng(0), 0
    for k, feeds in enumerate(all_feeds):
        rows = len(feeds["seqstarts"]) - 1
        params, uniforms = [pool[(k + r) % len(pool)] for r in range(rows)], rng.random(rows)
        logits = plain.run(feeds).copy()
        sampling = sampler_feeds(params, uniforms, runner.info.vocab_size)
        if sort == "one token":
            sampling[SORT_WIDTH] = np.array([1])
            drawn_on_host += sum(p.top_p < 1 or p.top_k > 1 for p in params)
        asked.clear()
        tokens = runner.run_sampled(feeds, sampling)
        assert tokens.dtype == np.int64 and tokens.tolist() == host_tokens(logits, params, uniforms), k
        assert asked == ([] if device == "cpu" else [(OUTPUT_NAME, "cuda"), (GREEDY_TOKENS, "cpu")])
        np.testing.assert_array_equal(runner.cache.numpy(), plain.cache.numpy())
    assert runner.host_sampled_rows == drawn_on_host and runner.host_chosen_rows == 0
    # a step with a row drawn on the host copies its logits (every row); on the CPU EP nothing is copied
    assert (runner.device_logit_rows > 0) == (device != "cpu" and sort != "least")


def test_a_device_sessions_other_graphs_name_no_cpu_ep():
    """The sampling graph and the key shift run with every node on the device: ONNX Runtime refuses that with the CPU
    EP named (as the default providers name it), so their sessions name the device's EPs only, options kept."""
    cuda = ("CUDAExecutionProvider", {"device_id": "1", "use_tf32": "0"})
    assert device_providers([cuda, "CPUExecutionProvider"]) == [cuda]
    assert device_providers(["CUDAExecutionProvider", ("CPUExecutionProvider", {})]) == ["CUDAExecutionProvider"]


def test_bfloat16_logits_are_sorted_whole(monkeypatch):
    """numpy has no bfloat16, so the host could not draw a bfloat16 row the graph left incomplete: a step with such
    logits sorts its rows whole (none can be incomplete). Here the float32 logits stand in, the runner told they
    are bfloat16 after its sampling graph was made."""
    path = hf_models.exported("llama")
    runner = ModelRunner(path, 8, ["CPUExecutionProvider"])
    feeds = next(steps(runner, 1))
    params = [SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=1.0)]
    sampling = sampler_feeds(params, [0.3, 0.6], runner.info.vocab_size)
    assert sampling[SORT_WIDTH][0] == 5
    runner.run_sampled(feeds, sampling)  # the graph made for float32 logits
    sorted_widths, real = [], runner._sampler_binding

    def watched():
        binding = real()
        bind = binding.bind_cpu_input
        binding.bind_cpu_input = lambda name, value: (
            sorted_widths.append(int(value[0])) if name == SORT_WIDTH else None, bind(name, value))
        return binding
    monkeypatch.setattr(runner, "_sampler_binding", watched)
    monkeypatch.setattr(runner, "_logits_type", TensorProto.BFLOAT16)
    runner.run_sampled(feeds, sampling)
    greedy = sampler_feeds([SamplingParams(), SamplingParams(temperature=0.5)], [0.3, 0.6], runner.info.vocab_size)
    runner.run_sampled(feeds, greedy)  # no top-k or top-p: nothing to sort
    assert sorted_widths == [runner.info.vocab_size, 1]


def test_a_sampled_step_copies_its_logits_once_however_many_rows_the_host_chooses(monkeypatch):
    """A row past the sort (drawn on the host) and a greedy row whose token from the device is outside the vocabulary
    (chosen on the host) in one step: the step's logits cross once."""
    path = hf_models.exported("llama")
    runner, plain = ModelRunner(path, 8, ["CPUExecutionProvider"]), ModelRunner(path, 8, ["CPUExecutionProvider"])
    as_device_session(runner, monkeypatch)
    real = runner._sampler_binding

    def sentinel_for_the_greedy_row():
        binding = real()
        outputs = binding.get_outputs

        def get_outputs():
            tokens, *rest = outputs()
            wrong = tokens.numpy().copy()
            wrong[1] = 2**31 - 1
            return [ort.OrtValue.ortvalue_from_numpy(wrong), *rest]
        binding.get_outputs = get_outputs
        return binding
    monkeypatch.setattr(runner, "_sampler_binding", sentinel_for_the_greedy_row)
    feeds = next(steps(runner, 1))
    params, uniforms = [SamplingParams(temperature=0.9, top_p=0.8), SamplingParams()], [0.4, 0.0]
    sampling = sampler_feeds(params, uniforms, runner.info.vocab_size)
    sampling[SORT_WIDTH] = np.array([1])
    logits = plain.run(feeds).copy()
    assert runner.run_sampled(feeds, sampling).tolist() == host_tokens(logits, params, uniforms)
    assert runner.host_sampled_rows == 1 and runner.host_chosen_rows == 1 and runner.device_logit_rows == 2
