"""Engine.submit: requests from many threads while others run, streamed token by token, cancelled at random,
against a sequential oracle (each finished request equals its lone run; a cancelled one a prefix of it; every
page back when all are done); the asyncio face; arguments refused before queueing; generate beside submitted
requests; a failing step fails the requests it ran (not those queued behind it) without losing pages."""

import asyncio
import pickle
import random
import threading
import time

import pytest

pytest.importorskip("torch")  # kvcache_op.hf imports it
pytest.importorskip("transformers")

import hf_models  # noqa: E402
from kvcache_op.serving import Engine, SamplingParams  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9] * 7, [300, 2, 3], list(range(40, 90)), [11, 12] * 9, [7] * 30, list(range(100, 140))]


@pytest.fixture(scope="module")
def path():
    return hf_models.exported("llama")


@pytest.fixture(scope="module")
def lone(path):
    """Each prompt's lone greedy run of 8 tokens (generate, one request at a time: the oracle)."""
    engine = Engine(path, num_pages=32)
    return {i: engine.generate([p], 8)[0] for i, p in enumerate(PROMPTS)}


def test_many_threads_submitting_and_cancelling_agree_with_the_sequential_oracle(path, lone):
    engine = Engine(path, num_pages=9, max_running=4, max_batch_tokens=48)  # requests queue for pages and slots
    outcomes, lock = [], threading.Lock()

    def client(seed):
        rng = random.Random(seed)
        for _ in range(4):
            i = rng.randrange(len(PROMPTS))
            handle = engine.submit(PROMPTS[i], SamplingParams(max_tokens=8))
            cancel = rng.random() < 0.3
            streamed = []
            for token in handle:
                streamed.append(token)
                if cancel and len(streamed) == rng.randrange(1, 4):
                    handle.cancel()
            with lock:
                outcomes.append((i, handle.finish_reason, streamed, handle.result(timeout=60)))

    with engine._lock:  # queued and cancelled before the engine can step it: one cancellation whatever the timing
        doomed = engine.submit(PROMPTS[0], SamplingParams(max_tokens=8))
        doomed.cancel()
    threads = [threading.Thread(target=client, args=(seed,)) for seed in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    assert len(outcomes) == 24
    assert doomed.result(timeout=60) is not None and doomed.finish_reason == "cancelled"
    outcomes.append((0, doomed.finish_reason, doomed.result(), doomed.result()))
    for i, reason, streamed, result in outcomes:
        assert streamed == result  # the stream is the result, in order
        if reason == "cancelled":
            assert result == lone[i][:len(result)]
        else:
            assert reason in ("length", "stop") and result == lone[i], f"prompt {i}"
    assert any(r == "cancelled" for _, r, _, _ in outcomes) and any(r == "length" for _, r, _, _ in outcomes)
    assert engine.metrics()["pages_in_use"] == 0
    engine.close(timeout=30)


def test_async_iteration_streams_the_same_tokens(path, lone):
    engine = Engine(path, num_pages=16)

    async def collect():
        handles = [engine.submit(PROMPTS[i], SamplingParams(max_tokens=8)) for i in (0, 2)]
        streams = []
        for handle in handles:  # one loop per handle: an async comprehension inside a plain one needs Python 3.11
            streams.append([token async for token in handle])
        return streams

    assert asyncio.run(collect()) == [lone[0], lone[2]]
    engine.close(timeout=30)


def test_seeded_sampling_is_the_same_alone_and_beside_others(path):
    engine = Engine(path, num_pages=24)
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=1234)
    alone = engine.submit(PROMPTS[1], params).result(timeout=60)
    busy = [engine.submit(p, SamplingParams(max_tokens=8)) for p in PROMPTS[2:5]]
    beside = engine.submit(PROMPTS[1], params)
    assert beside.result(timeout=60) == alone
    assert all(h.result(timeout=60) for h in busy)
    engine.close(timeout=30)


def test_generate_runs_beside_submitted_requests(path, lone):
    engine = Engine(path, num_pages=32)
    handles = [engine.submit(PROMPTS[i], SamplingParams(max_tokens=8)) for i in (3, 4)]
    assert engine.generate([PROMPTS[0], PROMPTS[5]], 8) == [lone[0], lone[5]]
    assert [h.result(timeout=60) for h in handles] == [lone[3], lone[4]]
    assert engine.metrics()["pages_in_use"] == 0
    engine.close(timeout=30)


