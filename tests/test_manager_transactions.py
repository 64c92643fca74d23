"""Steps are transactions: pages are published for prefix reuse only on commit; abort rolls a step back;
a failing call (bad salt, bad token, out of pages) changes nothing."""

import pytest

from kvcache_op.manager import KVCacheManager, OutOfPages
from manager_checks import manager_state as state


def test_a_step_that_never_ran_is_never_served_as_a_prefix():
    m = KVCacheManager(16, 4, 8)
    m.add_request("a", list(range(9)))
    plan = m.schedule({"a": list(range(9))})  # the op is never run for this plan
    assert m.add_request("x", list(range(9))) == 0, "pages of an uncommitted step were offered"
    m.abort(plan)
    m.finish("a")
    assert m.add_request("b", list(range(9))) == 0, "pages of an aborted step were offered as a prefix"
    m.check()


def test_commit_publishes_the_full_pages():
    m = KVCacheManager(16, 4, 8)
    m.add_request("a", list(range(9)))
    m.commit(m.schedule({"a": list(range(9))}))
    assert m.add_request("b", list(range(9))) == 8


def test_abort_restores_the_manager_exactly():
    m = KVCacheManager(16, 4, 8, sliding_window=5)
    m.add_request("a", list(range(6)))
    m.add_request("b", list(range(3)))
    m.commit(m.schedule({"a": list(range(6)), "b": [0, 1]}))
    before = state(m)
    plan = m.schedule({"a": [7, 7, 7, 7, 7], "b": [2]})  # a releases a page (window) and takes new ones
    assert state(m) != before
    m.abort(plan)
    assert state(m) == before
    replay = m.schedule({"a": [7, 7, 7, 7, 7], "b": [2]})  # the same step plans the same way again
    assert (replay.cachestarts == plan.cachestarts).all() and (replay.start_pos == plan.start_pos).all()


def test_one_step_is_outstanding_at_a_time():
    m = KVCacheManager(16, 4, 8)
    m.add_request("a", [1, 2, 3])
    plan = m.schedule({"a": [1]})
    with pytest.raises(RuntimeError, match="outstanding"):
        m.schedule({"a": [2]})
    with pytest.raises(RuntimeError, match="outstanding"):
        m.finish("a")
    m.commit(plan)
    with pytest.raises(ValueError, match="not the outstanding step"):
        m.commit(plan)
    with pytest.raises(ValueError, match="not the outstanding step"):
        m.abort(plan)


def test_reset_prefix_cache_forgets_every_published_page():
    m = KVCacheManager(16, 4, 8)
    m.add_request("a", list(range(9)))
    m.commit(m.schedule({"a": list(range(9))}))
    m.add_request("live", list(range(13)))
    m.commit(m.schedule({"live": list(range(8, 13))}))
    m.finish("a")
    m.add_request("c", list(range(50, 59)))
    m.commit(m.schedule({"c": list(range(50, 59))}))
    m.finish("c")  # two full pages nobody holds: cached
    assert m.metrics()["pages_cached"] == 2
    m.reset_prefix_cache()
    assert not m.index.by_hash and not m.pool.cached
    assert m.metrics()["pages_free"] == 16 - m.metrics()["pages_in_use"]
    assert m.add_request("b", list(range(9))) == 0
    m.check()


def test_pages_a_live_request_computes_after_a_reset_are_not_published_either():
    """A reset ends every live request's chain: pages it computes afterwards follow pages nobody can find, so
    they are not offered to others."""
    m = KVCacheManager(16, 2, 8)
    prompt = [1, 2, 3, 4, 5]
    m.add_request("a", prompt)
    m.reset_prefix_cache()
    m.commit(m.schedule({"a": prompt}))
    assert m.add_request("b", prompt) == 0
    m.check()


@pytest.mark.parametrize("bad", [
    {"salt": 1}, {"salt": True}, {"salt": 1.0}, {"salt": ["unhashable"]}, {"salt": {"a": 1}},
    {"prompt": [1.9, 2]}, {"prompt": "123"}, {"prompt": [True, 2]}, {"prompt": [2**63]}, {"prompt": [-1]},
    {"prompt": [2**31]}, {"prompt": [2**31 + 5 + 2**61 - 1]},
])
def test_hostile_admissions_are_refused_before_any_change(bad):
    m = KVCacheManager(16, 4, 8)
    run = {"prompt": [5, 6, 7, 8, 9], "salt": None, **bad}
    m.add_request("ok", [1, 2, 3, 4, 5])
    m.commit(m.schedule({"ok": [1, 2, 3, 4, 5]}))
    before = state(m)
    with pytest.raises((TypeError, ValueError)):
        m.add_request("x", **run)
    assert state(m) == before and m.queried_tokens == 5


