"""RequestHandle on its own (no engine): result() waits for the request's end, not for each token; it times out,
returns every token, and raises the step's exception; iteration still sees every token as it is pushed; done callbacks
run once, when it finishes (or at once), and one that raises is logged without stopping the others."""

import logging
import threading

import pytest

from kvcache_op.serving.online import RequestHandle


def test_result_waits_for_the_end_and_returns_every_token():
    handle = RequestHandle(7)
    with pytest.raises(TimeoutError, match="request 7 did not finish"):
        handle.result(timeout=0.01)
    got = []
    waiter = threading.Thread(target=lambda: got.append(handle.result(timeout=30)))
    waiter.start()
    for token in range(50):
        handle._push(token)
    assert waiter.is_alive()  # tokens alone do not end the wait
    handle._finish("length")
    waiter.join(timeout=30)
    assert got == [list(range(50))] and handle.finish_reason == "length"


def test_result_raises_the_failed_steps_error_and_iteration_sees_every_token():
    handle = RequestHandle("r")
    seen = []
    reader = threading.Thread(target=lambda: seen.extend(_drain(handle)))
    reader.start()
    for token in (3, 1, 4):
        handle._push(token)
    handle._finish("error", RuntimeError("the step failed"))
    reader.join(timeout=30)
    assert seen == [3, 1, 4, "raised: the step failed"]
    with pytest.raises(RuntimeError, match="the step failed"):
        handle.result(timeout=1)


def _drain(handle):
    out = []
    try:
        for token in handle:
            out.append(token)
    except RuntimeError as error:
        out.append(f"raised: {error}")
    return out


def test_done_callbacks_run_once_when_it_finishes_or_at_once_and_a_raising_one_is_logged(caplog):
    handle, calls = RequestHandle(9), []

    def broken(done):
        raise RuntimeError("a caller's bug")
    handle.add_done_callback(lambda done: calls.append(("first", done.finish_reason, done.tokens)))
    handle.add_done_callback(broken)
    handle.add_done_callback(lambda done: calls.append(("third", done.finish_reason, done.tokens)))
    handle._push(4)
    assert calls == []  # a token is no finish
    with caplog.at_level(logging.ERROR, logger="kvcache_op.serving"):
        handle._finish("length")
    assert calls == [("first", "length", [4]), ("third", "length", [4])]
    assert any("a done callback of request 9 failed" in r.getMessage() for r in caplog.records)
    handle._finish("cancelled")  # a second finish changes nothing and calls nobody again
    assert len(calls) == 2 and handle.finish_reason == "length"
    handle.add_done_callback(lambda done: calls.append(("late", done.finish_reason, done.tokens)))
    assert calls[-1] == ("late", "length", [4])  # added after the finish: called at once
