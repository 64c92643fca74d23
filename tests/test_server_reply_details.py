"""Details of the OpenAI-compatible replies, limits and metrics, each at its edge: the API key compared whole, streams
ending with [DONE], max_tokens defaults and limits taken at their bounds, stop ids and stop strings' held text,
logprobs in streams, n, seeds, roles, usage, chunk objects, and the Prometheus counters and gauges of one request.
In process (TestClient), on the session's tiny checkpoint export (conftest's ``exported``/``served_checkpoint``)."""

import json
import time

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from conftest import served_app  # noqa: E402

KEY = "sk-key"


@pytest.fixture(scope="module")
def served(exported, served_checkpoint):
    """(client, engine, tokenizer) of an app requiring KEY."""
    app = served_app(exported, served_checkpoint[2], api_key=KEY)
    with TestClient(app) as client:
        client.headers["Authorization"] = f"Bearer {KEY}"
        yield client, app.state.engine, served_checkpoint[2]


def _post(client, route, **body):
    reply = client.post(route, json={"model": "tiny", "temperature": 0, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()


def _events(client, route, **body):
    """(the JSON events, the raw data lines) of a streamed reply."""
    with client.stream("POST", route, json={"model": "tiny", "temperature": 0, "stream": True, **body}) as stream:
        assert stream.status_code == 200
        lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")], lines


def _greedy(engine, ids, n):
    from kvcache_op.serving import SamplingParams

    return engine.submit(ids, SamplingParams(max_tokens=n, ignore_eos=True)).result(timeout=120)


# ---- the app ---------------------------------------------------------------------------------------------------------
def test_a_key_with_characters_after_the_right_one_is_refused(served):
    """A token that starts with the key but goes on is not the key."""
    client, _, _ = served
    for token in (KEY + "x", KEY + KEY, KEY + " "):
        reply = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 1},
                            headers={"Authorization": f"Bearer {token}"})
        assert reply.status_code == 401, token


