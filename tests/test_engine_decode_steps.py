"""Decode steps planned at once (``Engine(decode_steps=...)``): the same tokens as one step at a time and as
transformers, runs that really span several steps (and pages), through the host's loop (sampled requests) and
through the graph's own greedy choice (plain greedy requests), failures inside a run that lose nothing, and runs
that end early for a caller queueing requests or a cancellation."""

import time

import numpy as np
import pytest

pytest.importorskip("torch")  # kvcache_op.hf imports it
pytest.importorskip("transformers")

import hf_models  # noqa: E402
from kvcache_op.hf.verify import reference_generate  # noqa: E402
from kvcache_op.manager import OutOfPages  # noqa: E402
from kvcache_op.serving import Engine, SamplingParams  # noqa: E402
from kvcache_op.serving.workload import shared_prefix_workload  # noqa: E402

NEW_TOKENS = 20
WORKLOAD = dict(count=10, vocab_size=384, seed=3)


def counting_advances(engine) -> list:
    """Records how many planned steps every ``advance`` moves on (one per row of tokens)."""
    calls, advance = [], engine.manager.advance

    def spy(plan, tokens):
        calls.append(len(tokens) if np.ndim(tokens) == 2 else 1)
        return advance(plan, tokens)

    engine.manager.advance = spy
    return calls


def counting_graph_steps(engine) -> list:
    """Records every step run through the graph's greedy choice (:class:`GreedySteps`): the run's index, per step."""
    stepper, runs = engine.runner.greedy_steps(), []
    start, step = stepper.start, stepper.step

    def counted_start(feeds, leading=None):
        runs.append(0)
        return start(feeds, leading)

    def counted_step():
        runs[-1] += 1
        return step()

    stepper.start, stepper.step = counted_start, counted_step
    return runs


@pytest.mark.parametrize("decode_steps", [3, 8])
def test_tokens_equal_one_step_at_a_time_and_transformers(decode_steps):
    path, workload = hf_models.exported("llama"), shared_prefix_workload(**WORKLOAD)
    sampled = [SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, top_k=20, seed=i) if i % 2 else SamplingParams()
               for i in range(len(workload.prompts))]
    results = {}
    for steps in (1, decode_steps):
        engine = Engine(path, num_pages=24, max_running=6, decode_steps=steps)
        advances = counting_advances(engine)
        results[steps] = engine.generate(workload.prompts, NEW_TOKENS, salts=workload.salts, params=sampled,
                                         arrival_steps=workload.arrival_steps)
        engine.manager.check()
        assert not engine.manager.requests and engine.metrics()["pages_in_use"] == 0
        assert (sum(advances) > 20) == (steps > 1), advances  # runs of several steps happened, or none
    assert results[1] == results[decode_steps]
    model = hf_models.model("llama")
    for i in range(0, len(workload.prompts), 2):  # the greedy ones
        assert results[decode_steps][i] == reference_generate(model, workload.prompts[i], NEW_TOKENS), f"request {i}"


#: Greedy requests with logprobs take the host's loop; plain greedy ones the graph's own choice. The same tokens.
PATHS = {"host": SamplingParams(max_tokens=NEW_TOKENS, logprobs=1), "graph": SamplingParams(max_tokens=NEW_TOKENS)}


@pytest.mark.parametrize("path_kind", PATHS)
def test_a_run_failing_inside_planned_steps_rolls_them_back_and_the_engine_recovers(monkeypatch, path_kind):
    path, workload = hf_models.exported("llama"), shared_prefix_workload(**WORKLOAD)
    engine = Engine(path, num_pages=24, decode_steps=8)
    advances, graph_runs = counting_advances(engine), counting_graph_steps(engine)
    stepper = engine.runner.greedy_steps()
    real_run, real_step = engine.runner.run, stepper.step

    def failing_run(feeds, *changed):
        if len(advances) == 5:  # the sixth step of a planned run (its first came from schedule_decode)
            raise RuntimeError("device lost")
        return real_run(feeds, *changed)

    def failing_step():
        if graph_runs[-1] == 6:  # the sixth step of a run (the counter counts this call)
            raise RuntimeError("device lost")
        return real_step()

    monkeypatch.setattr(engine.runner, "run", failing_run)
    monkeypatch.setattr(stepper, "step", failing_step)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.generate(workload.prompts[:3], NEW_TOKENS, params=PATHS[path_kind])
    assert (len(graph_runs) > 0) == (path_kind == "graph")
    engine.manager.check()
    assert not engine.manager.requests and engine.metrics()["pages_in_use"] == 0
    monkeypatch.setattr(engine.runner, "run", real_run)
    monkeypatch.setattr(stepper, "step", real_step)
    tokens = engine.generate(workload.prompts[:3], NEW_TOKENS, params=PATHS[path_kind])
    model = hf_models.model("llama")
    assert tokens == [reference_generate(model, p, NEW_TOKENS) for p in workload.prompts[:3]]


