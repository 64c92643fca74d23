"""A request whose HTTP call is cancelled (as a proxy such as Ray Serve's cancels the call when its client goes away or
times out, or an asyncio timeout around the app) leaves the engine: cancelled while its submit waits for the step in
progress, or while a streamed reply's headers are sent, before the body starts. Each call is driven through the app's
ASGI interface in this process; the engine's request is watched through its handle and the app's metrics."""

import asyncio
import json
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("torch")  # kvcache_op.hf imports it
pytest.importorskip("transformers")

from conftest import served_app  # noqa: E402

MAX_TOKENS = 900  # far more than the test waits for: a request left running is still running when looked at


def _scope(payload: bytes) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
            "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]}


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