def test_generate_calls_from_many_threads_join_one_continuous_batch(path, lone):
    # One decode step per graph run, so that every step of these greedy requests goes through runner.run_greedy
    # (runs of greedy steps do not), and steps paced at 5 ms there while the calls run: the long request's 900 steps
    # then outlast the calls however late the threads are scheduled on a loaded machine (unpaced, a tiny model's 900
    # steps once ended first).
    engine = Engine(path, num_pages=96, trace_steps=True, decode_steps=1)
    calls_done, run = threading.Event(), engine.runner.run_greedy

    runs = []  # one per call of runner.run_greedy: whether it was paced (made while the calls ran)

    def paced(feeds, *changed):
        runs.append(not calls_done.is_set())
        if runs[-1]:
            time.sleep(0.005)
        return run(feeds, *changed)
    engine.runner.run_greedy = paced
    long = engine.submit(PROMPTS[1], SamplingParams(max_tokens=900, ignore_eos=True))  # runs through all the calls
    results = {}

    def call(k):
        results[k] = engine.generate([PROMPTS[k], PROMPTS[(k + 1) % len(PROMPTS)]], 8)
    threads = [threading.Thread(target=call, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    calls_done.set()
    assert results == {k: [lone[k], lone[(k + 1) % len(PROMPTS)]] for k in range(4)}
    # Each call's 8 tokens take 8 graph runs at least (its prompt's, then one per decode step), all made while the
    # calls ran; so fewer than 8 paced runs means the steps bypassed runner.run_greedy. All four calls can share those 8
    # runs when they join at once, so no more than 8 can be asked for.
    assert sum(runs) >= 8, "the steps did not go through the paced runner.run_greedy"
    assert not long.done, "the long request should still be running"
    # The calls' requests ran in steps beside the submitted one (and beside each other), not after it.
    assert max(t["sequences"] for t in engine.step_trace) >= 3
    long.cancel()
    engine.close(timeout=30)
    assert long.finish_reason == "cancelled" and engine.metrics()["pages_in_use"] == 0
    # And every step the engine counted was one call of runner.run_greedy: none went round it.
    assert len(runs) == engine.metrics()["steps"]


@pytest.mark.parametrize("args, kwargs, error, message", [
    (([],), {}, ValueError, "must be a non-empty list of token ids"),
    (([1, 2.5],), {}, TypeError, "token ids must be integers"),
    (([1, 2], "greedy"), {}, TypeError, "params must be a SamplingParams"),
    (([1, 2], SamplingParams(stop=("x",))), {}, ValueError, "stop strings need a tokenizer"),
    (([1, 2],), {"salt": 3.5}, TypeError, "salt"),
    (([1] * 200, SamplingParams(max_tokens=100)), {}, ValueError, "more than num_pages=4"),
    (([1, 2],), {"max_waiting": -1}, ValueError, "max_waiting must be None or an int >= 0"),
    (([1, 2],), {"max_waiting": True}, ValueError, "max_waiting must be None or an int >= 0"),
    (([1, 2], [SamplingParams(), SamplingParams()]), {}, TypeError, "params must be a SamplingParams or a list of 1"),
])
def test_submit_checks_everything_before_queueing(path, args, kwargs, error, message):
    engine = Engine(path, num_pages=4)
    with pytest.raises(error, match=message):
        engine.submit(*args, **kwargs)
    assert engine._thread is None  # nothing was queued, no thread started
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit([1, 2])


def test_max_waiting_refuses_a_request_while_that_many_wait_and_counts_each_once(path):
    """Under max_waiting=2, with one request running alone: threads submitting at once queue exactly two (the
    count is taken under the lock that queues them), the rest get EngineBusy naming two waiting, and once one
    waiting request is cancelled a new one is queued."""
    from kvcache_op.serving import EngineBusy

    engine = Engine(path, num_pages=80, max_running=1)
    run = engine.runner.run

    def paced(feeds, *changed):  # 900 steps take 4.5 s at least: the request runs through the test however fast
        time.sleep(0.005)
        return run(feeds, *changed)
    engine.runner.run = paced
    # Sampled, so that every step goes through runner.run (a greedy run may lead a prompt through its own graph).
    running = engine.submit(PROMPTS[0], SamplingParams(max_tokens=900, ignore_eos=True, temperature=1.0, seed=1))
    deadline = time.monotonic() + 30
    while engine.running_count != 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    outcomes, start = [], threading.Barrier(8)

    def client(i):
        start.wait()
        try:
            outcomes.append(engine.submit(PROMPTS[i % len(PROMPTS)], SamplingParams(max_tokens=2), max_waiting=2))
        except EngineBusy as error:
            outcomes.append(error)
    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    queued = [o for o in outcomes if not isinstance(o, EngineBusy)]
    refused = [o for o in outcomes if isinstance(o, EngineBusy)]
    assert len(queued) == 2 and engine.queue_length == 2 and not running.done
    assert all(e.waiting == 2 and "2 requests are waiting to be admitted (the limit is 2)" in str(e) for e in refused)
    copy = pickle.loads(pickle.dumps(refused[0]))  # an error that crosses processes (Ray replicas) keeps its fields
    assert (copy.waiting, copy.max_waiting, str(copy)) == (2, 2, str(refused[0]))
    queued[0].cancel()
    deadline = time.monotonic() + 30
    while engine.queue_length != 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    queued.append(engine.submit(PROMPTS[1], SamplingParams(max_tokens=2), max_waiting=2))
    assert engine.queue_length == 2
    engine.close(timeout=30)
    assert all(h.finish_reason == "cancelled" for h in [running] + queued)


def test_a_failing_step_fails_its_requests_and_keeps_no_pages(path, monkeypatch):
    engine = Engine(path, num_pages=16)
    handle = engine.submit(PROMPTS[0], SamplingParams(max_tokens=4))
    assert len(handle.result(timeout=60)) == 4

    def broken(*args):
        raise RuntimeError("the device fell over")

    monkeypatch.setattr(engine.runner, "run", broken)
    monkeypatch.setattr(engine.runner, "run_greedy", broken)
    monkeypatch.setattr(engine.runner.greedy_steps(), "step", broken)  # a greedy request's run: its prompt leads it
    failing = engine.submit(PROMPTS[2], SamplingParams(max_tokens=4))
    with pytest.raises(RuntimeError, match="the device fell over"):
        failing.result(timeout=60)
    assert failing.finish_reason == "error"
    assert engine.metrics()["pages_in_use"] == 0
    monkeypatch.undo()
    assert engine.submit(PROMPTS[2], SamplingParams(max_tokens=4)).result(timeout=60)  # usable again
    engine.close(timeout=30)


def _fail_one_step(engine, message: str, then=None) -> threading.Event:
    """Every step of ``engine`` takes 10 ms at least (long enough for other requests to be queued meanwhile); once
    the returned event is set, the next one raises ``RuntimeError(message)`` (through any path a step runs:
    ``runner.run``, ``runner.run_greedy`` or a greedy run's step), clears the event and calls ``then()`` first."""
    greedy, armed = engine.runner.greedy_steps(), threading.Event()

    def once_broken(call):
        def wrapped(*args):
            time.sleep(0.01)
            if armed.is_set():
                armed.clear()
                if then is not None:
                    then()
                raise RuntimeError(message)
            return call(*args)
        return wrapped
    runner = engine.runner
    runner.run, runner.run_greedy = once_broken(runner.run), once_broken(runner.run_greedy)
    greedy.step = once_broken(greedy.step)
    return armed


def test_a_failing_step_fails_the_requests_it_ran_and_those_queued_behind_it_go_on(path, lone):
    """One step fails while one request runs (``max_running=1``) and two of other callers wait: the running one
    fails with the step's exception, the waiting ones finish as they would alone, and no page is kept."""
    engine = Engine(path, num_pages=32, max_running=1)
    armed = _fail_one_step(engine, "the device fell over once")
    first = engine.submit(PROMPTS[0], SamplingParams(max_tokens=60))
    next(iter(first))  # running
    queued = [engine.submit(PROMPTS[i], SamplingParams(max_tokens=8)) for i in (1, 3)]
    armed.set()
    with pytest.raises(RuntimeError, match="the device fell over once"):
        first.result(timeout=60)
    assert first.finish_reason == "error" and not armed.is_set()
    assert [h.result(timeout=60) for h in queued] == [lone[1], lone[3]]
    assert [h.finish_reason for h in queued] == ["length", "length"]
    engine.close(timeout=30)
    assert engine.metrics()["pages_in_use"] == 0


def test_a_roll_back_that_fails_too_still_finishes_every_request_and_frees_its_pages(path):
    """The step fails, then releasing a request's pages fails once during the roll-back: no request is left
    unanswered (its caller would wait for ever) and no page is kept."""
    engine = Engine(path, num_pages=32, max_running=2)
    finish, finish_armed = engine.manager.finish, threading.Event()

    def flaky_finish(*args):
        if finish_armed.is_set():
            finish_armed.clear()
            raise RuntimeError("the manager fell over too")
        return finish(*args)
    armed = _fail_one_step(engine, "the device fell over", then=finish_armed.set)
    engine.manager.finish = flaky_finish
    handles = [engine.submit(PROMPTS[i], SamplingParams(max_tokens=60)) for i in (0, 2)]
    for handle in handles:
        next(iter(handle))
    armed.set()
    for handle in handles:
        with pytest.raises(RuntimeError, match="fell over"):
            handle.result(timeout=60)
        assert handle.finish_reason == "error"
    engine.close(timeout=30)
    assert engine.metrics()["pages_in_use"] == 0


def test_a_failure_readying_a_greedy_run_rolls_its_step_back_and_the_engine_goes_on(path, lone):
    """The graph of greedy runs fails to load once, after the manager planned the run's steps: the request of that
    step fails, the one queued behind it (another caller's, ``max_running=1``) is served as alone (the step was rolled
    back: only the requests it ran fail), the manager is not left with the step outstanding (it refused every later
    step: no request could run again) and later requests are served as alone, with no page kept."""
    engine = Engine(path, num_pages=32, max_running=1)
    greedy_steps, armed = engine.runner.greedy_steps, threading.Event()

    def fails_once():
        if armed.is_set() and engine.manager.outstanding_plan is not None:  # the call after the step was planned
            armed.clear()
            raise MemoryError("no memory for the greedy graph, once")
        return greedy_steps()
    engine.runner.greedy_steps = fails_once
    with engine._lock:  # both queued before the engine looks: the second waits for the first's place
        armed.set()
        failed = engine.submit(PROMPTS[0], SamplingParams(max_tokens=8))
        queued = engine.submit(PROMPTS[2], SamplingParams(max_tokens=8))
    with pytest.raises(MemoryError, match="once"):
        failed.result(timeout=60)
    with engine._lock:  # between two steps (a step's plan is outstanding only while it runs, under the lock)
        assert failed.finish_reason == "error" and engine.manager.outstanding_plan is None
    assert queued.result(timeout=60) == lone[2] and queued.finish_reason == "length"
    assert [engine.submit(PROMPTS[i], SamplingParams(max_tokens=8)).result(timeout=60) for i in (1, 3)] == \
        [lone[1], lone[3]]
    engine.close(timeout=30)
    assert engine.metrics()["pages_in_use"] == 0


def test_a_failure_after_planning_that_no_roll_back_reaches_leaves_no_step_outstanding(path, lone):
    """Planning a step fails after the manager applied it (a failure no roll-back reaches): every request of the batch
    fails, the outstanding step is aborted and later requests are served as alone, with no page kept."""
    engine = Engine(path, num_pages=32, decode_steps=1)  # each decode step planned by its own schedule_decode
    schedule_decode, armed = engine.manager.schedule_decode, threading.Event()

    def applied_then_fails(*args):
        plan = schedule_decode(*args)
        if armed.is_set():
            armed.clear()
            raise RuntimeError("the planner fell over after the manager planned")
        return plan
    engine.manager.schedule_decode = applied_then_fails
    handle = engine.submit(PROMPTS[0], SamplingParams(max_tokens=60))
    next(iter(handle))  # decoding
    armed.set()
    with pytest.raises(RuntimeError, match="fell over after the manager planned"):
        handle.result(timeout=60)
    with engine._lock:
        assert engine.manager.outstanding_plan is None
    assert [engine.submit(PROMPTS[i], SamplingParams(max_tokens=8)).result(timeout=60) for i in (1, 3)] == \
        [lone[1], lone[3]]
    engine.close(timeout=30)
    assert engine.metrics()["pages_in_use"] == 0


class SlowToTakeLock:
    """The engine's lock, taken ``delay`` seconds late by one thread (``slow``): a caller the OS is slow to
    schedule once the lock is free. Everything else is the wrapped RLock's, Condition's hooks included."""

    def __init__(self, lock, delay):
        self._inner, self.delay, self.slow = lock, delay, None

    def acquire(self, *args, **kwargs):
        if threading.current_thread() is self.slow:
            time.sleep(self.delay)
        return self._inner.acquire(*args, **kwargs)

    def release(self):
        self._inner.release()

    __enter__ = acquire

    def __exit__(self, *exc):
        self.release()

    def __getattr__(self, name):  # _is_owned, _release_save, _acquire_restore: threading.Condition's
        return getattr(self._inner, name)


def test_a_caller_waiting_for_the_lock_gets_it_before_the_engine_steps_again(path):
    """A caller knocking for the engine's lock ends a run of decode steps at its next step, and the engine starts no
    other step until that caller holds the lock, however late the caller takes it (a lock is not fair: the engine's
    thread, which just let it go, took it back at once, step after step, while the caller waited)."""
    engine = Engine(path, num_pages=64, decode_steps=200)
    engine._lock = SlowToTakeLock(engine._lock, delay=0.05)
    engine._work = threading.Condition(engine._lock)
    steps, step = [], engine._step

    def counted_step(*args):
        ran = step(*args)
        steps.append(ran)
        return ran

    engine._step = counted_step
    long = engine.submit([5, 6, 7, 8], SamplingParams(max_tokens=1000, ignore_eos=True))
    tokens = iter(long)
    for _ in range(3):
        next(tokens)
    held = {}

    def knock():
        before = len(steps)
        with engine._lock_soon():
            held["steps"] = len(steps) - before

    knocker = threading.Thread(target=knock)
    engine._lock.slow = knocker
    knocker.start()
    knocker.join(30)
    long.cancel()
    long.result(timeout=60)
    engine.close(10)
    # The run in progress when it knocked ends (one call of _step; two where a run began between the count and the
    # knock, which ends at its next step); none begins while it waits 50 ms for the lock (without that, the engine
    # ran some three hundred one-step runs meanwhile).
    assert held["steps"] <= 2, held


def test_submit_takes_a_list_of_one_sampling_params_as_generate_does(path, lone):
    engine = Engine(path, num_pages=16)
    assert engine.submit(PROMPTS[1], [SamplingParams(max_tokens=8)]).result(timeout=60) == lone[1]
    engine.close(timeout=30)


def test_cancelling_a_finished_request_leaves_the_others_decode_run_alone(path, lone):
    """A finished request's cancel does nothing: no knock that would end the running requests' run of decode steps
    early. And an engine's last_logprobs and last_logits read None before any generate."""
    engine = Engine(path, num_pages=16)
    try:
        assert engine.last_logprobs is None and engine.last_logits is None
        handle = engine.submit(PROMPTS[1], SamplingParams(max_tokens=8))
        assert handle.result(timeout=60) == lone[1]
        knocks = len(engine._cancelling)
        handle.cancel()
        assert len(engine._cancelling) == knocks and handle.finish_reason != "cancelled"
    finally:
        engine.close(timeout=30)


def test_a_raising_on_token_fails_its_own_call_alone(path, lone):
    """generate's callback raising fails that call (its exception, its other requests cancelled); the requests of
    other callers, running beside it or queued behind it, finish as they would alone, and no page is kept."""
    engine = Engine(path, num_pages=32, max_running=2)
    run = engine.runner.run

    def paced(feeds, *changed):  # every step long enough for the others to be queued beside the failing call
        time.sleep(0.01)
        return run(feeds, *changed)
    engine.runner.run = paced
    started = threading.Event()

    def callback(i, token):
        started.set()
        raise KeyError("the caller's own bug")

    beside = engine.submit(PROMPTS[1], SamplingParams(max_tokens=8, temperature=1.0, seed=5))
    errors = []
    caller = threading.Thread(target=lambda: errors.append(pytest.raises(
        KeyError, engine.generate, [PROMPTS[2], PROMPTS[3]], 8, on_token=callback,
        params=SamplingParams(temperature=1.0, seed=2))))
    caller.start()
    assert started.wait(60)
    queued = engine.submit(PROMPTS[3], SamplingParams(max_tokens=8))
    caller.join(timeout=60)
    assert errors and "the caller's own bug" in str(errors[0].value)
    alone = Engine(path, num_pages=32).submit(PROMPTS[1], SamplingParams(max_tokens=8, temperature=1.0, seed=5))
    assert beside.result(timeout=60) == alone.result(timeout=60) and beside.finish_reason == "length"
    assert queued.result(timeout=60) == lone[3] and queued.finish_reason == "length"
    engine.close(timeout=30)
    assert engine.metrics()["pages_in_use"] == 0


def test_generate_from_an_on_token_callback_is_refused_not_a_deadlock(path, lone):
    """A callback runs in the engine's thread: a generate there waited for steps only that thread runs, forever. It
    raises now, and as any on_token exception fails its own call alone; the engine goes on."""
    engine = Engine(path, num_pages=32)
    inner = []

    def callback(i, token):
        try:
            engine.generate([PROMPTS[0]], 2)
        except RuntimeError as error:
            inner.append(str(error))
            raise

    outer = []
    caller = threading.Thread(target=lambda: outer.append(pytest.raises(
        RuntimeError, engine.generate, [PROMPTS[1]], 4, on_token=callback)), daemon=True)
    caller.start()
    caller.join(timeout=60)
    assert not caller.is_alive(), "generate inside on_token deadlocked the engine"
    assert outer and "generate was called from the engine's own thread" in str(outer[0].value)
    assert len(inner) == 1
    assert engine.generate([PROMPTS[3]], 8)[0] == lone[3]
    engine.close(timeout=30)
    assert engine.metrics()["pages_in_use"] == 0


def test_close_during_generate_raises_in_it_rather_than_returning_short_answers(path):
    engine = Engine(path, num_pages=80)
    run = engine.runner.run

    def paced(feeds, *changed):
        time.sleep(0.005)
        return run(feeds, *changed)
    engine.runner.run = paced
    outcome, tokens = [], threading.Event()

    def call():
        try:
            outcome.append(engine.generate([PROMPTS[0]], 900, params=SamplingParams(ignore_eos=True, temperature=1.0,
                                                                                     seed=1),
                                           on_token=lambda i, t: tokens.set()))
        except RuntimeError as error:
            outcome.append(error)
    caller = threading.Thread(target=call)
    caller.start()
    assert tokens.wait(60)
    engine.close(timeout=30)
    caller.join(timeout=60)
    assert len(outcome) == 1 and isinstance(outcome[0], RuntimeError), outcome
    assert "closed while generate ran" in str(outcome[0])


def test_close_reads_the_engine_thread_once_under_its_lock(path):
    """The engine's thread sets _thread to None as it ends: close read it twice, outside the lock, and could join
    None. Each read here yields to the other threads (a switch a busy machine makes at random)."""
    class SlowToRead(Engine):
        @property
        def _thread(self):
            value = self.__dict__.get("_thread_value")
            time.sleep(0.01)
            return value

        @_thread.setter
        def _thread(self, value):
            self.__dict__["_thread_value"] = value

    engine = SlowToRead(path, num_pages=16)
    assert engine.generate([[1, 2, 3]], 2)
    engine.close(timeout=30)
    assert engine.__dict__["_thread_value"] is None


def test_a_request_submitted_to_an_idle_engine_wakes_its_thread(path, monkeypatch):
    """The idle background thread waits on the engine's condition and is woken by the submission itself, not by its
    periodic look (made an hour here, so a missed wake-up fails the wait below rather than passing late)."""
    from kvcache_op.serving import online

    monkeypatch.setattr(online, "_IDLE_LOOK_SECONDS", 3600.0)
    engine = Engine(path, num_pages=16)
    engine.submit([5, 6, 7], SamplingParams(max_tokens=2)).result(timeout=60)  # the thread now exists
    for _ in range(3):
        time.sleep(0.2)  # the thread has gone idle: waiting on the condition
        assert len(engine.submit([5, 6, 7], SamplingParams(max_tokens=1)).result(timeout=60)) == 1
    engine.close(timeout=30)