def test_every_stream_ends_with_done(served):
    """OpenAI's streams end with `data: [DONE]`, once; clients that wait for it would hang."""
    client, _, _ = served
    for route, body in (("/v1/completions", {"prompt": "hello world"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        _, lines = _events(client, route, max_tokens=3, **body)
        assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1


def test_a_completion_without_max_tokens_gets_openais_default_of_16(served):
    """OpenAI's /v1/completions default is 16 tokens, not the context's room."""
    client, _, _ = served
    reply = _post(client, "/v1/completions", prompt="hello world", ignore_eos=True)
    assert reply["usage"]["completion_tokens"] == 16 and reply["choices"][0]["finish_reason"] == "length"


def test_a_default_max_tokens_is_cut_to_the_room_the_prompt_leaves(exported, served_checkpoint):
    """8 pages of 16 hold 129 positions; a prompt of 120 leaves 9, which a request without max_tokens gets (not a 400
    for 120 + 16, nor 8)."""
    app = served_app(exported, served_checkpoint[2], engine_options={"num_pages": 8})
    with TestClient(app) as client:
        assert client.get("/v1/models").json()["data"][0]["max_model_len"] == 129
        reply = _post(client, "/v1/completions", prompt=[5] * 120, ignore_eos=True)
        assert reply["usage"]["completion_tokens"] == 9 and reply["choices"][0]["finish_reason"] == "length"


def test_max_tokens_equal_to_the_limit_and_a_body_of_the_size_limit_are_served(exported, served_checkpoint):
    """max_tokens equal to max_tokens_limit, and a body of exactly max_body_bytes, are served; a byte more is a 413."""
    body = json.dumps({"model": "tiny", "prompt": "hello world", "max_tokens": 6, "temperature": 0,
                       "ignore_eos": True}).encode()
    app = served_app(exported, served_checkpoint[2], max_tokens_limit=6, max_body_bytes=len(body))
    with TestClient(app) as client:
        reply = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 6
        over = client.post("/v1/completions", content=body + b" ", headers={"content-type": "application/json"})
        assert over.status_code == 413


def test_the_engine_is_closed_when_the_app_shuts_down(exported, served_checkpoint):
    """The app's shutdown closes its engine: it takes no request after (its thread ends)."""
    from kvcache_op.serving import SamplingParams

    app = served_app(exported, served_checkpoint[2])
    with TestClient(app) as client:
        _post(client, "/v1/completions", prompt="hi", max_tokens=2)
    with pytest.raises(RuntimeError, match="closed"):
        app.state.engine.submit([5, 6], SamplingParams(max_tokens=1))


def test_streamed_logprobs_cover_every_token_also_those_whose_text_is_held(served):
    """With a stop string that holds a token's text back (it could start the stop), the stream still carries one
    logprobs entry per generated token, as the whole reply does."""
    client, _, _ = served
    body = dict(prompt="the quick brown fox", max_tokens=6, logprobs=1, ignore_eos=True)
    whole = _post(client, "/v1/completions", **body)["choices"][0]["logprobs"]
    held = whole["tokens"][2] + "\x7f\x7f"  # never completes: holds token 2's text until the next token
    events, _ = _events(client, "/v1/completions", stop=[held], **body)
    streamed = [t for e in events if e["choices"] and e["choices"][0]["logprobs"]
                for t in e["choices"][0]["logprobs"]["tokens"]]
    assert streamed == whole["tokens"]


# ---- generations -----------------------------------------------------------------------------------------------------
def test_a_stop_token_id_ends_the_reply_without_its_text(served):
    """stop_token_ids reach the engine, and the reply is the tokenizer's decode of the tokens before the stop token
    (vLLM's default), its finish_reason "stop", and the stop token is counted."""
    client, engine, tokenizer = served
    ids = tokenizer("hello world")["input_ids"]
    tokens = _greedy(engine, ids, 16)
    special = set(tokenizer.all_special_ids)
    stop = next(t for t in tokens[2:] if t not in special and tokenizer.decode([t]).strip())
    first = tokens.index(stop)
    reply = _post(client, "/v1/completions", prompt="hello world", max_tokens=16, ignore_eos=True,
                  stop_token_ids=[stop])
    assert reply["choices"][0]["text"] == tokenizer.decode(tokens[:first], skip_special_tokens=True)
    assert reply["choices"][0]["finish_reason"] == "stop" and reply["usage"]["completion_tokens"] == first + 1


def test_a_tail_held_for_a_stop_string_that_never_completes_is_sent_at_the_end(served):
    """A reply whose last character could start a stop string that never comes still ends with that character, streamed
    or not."""
    client, engine, tokenizer = served
    ids = tokenizer("hello world")["input_ids"]
    full = tokenizer.decode(_greedy(engine, ids, 10), skip_special_tokens=True)
    assert full and not full.endswith("\ufffd")
    stop = full[-1] + "\x7f"
    body = dict(prompt="hello world", max_tokens=10, ignore_eos=True, stop=[stop])
    assert _post(client, "/v1/completions", **body)["choices"][0]["text"] == full
    events, _ = _events(client, "/v1/completions", **body)
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == full


# ---- requests --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, -1])
def test_n_below_one_is_refused(served, n):
    """OpenAI refuses n < 1; answering one choice for n=0 would be wrong."""
    client, _, _ = served
    reply = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 1, "n": n})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "n"


def test_a_negative_seed_is_its_unsigned_64_bit_twin(served):
    """Seed -5 samples as the engine's seed 2**64 - 5 (the same bits, unsigned),
    not as 2**63 - 5 (which would make it collide with the valid seed 2**63 - 5)."""
    from kvcache_op.serving import SamplingParams

    client, engine, tokenizer = served
    ids = tokenizer("hello world")["input_ids"]
    tokens = engine.submit(ids, SamplingParams(max_tokens=12, temperature=1.0, seed=2 ** 64 - 5,
                                               ignore_eos=True)).result(timeout=120)
    reply = _post(client, "/v1/completions", prompt="hello world", max_tokens=12, temperature=1.0, seed=-5,
                  ignore_eos=True)
    assert reply["choices"][0]["text"] == tokenizer.decode(tokens, skip_special_tokens=True)


def test_the_most_top_logprobs_allowed_are_served(served):
    """The documented limit of 20 top logprobs is itself accepted."""
    client, _, _ = served
    reply = _post(client, "/v1/completions", prompt="hi", max_tokens=2, logprobs=20)
    assert all(1 <= len(top) <= 20 for top in reply["choices"][0]["logprobs"]["top_logprobs"])


def test_a_developer_message_is_rendered_as_a_system_message(served):
    """OpenAI's "developer" role is the system role: the template renders it as one."""
    client, _, _ = served
    replies = [_post(client, "/v1/chat/completions", max_tokens=4,
                     messages=[{"role": role, "content": "be brief"}, {"role": "user", "content": "hi"}])
               for role in ("developer", "system")]
    assert replies[0]["usage"]["prompt_tokens"] == replies[1]["usage"]["prompt_tokens"]
    assert replies[0]["choices"][0]["message"] == replies[1]["choices"][0]["message"]


def test_chat_logprobs_without_top_logprobs_report_each_tokens_logprob(served):
    """logprobs: true without top_logprobs reports every token's logprob, with no alternatives."""
    client, _, _ = served
    reply = _post(client, "/v1/chat/completions", max_tokens=4, logprobs=True,
                  messages=[{"role": "user", "content": "hi"}])
    content = reply["choices"][0]["logprobs"]["content"]
    assert len(content) == reply["usage"]["completion_tokens"] and all(e["top_logprobs"] == [] for e in content)


# ---- replies ---------------------------------------------------------------------------------------------------------
def test_total_tokens_is_prompt_plus_completion(served):
    """usage.total_tokens is prompt_tokens + completion_tokens, whole and streamed."""
    client, _, _ = served
    usage = _post(client, "/v1/completions", prompt="hello world", max_tokens=3)["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] and usage["prompt_tokens"] > 0
    events, _ = _events(client, "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                        stream_options={"include_usage": True})
    usage = events[-1]["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_stream_chunks_name_their_object_and_open_with_the_role(served):
    """OpenAI's chat stream chunks are "chat.completion.chunk", the first one's delta {"role": "assistant", "content":
    ""}."""
    client, _, _ = served
    events, _ = _events(client, "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert {e["object"] for e in events} == {"chat.completion.chunk"}
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    events, _ = _events(client, "/v1/completions", prompt="hi", max_tokens=3)
    assert {e["object"] for e in events} == {"text_completion"}


# ---- metrics ---------------------------------------------------------------------------------------------------------
def _metrics(client) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            out[(sample.name,) + tuple(sorted(sample.labels.items()))] = sample.value
    return out


def _paced_app(exported, served_checkpoint, pause, **engine_options):
    """An app whose engine runs every step through runner.run or runner.run_greedy (decode_steps=1), each at least
    ``pause`` s."""
    app = served_app(exported, served_checkpoint[2], engine_options={"decode_steps": 1, **engine_options})
    engine = app.state.engine

    def paced(run):
        def slow(*args):
            time.sleep(pause)
            return run(*args)
        return slow
    engine.runner.run, engine.runner.run_greedy = paced(engine.runner.run), paced(engine.runner.run_greedy)
    return app, engine


def test_one_requests_token_counts_and_latencies_are_what_it_served(exported, served_checkpoint):
    """One request of 5 tokens is 5 generated tokens, one first-token time and 4
    inter-token latencies, which together span no more than the request took (they telescope to its last token's
    time)."""
    app, _ = _paced_app(exported, served_checkpoint, 0.1)
    with TestClient(app) as client:
        began = time.perf_counter()
        _post(client, "/v1/completions", prompt="hello world", max_tokens=5, ignore_eos=True)
        took = time.perf_counter() - began
        m = _metrics(client)
    assert m[("kvcache_op_generation_tokens_total",)] == 5
    assert m[("kvcache_op_time_to_first_token_seconds_count",)] == 1
    assert m[("kvcache_op_inter_token_latency_seconds_count",)] == 4
    spanned = m[("kvcache_op_time_to_first_token_seconds_sum",)] + m[("kvcache_op_inter_token_latency_seconds_sum",)]
    assert 0.4 < spanned <= took


def test_the_queue_and_running_gauges_are_the_engines(exported, served_checkpoint):
    """The queue and running gauges read the engine's: one request runs (max_running=1) and two wait."""
    from kvcache_op.serving import SamplingParams

    app, engine = _paced_app(exported, served_checkpoint, 0.05, max_running=1)
    with TestClient(app) as client:
        handles = [engine.submit([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True)) for _ in range(3)]
        deadline = time.monotonic() + 60
        while engine.running_count != 1 or engine.queue_length != 2:
            assert time.monotonic() < deadline, "the engine never ran one request with two waiting"
            time.sleep(0.01)
        m = _metrics(client)
        assert m[("kvcache_op_queue_length",)] == 2 and m[("kvcache_op_running_requests",)] == 1
        for handle in handles:
            handle.cancel()


def test_preemptions_are_the_engines(exported, served_checkpoint):
    """The preemptions counter is the engine's: a pool of 3 pages preempts (no prefix cache: nothing is
    evicted, so the two counts differ)."""
    app = served_app(exported, served_checkpoint[2], engine_options={"num_pages": 3, "max_batch_tokens": 4,
                                                                          "prefix_caching": False})
    engine = app.state.engine
    with TestClient(app) as client:
        engine.generate([[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]], 20)
        counts = engine.metrics()
        assert counts["preemptions"] > 0 and counts["preemptions"] != counts["evictions"], counts
        assert _metrics(client)[("kvcache_op_preemptions_total",)] == counts["preemptions"]
