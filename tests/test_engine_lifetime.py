"""An Engine's lifetime: one dropped without close() is collected (its background thread ends with it) once its
requests are done, whether it served generate or submit; a request queued or running when its engine is dropped
finishes with the tokens it would have had; a failed request's handle does not keep its engine; ``with
Engine(...)`` closes it."""

import gc
import threading
import time
import traceback
import weakref

import pytest

pytest.importorskip("torch")  # kvcache_op.hf imports it
pytest.importorskip("transformers")

import hf_models  # noqa: E402
from kvcache_op.serving import Engine, SamplingParams  # noqa: E402

PROMPT = [5, 6, 7, 8, 9] * 3


@pytest.fixture(scope="module")
def path():
    return hf_models.exported("llama")


@pytest.fixture(scope="module")
def lone(path):
    """The prompt's greedy run of 6 tokens, from an engine closed at once (the oracle)."""
    engine = Engine(path, num_pages=8)
    try:
        return engine.generate([PROMPT], 6)[0]
    finally:
        engine.close()


def _engine_threads() -> list:
    return [t for t in threading.enumerate() if t.name == "kvcache-op-engine" and t.is_alive()]


def _collected(ref: weakref.ref, thread: threading.Thread, seconds: float = 20.0) -> bool:
    """Whether the engine behind ``ref`` is collected and its background thread has ended within ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        gc.collect()
        if ref() is None and not thread.is_alive():
            return True
        time.sleep(0.02)
    return False


def test_an_engine_that_ran_generate_and_is_dropped_without_close_is_collected(path, lone):
    engine = Engine(path, num_pages=8)
    assert engine.generate([PROMPT], 6) == [lone]
    ref, thread = weakref.ref(engine), engine._thread
    assert thread is not None and thread.is_alive()  # the engine's thread, idle now
    del engine
    assert _collected(ref, thread), "the dropped engine (its cache, session and thread) is still alive"


def test_an_engine_that_served_submit_and_is_dropped_is_collected_and_its_handle_stays_readable(path, lone):
    engine = Engine(path, num_pages=8)
    handle = engine.submit(PROMPT, SamplingParams(max_tokens=6))
    assert handle.result(timeout=60) == lone
    ref, thread = weakref.ref(engine), engine._thread
    del engine
    assert _collected(ref, thread)
    assert handle.tokens == lone and handle.finish_reason == "length"


def test_a_request_running_when_its_engine_is_dropped_finishes_then_the_engine_goes(path, lone):
    engine = Engine(path, num_pages=8)
    with engine._lock:  # queued before the engine can step it, then dropped by its caller
        handle = engine.submit(PROMPT, SamplingParams(max_tokens=6))
        ref, thread = weakref.ref(engine), engine._thread
        del engine
    assert handle.result(timeout=60) == lone
    assert _collected(ref, thread)


def test_a_request_submitted_to_an_idle_engine_then_dropped_still_finishes(path, lone):
    """The engine's thread waits, idle, when the request is queued and the caller lets the engine go."""
    engine = Engine(path, num_pages=8)
    engine.generate([PROMPT], 2)
    handle = engine.submit(PROMPT, SamplingParams(max_tokens=6))
    ref, thread = weakref.ref(engine), engine._thread
    del engine
    assert handle.result(timeout=60) == lone
    assert _collected(ref, thread)


def test_a_failed_requests_handle_does_not_keep_its_dropped_engine(path):
    """The handle keeps the step's error, whose printed form still names where it was raised."""
    engine = Engine(path, num_pages=8)

    def broken(*args):
        raise RuntimeError("the device fell over")

    engine.runner.run = engine.runner.run_greedy = engine.runner.greedy_steps().step = broken
    handle = engine.submit(PROMPT, SamplingParams(max_tokens=4))
    with pytest.raises(RuntimeError, match="the device fell over"):
        handle.result(timeout=60)
    ref, thread = weakref.ref(engine), engine._thread
    del engine
    assert _collected(ref, thread)
    assert handle.finish_reason == "error"
    assert "in broken" in "".join(traceback.format_exception(handle._error))


def test_many_engines_dropped_in_turn_leave_no_threads_behind(path):
    before = len(_engine_threads())
    for _ in range(4):
        engine = Engine(path, num_pages=8)
        engine.generate([PROMPT], 2)
        ref, thread = weakref.ref(engine), engine._thread
        del engine
        assert _collected(ref, thread)
    assert len(_engine_threads()) <= before


def test_with_closes_the_engine(path, lone):
    with Engine(path, num_pages=8) as engine:
        assert engine.generate([PROMPT], 6) == [lone]
        thread = engine._thread
    thread.join(timeout=20)
    assert not thread.is_alive() and engine._thread is None
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit(PROMPT)


def test_close_from_a_done_callback_does_not_wait_for_its_own_thread(path, lone):
    """A done callback runs on the engine's thread: close() there does not join that thread (it cannot join
    itself); it closes the engine and returns."""
    engine = Engine(path, num_pages=8)
    errors = []

    def close_engine(handle):
        try:
            engine.close()
        except Exception as error:  # noqa: BLE001 - what the test looks for
            errors.append(error)

    handle = engine.submit(PROMPT, SamplingParams(max_tokens=6))
    handle.add_done_callback(close_engine)
    assert handle.result(timeout=60) == lone
    deadline = time.monotonic() + 20
    while engine._thread is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert errors == [] and engine._thread is None
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit(PROMPT)
