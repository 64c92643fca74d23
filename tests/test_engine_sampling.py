"""Sampling through the engine: greedy params are the default's tokens, a seeded request gives the same tokens
alone and in a busy batch (preempted or not), stop_token_ids end a request, logprobs come per token."""

import pytest

pytest.importorskip("torch")  # kvcache_op.hf imports it
pytest.importorskip("transformers")

import hf_models  # noqa: E402
from kvcache_op.serving import Engine, SamplingParams  # noqa: E402

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]


@pytest.fixture(scope="module")
def path():
    return hf_models.exported("llama")


def test_temperature_zero_is_the_greedy_default(path):
    engine = Engine(path, num_pages=32)
    assert engine.generate(PROMPTS, 6, params=SamplingParams(temperature=0.0)) == engine.generate(PROMPTS, 6)


def test_a_seeded_request_draws_the_same_tokens_alone_and_in_a_busy_batch(path):
    seeded = SamplingParams(temperature=1.3, top_p=0.95, seed=1234)
    alone = Engine(path, num_pages=32).generate([PROMPTS[0]], 20, params=seeded)[0]
    others = [SamplingParams(temperature=0.8), SamplingParams(), SamplingParams(temperature=2.0, top_k=5)]
    busy = Engine(path, num_pages=3, max_batch_tokens=4)  # few pages: requests are preempted and recomputed
    tokens = busy.generate(PROMPTS, 20, params=[seeded] + others)
    assert busy.metrics()["preemptions"] > 0
    assert tokens[0] == alone
    again = Engine(path, num_pages=32).generate([PROMPTS[0]], 20, params=SamplingParams(temperature=1.3, top_p=0.95,
                                                                                        seed=99))[0]
    assert again != alone  # the seed matters (20 draws at temperature 1.3 from a random model)


def test_stop_token_ids_end_a_request_and_logprobs_are_kept(path):
    engine = Engine(path, num_pages=32)
    greedy = engine.generate([PROMPTS[1]], 8)[0]
    stop = greedy[3]
    first = greedy.index(stop)
    stopped = engine.generate([PROMPTS[1]], 8, params=SamplingParams(stop_token_ids=[stop], logprobs=3))[0]
    assert stopped == greedy[:first + 1]
    assert len(engine.last_logprobs[0]) == len(stopped)
    assert all(e.top[0][0] == token and len(e.top) == 3 and e.logprob == e.top[0][1]
               for e, token in zip(engine.last_logprobs[0], stopped))


@pytest.mark.parametrize("params, error, message", [
    ([SamplingParams()], TypeError, "params must be a SamplingParams or a list of 2"),
    ("greedy", TypeError, "params must be a SamplingParams or a list of 2"),
    (SamplingParams(stop=["</s>"]), ValueError, "stop strings need a tokenizer"),
])
def test_bad_params_are_refused_before_any_step(path, params, error, message):
    engine = Engine(path, num_pages=32)
    with pytest.raises(error, match=message):
        engine.generate(PROMPTS[:2], 4, params=params)
    assert engine.metrics()["steps"] == 0
