"""The manager's refusals say exactly what is wrong: the token id outside the vocabulary (the negative one, the one
past the end, an unsigned id past int64 as itself), the vocabulary sizes allowed at their bounds, rows of tokens that
are not rows, and how many pages a step lacked; and its own consistency check catches each kind of damage."""

import numpy as np
import pytest

from kvcache_op.manager import KVCacheManager, OffsetCacheManager, OutOfPages, StreamingPolicy, keyed_page_hash


def _decoding(vocab_size=10, steps=1):
    """A manager with requests "a" and "b" past their prompts, and a decode step of both planned."""
    m = KVCacheManager(16, 4, 8, vocab_size=vocab_size)
    for rid in ("a", "b"):
        m.add_request(rid, [1, 2, 3])
    m.commit(m.schedule({"a": [1, 2, 3], "b": [1, 2, 3]}))
    return m, m.schedule_decode(["a", "b"], [4, 5], steps=steps)


@pytest.mark.parametrize("tokens, named", [
    (np.array([-1, 5]), "-1"),                       # a negative id beside a valid one
    (np.array([5, -3]), "-3"),
    (np.array([0, 13]), "13"),                       # past the end beside 0
    (np.array([13, 4]), "13"),
    (np.array([2**63, 1], np.uint64), str(2**63)),   # an unsigned id int64 cannot hold, as itself
    (np.array([2**64 - 1, 1], np.uint64), str(2**64 - 1)),
    ([0, 10], "10"),
    ([-2, 0], "-2"),
])
def test_a_token_outside_the_vocabulary_is_named_as_given(tokens, named):
    m, plan = _decoding()
    m.abort(plan)
    with pytest.raises(ValueError, match=rf"token id {named} is outside \[0, vocab_size=10\)"):
        m.schedule_decode(["a", "b"], tokens)
    if isinstance(tokens, list):
        with pytest.raises(ValueError, match=rf"request 'a': fed tokens: token id {named} is outside"):
            m.schedule({"a": tokens})


@pytest.mark.parametrize("rows, named", [
    (np.array([[0, 13]]), "13"),
    (np.array([[-1, 5]]), "-1"),
    (np.array([[2**63, 1]], np.uint64), str(2**63)),
])
def test_a_row_of_tokens_outside_the_vocabulary_is_named_as_given(rows, named):
    m, plan = _decoding(steps=3)
    with pytest.raises(ValueError, match=rf"advance: tokens: token id {named} is outside"):
        m.advance(plan, rows)
    m.advance(plan, np.array([[6, 7]]))  # nothing changed: the plan is still the outstanding one


@pytest.mark.parametrize("rows", [np.zeros((0, 2), np.int64), [np.array([[1, 2]])], np.zeros((1, 3), np.int64)])
def test_rows_of_tokens_that_are_not_rows_of_one_token_a_request_are_refused(rows):
    m, plan = _decoding(steps=3)
    with pytest.raises(ValueError, match=r"advance: tokens: expected rows of 2 token ids, got shape"):
        m.advance(plan, rows)
    m.commit(m.advance(plan, [[6, 7]]))
    m.check()


@pytest.mark.parametrize("size, allowed", [(1, True), (0, False), (2**63, True), (2**63 + 1, False)])
def test_the_vocabulary_size_is_taken_at_its_bounds(size, allowed):
    if not allowed:
        with pytest.raises(ValueError, match=r"vocab_size must be in \[1, 2\*\*63\]"):
            KVCacheManager(4, 4, 2, vocab_size=size)
        return
    m = KVCacheManager(4, 4, 2, vocab_size=size)
    assert m.add_request("a", [0, 0, size - 1]) == 0
    with pytest.raises(ValueError, match="outside"):
        m.add_request("b", [size])


def test_out_of_pages_says_how_many_pages_the_step_needs_and_has():
    m = KVCacheManager(4, 4, 8)
    m.add_request("a", list(range(20)))
    with pytest.raises(OutOfPages, match=r"^the step needs 5 new page\(s\) but only 4 are free or evictable$"):
        m.schedule({"a": list(range(20))})


