"""RequestHandle on its own (no engine): result() waits for the request's end, not for each token; it times out,
returns every token, and raises the step's exception; iteration still sees every token as it is pushed."""

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
