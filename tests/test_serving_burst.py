"""Requests that arrive together share their common prefix: a burst of requests with one system prompt feeds
about what the same requests fed when the first arrived earlier (its prompt then published before the others
came), with the same tokens; requests with different first pages, or salts, are not held back."""

import numpy as np
import pytest

pytest.importorskip("torch")  # kvcache_op.hf imports it
pytest.importorskip("transformers")

import hf_models  # noqa: E402
from kvcache_op.serving import Engine  # noqa: E402

SYSTEM = list(np.random.default_rng(3).integers(0, 300, 128))
PROMPTS = [SYSTEM + list(np.random.default_rng(10 + i).integers(0, 300, 8)) for i in range(12)]


def served(arrivals, salts=None, prompts=PROMPTS):
    engine = Engine(hf_models.exported("llama"), num_pages=64)
    tokens = engine.generate(prompts, 4, salts=salts, arrival_steps=arrivals)
    return tokens, engine.metrics()


def test_a_burst_feeds_about_what_a_staggered_arrival_feeds_with_the_same_tokens():
    burst, burst_metrics = served([0] * len(PROMPTS))
    staggered, staggered_metrics = served([0] + [2] * (len(PROMPTS) - 1))
    assert burst == staggered
    assert burst_metrics["fed_tokens"] <= 1.1 * staggered_metrics["fed_tokens"]
    # without the deferral every request would compute the 128 shared tokens: 12 x 136 prompt tokens fed
    assert burst_metrics["fed_tokens"] < 0.5 * len(PROMPTS) * len(PROMPTS[0])
    assert burst_metrics["prefix_hit_tokens"] >= (len(PROMPTS) - 1) * 128
    # the followers wait for the shared prompt only, then join together (not one request per step)
    assert burst_metrics["steps"] <= staggered_metrics["steps"] + 1


def test_salted_requests_do_not_wait_for_each_other():
    """A different salt is another tenant's prefix cache: nothing to share, so nobody is held back (each
    computes its own prompt, as without the deferral)."""
    _, metrics = served([0] * 4, salts=["a", "b", "c", "d"], prompts=PROMPTS[:4])
    assert metrics["prefix_hit_tokens"] == 0
    assert metrics["fed_tokens"] >= 4 * len(PROMPTS[0])


@pytest.mark.parametrize("system_tokens", [128, 144])  # leaders of 8 and 9 chunks: an even and an odd number of waits
def test_requests_waiting_for_a_leaders_prefix_are_admitted_in_arrival_order(system_tokens):
    """Requests held back while the first computes their shared prefix go back first in line in their own order;
    reversed at every step they wait, one that came later would run first. One running place beside the leader, so
    admissions come one by one."""
    system = SYSTEM[:system_tokens] + list(np.random.default_rng(4).integers(0, 300, max(0, system_tokens - 128)))
    prompts = [system + list(np.random.default_rng(10 + i).integers(0, 300, 8)) for i in range(4)]
    engine = Engine(hf_models.exported("llama"), num_pages=64, max_running=2, max_batch_tokens=16)
    admitted, add = [], engine.manager.add_request

    def recording_add(index, *args):
        admitted.append(index)
        return add(index, *args)

    engine.manager.add_request = recording_add
    engine.generate(prompts, 3, arrival_steps=[0] * len(prompts))
    first_admissions = list(dict.fromkeys(admitted))
    assert len(first_admissions) == len(prompts) and first_admissions == sorted(first_admissions), admitted
