"""Stop strings with a tokenizer: a request ends with the token whose text completes one (also when the string
spans tokens), through generate and submit; without a tokenizer they are refused up front."""

import pytest

pytest.importorskip("torch")  # kvcache_op.hf imports it
pytest.importorskip("transformers")

import hf_models  # noqa: E402
from kvcache_op.serving import Engine, SamplingParams  # noqa: E402

PROMPT = [5, 6, 7, 8, 9] * 7


class AngleTokenizer:
    """Token i reads "<i>": every token's text is unambiguous, so a stop string names where it must stop."""

    def decode(self, ids):
        return "".join(f"<{int(i)}>" for i in ids)


@pytest.fixture(scope="module")
def lone():
    return Engine(hf_models.exported("llama"), num_pages=16).generate([PROMPT], 10)[0]


def test_a_stop_string_ends_the_request_with_the_token_that_completes_it(lone):
    engine = Engine(hf_models.exported("llama"), num_pages=16, tokenizer=AngleTokenizer())
    first = lone.index(lone[3])  # where the token first occurs
    params = SamplingParams(max_tokens=10, stop=(f"<{lone[3]}>",))
    assert engine.generate([PROMPT], 10, params=params)[0] == lone[:first + 1]
    spanning = SamplingParams(max_tokens=10, stop=(f"{lone[4]}><{lone[5]}",))  # across two tokens' text
    want = next(i for i in range(1, len(lone)) if (lone[i - 1], lone[i]) == (lone[4], lone[5]))
    assert engine.submit(PROMPT, spanning).result(timeout=60) == lone[:want + 1]
    never = SamplingParams(max_tokens=10, stop=("<no such token>",))
    handle = engine.submit(PROMPT, never)
    assert handle.result(timeout=60) == lone and handle.finish_reason == "length"
    engine.close(timeout=30)


def test_stop_strings_without_a_tokenizer_are_refused_up_front():
    engine = Engine(hf_models.exported("llama"), num_pages=16)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        engine.generate([PROMPT], 4, params=SamplingParams(stop=("x",)))
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        engine.submit(PROMPT, SamplingParams(stop=("x",)))
    with pytest.raises(TypeError, match="decode"):
        Engine(hf_models.exported("llama"), num_pages=16, tokenizer=object())


def test_a_stop_token_that_is_also_the_last_allowed_token_finishes_as_stop(lone):
    """Both limits reached by the same token: the model stopped, so the finish reason is "stop" (as OpenAI's and
    vLLM's); one token short of the stop token, "length"."""
    engine = Engine(hf_models.exported("llama"), num_pages=16)
    first = lone.index(lone[3])
    handle = engine.submit(PROMPT, SamplingParams(max_tokens=first + 1, stop_token_ids=[lone[3]]))
    assert handle.result(timeout=60) == lone[:first + 1] and handle.finish_reason == "stop"
    if first:
        short = engine.submit(PROMPT, SamplingParams(max_tokens=first, stop_token_ids=[lone[3]]))
        assert short.result(timeout=60) == lone[:first] and short.finish_reason == "length"
    engine.close(timeout=30)


def test_a_request_with_stop_strings_still_ends_at_its_stop_token(lone):
    """Stop strings add to the stop token ids (and the model's end-of-sequence ids, which go the same way); strings
    that never match leave them in force."""
    engine = Engine(hf_models.exported("llama"), num_pages=16, tokenizer=AngleTokenizer())
    first = lone.index(lone[3])
    handle = engine.submit(PROMPT, SamplingParams(max_tokens=10, stop=("<no such token>",), stop_token_ids=[lone[3]]))
    assert handle.result(timeout=60) == lone[:first + 1] and handle.finish_reason == "stop"
    engine.close(timeout=30)


class FailingOn:
    """AngleTokenizer that raises on any text holding ``token`` (a slow tokenizer given an id past its vocabulary)."""

    def __init__(self, token):
        self.token = token

    def decode(self, ids):
        if self.token in [int(i) for i in ids]:
            raise IndexError("piece id is out of range")
        return AngleTokenizer().decode(ids)


def test_a_tokenizer_failing_on_one_requests_text_fails_that_request_alone(lone):
    """A tokenizer error on one request's stop-string text fails that request; the others in flight go on."""
    engine = Engine(hf_models.exported("llama"), num_pages=32, tokenizer=FailingOn(lone[2]))
    others = [engine.submit(list(PROMPT), SamplingParams(max_tokens=10)) for _ in range(3)]  # no stop strings
    failing = engine.submit(list(PROMPT), SamplingParams(max_tokens=10, stop=("<no such token>",)))
    with pytest.raises(IndexError, match="piece id is out of range"):
        failing.result(timeout=60)
    assert failing.finish_reason == "error"
    assert [h.result(timeout=60) for h in others] == [lone] * 3
    engine.close(timeout=30)
    assert not engine.manager.requests and engine.manager.metrics()["pages_in_use"] == 0