def _corrupt_free_list_twice(m):
    m.pool.free.append(m.pool.free[0])


def _corrupt_table_slot(m):
    m.rows.table[m._row_of["a"], 0] += 1  # a slot that is not a page's first


def _corrupt_token_history(m):
    m.requests["a"].token_base = 8  # past what was computed: tokens the next step needs are gone


def _corrupt_cached_page_freed(m):
    page = next(iter(m.pool.cached))
    del m.pool.cached[page]
    m.pool.free.append(page)  # published, yet free: the next request could overwrite what the index serves


@pytest.mark.parametrize("corrupt", [_corrupt_free_list_twice, _corrupt_table_slot, _corrupt_token_history,
                                     _corrupt_cached_page_freed])
def test_the_consistency_check_catches_each_kind_of_damage(corrupt):
    """``check()`` is the oracle of the manager's stateful tests: each damage it exists for must fail it."""
    m = KVCacheManager(16, 4, 8)
    m.add_request("done", list(range(9)))
    m.commit(m.schedule({"done": list(range(9))}))
    m.finish("done")  # its two full pages stay cached
    m.add_request("a", [7] * 6)
    m.commit(m.schedule({"a": [7] * 6}))
    m.check()
    corrupt(m)
    with pytest.raises(AssertionError):
        m.check()


@pytest.mark.parametrize("settings, message", [
    (dict(page_size=0), r"page_size and max_pages must be >= 1, got 0, 8"),
    (dict(max_pages=0), r"page_size and max_pages must be >= 1, got 4, 0"),
    (dict(sliding_window=0), r"sliding_window must be >= 1, got 0"),
])
def test_settings_below_their_bounds_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        KVCacheManager(**{"num_pages": 16, "page_size": 4, "max_pages": 8, **settings})


def test_a_window_of_one_token_holds_one_page():
    """sliding_window 1 (each query sees only itself) is the smallest window, not a refused one."""
    m = KVCacheManager(16, 4, 8, sliding_window=1)
    m.add_request("a", list(range(10)))
    m.commit(m.schedule({"a": list(range(10))}))
    plan = m.schedule({"a": [3]})
    assert list(plan.key_positions) == [8, 9, 10] and len(m.page_table("a")) == 1  # the page of position 10
    m.commit(plan)
    m.check()


@pytest.mark.parametrize("steps", [1, 2, 3, 5])
def test_decode_steps_may_fill_max_pages_exactly_and_not_one_page_more(steps):
    """page_size 2, max_pages 3: a request past a 3-token prompt holds 2 pages; decode steps reaching position 5
    hold 3 (allowed), one step more would need a fourth (refused, the request named, nothing changed). Planned one
    step at a time or several (more steps than a page: counted, not flagged, pages)."""
    m = KVCacheManager(16, 2, 3)
    m.add_request("a", [1, 2, 3])
    m.add_request("b", [1])
    m.commit(m.schedule({"a": [1, 2, 3], "b": [1]}))
    assert len(m.page_table("a")) == 2
    if steps == 5:  # positions 3..7: pages 1 to 3 from position 4 on
        with pytest.raises(ValueError, match=r"request 'a': 5 decode steps need more than max_pages=3 pages"):
            m.schedule_decode(["b", "a"], [0, 0], steps=5)
        plan = m.schedule_decode(["b", "a"], [0, 0], steps=3)  # positions 3..5: three pages exactly
        m.commit(plan, [[0, 0], [0, 0]])
    else:
        for chunk in {1: (1, 1, 1), 2: (2, 1), 3: (3,)}[steps]:
            plan = m.schedule_decode(["b", "a"], [0, 0], steps=chunk)
            m.commit(plan, [[0, 0]] * (chunk - 1) or None)
    assert m.computed("a") == 6 and len(m.page_table("a")) == 3
    m.check()
    with pytest.raises(ValueError, match="exceed max_pages=3|more than max_pages=3"):
        m.schedule_decode(["b", "a"], [0, 0])
    assert m.computed("a") == 6
    m.check()


