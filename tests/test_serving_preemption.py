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


@pytest.mark.parametrize("mode, tight_pages", [(None, 20), ("shift", 14), ("reevaluate", 14)])
def test_tokens_do_not_depend_on_the_pool_or_the_step_budget(mode, tight_pages):
    ample, none_preempted = _serve(mode, 512, 256)
    assert not none_preempted
    tight, preempted_at = _serve(mode, tight_pages, 8)
    assert preempted_at, "the tight pool preempted nothing: the test would prove nothing"
    if mode is not None:  # at least one request was preempted after its cache had discarded pages
        assert max(preempted_at) > POLICY["budget_pages"] * PAGE, preempted_at
    assert tight == ample
