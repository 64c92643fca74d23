"""A manager's plan as the feeds of an exported decoder's step (serving/step_feeds.py), checked against the plan by
hand: the fed tokens in order, the count of leading one-token sequences, the page tables cut to the columns in use."""

import numpy as np

from kvcache_op.manager import KVCacheManager
from kvcache_op.serving.step_feeds import step_feeds


def fed_in_order(plan) -> list:
    return [t for rid in plan.request_ids for t in plan.fed_tokens[rid]]


def check_feeds(plan, decodes: int) -> dict:
    feeds = step_feeds(plan)
    assert all(v.dtype == np.int64 and v.flags.c_contiguous for v in feeds.values())
    assert feeds["input_ids"].tolist() == fed_in_order(plan)
    assert int(feeds["decoding_batches"]) == decodes and feeds["decoding_batches"].ndim == 0
    table = np.asarray(plan.cachestarts)
    used = max([c + 1 for row in table.tolist() for c, slot in enumerate(row) if slot >= 0], default=0)
    assert feeds["cachestarts"].shape == (len(plan.request_ids), max(used, 1))
    np.testing.assert_array_equal(feeds["cachestarts"], table[:, :max(used, 1)])
    return feeds


def test_a_mixed_step_counts_its_leading_decodes_and_cuts_the_page_tables():
    m = KVCacheManager(num_pages=32, page_size=4, max_pages=8, vocab_size=100)
    for rid, prompt in (("a", list(range(9))), ("b", [5, 6]), ("c", list(range(20, 27)))):
        m.add_request(rid, prompt)
    m.commit(m.schedule({"a": list(range(9)), "b": [5, 6]}))
    plan = m.schedule({"a": [40], "b": [41], "c": list(range(20, 25))})  # two decodes, then a prefill chunk
    feeds = check_feeds(plan, decodes=2)
    assert feeds["cachestarts"].shape[1] == 3  # a: 10 positions in 3 pages of 4
    m.commit(plan)
    plan = m.schedule_decode(["a", "b"], np.array([42, 43]))  # decodes alone
    check_feeds(plan, decodes=2)


def test_a_prefill_first_has_no_leading_decodes():
    m = KVCacheManager(num_pages=8, page_size=4, max_pages=4, vocab_size=100)
    m.add_request("x", [1, 2, 3])
    m.add_request("y", [4])
    check_feeds(m.schedule({"x": [1, 2, 3], "y": [4]}), decodes=0)
