"""The server's refusals: every bad request gets an OpenAI-style JSON error with the right 4xx status (never a
dropped connection or a 500), the API key is required on /v1 routes, the limits are enforced, a full queue answers
503, and the server keeps serving afterwards. Random JSON bodies never make it fail."""

import functools
import json
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from conftest import SERVER_API_KEY, served_app as _app  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

AUTH = {"Authorization": f"Bearer {SERVER_API_KEY}"}
GOOD = {"model": "tiny", "prompt": "hello world", "max_tokens": 2, "temperature": 0}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _error(reply, status):
    assert reply.status_code == status, reply.text
    body = reply.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    return body


@pytest.mark.parametrize("route, body, status, param", [
    ("/v1/completions", {**GOOD, "temperature": "1"}, 400, "temperature"),
    ("/v1/completions", {**GOOD, "temperature": 3}, 400, "temperature"),
    ("/v1/completions", {**GOOD, "top_p": -0.1}, 400, "top_p"),
    ("/v1/completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "max_tokens": 1001}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "max_tokens": 2.5}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "n": 2}, 400, "n"),
    ("/v1/completions", {**GOOD, "echo": True}, 400, "echo"),
    ("/v1/completions", {**GOOD, "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {**GOOD, "logit_bias": {"3": 1}}, 400, "logit_bias"),
    ("/v1/completions", {**GOOD, "prompt": []}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": [1, 99999]}, 400, "prompt"),  # outside the vocabulary
    ("/v1/completions", {**GOOD, "prompt": list(range(1, 300)) * 4}, 400, "prompt"),  # over the context
    ("/v1/completions", {**GOOD, "prompt": [5] * 1000, "max_tokens": 100}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "cache_salt": 7}, 400, "cache_salt"),
    ("/v1/completions", {**GOOD, "stop": [""]}, 400, "stop"),
    ("/v1/completions", {**GOOD, "seed": -2 ** 63 - 1}, 400, "seed"),
    ("/v1/completions", {**GOOD, "seed": 2 ** 70}, 400, "seed"),
    ("/v1/completions", {**GOOD, "stop_token_ids": [3] * 1025}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x"}, 400, "model"),
    ("/v1/completions", {**GOOD, "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {**GOOD, "stop": [f"s{i}" for i in range(17)]}, 400, "stop"),
    ("/v1/completions", {**GOOD, "stop": ["x" * 257]}, 400, "stop"),
    ("/v1/completions", {**GOOD, "stop_token_ids": [2 ** 70]}, 400, "stop_token_ids"),
    ("/v1/completions", {**GOOD, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {**GOOD, "stream": True, "stream_options": {"include_usage": "no"}}, 400, "stream_options"),
    ("/v1/completions", {**GOOD, "stream": True, "stream_options": {"include_obfuscation": "no"}}, 400,
     "stream_options"),
    ("/v1/completions", {**GOOD, "stream": True, "stream_options": {"continuous_usage_stats": True}}, 400,
     "stream_options"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
    ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f", "parameters": {}}]}, 400, "functions"),
    ("/v1/chat/completions", {**CHAT, "function_call": {"name": "f"}}, 400, "function_call"),
    ("/v1/chat/completions", {**CHAT, "stream": True, "temperature": -1}, 400, "temperature"),
])
def test_bad_fields_are_refused_by_name(api_server, route, body, status, param):
    error = _error(httpx.post(api_server + route, json=body, headers=AUTH, timeout=30), status)
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_a_prompt_the_tokenizer_cannot_encode_is_400(api_server):
    raw = b'{"model": "tiny", "prompt": "\\ud800", "max_tokens": 2}'  # a lone surrogate, as a JSON escape
    reply = httpx.post(api_server + "/v1/completions", content=raw, headers={**AUTH, "content-type": "application/json"})
    error = _error(reply, 400)
    assert error["param"] == "prompt" and error["message"] == "the prompt is not valid Unicode text (it holds a lone " \
        "surrogate)"
    raw = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "\\udc00"}]}'
    reply = httpx.post(api_server + "/v1/chat/completions", content=raw,
                       headers={**AUTH, "content-type": "application/json"})
    error = _error(reply, 400)
    assert error["param"] == "messages.1.content" and error["message"] == "message 1 is not valid Unicode text (it " \
        "holds a lone surrogate)"


def test_an_unknown_model_is_404(api_server):
    error = _error(httpx.post(api_server + "/v1/completions", json={**GOOD, "model": "gpt-9"}, headers=AUTH), 404)
    assert error["code"] == "model_not_found" and "tiny" in error["message"]


@pytest.mark.parametrize("raw", [b"{bad", b"[1, 2]", b"", b"\xff\xfe", b"[" * 100000])
def test_a_body_that_is_not_a_json_object_is_400(api_server, raw):
    reply = httpx.post(api_server + "/v1/completions", content=raw, headers={**AUTH, "content-type": "application/json"})
    _error(reply, 400)


def test_a_body_over_the_size_limit_is_413(api_server):
    big = json.dumps({**GOOD, "prompt": "x" * (1 << 20)})
    _error(httpx.post(api_server + "/v1/completions", content=big, headers=AUTH), 413)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": SERVER_API_KEY},
                                     {"Authorization": f"Basic {SERVER_API_KEY}"}])
def test_the_api_routes_need_the_key(api_server, headers):
    for method, route in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("POST", "/v1/nope")):
        reply = httpx.request(method, api_server + route, json=GOOD, headers=headers)
        assert _error(reply, 401)["code"] == "invalid_api_key"
        assert reply.headers["www-authenticate"] == "Bearer"


def test_health_and_metrics_need_no_key_and_unknown_routes_are_json_404s(api_server):
    assert httpx.get(api_server + "/health").json() == {"status": "ok"}
    assert "kvcache_op_requests_total" in httpx.get(api_server + "/metrics").text
    _error(httpx.get(api_server + "/v1/nope", headers=AUTH), 404)
    _error(httpx.get(api_server + "/v1/completions", headers=AUTH), 405)
    assert httpx.post(api_server + "/v1/completions", json=GOOD,
                      headers={"Authorization": f"bearer {SERVER_API_KEY}"}).status_code == 200


def test_the_server_still_serves_after_the_refusals(api_server):
    reply = httpx.post(api_server + "/v1/completions", json=GOOD, headers=AUTH, timeout=30)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2


# ---- in process: the queue limit and random bodies ---------------------------------------------------------------
def test_a_burst_within_the_running_slots_is_served_and_the_next_request_answers_503(exported, served_checkpoint):
    """max_queue=0, max_running=4: four requests at once on an idle server all start (a free running slot is no
    queue; they once counted as waiting until the next step admitted them, and got 503s); with the four running, a
    fifth is refused with Retry-After; closing the engine ends the four."""
    import asyncio

    from kvcache_op.serving import Engine
    from kvcache_op.serving.server import ServerLimits, create_app
    from kvcache_op.serving.tokenizer import PlainText

    tokenizer = served_checkpoint[2]
    engine = Engine(exported, tokenizer=PlainText(tokenizer), num_pages=256, max_running=4)
    run = engine.runner.run

    def paced(feeds, *changed):  # 900 steps take 4.5 s at least: the four run through the test however fast
        time.sleep(0.005)
        return run(feeds, *changed)
    engine.runner.run = paced
    app = create_app(engine, tokenizer, model_name="tiny", limits=ServerLimits(max_queue=0))
    # Sampled, so that every step goes through runner.run (a greedy run may lead a prompt through its own graph).
    body = {**GOOD, "max_tokens": 900, "ignore_eos": True, "temperature": 1.0, "seed": 3}

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            four = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(4)]
            for _ in range(2000):
                if engine.running_count == 4 or any(t.done() for t in four):
                    break
                await asyncio.sleep(0.005)
            fifth = await client.post("/v1/completions", json={**body, "max_tokens": 2})
            running = engine.running_count
            await asyncio.to_thread(engine.close, 10.0)
            return await asyncio.gather(*four), fifth, running
    four, fifth, running = asyncio.run(scenario())
    assert [r.status_code for r in four] == [200] * 4, [r.text for r in four]
    assert running == 4 and [r.json()["choices"][0]["finish_reason"] for r in four] == ["abort"] * 4
    error = _error(fifth, 503)
    assert error["type"] == "server_overloaded" and fifth.headers["retry-after"] == "1"
    assert error["message"] == ("the server is busy: with this request 1 would wait for a running slot, more than the "
                                "limit of 0; retry later")


def test_the_prompt_limit_is_a_clear_400(exported, served_checkpoint):
    from fastapi.testclient import TestClient

    with TestClient(_app(exported, served_checkpoint[2], max_prompt_tokens=5)) as client:
        error = _error(client.post("/v1/completions", json={**GOOD, "prompt": [1, 2, 3, 4, 5, 6]}), 400)
        assert error["param"] == "prompt" and "over the limit of 5" in error["message"]
        assert client.post("/v1/completions", json={**GOOD, "prompt": [1, 2, 3, 4, 5]}).status_code == 200


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)
FIELDS = st.sampled_from(["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p",
                          "stop", "seed", "logprobs", "top_logprobs", "stream", "stream_options", "n",
                          "cache_salt", "stop_token_ids", "presence_penalty", "repetition_penalty", "ignore_eos"])