@pytest.mark.parametrize("path_kind", PATHS)
def test_a_raising_callback_inside_planned_steps_keeps_what_ran_and_leaves_the_manager_usable(path_kind):
    path, workload = hf_models.exported("llama"), shared_prefix_workload(**WORKLOAD)
    engine = Engine(path, num_pages=24, decode_steps=8)
    graph_runs, seen = counting_graph_steps(engine), []

    def on_token(i, token):
        seen.append(token)
        if len(seen) == 2 * 5:  # within the first planned run (the prompts' first tokens came from their prefill)
            raise ValueError("the client went away")

    with pytest.raises(ValueError, match="client went away"):
        engine.generate(workload.prompts[:2], NEW_TOKENS, on_token=on_token, params=PATHS[path_kind])
    assert (len(graph_runs) > 0) == (path_kind == "graph")
    engine.manager.check()
    assert not engine.manager.requests and engine.metrics()["pages_in_use"] == 0
    tokens = engine.generate(workload.prompts[:2], NEW_TOKENS)
    model = hf_models.model("llama")
    assert tokens == [reference_generate(model, p, NEW_TOKENS) for p in workload.prompts[:2]]


def test_graph_chosen_runs_past_a_page_give_the_host_loops_tokens_and_transformers():
    """Runs of greedy decode steps longer than a page (several pages taken at once) through the graph's own choice:
    the same tokens as one step at a time, as the host's loop, and as transformers, requests ending (and giving back
    the pages of the steps they did not run) at different steps; the trace counts every step."""
    path, workload = hf_models.exported("llama"), shared_prefix_workload(**WORKLOAD)
    page = Engine(path, num_pages=64, decode_steps=1).info.page_size
    lengths = [page * 2 + 7 + 3 * i for i in range(4)]
    prompts = workload.prompts[:4]
    results, steps_run = {}, {}
    for kind, steps, params in (("one", 1, None), ("host", 40, [SamplingParams(max_tokens=n, logprobs=1) for n in lengths]),
                                ("graph", 40, None)):
        engine = Engine(path, num_pages=64, decode_steps=steps, trace_steps=True)
        graph_runs = counting_graph_steps(engine)
        params = params or [SamplingParams(max_tokens=n) for n in lengths]
        with engine._lock:  # queued together (submit sets each request's own max_tokens; generate one for all)
            handles = [engine.submit(prompt, p) for prompt, p in zip(prompts, params)]
        results[kind] = [handle.result(timeout=120) for handle in handles]
        engine.close(timeout=60)
        engine.manager.check()
        assert not engine.manager.requests and engine.metrics()["pages_in_use"] == 0
        steps_run[kind] = engine.metrics()["steps"]
        assert steps_run[kind] == len(engine.step_trace) == steps_run["one"]  # every step counted, as one at a time
        assert (max(graph_runs, default=0) > page) == (kind == "graph"), graph_runs
    assert results["one"] == results["host"] == results["graph"]
    model = hf_models.model("llama")
    for prompt, n, tokens in zip(prompts, lengths, results["graph"]):
        assert tokens == reference_generate(model, prompt, n)


