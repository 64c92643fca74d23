"""A request whose HTTP call is cancelled (as a proxy such as Ray Serve's cancels the call when its client goes away or
times out, or an asyncio timeout around the app) leaves the engine: cancelled while its submit waits for the step in
progress, or while a streamed reply's headers are sent, before the body starts. Each call is driven through the app's
ASGI interface in this process; the engine's request is watched through its handle and the app's metrics."""

import asyncio
import json
import logging
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("torch")  # kvcache_op.hf imports it
pytest.importorskip("transformers")

from conftest import served_app  # noqa: E402

MAX_TOKENS = 900  # far more than the test waits for: a request left running is still running when looked at


def _scope(payload: bytes, spec_version: str = "2.4", method: str = "POST", path: str = "/v1/completions") -> dict:
    """An HTTP call's scope (uvicorn's spec_version is 2.3: a streamed reply then listens for the disconnect)."""
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}, "http_version": "1.1",
            "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
            "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]}


async def _metrics(app) -> str:
    """What ``GET /metrics`` answers, through the app's ASGI interface."""
    body = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        if message["type"] == "http.response.body":
            body.append(message.get("body", b""))
    await app(_scope(b"", method="GET", path="/metrics"), receive, send)
    return b"".join(body).decode()


def _payload(stream: bool) -> bytes:
    return json.dumps({"model": "tiny", "prompt": [5 + i % 300 for i in range(50)], "max_tokens": MAX_TOKENS,
                       "temperature": 0, "ignore_eos": True, "stream": stream}).encode()


def _body_then_silence(payload: bytes):
    """An ASGI ``receive``: the request's body, then nothing (a client that neither sends nor leaves)."""
    sent = []

    async def receive():
        if not sent:
            sent.append(True)
            return {"type": "http.request", "body": payload, "more_body": False}
        await asyncio.sleep(3600)
    return receive


@pytest.fixture
def app_and_handles(exported, served_checkpoint):
    """The app over a fresh engine whose submits are recorded (the handles the app holds)."""
    app = served_app(exported, served_checkpoint[2], engine_options={"decode_steps": 1})
    engine, handles = app.state.engine, []
    submit = engine.submit

    def recorded(*args, **kwargs):
        handles.append(submit(*args, **kwargs))
        return handles[-1]
    engine.submit = recorded
    yield app, engine, handles
    engine.close(timeout=30)