@settings(max_examples=80)
@given(route=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
       fields=st.dictionaries(FIELDS, JSON, max_size=6), base=st.booleans())
def test_random_bodies_never_make_the_server_fail(fuzz_client, route, fields, base):
    body = {**(GOOD if route == "/v1/completions" else CHAT), **fields} if base else fields
    if body.get("max_tokens", 0) is not None and isinstance(body.get("max_tokens"), int):
        body["max_tokens"] = min(body["max_tokens"], 4)  # keep generations short
    body.pop("stream", None)
    reply = fuzz_client.post(route, content=json.dumps(body), headers={"content-type": "application/json"})  # NaN too
    assert reply.status_code in (200, 400, 404, 413), reply.text
    if reply.status_code != 200:
        _error(reply, reply.status_code)


@pytest.fixture(scope="module")
def fuzz_client(exported, served_checkpoint):
    from fastapi.testclient import TestClient

    with TestClient(_app(exported, served_checkpoint[2], max_tokens_limit=8)) as client:
        yield client


@pytest.mark.parametrize("extra", [{"top_k": 2 ** 70, "temperature": 0.5}, {"seed": 2 ** 63 - 1, "temperature": 0.5},
                                   {"seed": -2 ** 63, "temperature": 0.5},
                                   {"temperature": 1e-300}, {"top_p": 1e-300, "temperature": 1.0},
                                   {"stop": ["\ud800"]}, {"cache_salt": "\x00" * 5000},
                                   {"repetition_penalty": 1e308}, {"prompt": [[1, 2]]}, {"logprobs": 0}])
