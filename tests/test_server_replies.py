"""What the server's replies hold where the engine and the reply could disagree: a stop string around a special token
generated mid-text ends the request in the engine (usage, logprobs and the stream stop there too), optional fields
sent as null take their defaults (the openai client sends null for None), a long text prompt within the token limit
is served whatever its characters per token, refusals of the API key carry the engine header, the logprobs' bytes
of tokens that split a character join to the reply's bytes, a repetition penalty that overflows samples no NaN, a
token limit out of range is refused by the name the client used, and a shutdown ends requests in flight as whole
"abort" replies."""

import json

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from conftest import served_app  # noqa: E402

GOOD = {"model": "tiny", "prompt": "hello world", "max_tokens": 2, "temperature": 0}
CANDIDATES = ["hello", "cache 東京 cache", "hello keeps", "world the attention café", "world", "the cache",
              "attention keeps the world", "café hello"]


def _special_token_mid_text(exported, tokenizer, max_tokens):
    """(prompt, index k of a special token in its greedy generation, the reply's text before it, a stop string of the
    character before and the character after it): the first candidate prompt whose generation has one."""
    from kvcache_op.serving import Engine

    engine = Engine(exported, num_pages=64)
    try:
        outputs = engine.generate([tokenizer(p)["input_ids"] for p in CANDIDATES], max_tokens)
    finally:
        engine.close()
    special = set(tokenizer.all_special_ids)
    for prompt, ids in zip(CANDIDATES, outputs):
        for k in range(1, len(ids) - 1):
            if ids[k] not in special:
                continue
            before = tokenizer.decode(ids[:k], skip_special_tokens=True)
            after = tokenizer.decode(ids[:k + 2], skip_special_tokens=True)
            if before and len(after) > len(before) and all(c.isprintable() and c != "\ufffd"
                                                           for c in (before[-1], after[len(before)])):
                return prompt, k, before, before[-1] + after[len(before)]
    raise AssertionError("no candidate prompt generates a special token between two characters: add candidates")


def test_a_stop_string_around_a_special_token_ends_the_request_in_the_engine(exported, served_checkpoint):
    """The reply leaves special tokens out, so a stop string can span one: the engine must find it in the same text
    and end the request with the token that completes it (not run on to max_tokens, counting tokens the reply
    never shows and streaming empty chunks after the stop)."""
    from fastapi.testclient import TestClient

    tokenizer = served_checkpoint[2]
    prompt, k, before, stop = _special_token_mid_text(exported, tokenizer, 40)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 40, "temperature": 0, "stop": [stop], "logprobs": 0}
    with TestClient(served_app(exported, tokenizer)) as client:
        reply = client.post("/v1/completions", json=body).json()
        choice = reply["choices"][0]
        assert choice["text"] == before[:-1] and choice["finish_reason"] == "stop"
        assert reply["usage"]["completion_tokens"] == k + 2 == len(choice["logprobs"]["tokens"])
        with client.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                             "stream_options": {"include_usage": True}}) as stream:
            events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    texts = [e["choices"][0]["text"] for e in events if e["choices"] and e["choices"][0]["finish_reason"] is None]
    assert "".join(texts) == before[:-1] and len(texts) <= k + 2
    assert events[-1]["usage"]["completion_tokens"] == k + 2


def test_the_app_refuses_an_engine_that_matches_stops_in_other_text(exported, served_checkpoint):
    from kvcache_op.serving import Engine
    from kvcache_op.serving.server import create_app

    engine = Engine(exported, num_pages=8, tokenizer=served_checkpoint[2])
    with pytest.raises(ValueError, match="PlainText"):
        create_app(engine, served_checkpoint[2], model_name="tiny")