def _finished_as_cancelled(engine, handle) -> None:
    handle.result(timeout=60)
    assert handle.finish_reason == "cancelled", f"the request ran on for nobody: {len(handle.tokens)} tokens"
    assert len(handle.tokens) < MAX_TOKENS
    deadline = time.monotonic() + 30
    while engine.metrics()["pages_in_use"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.metrics()["pages_in_use"] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cancelled_while_its_submit_waits_cancels_the_request_it_queues(app_and_handles, stream):
    app, engine, handles = app_and_handles
    payload, held = _payload(stream), threading.Event()

    def a_long_step():  # the engine's lock held as by a step in progress: the submit waits for it
        with engine._lock:
            held.set()
            time.sleep(1.0)

    async def call():
        receive = _body_then_silence(payload)

        async def send(message):
            pass

        holder = threading.Thread(target=a_long_step)
        holder.start()
        await asyncio.to_thread(held.wait, 10)
        task = asyncio.create_task(app(_scope(payload), receive, send))
        await asyncio.sleep(0.3)  # the call waits in its submit
        assert not handles, "the submit did not wait for the step"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.to_thread(holder.join, 30)
        # The loop runs on (as a server's does) until the request the submit queued is done: its cancellation is
        # answered on this loop once the submit returns.
        deadline = time.monotonic() + 60
        while not (handles and handles[0].done) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    asyncio.run(call())
    (handle,) = handles
    _finished_as_cancelled(engine, handle)


def test_a_stream_cancelled_while_its_headers_are_sent_cancels_its_request(app_and_handles):
    app, engine, handles = app_and_handles
    payload = _payload(stream=True)

    async def call():
        receive, started = _body_then_silence(payload), asyncio.Event()

        async def send(message):
            if message["type"] == "http.response.start":  # a proxy's send that takes a moment
                started.set()
                await asyncio.sleep(0.5)

        task = asyncio.create_task(app(_scope(payload), receive, send))
        await asyncio.wait_for(started.wait(), 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(call())
    (handle,) = handles
    _finished_as_cancelled(engine, handle)


def test_a_client_leaving_before_its_body_arrived_is_no_server_error(app_and_handles, caplog):
    """Half a body, then the client goes: counted as 499 (nginx's "client closed request"), nothing logged as an
    error, nothing submitted (it was a 500 with two tracebacks, one raised out of the app)."""
    app, _, handles = app_and_handles
    payload, statuses = _payload(stream=False), []

    async def call():
        parts = [{"type": "http.request", "body": payload[:20], "more_body": True}, {"type": "http.disconnect"}]

        async def receive():
            if parts:
                return parts.pop(0)
            await asyncio.sleep(3600)

        async def send(message):
            if message["type"] == "http.response.start":
                statuses.append(message["status"])
        await app(_scope(payload), receive, send)
        return await _metrics(app)

    with caplog.at_level(logging.ERROR):
        text = asyncio.run(call())
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert statuses == [499] and not handles
    assert 'kvcache_op_requests_total{route="/v1/completions",status="499"} 1.0' in text
    assert 'status="500"' not in text


def test_a_stream_left_during_its_last_step_is_counted_as_that_step_ended_it(app_and_handles):
    """The client goes after the first of two tokens, while the step choosing the second runs: the engine ends the
    request as "length" with both tokens, and the metrics say so once it has (they counted it as cancelled with one
    token when the reply ended, before the engine had)."""
    app, engine, handles = app_and_handles
    payload = json.dumps({"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0,
                          "ignore_eos": True, "stream": True}).encode()
    second_step, left = threading.Event(), threading.Event()

    def second_step_waits_for_the_client_to_leave(run):
        def waiting(*args, **kwargs):
            if handles and handles[0].tokens:
                second_step.set()
                left.wait(30)
            return run(*args, **kwargs)
        return waiting
    runner = engine.runner  # a greedy request's steps: run_greedy
    runner.run, runner.run_greedy = map(second_step_waits_for_the_client_to_leave, (runner.run, runner.run_greedy))

    async def call():
        sent = []

        async def receive():
            if not sent:
                sent.append(True)
                return {"type": "http.request", "body": payload, "more_body": False}
            await asyncio.to_thread(second_step.wait, 30)  # the client leaves once the second step is under way
            return {"type": "http.disconnect"}

        async def send(message):
            pass
        await app(_scope(payload, spec_version="2.3"), receive, send)  # the reply ends: its client left
        assert second_step.is_set() and not handles[0].done, "the request ended first: the test checks nothing"
        left.set()
        deadline = time.monotonic() + 60
        while "kvcache_op_finished_requests_total{" not in await _metrics(app) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return await _metrics(app)

    text = asyncio.run(call())
    (handle,) = handles
    assert handle.finish_reason == "length" and len(handle.tokens) == 2
    assert 'kvcache_op_finished_requests_total{reason="length"} 1.0' in text
    assert 'reason="cancelled"' not in text
    assert "kvcache_op_generation_tokens_total 2.0" in text


def test_a_stream_whose_client_left_under_an_asgi_2_4_server_ends_quietly(app_and_handles, caplog):
    """An ASGI 2.4 server reports a client gone mid-stream by failing ``send`` (OSError; starlette raises
    ClientDisconnect): the call ends without an error raised out of the app or logged, and the request is cancelled."""
    app, engine, handles = app_and_handles
    payload = _payload(stream=True)

    async def call():
        async def send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                raise OSError("the connection was closed")
        await app(_scope(payload, spec_version="2.4"), _body_then_silence(payload), send)

    with caplog.at_level(logging.ERROR):
        asyncio.run(call())
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    (handle,) = handles
    _finished_as_cancelled(engine, handle)