def test_extreme_but_valid_values_are_served(fuzz_client, extra):
    reply = fuzz_client.post("/v1/completions", content=json.dumps({**GOOD, **extra}),
                             headers={"content-type": "application/json"})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] >= 1


def test_the_key_is_required_under_a_path_prefix_too(exported, served_checkpoint):
    """A proxy (or Ray Serve's route prefix) puts a root path in front: the routes under it still need the key."""
    from fastapi.testclient import TestClient

    with TestClient(_app(exported, served_checkpoint[2], api_key="k"), root_path="/api") as client:
        assert _error(client.post("/api/v1/completions", json=GOOD), 401)["code"] == "invalid_api_key"
        assert client.get("/api/openapi.json").status_code == 401  # the docs too
        assert client.get("/api/health").status_code == 200
        assert client.post("/api/v1/completions", json=GOOD, headers={"Authorization": "Bearer k"}).status_code == 200


def test_a_burst_cannot_get_past_the_queue_limit(exported, served_checkpoint):
    import asyncio

    app = _app(exported, served_checkpoint[2], max_queue=1, engine_options={"max_running": 1})
    peaks = []
    from kvcache_op.serving import Engine

    original = Engine.submit

    def submit(self, *args, **kwargs):
        handle = original(self, *args, **kwargs)
        peaks.append(self.backlog())
        return handle

    async def burst():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            body = {**GOOD, "max_tokens": 8, "ignore_eos": True}
            return await asyncio.gather(*(client.post("/v1/completions", json=body, timeout=60) for _ in range(30)))
    Engine.submit = submit
    try:
        replies = asyncio.run(burst())
    finally:
        Engine.submit = original
    codes = [r.status_code for r in replies]
    assert set(codes) <= {200, 503} and 503 in codes and 200 in codes, codes
    assert max(peaks) <= 1, f"the backlog grew to {max(peaks)} with max_queue=1"


