"""Decode steps planned at once (``Engine(decode_steps=...)``): the same tokens as one step at a time and as
transformers, runs that really span several steps, and failures inside a run that lose nothing."""

import pytest

pytest.importorskip("transformers")

import hf_models  # noqa: E402
from kvcache_op.hf.verify import reference_generate  # noqa: E402
from kvcache_op.serving import Engine, SamplingParams  # noqa: E402
from kvcache_op.serving.workload import shared_prefix_workload  # noqa: E402

NEW_TOKENS = 20
WORKLOAD = dict(count=10, vocab_size=384, seed=3)


def counting_advances(engine) -> list:
    """Records the batch size of every ``advance`` (a step planned ahead that ran)."""
    calls, advance = [], engine.manager.advance

    def spy(plan, tokens):
        calls.append(len(tokens))
        return advance(plan, tokens)

    engine.manager.advance = spy
    return calls


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
        assert (len(advances) > 20) == (steps > 1), len(advances)  # runs of several steps happened, or none
    assert results[1] == results[decode_steps]
    model = hf_models.model("llama")
    for i in range(0, len(workload.prompts), 2):  # the greedy ones
        assert results[decode_steps][i] == reference_generate(model, workload.prompts[i], NEW_TOKENS), f"request {i}"


def test_a_run_failing_inside_planned_steps_rolls_them_back_and_the_engine_recovers(monkeypatch):
    path, workload = hf_models.exported("llama"), shared_prefix_workload(**WORKLOAD)
    engine = Engine(path, num_pages=24, decode_steps=8)
    advances, real_run = counting_advances(engine), engine.runner.run

    def failing_run(feeds, *changed):
        if len(advances) == 5:  # the sixth step of a planned run (its first came from schedule_decode)
            raise RuntimeError("device lost")
        return real_run(feeds, *changed)

    monkeypatch.setattr(engine.runner, "run", failing_run)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.generate(workload.prompts[:3], NEW_TOKENS)
    engine.manager.check()
    assert not engine.manager.requests and engine.metrics()["pages_in_use"] == 0
    monkeypatch.setattr(engine.runner, "run", real_run)
    tokens = engine.generate(workload.prompts[:3], NEW_TOKENS)
    model = hf_models.model("llama")
    assert tokens == [reference_generate(model, p, NEW_TOKENS) for p in workload.prompts[:3]]


def test_a_raising_callback_inside_planned_steps_keeps_what_ran_and_leaves_the_manager_usable():
    path, workload = hf_models.exported("llama"), shared_prefix_workload(**WORKLOAD)
    engine = Engine(path, num_pages=24, decode_steps=8)
    advances, seen = counting_advances(engine), []

    def on_token(i, token):
        seen.append(token)
        if len(advances) == 3:
            raise ValueError("the client went away")

    with pytest.raises(ValueError, match="client went away"):
        engine.generate(workload.prompts[:2], NEW_TOKENS, on_token=on_token)
    engine.manager.check()
    assert not engine.manager.requests and engine.metrics()["pages_in_use"] == 0
    tokens = engine.generate(workload.prompts[:2], NEW_TOKENS)
    model = hf_models.model("llama")
    assert tokens == [reference_generate(model, p, NEW_TOKENS) for p in workload.prompts[:2]]


def test_decode_steps_are_checked_and_off_where_pages_move():
    path = hf_models.exported("llama")
    for bad in (0, -1):
        with pytest.raises(ValueError, match="decode_steps"):
            Engine(path, num_pages=8, decode_steps=bad)
    for bad in (2.5, True, "4"):
        with pytest.raises(TypeError, match="decode_steps"):
            Engine(path, num_pages=8, decode_steps=bad)
    assert Engine(path, num_pages=8, decode_steps=100).decode_steps == 16  # at most a page
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