def test_the_app_refuses_a_tokenizer_with_more_tokens_than_the_model(exported):
    """Another model's tokenizer (left beside a re-exported file, or given by mistake) would send ids past the
    embedding."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    from kvcache_op.serving import Engine, ModelInfo
    from kvcache_op.serving.server import create_app
    from kvcache_op.serving.tokenizer import PlainText

    vocab = ModelInfo.of_model(exported).vocab_size
    words = {f"w{i}": i for i in range(vocab + 1)}
    big = PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel(words, "w0")))
    assert len(big) == vocab + 1
    engine = Engine(exported, num_pages=8, tokenizer=PlainText(big))
    with pytest.raises(ValueError, match=f"more than the model's vocabulary of {vocab}: it is not this model's"):
        create_app(engine, big, model_name="tiny")


@pytest.fixture(scope="module")
def client(exported, served_checkpoint):
    from fastapi.testclient import TestClient

    with TestClient(served_app(exported, served_checkpoint[2], api_key="sk-key")) as client:
        client.headers["Authorization"] = "Bearer sk-key"
        yield client


COMPLETION_NULLS = ["max_tokens", "temperature", "top_p", "n", "stream", "logprobs", "echo", "stop", "seed",
                    "presence_penalty", "frequency_penalty", "user", "stream_options", "best_of", "suffix"]
CHAT_NULLS = ["max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream", "logprobs",
              "top_logprobs", "stop", "seed", "presence_penalty", "frequency_penalty", "user", "stream_options",
              "functions", "function_call"]


@pytest.mark.parametrize("route, field", [("/v1/completions", f) for f in COMPLETION_NULLS] +
                         [("/v1/chat/completions", f) for f in CHAT_NULLS])
def test_an_optional_field_sent_as_null_takes_its_default(client, route, field):
    base = GOOD if route == "/v1/completions" else {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                   "max_tokens": 2, "temperature": 0}
    want = client.post(route, json={k: v for k, v in base.items() if k != field})
    got = client.post(route, json={**base, field: None})
    assert want.status_code == 200, want.text
    assert got.status_code == 200, got.text
    if field not in ("temperature", "seed"):  # without them: sampled, so only the status is comparable
        assert got.json()["choices"] == want.json()["choices"]


def test_a_text_prompt_of_long_tokens_within_the_limit_is_served(exported, served_checkpoint):
    """The prompt's characters are no measure of its tokens: a prompt of the vocabulary's longest token, more
    characters a token than 8, is served when its tokens fit, and refused with its own count when they do not."""
    from fastapi.testclient import TestClient

    tokenizer = served_checkpoint[2]
    longest = max((tokenizer.decode([i]) for i in range(len(tokenizer))), key=len)
    prompt = longest * 200
    tokens = len(tokenizer(prompt)["input_ids"])
    assert len(prompt) > 8 * tokens + 64, (longest, tokens)  # more characters than 8 a token
    with TestClient(served_app(exported, tokenizer, max_prompt_tokens=tokens)) as client:
        reply = client.post("/v1/completions", json={**GOOD, "prompt": prompt})
        assert reply.status_code == 200, reply.text
        over = client.post("/v1/completions", json={**GOOD, "prompt": prompt + longest})
        error = over.json()["error"]
        assert over.status_code == 400 and error["code"] == "context_length_exceeded"
        assert f"has {tokens + 1} tokens, over the limit of {tokens}" in error["message"]


def test_a_refused_api_key_still_names_the_engine(client):
    refused = client.post("/v1/completions", json=GOOD, headers={"Authorization": "Bearer wrong"})
    assert refused.status_code == 401
    assert refused.headers["x-kvcache-op-engine"] == client.post("/v1/completions", json=GOOD).headers[
        "x-kvcache-op-engine"]


def test_the_logprobs_bytes_of_a_chat_reply_join_to_its_text(client, served_checkpoint):
    """Tokens that hold part of a character carry their own bytes (not the replacement character's), so joining
    the bytes of every token the reply shows (special tokens have no text in it) gives the reply's text, for
    replies whose characters span tokens."""
    special = set(served_checkpoint[2].all_special_tokens)
    seen_split = False
    for seed in range(12):
        body = {"model": "tiny", "messages": [{"role": "user", "content": "東京 café 🙂"}], "max_tokens": 24,
                "temperature": 1.5, "seed": seed, "logprobs": True, "top_logprobs": 1}
        reply = client.post("/v1/chat/completions", json=body).json()
        choice = reply["choices"][0]
        entries = choice["logprobs"]["content"]
        joined = b"".join(bytes(e["bytes"]) for e in entries if e["token"] not in special)
        assert joined.decode("utf-8", errors="replace") == choice["message"]["content"]
        seen_split |= any(e["token"].endswith("\ufffd") or "\ufffd" in e["token"] for e in entries)
        for e in entries:
            assert all(bytes(t["bytes"]) == t["token"].encode() or "\ufffd" in t["token"] for t in e["top_logprobs"])
    assert seen_split, "no reply had a token holding part of a character: the test checks nothing"


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "hello world"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello world"}]}),
])
def test_stream_options_as_the_openai_client_types_them(client, route, body):
    """The client's stream options are include_usage and include_obfuscation (padding a server may leave out): both
    taken. With include_usage every chunk before the last carries "usage": null, as OpenAI documents it."""
    body = {"model": "tiny", **body, "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "include_obfuscation": False}}
    with client.stream("POST", route, json=body) as stream:
        assert stream.status_code == 200
        events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    assert len(events) >= 3 and all("usage" in e and e["usage"] is None for e in events[:-1])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] >= 1


def test_a_tiny_repetition_penalty_still_samples_a_real_distribution():
    """A penalty that overflows the seen tokens' logits makes them the likeliest, not NaN: sampled or greedy, the
    token is a seen one (a positive logit raised to the top) and its logprob is finite."""
    from kvcache_op.serving.sampling import SamplingParams, choose_tokens

    logits = np.array([[0.5, 2.0, 1.0, -1.0, 0.25]], np.float32)
    for penalty in (1e-300, 1e-320, 5e-324):
        for temperature in (0.0, 0.5, 1.0):
            for seed in range(3):
                params = SamplingParams(temperature=temperature, repetition_penalty=penalty, seed=seed, logprobs=1)
                tokens, logprobs = choose_tokens(logits, [params], [([1, 2], [])], [np.random.default_rng(seed)])
                assert tokens[0] in (1, 2) and np.isfinite(logprobs[0].logprob), (penalty, temperature, seed, tokens)


def _wait_until_held(url, count):
    """Returns once the server at ``url`` has received ``count`` generations (queued, running or finished), as its
    ``/metrics`` show."""
    from conftest import wait_for_metrics

    wait_for_metrics(url, lambda m: m[("kvcache_op_queue_length",)] + m[("kvcache_op_running_requests",)] + sum(
        value for key, value in m.items() if key[0] == "kvcache_op_finished_requests_total") >= count,
        f"the server did not hold {count} requests")


def test_a_shutdown_ends_requests_in_flight_as_aborted_replies(exported):
    """SIGTERM with streams and plain requests running or queued (a pool of 64 pages runs one such request at a
    time): every one gets a whole reply (JSON, or a stream ending with its last chunk and [DONE]), those cut short
    with finish_reason "abort", or, sent once the shutdown began, a JSON 503; none gets a 500 or a cut body; the
    server exits before uvicorn's graceful timeout cancels any handler.

    The signal goes as soon as the server holds all nine requests, not after a fixed sleep: the tiny model
    generates a 900-token reply in about half a second, so a sleep could outlast the probe. Together the nine
    need several seconds, so some are still running or queued when the signal lands."""
    import signal
    import threading

    import httpx
    from kvcache_op.serve_command import ServerProcess

    body = {"model": "tiny", "prompt": "hello world", "max_tokens": 900, "temperature": 0, "ignore_eos": True}
    outcomes = []

    def stream(url):
        try:
            with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as reply:
                if reply.status_code != 200:
                    outcomes.append(("stream", reply.status_code, reply.read().decode()))
                    return
                lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
                outcomes.append(("stream", reply.status_code, lines))
        except httpx.HTTPError as error:
            outcomes.append(("stream", None, repr(error)))

    def plain(url):
        try:
            reply = httpx.post(url + "/v1/completions", json=body, timeout=60)
            outcomes.append(("plain", reply.status_code, reply.text))
        except httpx.HTTPError as error:
            outcomes.append(("plain", None, repr(error)))

    with ServerProcess(exported, "--num-pages", 64, "--model-name", "tiny", "--max-tokens-limit", 1000,
                       lifetime=120) as server:
        threads = [threading.Thread(target=f, args=(server.url,)) for f in (stream, plain) * 4]
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as probe:
            lines = probe.iter_lines()
            next(line for line in lines if line.startswith("data: {"))  # running now, the others queue behind it
            for t in threads:
                t.start()
            _wait_until_held(server.url, 1 + len(threads))
            server.process.send_signal(signal.SIGTERM)
            tail = [line for line in lines if line.startswith("data: ")]
        server.wait(30)
        for t in threads:
            t.join(60)
    # uvicorn cancels the handlers still running at its graceful timeout, and says so.
    assert "graceful shutdown exceeded" not in server.output, server.output[-2000:]
    assert server.process.returncode == 0 and "stopped by SIGTERM after" in server.output, server.output[-2000:]
    assert tail[-1] == "data: [DONE]", tail[-3:]
    reasons = [json.loads(tail[-2][6:])["choices"][0]["finish_reason"]]
    for kind, status, result in outcomes:
        # Sent once the shutdown began: a JSON 503 (the engine closed), or no connection (no longer listening).
        assert status in (200, 503) or (status is None and "Connect" in result), (kind, status, str(result)[-300:])
        if status == 503:
            assert json.loads(result)["error"]["type"] == "server_overloaded", result
        if status != 200:
            continue
        if kind == "stream":
            assert result[-1] == "data: [DONE]", result[-3:]
            reasons.append(json.loads(result[-2][6:])["choices"][0]["finish_reason"])
        else:
            reasons.append(json.loads(result)["choices"][0]["finish_reason"])
    assert set(reasons) <= {"abort", "length"} and "abort" in reasons, reasons


def test_ctrl_c_stops_the_server_quietly_with_its_last_line(exported):
    """SIGINT (Ctrl-C) with one request running and two queued behind it (--max-running 1, 900 tokens each): the
    queued ones at least end "abort", and the command ends as it does at --stop-after: its last line, exit status
    0, no traceback (uvicorn raises the signal again once it is down)."""
    import signal
    import threading

    import httpx
    from kvcache_op.serve_command import ServerProcess

    body = {"model": "tiny", "prompt": "hello world", "max_tokens": 900, "temperature": 0, "ignore_eos": True}
    replies = []

    def plain(url):
        replies.append(httpx.post(url + "/v1/completions", json=body, timeout=60))
    with ServerProcess(exported, "--num-pages", 64, "--model-name", "tiny", "--max-tokens-limit", 1000,
                       "--max-running", 1, lifetime=120) as server:
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as reply:
            lines = reply.iter_lines()
            next(line for line in lines if line.startswith("data: {"))  # running: the next two queue behind it
            threads = [threading.Thread(target=plain, args=(server.url,)) for _ in range(2)]
            for t in threads:
                t.start()
            _wait_until_held(server.url, 3)
            server.process.send_signal(signal.SIGINT)
            tail = [line for line in lines if line.startswith("data: ")]
        code = server.wait(30)
        for t in threads:
            t.join(60)
    assert tail[-1] == "data: [DONE]" and json.loads(tail[-2][6:])["choices"][0]["finish_reason"] in ("abort", "length")
    assert [r.status_code for r in replies] == [200, 200], [r.text for r in replies]
    assert "abort" in [r.json()["choices"][0]["finish_reason"] for r in replies]
    assert code == 0 and "Traceback" not in server.output, server.output[-2000:]
    assert server.output.splitlines()[-1].startswith("stopped by SIGINT after "), server.output[-500:]


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_chat_token_limit_out_of_range_is_refused_by_its_own_name(client, field):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], field: 0}
    error = client.post("/v1/chat/completions", json=body).json()["error"]
    assert error["param"] == field and error["message"].startswith(f"{field} must be in [1, ")