def test_a_request_being_submitted_is_counted_once_against_the_queue_limit(exported, served_checkpoint):
    """One request runs (max_running 1), B waits in the queue while its submit has not yet returned to the event
    loop, and C arrives: one request waits, under max_queue=2, so C is queued too, not refused as if B were there
    twice. Then D, with two waiting, is refused, and closing the engine ends every request."""
    import asyncio
    import time

    from kvcache_op.serving import Engine
    from kvcache_op.serving.server import ServerLimits, create_app
    from kvcache_op.serving.tokenizer import PlainText

    tokenizer = served_checkpoint[2]
    engine = Engine(exported, tokenizer=PlainText(tokenizer), num_pages=64, max_running=1)
    app = create_app(engine, tokenizer, model_name="tiny", limits=ServerLimits(max_queue=2))
    original, b_prompt = engine.submit, [7, 8, 9]

    def submit(prompt, *args, **kwargs):
        handle = original(prompt, *args, **kwargs)
        if list(prompt) == b_prompt:  # B queued; its handler resumes only once this returns
            time.sleep(0.5)
        return handle
    engine.submit = submit
    body = {**GOOD, "max_tokens": 2}

    async def until(condition):
        for _ in range(2000):
            if condition():
                return
            await asyncio.sleep(0.005)
        raise AssertionError("timed out")

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            post = functools.partial(client.post, "/v1/completions")
            a = asyncio.create_task(post(json={**body, "max_tokens": 900, "ignore_eos": True}))
            await until(lambda: engine.running_count == 1)
            b = asyncio.create_task(post(json={**body, "prompt": b_prompt}))
            await until(lambda: engine.queue_length == 1)
            c = asyncio.create_task(post(json=body))
            await until(lambda: engine.queue_length == 2 or c.done())
            d = await post(json=body) if not c.done() else None
            assert not b.done() and engine.running_count == 1
            await asyncio.to_thread(engine.close, 10.0)
            return await asyncio.gather(a, b, c), d
    (a, b, c), d = asyncio.run(scenario())
    assert c.status_code == 200, c.text
    assert _error(d, 503)["message"] == ("the server is busy: with this request 3 would wait for a running slot, "
                                         "more than the limit of 2; retry later")
    assert [r.json()["choices"][0]["finish_reason"] for r in (a, b, c)] == ["abort"] * 3


def test_a_refusal_from_the_engines_own_count_is_a_503_with_retry_after(exported, served_checkpoint, monkeypatch):
    """The queue looked short when the request arrived, but the engine, counting under its lock, refuses it: the
    same 503 as the early check's, with Retry-After and the engine's count."""
    from fastapi.testclient import TestClient
    from kvcache_op.serving import Engine, EngineBusy

    def busy(self, prompt, params=None, *, salt=None, max_waiting=None):
        assert max_waiting == 5
        raise EngineBusy(7, max_waiting)
    monkeypatch.setattr(Engine, "submit", busy)
    with TestClient(_app(exported, served_checkpoint[2], max_queue=5)) as client:
        reply = client.post("/v1/completions", json=GOOD)
        error = _error(reply, 503)
    assert error["type"] == "server_overloaded" and reply.headers["retry-after"] == "1"
    assert error["message"] == ("the server is busy: with this request 8 would wait for a running slot, more than the "
                                "limit of 5; retry later")


def test_logprobs_of_filtered_tokens_are_finite_json(fuzz_client):
    body = {**GOOD, "temperature": 1.0, "top_k": 1, "logprobs": 3, "seed": 1, "max_tokens": 3}
    reply = fuzz_client.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    def refuse(constant):
        raise AssertionError(f"{constant} in the JSON")
    data = json.loads(reply.text, parse_constant=refuse)
    for top in data["choices"][0]["logprobs"]["top_logprobs"]:
        assert all(-9999.0 <= v <= 0 for v in top.values())
    streamed = fuzz_client.post("/v1/completions", json={**body, "stream": True})
    for line in streamed.text.splitlines():
        if line.startswith("data: {"):
            json.loads(line[6:], parse_constant=refuse)


def test_a_temperature_too_small_to_divide_by_is_greedy(fuzz_client):
    greedy = fuzz_client.post("/v1/completions", json={**GOOD, "max_tokens": 4}).json()["choices"][0]["text"]
    reply = fuzz_client.post("/v1/completions", json={**GOOD, "max_tokens": 4, "temperature": 1e-310, "logprobs": 1})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == greedy


def test_a_chat_without_max_tokens_fits_a_small_pool(exported, served_checkpoint):
    from fastapi.testclient import TestClient

    with TestClient(_app(exported, served_checkpoint[2], engine_options={"num_pages": 8})) as client:
        reply = client.post("/v1/chat/completions", json={"model": "tiny", "temperature": 0,
                                                          "messages": [{"role": "user", "content": "hi"}]})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["total_tokens"] <= 8 * 16 + 1


def test_a_prompt_of_token_ids_outside_the_vocabulary_is_a_400_naming_the_prompt(exported, served_checkpoint):
    """Ids the engine refuses (past the vocabulary, below 0, beyond int64) are the prompt's error, said as such."""
    from fastapi.testclient import TestClient

    with TestClient(_app(exported, served_checkpoint[2])) as client:
        for ids in ([10 ** 30], [-1], [5, 10 ** 6]):
            error = _error(client.post("/v1/completions", json={**GOOD, "prompt": ids}), 400)
            assert error["param"] == "prompt" and "is outside the vocabulary" in error["message"], error
            assert error["message"].startswith("the prompt: token"), error
        assert client.post("/v1/completions", json=GOOD).status_code == 200  # and it serves on
