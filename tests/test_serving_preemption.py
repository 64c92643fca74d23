"""Preemption loses nothing: the same prompts give the same tokens at ample and tight pool sizes and at any
step token budget, with and without StreamingLLM (shift and re-evaluate), including requests preempted after
their cache had already discarded pages."""

import numpy as np
import pytest

pytest.importorskip("torch")  # kvcache_op.hf imports it
pytest.importorskip("transformers")

import hf_models  # noqa: E402
from kvcache_op.manager import StreamingPolicy  # noqa: E402
from kvcache_op.serving import Engine  # noqa: E402

PAGE = 4
POLICY = dict(sinks=4, budget_pages=6)  # 24 slots: every request's context outgrows it


def _prompts():
    rng = np.random.default_rng(0)
    prefix = rng.integers(1, 300, 9).tolist()
    return [prefix + rng.integers(1, 300, 12 + i % 4).tolist() for i in range(8)]


def _serve(mode, num_pages, max_batch_tokens):
    """The tokens of 40 new tokens per prompt, and the context length of each request when it was preempted."""
    streaming = None if mode is None else StreamingPolicy(mode=mode, **POLICY)
    engine = Engine(hf_models.exported("llama", page_size=PAGE), num_pages=num_pages,
                    max_batch_tokens=max_batch_tokens, streaming=streaming, intra_op_num_threads=1)
    preempted_at, preempt = [], engine._preempt

    def recording_preempt(q, waiting):
        if q.ran:
            preempted_at.append(len(q.context))
        preempt(q, waiting)

    engine._preempt = recording_preempt
    tokens = engine.generate(_prompts(), 40)
    engine.manager.check()
    return tokens, preempted_at


# A "reevaluate" step's budget counts the kept tokens a discard feeds again: at 8 tokens a step its requests fit
# 14 pages without a preemption after a discard, 15 pages at 12 tokens a step preempt one at 30 positions.
@pytest.mark.parametrize("mode, tight_pages, tight_budget", [(None, 20, 8), ("shift", 14, 8), ("reevaluate", 15, 12)])
def test_tokens_do_not_depend_on_the_pool_or_the_step_budget(mode, tight_pages, tight_budget):
    ample, none_preempted = _serve(mode, 512, 256)
    assert not none_preempted
    tight, preempted_at = _serve(mode, tight_pages, tight_budget)
    assert preempted_at, "the tight pool preempted nothing: the test would prove nothing"
    if mode is not None:  # at least one request was preempted after its cache had discarded pages
        assert max(preempted_at) > POLICY["budget_pages"] * PAGE, preempted_at
    assert tight == ample


@pytest.fixture(scope="module")
def tight_run():
    """One run on a tight pool, recording each admission ("admit", index) and each preemption ("preempt", index,
    the indices still running, those waiting, whether it had run a step), and the engine's metrics after."""
    engine = Engine(hf_models.exported("llama", page_size=PAGE), num_pages=20, max_batch_tokens=8,
                    intra_op_num_threads=1)
    events, add, preempt = [], engine.manager.add_request, engine._preempt

    def recording_add(index, *args):
        events.append(("admit", index))
        return add(index, *args)

    def recording_preempt(q, waiting):
        events.append(("preempt", q.index, [r.index for r in engine._online_running],
                       [w.index for w in waiting], q.ran))
        preempt(q, waiting)

    engine.manager.add_request, engine._preempt = recording_add, recording_preempt
    engine.generate(_prompts(), 40)
    preemptions = [e for e in events if e[0] == "preempt"]
    assert preemptions, "nothing was preempted: the tests would prove nothing"
    return events, preemptions, engine.metrics()


def test_the_most_recently_admitted_request_is_preempted(tight_run):
    """The oldest requests, furthest along, keep their pages; the one admitted last goes back (vLLM's recompute
    policy too)."""
    events, preemptions, _ = tight_run
    assert any(p[2] for p in preemptions), "no preemption left others running: the test would prove nothing"
    for preemption in preemptions:
        at = events.index(preemption)
        last = {e[1]: i for i, e in enumerate(events[:at]) if e[0] == "admit"}
        victim, others = preemption[1], preemption[2]
        assert all(last[victim] > last[o] for o in others), (victim, others)


def test_the_preemption_count_is_of_requests_that_had_run(tight_run):
    """A request sent back before it ran a step (admitted, then out of pages when the step is planned) lost nothing:
    no preemption in metrics()."""
    _, preemptions, metrics = tight_run
    ran = sum(e[4] for e in preemptions)
    assert ran and ran < len(preemptions), "the run needs both kinds of preemption to prove anything"
    assert metrics["preemptions"] == ran


def test_a_preempted_request_goes_back_first_in_line(tight_run):
    """A preempted request is recomputed before the requests that were waiting when it was preempted (they arrived
    later); at the back of the line it would wait behind all of them."""
    events, preemptions, _ = tight_run
    checked = 0
    for preemption in preemptions:
        victim, behind = preemption[1], set(preemption[3])
        if not behind:
            continue
        later = [e[1] for e in events[events.index(preemption) + 1:]
                 if e[0] == "admit" and (e[1] == victim or e[1] in behind)]
        assert later and later[0] == victim, (victim, sorted(behind), later[:3])
        checked += 1
    assert checked, "no request was preempted while others waited: the test would prove nothing"