def test_a_bad_feed_late_in_the_batch_changes_nothing():
    m = KVCacheManager(16, 4, 8)
    for rid in ("a", "b"):
        m.add_request(rid, [1, 2, 3])
    before = state(m)
    for bad in ([1.5], ["7"], [2**40], [None]):
        with pytest.raises((TypeError, ValueError)):
            m.schedule({"a": [1, 2, 3], "b": bad})
        assert state(m) == before


def test_an_unhashable_cache_key_is_refused_at_construction():
    for key in ({"dtype": "int8"}, [1.5], object()):
        with pytest.raises(TypeError, match="cache_key"):
            KVCacheManager(16, 4, 8, cache_key=key)


def test_salts_compare_by_type_and_value():
    m = KVCacheManager(16, 4, 8)
    m.add_request("a", list(range(9)), salt="1")
    m.commit(m.schedule({"a": list(range(9))}))
    assert m.add_request("b", list(range(9)), salt=b"1") == 0
    assert m.add_request("c", list(range(9)), salt="1") == 8


def test_token_range_is_configurable():
    m = KVCacheManager(16, 4, 8, vocab_size=10)
    with pytest.raises(ValueError, match=r"outside \[0, vocab_size=10\)"):
        m.add_request("a", [3, 10])
    m.add_request("a", [3, 9])
    with pytest.raises(ValueError, match="vocab_size"):
        m.schedule({"a": [3, 9, 11]})
    with pytest.raises(TypeError):
        KVCacheManager(16, 4, 8, vocab_size=10.0)


def test_out_of_pages_changes_nothing_even_after_window_releases():
    m = KVCacheManager(3, 4, 3, sliding_window=4)
    m.add_request("a", list(range(8)))
    m.commit(m.schedule({"a": list(range(8))}))
    m.add_request("b", list(range(30, 35)))
    before = state(m)
    with pytest.raises(OutOfPages):
        m.schedule({"a": [1, 1, 1, 1, 1], "b": list(range(30, 35))})
    assert state(m) == before


def test_finish_during_a_step_is_refused_whatever_the_caller_does_to_the_plan():
    m = KVCacheManager(8, 4, 4)
    m.add_request("a", list(range(9)))
    plan = m.schedule({"a": list(range(9))})
    plan.fed_tokens.clear()  # the plan is the caller's object; the manager must not depend on it
    with pytest.raises(RuntimeError, match="outstanding"):
        m.finish("a")
    m.commit(plan)
    m.check()


def test_numpy_integer_settings_are_plain_integers():
    import numpy as np

    m = KVCacheManager(np.int64(8), np.int32(2), np.uint8(8), sliding_window=np.uint64(4))
    m.add_request("a", list(range(5)))
    plan = m.schedule({"a": list(range(5))})
    assert plan.cachestarts[0, :3].tolist() == [p * 2 for p in m.page_table("a")]
    m.commit(plan)
    m.commit(m.schedule({"a": [1, 2]}))  # the window now releases a page; no wrap-around
    assert len(m.page_table("a")) == 3
    m.check()


def test_a_prompt_no_page_table_can_hold_is_refused_at_admission():
    m = KVCacheManager(64, 4, 2)
    with pytest.raises(ValueError, match="needs more than max_pages=2"):
        m.add_request("a", list(range(9)))
    assert not m.requests


def test_the_outstanding_plan_is_the_one_commit_or_abort_takes_next():
    m = KVCacheManager(16, 4, 8)
    m.add_request("a", list(range(5)))
    assert m.outstanding_plan is None
    plan = m.schedule({"a": list(range(5))})
    assert m.outstanding_plan is plan
    m.commit(plan)
    assert m.outstanding_plan is None
    first = m.schedule_decode(["a"], [9], steps=3)
    second = m.advance(first, [10])
    assert m.outstanding_plan is second
    m.abort(m.outstanding_plan)
    assert m.outstanding_plan is None
    m.check()


def test_a_plans_input_ids_cannot_be_edited_under_its_fed_tokens():
    """fed_tokens is read from the plan's input_ids when asked: an edit of input_ids (the op's feed, which a caller
    may be tempted to reuse as a buffer) fails instead of changing what the manager says was fed."""
    m = KVCacheManager(16, 4, 8)
    m.add_request("a", [1, 2, 3])
    m.add_request("b", [4, 5])
    plan = m.schedule({"a": [1, 2, 3], "b": [4, 5]})
    with pytest.raises(ValueError, match="read-only"):
        plan.input_ids[0] = 9
    assert plan.fed_tokens == {"a": [1, 2, 3], "b": [4, 5]}
    m.commit(plan)
    m.check()