def test_prompts_last_chunks_lead_graph_runs_with_the_tokens_of_one_step_at_a_time():
    """A step that ends prompts (chunked ones, prefix hits, late arrivals beside running decodes) is planned with
    the decode steps after it and runs first in the graph's run, its chosen tokens feeding the next step in place:
    the same tokens, steps and fed tokens as one step at a time, and as transformers; where the pages for the steps
    run short, the step is planned alone."""
    path, workload = hf_models.exported("llama"), shared_prefix_workload(**WORKLOAD)
    arrivals = [12 * (i // 2) for i in range(len(workload.prompts))]  # pairs, while others decode
    results, metrics, led = {}, {}, []
    for steps, pages in ((1, 40), (8, 40), (8, 9)):
        engine = Engine(path, num_pages=pages, max_running=4, max_batch_tokens=24, decode_steps=steps)
        graph_runs, schedule = counting_graph_steps(engine), engine.manager.schedule
        leading_starts, start = [], engine.runner.greedy_steps().start

        def spied_start(feeds, leading=None, start=start, leading_starts=leading_starts):
            leading_starts.append(leading is not None)
            return start(feeds, leading)

        def spied_schedule(feeds, steps=1, schedule=schedule, engine=engine):
            try:
                plan = schedule(feeds, steps)
            except OutOfPages:
                led.append((engine.num_pages, steps, "out of pages"))
                raise
            led.append((engine.num_pages, steps, "planned"))
            return plan

        engine.runner.greedy_steps().start, engine.manager.schedule = spied_start, spied_schedule
        results[steps, pages] = engine.generate(workload.prompts, NEW_TOKENS, salts=workload.salts,
                                                arrival_steps=arrivals)
        m = engine.metrics()
        metrics[steps, pages] = (m["steps"], m["fed_tokens"], m["generated_tokens"])
        engine.manager.check()
        assert not engine.manager.requests and m["pages_in_use"] == 0
        if steps > 1 and pages == 40:
            assert sum(leading_starts) >= 3, leading_starts  # several runs began with a prompt's last chunk
    assert results[1, 40] == results[8, 40] == results[8, 9]
    assert metrics[1, 40] == metrics[8, 40], metrics  # every step of a led run counted, as one at a time
    short = [(steps, outcome) for pages, steps, outcome in led if pages == 9]  # led steps were planned, and where
    # their pages ran short the step alone was
    assert (8, "planned") in short or (7, "planned") in short, short
    fell_back = [j for j, (steps, outcome) in enumerate(short) if steps > 1 and outcome == "out of pages"]
    assert fell_back and all(short[j + 1] == (1, "planned") for j in fell_back), short
    model = hf_models.model("llama")
    for prompt, tokens in zip(workload.prompts, results[8, 40]):
        assert tokens == reference_generate(model, prompt, NEW_TOKENS)


def hold_until_interrupted(engine, runs, at_step, timeout=30.0):
    """Makes the first graph run wait, once it has run ``at_step`` steps, until a caller interrupts it (knocks for the
    lock or cancels), at most ``timeout`` seconds: a tiny model's steps take a fraction of a millisecond, so without it the
    run could end before the test's thread, woken by the OS, gets to interrupt it. ``runs``: what
    :func:`counting_graph_steps` counts."""
    stepper = engine.runner.greedy_steps()
    step = stepper.step

    def held_step():
        if len(runs) == 1 and runs[0] == at_step:
            deadline = time.monotonic() + timeout
            while not engine._interrupted() and time.monotonic() < deadline:
                time.sleep(0.001)
        return step()

    stepper.step = held_step


@pytest.mark.parametrize("interruption", ["submit", "cancel", "metrics"])
def test_a_caller_queueing_cancelling_or_reading_metrics_ends_a_long_run_at_its_next_step(interruption):
    """A run of many decode steps holds the engine: a request submitted, a cancellation, or a ``metrics()`` call while
    it runs ends it at its next step (the newcomer's first token comes long before the running request's last one;
    the cancelled request stops long before its end; the metrics do not wait for the run)."""
    path = hf_models.exported("llama")
    engine = Engine(path, num_pages=64, decode_steps=200)
    graph_runs, total = counting_graph_steps(engine), engine.decode_steps
    hold_until_interrupted(engine, graph_runs, at_step=5)
    first = engine.submit([5, 6, 7, 8], SamplingParams(max_tokens=total, ignore_eos=True))
    tokens = iter(first)
    for _ in range(3):  # the long run has begun
        next(tokens)
    if interruption == "submit":
        second = engine.submit([9, 10, 11], SamplingParams(max_tokens=4, ignore_eos=True))
        second.result(timeout=60)
        first.result(timeout=60)
        assert second.token_times[0] < first.token_times[total // 2], "the newcomer waited for the long run"
        assert first.result() == engine.generate([[5, 6, 7, 8]], total, params=SamplingParams(max_tokens=total,
                                                                                          ignore_eos=True))[0]
    elif interruption == "cancel":
        first.cancel()
        first.result(timeout=60)
        assert first.finish_reason == "cancelled" and len(first.tokens) < total // 2, len(first.tokens)
    else:
        assert engine.metrics()["generated_tokens"] < total // 2
        first.result(timeout=60)
    assert graph_runs[0] < total // 2, graph_runs  # the run that was going ended early
    engine.close(timeout=60)
    assert engine.metrics()["pages_in_use"] == 0


def test_decode_steps_are_checked_and_off_where_pages_move():
    path = hf_models.exported("llama")
    for bad in (0, -1):
        with pytest.raises(ValueError, match="decode_steps"):
            Engine(path, num_pages=8, decode_steps=bad)
    for bad in (2.5, True, "4"):
        with pytest.raises(TypeError, match="decode_steps"):
            Engine(path, num_pages=8, decode_steps=bad)
    engine = Engine(path, num_pages=8, decode_steps=10**6)
    assert engine.decode_steps == engine.manager.max_pages * engine.info.page_size  # at most a page table
    assert Engine(hf_models.exported("mistral"), num_pages=8, decode_steps=8).decode_steps == 1  # a window


def test_planned_steps_bind_as_a_device_session_binds():
    """A device session binds every input afresh each step (``bind_cpu_input``), which takes int64 arrays only (a
    numpy scalar is refused): the runner's device path, run here over the CPU EP, gives the same tokens planning
    steps ahead as one at a time."""
    path, prompts = hf_models.exported("llama"), [[1, 2, 3, 4, 5], [9, 8, 7]]
    results = []
    for steps in (1, 4):
        engine = Engine(path, num_pages=24, decode_steps=steps)
        engine.runner.device = ("cuda", 0)  # the binding path of a device session; the session stays on the CPU
        results.append(engine.generate(prompts, 10))
    assert results[0] == results[1]


@pytest.mark.parametrize("path_kind", PATHS)
def test_a_raising_callback_in_planned_steps_fails_its_call_at_once_and_no_other_callers(path_kind):
    """Inside a run of planned decode steps (the host's loop, or the graph's own choice), one generate call's callback
    raises for its second request: the call raises at once (its first request does not run on to its end), and a
    request another caller submitted, running in the same steps, gets its lone tokens."""
    import threading

    path, workload = hf_models.exported("llama"), shared_prefix_workload(**WORKLOAD)
    engine = Engine(path, num_pages=64, decode_steps=8)
    long = 400
    params = SamplingParams(max_tokens=long, ignore_eos=True, logprobs=PATHS[path_kind].logprobs)
    beside = engine.submit(workload.prompts[2], SamplingParams(max_tokens=NEW_TOKENS))
    counts = [0, 0]

    def on_token(i, token):
        counts[i] += 1
        if i == 1 and counts[1] == 5:  # a planned run's token (the first came from the prefill)
            raise ValueError("the client went away")

    caller = []
    thread = threading.Thread(target=lambda: caller.append(pytest.raises(
        ValueError, engine.generate, workload.prompts[:2], long, on_token=on_token, params=params)))
    thread.start()
    thread.join(timeout=120)
    assert caller and "client went away" in str(caller[0].value)
    assert counts[0] < long // 2, counts  # cancelled with its call, not waited for
    model = hf_models.model("llama")
    assert beside.result(timeout=60) == reference_generate(model, workload.prompts[2], NEW_TOKENS)
    engine.close(timeout=30)
    engine.manager.check()
    assert not engine.manager.requests and engine.metrics()["pages_in_use"] == 0


@pytest.mark.parametrize("interruption", ["submit", "cancel"])
def test_a_host_run_of_decode_steps_ends_at_its_next_step_when_interrupted(interruption):
    """Requests that are not plain greedy (here: logprobs) run their decode steps in the host's loop, one session
    run a step; a request submitted or a cancellation while such a run goes on ends it at its next step too. The
    run's fifth session run waits until the engine sees the interruption (or the test has made it already, should
    the run have ended before), so the test does not race the run."""
    import threading

    engine = Engine(hf_models.exported("llama"), num_pages=64, decode_steps=200)
    total, runs, run, acted = engine.decode_steps, [0], engine.runner.run, threading.Event()

    def held_run(*args):
        runs[0] += 1
        if runs[0] == 5:
            deadline = time.monotonic() + 60
            while not (engine._interrupted() or acted.is_set()) and time.monotonic() < deadline:
                time.sleep(0.001)
        return run(*args)

    engine.runner.run = held_run
    host = SamplingParams(max_tokens=total, ignore_eos=True, logprobs=1)
    first = engine.submit([5, 6, 7, 8], host)
    tokens = iter(first)
    for _ in range(3):  # the run has begun
        next(tokens)
    if interruption == "submit":
        second = engine.submit([9, 10, 11], SamplingParams(max_tokens=2, ignore_eos=True, logprobs=1))
        acted.set()
        second.result(timeout=60)
        first.result(timeout=60)
        assert second.token_times[0] < first.token_times[total // 2], "the newcomer waited for the long run"
    else:
        first.cancel()
        acted.set()
        first.result(timeout=60)
        assert first.finish_reason == "cancelled" and len(first.tokens) < total // 2, len(first.tokens)
    engine.close(timeout=60)
    assert engine.metrics()["pages_in_use"] == 0
