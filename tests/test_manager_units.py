"""Unit tests of the manager: collisions, tenants, LRU order, out-of-pages, sliding window, masks."""

import numpy as np
import pytest

from kvcache_op.manager import (KVCacheManager, OutOfPages, PagePool, UnknownRequest,
                                block_diagonal_causal_mask)


def run_prompt(m, rid, prompt, salt=None):
    hit = m.add_request(rid, prompt, salt=salt)
    m.commit(m.schedule({rid: prompt[hit:]}))
    return hit


def test_prefix_is_reused_and_the_last_token_is_always_computed():
    m = KVCacheManager(16, 4, 8)
    run_prompt(m, "a", list(range(12)))
    assert m.add_request("b", list(range(12))) == 8  # 2 full pages; the 3rd holds the last token
    assert m.page_table("b")[:2] == m.page_table("a")[:2]
    assert m.add_request("c", list(range(9))) == 8
    assert m.metrics()["hit_tokens"] == 16


def test_a_weak_hash_never_returns_another_prompts_pages():
    m = KVCacheManager(16, 4, 8, hash_fn=lambda parent, tokens, extra: 0)  # every page collides
    run_prompt(m, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert m.add_request("b", [9, 9, 9, 9, 5, 6, 7, 8, 9]) == 0  # same hash, other tokens: a miss
    assert m.add_request("c", [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 4  # only the first page could be registered
    m.check()


def test_a_re_inserted_parent_does_not_adopt_stale_children():
    """A parent page is evicted while its child stays cached; other content is registered under the
    parent's hash. The old child hashes the same under the new parent but holds keys computed after the
    old content: it must not match."""
    weak = lambda parent, tokens, extra: 1 if parent is None else hash((parent, tokens))  # all roots collide
    m = KVCacheManager(3, 2, 4, hash_fn=weak, sliding_window=2)
    run_prompt(m, "a", [1, 1, 2, 2, 5])  # pages [1,1] -> [2,2] registered
    m.finish("a")
    assert m.add_request("keep", [1, 1, 2, 2, 9]) == 4  # the window holds only the child page [2,2]
    run_prompt(m, "b", [7, 7, 2])  # evicts [1,1] only; registers [7,7] under the freed root hash
    m.finish("b")
    hit = m.add_request("c", [7, 7, 2, 2, 9])
    assert hit == 2, "the stale [2,2] page (computed after [1,1]) was matched after [7,7]"
    m.check()


PROMPT = [1, 2, 3, 4, 5, 6, 7]


def _b_running_after_an_evicted_parent():
    """A (the system prompt [1, 2, 3, 4] then 0) and B (``PROMPT``) prefilled together, so B's third page is
    registered after A's second; A finished and its second page evicted by X while B still runs."""
    m = KVCacheManager(num_pages=10, page_size=2, max_pages=8)
    m.add_request("A", [1, 2, 3, 4, 0])
    m.add_request("B", PROMPT)
    m.commit(m.schedule({"A": [1, 2, 3, 4, 0], "B": PROMPT}))
    m.finish("A")
    run_prompt(m, "X", list(range(50, 60)))  # evicts A's page [3, 4] (the least recently used)
    m.finish("X")
    return m


def test_a_page_whose_parent_was_evicted_does_not_keep_its_content_from_being_published():
    """A and B prefill one system prompt together: B's third page is registered after A's second. A finishes and its
    second page is evicted while B still runs, which leaves B's entry after a parent no lookup can reach. C computes
    the prompt again: its third page takes the hash's place (it was refused as a collision, closing C's chain), so D
    and E find all three pages."""
    m = _b_running_after_an_evicted_parent()
    assert m.metrics()["evictions"] >= 1
    hits = []
    for rid in ("C", "D", "E"):
        hits.append(run_prompt(m, rid, PROMPT))
        m.check()
        m.finish(rid)
    assert hits == [2, 6, 6]
    m.finish("B")
    m.check()
    assert m.metrics()["pages_in_use"] == 0


def test_a_cached_page_whose_parent_was_evicted_is_freed_when_its_content_is_published_again():
    """As above, but B finishes before C comes: B's third page is cached with nobody holding it, after a parent no
    lookup can reach. When C publishes the same content, that page leaves the index and must become free (it was in
    no state at all: neither free, nor cached, nor held, a page lost to the pool for good)."""
    m = _b_running_after_an_evicted_parent()
    stale = m.page_table("B")[2]  # B's page [5, 6], registered after the evicted [3, 4]
    m.finish("B")
    assert m.index.is_cached(stale) and stale in m.pool.cached
    assert run_prompt(m, "C", PROMPT) == 2
    m.check()
    assert not m.index.is_cached(stale) and stale in m.pool.free
    counts = m.metrics()
    assert counts["pages_free"] + counts["pages_cached"] + counts["pages_in_use"] == 10
    m.finish("C")
    assert run_prompt(m, "D", PROMPT) == 6  # C's pages serve the whole prompt now
    m.check()


def test_a_page_two_windows_release_in_one_step_counts_as_freed():
    """Two windowed requests share a page and both release it in the step being planned: the step fits once it runs
    (it was refused with OutOfPages, the page counted as freed only where one request held it)."""
    m = KVCacheManager(num_pages=6, page_size=1, max_pages=6, sliding_window=2)
    m.add_request("r13", [1, 2, 3, 4, 5, 6, 7])
    m.commit(m.schedule({"r13": [1, 2, 3]}))
    m.add_request("r15", [1, 2, 3, 4])
    m.commit(m.schedule({"r15": [4], "r13": [4, 5, 6]}))
    shared = set(m.page_table("r13")) & set(m.page_table("r15"))
    assert shared and m.pool.available() == 1
    m.commit(m.schedule({"r15": [2, 0, 3], "r13": [7]}))
    m.check()


def test_tenants_with_different_salts_never_share():
    m = KVCacheManager(16, 4, 8)
    run_prompt(m, "a", list(range(9)), salt="tenant-a")
    assert m.add_request("b", list(range(9)), salt="tenant-b") == 0
    assert m.add_request("c", list(range(9)), salt="tenant-a") == 8
    m.commit(m.schedule({"b": list(range(9))}))
    # each tenant's pages hash apart (not only compare apart): b's are published too, and serve its tenant
    assert m.add_request("d", list(range(9)), salt="tenant-b") == 8
    assert m.page_table("d")[:2] == m.page_table("b")[:2] != m.page_table("c")[:2]
    m.check()


def test_cache_settings_are_part_of_the_page_identity():
    seen = []
    a = KVCacheManager(16, 4, 8, cache_key=("int8", 8), hash_fn=lambda p, t, identity: seen.append(identity) or
                       hash((p, t, identity)))
    run_prompt(a, "a", list(range(9)))
    b = KVCacheManager(16, 4, 8, cache_key=("int4", 8), hash_fn=lambda p, t, identity: seen.append(identity) or
                       hash((p, t, identity)))
    run_prompt(b, "a", list(range(9)))
    identities = set(seen)
    assert len(identities) == 2 and {b"int8" in x for x in identities} == {True, False}


def test_free_pages_are_used_before_cached_ones_and_eviction_is_lru():
    pool = PagePool(4)
    evicted = []
    pool.on_evict = evicted.append
    pages = [pool.take() for _ in range(4)]
    pool.release(pages[0], cached=True)
    pool.release(pages[1], cached=True)
    pool.release(pages[2], cached=False)
    assert pool.take() == pages[2] and evicted == []  # the unhashed page first
    pool.acquire(pages[0])  # touched again: now the most recently used
    pool.release(pages[0], cached=True)
    assert pool.take() == pages[1] and evicted == [pages[1]]
    pool.check()


@pytest.mark.parametrize("n", [0, 2, 3, 5, 6])
def test_taking_several_pages_is_taking_them_one_by_one(n):
    """take_many(n) hands out the pages n calls of take would, in the same order, evicting the same
    cached pages; asked for more than are available it raises and takes nothing."""
    def pool_with_free_and_cached():
        pool, evicted = PagePool(8), []
        pool.on_evict = evicted.append
        pages = [pool.take() for _ in range(8)]
        for page, cached in zip(pages[:5], (True, False, True, False, True)):
            pool.release(page, cached=cached)
        return pool, evicted  # 2 free pages, 3 cached ones
    many, evicted_many = pool_with_free_and_cached()
    single, evicted_single = pool_with_free_and_cached()
    if n > 5:
        with pytest.raises(IndexError):
            many.take_many(n)
        assert (many.ref_count, list(many.free), list(many.cached), evicted_many) == \
               (single.ref_count, list(single.free), list(single.cached), evicted_single)
        return
    assert many.take_many(n) == [single.take() for _ in range(n)]
    assert (many.ref_count, list(many.free), list(many.cached), evicted_many) == \
           (single.ref_count, list(single.free), list(single.cached), evicted_single)
    many.check()


def test_out_of_pages_is_typed_and_changes_nothing():
    m = KVCacheManager(4, 4, 8)
    m.add_request("a", list(range(20)))
    before = (list(m.pool.ref_count), list(m.pool.free))
    with pytest.raises(OutOfPages) as error:
        m.schedule({"a": list(range(20))})
    assert error.value.needed == 5 and error.value.available == 4
    assert (list(m.pool.ref_count), list(m.pool.free)) == before and m.computed("a") == 0


def test_unknown_requests_and_bad_feeds_are_clear_errors():
    m = KVCacheManager(4, 4, 2)
    with pytest.raises(UnknownRequest):
        m.schedule({"x": [1]})
    m.add_request("a", [1, 2, 3])
    with pytest.raises(ValueError, match="differ from the prompt"):
        m.schedule({"a": [1, 9]})
    with pytest.raises(ValueError, match="exceed max_pages=2"):
        m.schedule({"a": [1, 2, 3] + [0] * 6})


def test_a_batch_with_two_bad_requests_names_the_first():
    """A contradicted prompt first in the batch, a feed no page table can hold after it: the error is the first's,
    whatever the plan met first."""
    m = KVCacheManager(8, 4, 2)
    m.add_request("a", [1, 2, 3])
    m.add_request("b", [4, 5, 6])
    with pytest.raises(ValueError, match="request 'a': fed tokens differ from the prompt"):
        m.schedule({"a": [1, 9], "b": [4, 5, 6] + [0] * 6})
    with pytest.raises(ValueError, match="request 'b': 3 pages exceed max_pages=2"):
        m.schedule({"b": [4, 5, 6] + [0] * 6, "a": [1, 9]})
    m.check()


def test_a_request_id_already_active_is_refused_and_changes_nothing():
    """Admitting an active id again would orphan the first admission's pages: refused, and finishing the request
    frees every page."""
    m = KVCacheManager(8, 4, 4)
    run_prompt(m, "a", [1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="request 'a' is already active"):
        m.add_request("a", [1, 2, 3, 4, 5, 6])
    assert m.computed("a") == 5
    m.finish("a")
    assert m.metrics()["pages_in_use"] == 0
    m.check()


def test_sliding_window_bounds_memory_and_reports_absolute_positions():
    m = KVCacheManager(8, 4, 3, sliding_window=5)
    m.add_request("a", [1] * 3)
    m.commit(m.schedule({"a": [1] * 3}))
    for _ in range(40):
        plan = m.schedule({"a": [0]})
        m.commit(plan)
        assert len(m.page_table("a")) <= 3
    q = int(plan.query_positions[0])
    assert q == 42 and plan.key_positions[-1] == 42
    assert plan.key_positions[0] <= q - 4  # everything inside the window is still gathered
    assert plan.start_pos[0] == q - plan.key_positions[0]  # the op's view starts at the first kept page


def test_a_windowed_admission_holds_only_the_hit_pages_its_first_query_sees():
    """The first query (position 6, window 3) sees keys 4..6: of the three hit pages (keys 0-1, 2-3, 4-5) only the
    last is held; keys 3..6 would need the middle one too, a page held for nothing."""
    m = KVCacheManager(8, 2, 4, sliding_window=3)
    run_prompt(m, "a", [1, 2, 3, 4, 5, 6, 7])  # one step: all three full pages published
    hits = m.page_table("a")[:3]
    m.finish("a")
    assert m.add_request("b", [1, 2, 3, 4, 5, 6, 7]) == 6
    assert m.page_table("b") == [hits[2]]
    m.check()
    plan = m.schedule({"b": [7]})
    assert list(plan.key_positions) == [4, 5, 6]


def test_block_diagonal_causal_mask_with_window():
    # Two sequences: 2 queries at positions 3, 4 over keys 0..4; 1 query at position 1 over keys 0..1.
    mask = block_diagonal_causal_mask([0, 2, 3], [0, 5, 7], [3, 4, 1], [0, 1, 2, 3, 4, 0, 1], sliding_window=3)
    expected = np.array([[0, 1, 1, 1, 0, 0, 0],
                         [0, 0, 1, 1, 1, 0, 0],
                         [0, 0, 0, 0, 0, 1, 1]], bool)
    assert np.array_equal(mask, expected)


def test_block_diagonal_causal_mask_takes_a_window_of_zero_as_the_ops_do_no_window():
    args = ([0, 2, 3], [0, 5, 7], [3, 4, 1], [0, 1, 2, 3, 4, 0, 1])
    expected = np.array([[1, 1, 1, 1, 0, 0, 0],
                         [1, 1, 1, 1, 1, 0, 0],
                         [0, 0, 0, 0, 0, 1, 1]], bool)
    assert np.array_equal(block_diagonal_causal_mask(*args), expected)
    assert np.array_equal(block_diagonal_causal_mask(*args, sliding_window=0), expected)
    with pytest.raises(ValueError, match="sliding_window must be None, 0 .off. or a window >= 1, got -1"):
        block_diagonal_causal_mask(*args, sliding_window=-1)
