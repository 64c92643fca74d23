"""Prefix caching under attack: nobody can block another tenant's chain or be served another prompt's or
tenant's pages (not even through a weak hash function), and a stream's host memory stays bounded."""

import tracemalloc

from kvcache_op.manager import KVCacheManager

SYSTEM = list(range(1000, 1016))  # a 16-token system prompt: 4 pages of 4


def serve(m, rid, prompt, salt=None):
    hit = m.add_request(rid, prompt, salt=salt)
    m.commit(m.schedule({rid: prompt[hit:]}))
    return hit


def test_tokens_that_alias_a_real_page_under_a_modular_hash_cannot_squat_it():
    """Python's int hash is modulo 2**61 - 1: ``t + (2**61 - 1)`` hashed like ``t``. Such ids are refused
    (out of range), and in-range ids cannot be made to collide with a keyed hash."""
    m = KVCacheManager(64, 4, 8)
    squatter = [t + (2**61 - 1) for t in SYSTEM[:4]] + [7]
    try:
        serve(m, "squat", squatter)
    except ValueError:
        pass
    serve(m, "owner", SYSTEM + [1])
    assert serve(m, "user", SYSTEM + [2]) == 16


def test_a_concurrent_partial_copy_of_a_prefix_does_not_close_the_real_chain():
    """A squatter computes the first page of a shared system prompt in the same step as the tenant that
    computes all of it. Later requests must still get every page of the system prompt."""
    m = KVCacheManager(64, 4, 8)
    m.add_request("squat", SYSTEM[:4] + [7])
    m.add_request("owner", SYSTEM + [1])
    m.commit(m.schedule({"squat": SYSTEM[:4] + [7], "owner": SYSTEM + [1]}))
    m.finish("squat")
    assert serve(m, "user", SYSTEM + [2]) == 16
    m.check()


def test_other_tenants_cannot_touch_a_salted_chain():
    m = KVCacheManager(64, 4, 8)
    m.add_request("squat", SYSTEM + [7], salt="mallory")
    m.add_request("owner", SYSTEM + [1], salt="alice")
    m.commit(m.schedule({"squat": SYSTEM + [7], "owner": SYSTEM + [1]}))
    assert serve(m, "alice-2", SYSTEM + [2], salt="alice") == 16
    assert serve(m, "bob", SYSTEM + [3], salt="bob") == 0


def test_a_prefix_hit_ends_at_the_first_page_that_misses():
    """Keys depend on every token before them: B shares A's first page only, so A's page [5, 6] (computed after
    [1, 2]) is not B's third page [5, 6] (computed after [1, 2, 3, 4])."""
    m = KVCacheManager(16, 2, 8)
    serve(m, "a", [1, 2, 5, 6, 7])
    assert m.add_request("b", [1, 2, 3, 4, 5, 6, 9]) == 2
    assert m.page_table("b") == m.page_table("a")[:1]
    m.check()


def test_a_hash_that_ignores_the_tenant_still_never_shares_across_tenants():
    """hash_fn is replaceable; whatever it ignores, a page is matched only with its own tenant's identity."""
    m = KVCacheManager(16, 2, 8, hash_fn=lambda parent, tokens, identity: hash((parent, tokens)))
    serve(m, "a", [1, 2, 3, 4, 5], salt="tenant-a")
    assert m.add_request("b", [1, 2, 3, 4, 5], salt="tenant-b") == 0
    assert m.add_request("a-2", [1, 2, 3, 4, 5], salt="tenant-a") == 4
    m.check()


def test_a_hash_that_ignores_the_parent_does_not_unpublish_a_live_chains_page():
    """With a hash that ignores the parent, B's page [3, 4] (after [9, 9]) collides with A's (after [1, 2]). A's
    entry has a registered parent: it is not stale, it stays, and A's whole prompt is still served."""
    m = KVCacheManager(16, 2, 8, hash_fn=lambda parent, tokens, identity: hash((tokens, identity)))
    serve(m, "a", [1, 2, 3, 4, 5])
    serve(m, "b", [9, 9, 3, 4, 5])
    assert m.add_request("c", [1, 2, 3, 4, 5]) == 4
    assert m.page_table("c")[:2] == m.page_table("a")[:2]
    m.check()


def test_the_page_hash_is_keyed_per_manager():
    a, b = KVCacheManager(8, 4, 4), KVCacheManager(8, 4, 4)
    tokens, identity = (1, 2, 3, 4), b"x"
    assert a.index.hash_fn(None, tokens, identity) != b.index.hash_fn(None, tokens, identity)
    assert a.index.hash_fn(None, tokens, identity) == a.index.hash_fn(None, tokens, identity)


def test_a_long_sliding_window_stream_keeps_host_memory_bounded():
    """100k tokens through a window of 64: the request's token history, page table and chain stay
    O(window + chunk), and so does the manager's memory."""
    m = KVCacheManager(64, 16, 8, sliding_window=64)
    m.add_request("s", list(range(100)))
    m.commit(m.schedule({"s": list(range(100))}))
    tracemalloc.start()
    sizes = []
    for step in range(100_000 // 8):
        m.commit(m.schedule({"s": [step % 50_000] * 8}))
        if step in (2_000, 12_000):
            sizes.append(tracemalloc.get_traced_memory()[0])
    tracemalloc.stop()
    r = m.requests["s"]
    assert m.computed("s") == 100 + 100_000
    assert len(r.tokens) <= 64 + 16 + 8, len(r.tokens)
    assert len(m.page_table("s")) <= -(-(64 + 8) // 16) + 1
    assert len(m.index.by_hash) <= 64
    assert sizes[1] - sizes[0] < 64 * 1024, f"memory grew by {sizes[1] - sizes[0]} bytes over 80k tokens"


def test_a_windowed_prefix_hit_holds_only_the_pages_of_the_window():
    """A long cached prompt re-admitted under a small window: only the pages the first query's window
    needs are held, so a queued request cannot pin the whole prompt."""
    m = KVCacheManager(22, 2, 4, sliding_window=4)
    prompt = list(range(41))
    m.add_request("a", prompt)
    for start in range(0, 41, 3):
        m.commit(m.schedule({"a": prompt[start:start + 3]}))
    m.finish("a")
    assert m.add_request("b", prompt) == 40
    assert len(m.page_table("b")) <= 2 and m.pool.counts()["pages_in_use"] <= 2
    plan = m.schedule({"b": [40]})
    assert plan.key_positions[0] <= 40 - 3  # the window (37, 40] is still gathered
    m.commit(plan)
    m.check()


def test_finished_chains_are_evicted_tail_first():
    m = KVCacheManager(4, 2, 4)
    serve(m, "a", [1, 2, 3, 4, 5, 6, 7])  # pages [1,2] -> [3,4] -> [5,6] registered, [7] private
    m.finish("a")
    serve(m, "x", [9, 9, 9])  # needs 2 pages: the free one, then one eviction
    m.finish("x")
    assert m.add_request("b", [1, 2, 3, 4, 5, 6, 8]) == 4, "the chain's root was evicted before its tail"