def test_a_request_at_max_pages_with_room_in_its_last_page_decodes_beside_one_taking_a_page():
    """page_size 2, max_pages 3: "a" holds 3 pages with room for position 5; "b" takes its third page for position 4.
    Both end at max_pages exactly: the step is allowed (holding max_pages is not needing more)."""
    m = KVCacheManager(16, 2, 3)
    m.add_request("a", [1, 2, 3, 4, 5])
    m.add_request("b", [1, 2, 3, 4])
    m.commit(m.schedule({"a": [1, 2, 3, 4, 5], "b": [1, 2, 3, 4]}))
    m.commit(m.schedule_decode(["a", "b"], [6, 5]))
    assert [len(m.page_table(r)) for r in ("a", "b")] == [3, 3] and m.computed("a") == 6
    m.check()


def test_a_batch_with_one_empty_feed_is_refused_and_changes_nothing():
    m = KVCacheManager(16, 4, 8)
    m.add_request("a", [1, 2, 3])
    m.add_request("b", [4, 5])
    with pytest.raises(ValueError, match="request 'b': a step must feed at least one token"):
        m.schedule({"a": [1, 2, 3], "b": []})
    assert m.computed("a") == 0
    m.check()


def test_unsigned_token_arrays_in_the_vocabulary_are_taken():
    m, plan = _decoding()
    m.abort(plan)
    for dtype in (np.uint8, np.uint32, np.uint64):
        plan = m.schedule_decode(["a", "b"], np.array([4, 9], dtype))
        assert plan.input_ids.tolist() == [4, 9]
        m.abort(plan)
    plan = m.schedule_decode(["a", "b"], [4, 5], steps=3)
    m.commit(m.advance(plan, np.array([[6, 7]], np.uint16)))
    assert m.computed("a") == 5


@pytest.mark.parametrize("make", [
    lambda: KVCacheManager(num_pages=1, page_size=4, max_pages=1),  # the smallest pool and table
    lambda: KVCacheManager(8, 4, 4, streaming=StreamingPolicy(sinks=0, budget_pages=2)),  # no sinks
    lambda: KVCacheManager(8, 4, 4, streaming=StreamingPolicy(sinks=4, budget_pages=4)),  # the whole table
])
def test_settings_at_their_bounds_are_taken(make):
    m = make()
    m.add_request("a", [1, 2, 3])
    m.commit(m.schedule({"a": [1, 2, 3]}))
    m.commit(m.schedule_decode(["a"], [4]))
    assert m.computed("a") == 4
    m.check()


def test_the_smallest_offset_cache_holds_one_token():
    m = OffsetCacheManager(1)
    assert m.add_request("a", 1) == 0
    assert m.schedule({"a": 1}).cachestarts.tolist() == [0]
    m.finish("a")
    m.check()


def test_a_page_repeating_under_another_parent_is_published_under_each():
    """Pages hash their parent: the same second page after two different first pages is two entries, so each
    prompt is served whole (without the parent in the hash the second registration collides and closes its
    chain)."""
    m = KVCacheManager(16, 4, 8)
    for rid, first in (("a", [1, 2, 3, 4]), ("b", [9, 9, 9, 9])):
        prompt = first + [5, 6, 7, 8, 0]
        m.add_request(rid, prompt)
        m.commit(m.schedule({rid: prompt}))
    assert m.add_request("c", [9, 9, 9, 9, 5, 6, 7, 8, 0]) == 8
    assert m.page_table("c")[:2] == m.page_table("b")[:2]
    m.check()


@pytest.mark.parametrize("size, allowed", [(16, True), (64, True), (15, False), (65, False)])
def test_the_page_hash_key_is_taken_at_its_bounds(size, allowed):
    if not allowed:
        with pytest.raises(ValueError, match=rf"the page hash key must have 16..64 bytes, got {size}"):
            keyed_page_hash(b"k" * size)
        return
    page_hash = keyed_page_hash(b"k" * size)
    same_key = keyed_page_hash(b"k" * size)
    assert page_hash(None, (1, 2), b"") == same_key(None, (1, 2), b"") != page_hash(None, (1, 3), b"")
