"""What the manager's parts refuse, each with a clear error and nothing changed: page ids the pool does not
have, token containers with no order or read once, inspection of unknown requests, settings of the wrong
type, a prompt a window too wide for the page table cannot bound."""

import numpy as np
import pytest

from kvcache_op.manager import (KVCacheManager, OffsetCacheManager, PagePool, StreamingPolicy, UnknownRequest,
                                block_diagonal_causal_mask)


def _pool_state(pool):
    return list(pool.ref_count), list(pool.free), list(pool.cached)


@pytest.mark.parametrize("call, error", [
    (lambda pool: pool.acquire(-1), ValueError),                 # would index the last page
    (lambda pool: pool.acquire(3), ValueError),
    (lambda pool: pool.release(-3, cached=False), ValueError),   # would release page 0 and free "-3"
    (lambda pool: pool.release(True, cached=False), TypeError),  # would release page 1
    (lambda pool: pool.release(1.0, cached=False), TypeError),
    (lambda pool: pool.untake(-2), ValueError),
    (lambda pool: pool.reclaim(-1), ValueError),
    (lambda pool: pool.forget_cached(-1), ValueError),
    (lambda pool: pool.take_many(-1), ValueError),               # a negative count, not an empty list
    (lambda pool: pool.take_many(1.0), TypeError),
])
def test_a_page_id_the_pool_does_not_have_is_refused_and_changes_nothing(call, error):
    pool = PagePool(3)
    pages = [pool.take() for _ in range(3)]
    pool.release(pages[1], cached=True)
    before = _pool_state(pool)
    with pytest.raises(error):
        call(pool)
    assert _pool_state(pool) == before
    pool.check()


def test_numpy_page_ids_are_taken_as_their_values():
    pool = PagePool(3)
    page = pool.take()
    pool.acquire(np.int64(page))
    assert pool.ref_count[page] == 2


@pytest.mark.parametrize("num_pages, error", [(True, TypeError), (2.5, TypeError), (0, ValueError)])
def test_a_pool_size_that_is_not_a_count_is_refused(num_pages, error):
    with pytest.raises(error, match="num_pages"):
        PagePool(num_pages)


@pytest.mark.parametrize("prompt", [{3, 1, 2}, {1: "a", 2: "b"}, (t for t in [1, 2, 3]), iter([1, 2, 3]), None, 5])
def test_a_prompt_that_is_not_a_sequence_is_refused_by_name(prompt):
    """A set (no order), a dict (its keys) or an iterator (read once, by the check) is no prompt."""
    m = KVCacheManager(8, 4, 4)
    with pytest.raises(TypeError, match=r"request 'a': prompt must be a sequence"):
        m.add_request("a", prompt)
    assert m.requests == {} and m.metrics()["pages_free"] == 8


def test_a_range_is_a_sequence_of_token_ids():
    m = KVCacheManager(8, 4, 4)
    m.add_request("a", range(1, 6))
    assert m.pending_tokens("a") == [1, 2, 3, 4, 5]


def test_a_feed_read_once_is_refused_with_its_own_reason():
    """A feed read once is refused by name before a check reads it (a second check would see it empty)."""
    m = KVCacheManager(16, 4, 8)
    m.add_request("a", [1, 2, 3, 4, 5, 6])
    with pytest.raises(TypeError, match=r"request 'a': fed tokens must be a sequence"):
        m.schedule({"a": (t for t in [1, 2, 3])}, steps=2)
    assert m.computed("a") == 0 and m.outstanding_plan is None


@pytest.mark.parametrize("streaming", [None, StreamingPolicy(1, 3)])
def test_inspecting_an_unknown_request_is_refused_with_or_without_streaming(streaming):
    m = KVCacheManager(8, 4, 4, streaming=streaming)
    with pytest.raises(UnknownRequest, match="unknown request 'nobody'"):
        m.step_room("nobody")
    with pytest.raises(UnknownRequest):
        m.refed_tokens("nobody", 1)


@pytest.mark.parametrize("n_new, error", [(-5, ValueError), (0, ValueError), (2.5, TypeError), (True, TypeError)])
def test_refed_tokens_of_a_step_that_feeds_no_whole_token_is_refused(n_new, error):
    m = KVCacheManager(8, 4, 4, streaming=StreamingPolicy(1, 3, "reevaluate"))
    m.add_request("a", [1, 2, 3])
    with pytest.raises(error, match="n_new"):
        m.refed_tokens("a", n_new)
    assert m.refed_tokens("a", 1) == 0


def test_streaming_settings_that_are_not_a_policy_are_a_type_error():
    with pytest.raises(TypeError, match=r"streaming must be a StreamingPolicy"):
        KVCacheManager(4, 4, 4, streaming=(1, 3))


@pytest.mark.parametrize("key", [10**5000, -(10**70000), (2**64, -1), 0], ids=["5001-digits", "-70001-digits",
                                                                                "tuple", "zero"])
def test_cache_keys_of_any_integer_size_are_taken(key):
    """Integer keys of any size enter the page identity (beyond 4300 digits Python refuses decimal text, beyond
    65535 bytes a two-byte length would overflow)."""
    a, b = KVCacheManager(8, 2, 4, cache_key=key), KVCacheManager(8, 2, 4, cache_key=(key, 1))
    assert a.add_request("r", [1, 2, 3]) == 0 and b.add_request("r", [1, 2, 3]) == 0


def test_cache_keys_that_differ_give_different_identities():
    from kvcache_op.manager.identity import key_bytes
    keys = [0, 1, -1, 255, 256, -256, -257, 2**63, -(2**63), 2**64, True, False, None, "1", b"1", (1,), (1, 2)]
    encoded = [key_bytes(k) for k in keys]
    assert len(set(encoded)) == len(keys)


def test_a_window_wider_than_the_page_table_does_not_admit_a_prompt_it_cannot_hold():
    """A window that spans more pages than max_pages frees none in time: the prompt is refused at admission, as
    without a window, instead of being admitted and stuck at its first step past max_pages."""
    m = KVCacheManager(100, 4, 4, sliding_window=100)
    with pytest.raises(ValueError, match=r"a prompt of 50 tokens needs more than max_pages=4 pages of 4 "
                                         r"\(the sliding window of 100 tokens spans more than those pages"):
        m.add_request("a", list(range(50)))
    assert m.requests == {}
    m.add_request("b", list(range(16)))  # what the page table holds is still taken


def test_a_window_the_page_table_holds_still_admits_a_long_prompt():
    """Window 13 over pages of 4: a decode step spans at most ceil(12 / 4) + 1 = 4 pages, so a prompt longer than
    the page table is fed in chunks and its early pages released."""
    m = KVCacheManager(16, 4, 4, sliding_window=13)
    m.add_request("a", list(range(40)))
    for start in range(0, 40, 4):
        m.commit(m.schedule({"a": list(range(start, start + 4))}))
    assert m.computed("a") == 40 and len(m.page_table("a")) <= 4
    m.check()


def test_an_offset_step_that_is_not_a_dict_is_a_type_error():
    m = OffsetCacheManager(16)
    m.add_request("a", 4)
    with pytest.raises(TypeError, match="counts must be a dict"):
        m.schedule([("a", 1)])
    assert m.schedule({"a": 1}).start_pos.tolist() == [0]


@pytest.mark.parametrize("window", [True, 1.5, "3"])
def test_a_mask_window_that_is_not_an_integer_is_a_type_error(window):
    with pytest.raises(TypeError, match="sliding_window"):
        block_diagonal_causal_mask([0, 1], [0, 2], [1], [0, 1], sliding_window=window)
