"""``kvcache-op serve`` driven by the official ``openai`` client, as a user would: a checkpoint folder (random
weights, a tokenizer trained here, a chat template) exported by the server itself, greedy text equal to
``transformers``' generate on the same tokens (completions and chat, streamed or not), 32 concurrent streams,
logprobs, seeded sampling, stop strings, tenant salts, cancellation by disconnecting, and the Prometheus metrics."""

import asyncio

import pytest

pytest.importorskip("torch")  # kvcache_op.hf imports it
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from conftest import SERVER_API_KEY, metric_values, wait_for_metrics  # noqa: E402

from kvcache_op.hf.verify import reference_generate  # noqa: E402

PROMPTS = ["hello world", "the cache keeps", "paged attention reads", "café 東京", "the quick brown fox"]


@pytest.fixture(scope="module")
def client(api_server):
    return openai.OpenAI(base_url=api_server + "/v1", api_key=SERVER_API_KEY, max_retries=0, timeout=120)


def expected(served_checkpoint, prompt_ids, max_tokens):
    """(text, finish_reason, completion tokens) of transformers' own greedy generate on ``prompt_ids``."""
    _, model, tokenizer = served_checkpoint
    tokens = reference_generate(model, prompt_ids, max_tokens)
    stopped = tokens[-1] == model.config.eos_token_id
    return tokenizer.decode(tokens, skip_special_tokens=True), "stop" if stopped else "length", len(tokens)


def test_the_served_model_is_listed(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("another")


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_completion_text_equals_transformers(client, served_checkpoint, prompt):
    ids = served_checkpoint[2](prompt)["input_ids"]
    text, reason, count = expected(served_checkpoint, ids, 12)
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert reply.choices[0].text == text
    assert reply.choices[0].finish_reason == reason
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), count)


def test_a_prompt_of_token_ids_is_served_as_given(client, served_checkpoint):
    ids = [0, 40, 41, 42, 43, 44]
    text, _, _ = expected(served_checkpoint, ids, 8)
    assert client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0).choices[0].text == text


def test_a_streamed_completion_joins_to_the_same_text(client, served_checkpoint):
    ids = served_checkpoint[2](PROMPTS[3])["input_ids"]
    text, reason, count = expected(served_checkpoint, ids, 20)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == count


def test_chat_is_the_template_rendered_then_generated(client, served_checkpoint):
    tokenizer = served_checkpoint[2]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    ids = tokenizer(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                    add_special_tokens=False)["input_ids"]
    text, reason, _ = expected(served_checkpoint, ids, 10)
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == text and reply.choices[0].finish_reason == reason
    assert reply.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == reason


def test_32_concurrent_streams_each_get_their_own_greedy_text(api_server, served_checkpoint):
    tokenizer = served_checkpoint[2]
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(32)]
    want = [expected(served_checkpoint, tokenizer(p)["input_ids"], 10)[0] for p in prompts]

    async def run():
        client = openai.AsyncOpenAI(base_url=api_server + "/v1", api_key=SERVER_API_KEY, max_retries=0, timeout=120)

        async def one(prompt):
            stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0,
                                                     stream=True)
            return "".join([c.choices[0].text async for c in stream])
        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await client.close()
    assert asyncio.run(run()) == want


def test_logprobs_are_reported_per_token(client):
    reply = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=3)
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == reply.usage.completion_tokens
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and chosen == pytest.approx(max(top.values()))  # greedy: the most likely
    assert lp.text_offset[0] == 0
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 and e.logprob == pytest.approx(e.top_logprobs[0].logprob) for e in content)


def test_a_seeded_sampled_request_is_reproducible(client):
    def sample(seed):
        return client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=16, temperature=1.0,
                                         top_p=0.9, seed=seed).choices[0].text
    first = sample(7)
    assert sample(7) == first
    assert any(sample(s) != first for s in (8, 9, 10))


def test_a_stop_string_ends_the_text_before_it(client, served_checkpoint):
    ids = served_checkpoint[2](PROMPTS[4])["input_ids"]
    text, _, _ = expected(served_checkpoint, ids, 24)
    cut = next(i for i in range(3, len(text) - 2) if text[i:i + 2].isprintable() and text[i:i + 2].strip())
    stop = text[cut:cut + 2]
    want = text[:text.index(stop)]
    for stream in (False, True):
        reply = client.completions.create(model="tiny", prompt=PROMPTS[4], max_tokens=24, temperature=0, stop=[stop],
                                          stream=stream)
        chunks = list(reply) if stream else [reply]
        assert "".join(c.choices[0].text for c in chunks) == want
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_cache_salt_isolates_a_tenants_prefix(client, api_server):
    prompt = list(range(10, 110))  # 100 tokens: several full pages

    def hits_after(salt):
        before = metric_values(api_server)[("kvcache_op_prefix_hit_tokens_total",)]
        client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0,
                                  extra_body={"cache_salt": salt})
        return metric_values(api_server)[("kvcache_op_prefix_hit_tokens_total",)] - before
    assert hits_after("tenant-a") == 0  # first time: nothing cached
    assert hits_after("tenant-a") >= 96  # its own pages come back
    assert hits_after("tenant-b") == 0  # another tenant's do not


def _wait_until_idle_after_a_cancel(api_server, cancelled_before):
    return wait_for_metrics(
        api_server, lambda m: m.get(("kvcache_op_finished_requests_total", ("reason", "cancelled")), 0) >
        cancelled_before and m[("kvcache_op_running_requests",)] == 0 and m[("kvcache_op_pages_in_use",)] == 0,
        "the request was not cancelled", poll=0.1)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_cancels_its_request(api_server, stream):
    cancelled = metric_values(api_server).get(("kvcache_op_finished_requests_total", ("reason", "cancelled")), 0)
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    headers = {"Authorization": f"Bearer {SERVER_API_KEY}"}
    if stream:
        with httpx.stream("POST", api_server + "/v1/completions", json=body, headers=headers, timeout=60) as reply:
            lines = reply.iter_lines()
            assert next(lines).startswith("data: ")  # it started; now the client goes away
    else:
        # A bare socket, closed once the server runs the request (a client-side timeout could instead go before
        # the server has read the request, which then never runs).
        import json
        import socket
        from urllib.parse import urlsplit

        where, payload = urlsplit(api_server), json.dumps(body).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {where.netloc}\r\nContent-Type: application/json\r\n"
                f"Authorization: Bearer {SERVER_API_KEY}\r\nContent-Length: {len(payload)}\r\n\r\n")
        with socket.create_connection((where.hostname, where.port), timeout=30) as connection:
            connection.sendall(head.encode() + payload)
            wait_for_metrics(api_server, lambda m: m[("kvcache_op_running_requests",)] >= 1,
                             "the request did not start running")
    m = _wait_until_idle_after_a_cancel(api_server, cancelled)
    assert m[("kvcache_op_finished_requests_total", ("reason", "cancelled"))] == cancelled + 1


def test_metrics_count_what_was_served(client, api_server):
    client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=3, temperature=0)
    m = metric_values(api_server)
    assert m[("kvcache_op_requests_total", ("route", "/v1/completions"), ("status", "200"))] >= 1
    assert m[("kvcache_op_generation_tokens_total",)] >= 3
    assert m[("kvcache_op_time_to_first_token_seconds_count",)] >= 1
    assert m[("kvcache_op_inter_token_latency_seconds_count",)] >= 2
    assert m[("kvcache_op_pages_total",)] == 160
    assert 0 <= m[("kvcache_op_prefix_hit_rate",)] <= 1 and m[("kvcache_op_queue_length",)] >= 0
