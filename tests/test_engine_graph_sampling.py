"""The engine drawing sampled tokens with the sampling graph, as it does on a device (here on the CPU EP, where it
is asked to): seeded requests get the host sampler's tokens, over single steps, runs of decode steps and prompts fed
in chunks (a chunk with more of its prompt to come takes its draw back); steps with a request that has penalties or
logprobs, or keeps its logits, are sampled on the host; a failed step takes its draws back."""

import numpy as np
import pytest

pytest.importorskip("torch")  # kvcache_op.hf imports it
pytest.importorskip("transformers")

import hf_models  # noqa: E402
from kvcache_op.serving import Engine, SamplingParams  # noqa: E402

PROMPTS = [list(range(5, 40)), [9, 10, 11], list(range(50, 70)), [17, 18]]
PARAMS = [SamplingParams(temperature=0.9, top_p=0.9, seed=1), SamplingParams(temperature=1.2, top_k=8, seed=2),
          SamplingParams(temperature=0.7, min_p=0.05, seed=3), SamplingParams(seed=4)]  # the last greedy


@pytest.fixture(scope="module")
def path():
    return hf_models.exported("llama")


def _refuse(*args, **kwargs):
    raise AssertionError("a step's logits were read")


def graph_engine(path, monkeypatch, **settings) -> tuple:
    """An engine that samples with the graph and never reads a step's logits; and the list its sampled steps'
    row counts go to."""
    engine = Engine(path, num_pages=32, **settings)
    engine.runner.graph_sampling = True
    sampled, real = [], engine.runner.run_sampled

    def run_sampled(feeds, sampling, changed=None):
        sampled.append(len(sampling["uniform"]))
        return real(feeds, sampling, changed)
    monkeypatch.setattr(engine.runner, "run_sampled", run_sampled)
    monkeypatch.setattr(engine.runner, "run", _refuse)
    return engine, sampled


@pytest.mark.parametrize("settings", [dict(), dict(decode_steps=1), dict(max_batch_tokens=8)],
                         ids=["decode runs", "single steps", "prompts in chunks"])
def test_the_graph_draws_the_host_samplers_tokens(path, monkeypatch, settings):
    want = Engine(path, num_pages=32, **settings).generate(PROMPTS, 12, params=PARAMS)
    engine, sampled = graph_engine(path, monkeypatch, **settings)
    assert engine.generate(PROMPTS, 12, params=PARAMS) == want
    assert len(sampled) >= 11 and max(sampled) == len(PROMPTS)
    again, _ = graph_engine(path, monkeypatch, **settings)  # seeded: the same again, whatever else ran
    assert again.generate(PROMPTS, 12, params=PARAMS) == want


@pytest.mark.parametrize("odd_one", [SamplingParams(temperature=0.9, seed=7, logprobs=2),
                                     SamplingParams(temperature=0.9, seed=7, presence_penalty=0.5),
                                     SamplingParams(temperature=0.9, seed=7, repetition_penalty=1.3)],
                         ids=["logprobs", "presence", "repetition"])
def test_a_request_with_penalties_or_logprobs_is_sampled_on_the_host(path, monkeypatch, odd_one):
    params = PARAMS[:2] + [odd_one]
    want = Engine(path, num_pages=32).generate(PROMPTS[:3], 6, params=params)
    engine = Engine(path, num_pages=32)
    engine.runner.graph_sampling = True
    monkeypatch.setattr(engine.runner, "run_sampled", _refuse)
    assert engine.generate(PROMPTS[:3], 6, params=params) == want


def test_recorded_logits_are_the_steps_own(path, monkeypatch):
    """A call keeping its logits reads them: those steps are sampled on the host, with the same tokens."""
    want = Engine(path, num_pages=32).generate(PROMPTS[:2], 5, params=PARAMS[:2], record_logits=True)
    engine = Engine(path, num_pages=32)
    engine.runner.graph_sampling = True
    monkeypatch.setattr(engine.runner, "run_sampled", _refuse)
    assert engine.generate(PROMPTS[:2], 5, params=PARAMS[:2], record_logits=True) == want


def test_a_failed_sampled_step_takes_its_draws_back(path):
    """The run raised: every sampled request's generator is as it was before the step."""
    engine = Engine(path, num_pages=32)

    class Request:
        def __init__(self, params):
            self.params, self.generator = params, np.random.default_rng(params.seed)

    requests = [Request(p) for p in PARAMS]
    before = [q.generator.bit_generator.state for q in requests]

    def broken(*args):
        raise RuntimeError("the device fell over")
    engine.runner.run_sampled = broken
    with pytest.raises(RuntimeError, match="fell over"):
        engine._run_sampled(requests, {})
    assert [q.generator.bit_generator.state for q in requests] == before
