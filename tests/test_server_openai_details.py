"""Details of OpenAI's API a client relies on, checked in process: a reply cut inside a character is the
tokenizer's decode of its tokens and streams no half character before its end, completions' ``text_offset``
indexes the tokens' own texts, the context a request may fill is the one ``/v1/models`` reports (the page pool's
where it is smaller, refused with ``context_length_exceeded`` naming the field that carries the prompt),
``/v1/models/{id}``, ``HEAD /health``, an empty text prompt, any signed 64-bit seed, and ``top_p`` 0."""

import json

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

REPLACEMENT = "\ufffd"


def _engine_and_app(exported, tokenizer, num_pages=64):
    from kvcache_op.serving import Engine
    from kvcache_op.serving.server import create_app
    from kvcache_op.serving.tokenizer import PlainText

    engine = Engine(exported, tokenizer=PlainText(tokenizer), num_pages=num_pages)
    return engine, create_app(engine, tokenizer, model_name="tiny")


@pytest.fixture(scope="module")
def served(exported, served_checkpoint):
    """(engine, client, tokenizer) over 64 pages."""
    engine, app = _engine_and_app(exported, served_checkpoint[2])
    with TestClient(app) as client:
        yield engine, client, served_checkpoint[2]


def _complete(client, **fields):
    reply = client.post("/v1/completions", json={"model": "tiny", "temperature": 0, **fields})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


def _error(reply, status):
    assert reply.status_code == status, reply.text
    return reply.json()["error"]


def test_a_reply_cut_inside_a_character_ends_as_the_tokenizer_decodes_it(served):
    """max_tokens reached between the bytes of a character: the reply, streamed or not, is the tokenizer's decode of
    its tokens (the cut character a U+FFFD at its end, as transformers' decode and vLLM's replies have it), and no
    streamed chunk but the last holds a replacement character. The cut is found from the model's own greedy tokens."""
    from kvcache_op.serving import SamplingParams

    engine, client, tokenizer = served
    cut = None
    for prompt in ("hello world", "the cache keeps", "caf\u00e9 na\u00efve", "\u6771\u4eac \U0001f642"):
        ids = tokenizer(prompt)["input_ids"]
        tokens = engine.submit(ids, SamplingParams(max_tokens=60, ignore_eos=True)).result(timeout=120)
        for k in range(1, len(tokens)):
            text = tokenizer.decode(tokens[:k])
            if text.endswith(REPLACEMENT) and not tokenizer.decode(tokens)[len(text) - 1:].startswith(REPLACEMENT):
                cut = prompt, k, text
                break
        if cut:
            break
    assert cut, "no greedy reply of these prompts cuts a character: pick prompts whose replies hold multi-byte ones"
    prompt, k, want = cut
    body = {"prompt": prompt, "max_tokens": k, "ignore_eos": True}
    assert _complete(client, **body)["text"] == want
    streamed = client.post("/v1/completions", json={"model": "tiny", "temperature": 0, "stream": True, **body})
    chunks = [json.loads(line[6:])["choices"][0]["text"] for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    assert "".join(chunks) == want
    sent = [c for c in chunks if c]
    assert sent[-1].endswith(REPLACEMENT) and not any(c.endswith(REPLACEMENT) for c in sent[:-1])


def test_text_offset_indexes_the_tokens_own_texts(served):
    """Each offset is where its token starts in the tokens' texts joined, also while a possible stop string holds a
    token's text back (the offsets once followed the text emitted so far)."""
    _, client, _ = served
    body = {"prompt": "the quick brown fox", "max_tokens": 6, "logprobs": 1}
    plain = _complete(client, **body)["logprobs"]
    held = _complete(client, **body, stop=[plain["tokens"][2] + "\x7f\x7f\x7f"])["logprobs"]  # never completes
    for logprobs in (plain, held):
        tokens = logprobs["tokens"]
        assert logprobs["text_offset"] == [len("".join(tokens[:i])) for i in range(len(tokens))]


def test_the_context_is_the_page_pools_where_that_is_smaller(exported, served_checkpoint):
    """40 pages of 16 hold 640 positions (641 with the last token, which is never fed back): /v1/models says 641,
    and a request past it is refused as context_length_exceeded on the field that carries its prompt (not the
    engine's page count with no code, nor a context of 1024 that no request could fill)."""
    tokenizer = served_checkpoint[2]
    engine, app = _engine_and_app(exported, tokenizer, num_pages=40)
    assert engine.info.max_positions > 641
    with TestClient(app) as client:
        assert client.get("/v1/models").json()["data"][0]["max_model_len"] == 641
        assert _complete(client, prompt=[5] * 639, max_tokens=2)["text"] is not None  # 641: fits exactly
        error = _error(client.post("/v1/completions", json={"model": "tiny", "prompt": [5] * 640, "max_tokens": 2}),
                       400)
        assert (error["param"], error["code"]) == ("max_tokens", "context_length_exceeded")
        assert "641" in error["message"]
        error = _error(client.post("/v1/completions", json={"model": "tiny", "prompt": [5] * 700}), 400)
        assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hello world " * 400}]}
        error = _error(client.post("/v1/chat/completions", json=chat), 400)
        assert (error["param"], error["code"]) == ("messages", "context_length_exceeded")


def test_a_model_is_retrieved_by_id_and_health_answers_head(served):
    _, client, _ = served
    listed = client.get("/v1/models").json()["data"][0]
    assert client.get("/v1/models/tiny").json() == listed
    assert _error(client.get("/v1/models/another"), 404)["code"] == "model_not_found"
    assert client.head("/health").status_code == 200


def test_an_empty_text_prompt_is_its_beginning_of_sequence_token(served):
    _, client, tokenizer = served
    assert tokenizer("")["input_ids"], "the tokenizer must add a beginning-of-sequence token"
    assert _complete(client, prompt="", max_tokens=3)["finish_reason"] in ("length", "stop")


def test_any_signed_64_bit_seed_samples_reproducibly(served):
    _, client, _ = served
    for seed in (-5, -2 ** 63, 2 ** 63 - 1):
        body = {"prompt": "hello world", "max_tokens": 8, "temperature": 1.0, "seed": seed}
        assert _complete(client, **body)["text"] == _complete(client, **body)["text"]


def test_top_p_zero_keeps_the_most_likely_token(served):
    _, client, _ = served
    greedy = _complete(client, prompt="hello world", max_tokens=8, ignore_eos=True)["text"]
    assert _complete(client, prompt="hello world", max_tokens=8, ignore_eos=True, temperature=1.0, top_p=0,
                     seed=1)["text"] == greedy
