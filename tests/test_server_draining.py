"""DrainingServer, the app under uvicorn in this process: told to stop with requests running and queued (one runs
at a time), it ends them as whole replies (streams with their last chunk and [DONE]), those cut short with
finish_reason "abort", well before uvicorn's graceful timeout would cancel their handlers."""

import json
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
pytest.importorskip("transformers")

from conftest import served_app, wait_for_metrics  # noqa: E402

BODY = {"model": "tiny", "prompt": "hello world", "max_tokens": 900, "temperature": 0, "ignore_eos": True}
GRACEFUL_TIMEOUT_S = 20


def test_a_draining_server_ends_its_requests_as_whole_replies(exported, served_checkpoint):
    import httpx
    import uvicorn
    from kvcache_op.serving.server import DrainingServer

    app = served_app(exported, served_checkpoint[2], engine_options={"max_running": 1})
    engine = app.state.engine
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = DrainingServer(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=GRACEFUL_TIMEOUT_S),
                            engine)
    serving = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    serving.start()
    replies = []

    def ask(stream):
        try:
            if stream:
                with httpx.stream("POST", url + "/v1/completions", json={**BODY, "stream": True}, timeout=60) as r:
                    replies.append(("stream", r.status_code, [x for x in r.iter_lines() if x.startswith("data: ")]))
            else:
                r = httpx.post(url + "/v1/completions", json=BODY, timeout=60)
                replies.append(("plain", r.status_code, r.text))
        except httpx.HTTPError as error:
            replies.append(("error", None, repr(error)))
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.started
        clients = [threading.Thread(target=ask, args=(stream,)) for stream in (True, False) * 2]
        for client in clients:
            client.start()
        # all four received (queued, running or finished) before the stop, so none arrives after the server stopped
        # listening; together they take seconds, so some are still running or queued when it stops
        wait_for_metrics(url, lambda m: m[("kvcache_op_queue_length",)] + m[("kvcache_op_running_requests",)] + sum(
            value for key, value in m.items() if key[0] == "kvcache_op_finished_requests_total") >= 4,
            "the server did not receive the requests")
        began = time.monotonic()
        server.should_exit = True
        for client in clients:
            client.join(60)
        serving.join(60)
        took = time.monotonic() - began
    finally:
        server.should_exit = True
        serving.join(60)
        engine.close(timeout=30)
    assert took < GRACEFUL_TIMEOUT_S / 2, f"the shutdown waited {took:.1f} s: uvicorn's timeout, not the drain"
    reasons = []
    for kind, status, result in replies:
        assert status == 200, (kind, status, str(result)[-300:])
        if kind == "stream":
            assert result[-1] == "data: [DONE]", result[-3:]
            reasons.append(json.loads(result[-2][6:])["choices"][0]["finish_reason"])
        else:
            reasons.append(json.loads(result)["choices"][0]["finish_reason"])
    assert len(reasons) == 4 and set(reasons) <= {"abort", "length"} and "abort" in reasons, reasons
