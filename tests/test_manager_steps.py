"""How the manager builds steps: pages filled by decoding are published with their own tokens, a plan
owns its arrays (a caller changing them, or later steps, change nothing else), and every index array
agrees with an independent reading of the manager through its public API, also past the first rows'
capacity."""

import numpy as np
import pytest

from kvcache_op.manager import KVCacheManager, keyed_page_hash
from manager_checks import manager_state


def decode(m, rid, tokens, arrays):
    for token in tokens:
        m.commit(m.schedule_decode([rid], [token]) if arrays else m.schedule({rid: [token]}))


@pytest.mark.parametrize("arrays", [False, True])
def test_pages_filled_by_decoding_are_published_with_their_tokens(arrays):
    """A 6-token prompt, then 10 generated tokens: page 1 holds prompt and generated tokens, pages 2 and 3
    generated ones only. The next turn (history + a new message) reuses all four pages; a prompt that
    differs in one generated token reuses only the pages before it."""
    m = KVCacheManager(64, 4, 16)
    prompt = [1, 2, 3, 4, 5, 6]
    m.add_request("a", prompt)
    m.commit(m.schedule({"a": prompt}))
    generated = list(range(10, 20))
    decode(m, "a", generated, arrays)
    history = prompt + generated
    assert m.add_request("next-turn", history + [99]) == 16
    assert m.page_table("next-turn")[:4] == m.page_table("a")[:4]
    changed = history[:9] + [77] + history[10:] + [99]  # position 9: page 2
    assert m.add_request("other", changed) == 8
    m.finish("a")
    assert m.add_request("again", history) == 12  # the last token is always computed: 3 full pages
    m.check()


def test_a_plan_owns_its_arrays():
    """Changing every array of a plan changes nothing in the manager; a plan read after later steps
    (key_positions and fed_tokens are built on first access) equals one read at once."""
    twins = [KVCacheManager(64, 4, 8, sliding_window=7, hash_fn=keyed_page_hash(b"twins" * 4)) for _ in range(2)]
    kept = []
    for m in twins:
        for i in range(3):
            m.add_request(i, list(range(5 * i, 5 * i + 6)))
        m.commit(m.schedule({i: list(range(5 * i, 5 * i + 6)) for i in range(3)}))
    for step in range(9):
        plans = [m.schedule({0: [step], 2: [step + 1, step + 2]}) for m in twins]
        read_at_once = {name: np.copy(getattr(plans[0], name)) for name in ("key_positions", "query_positions")}
        kept.append((plans[1], read_at_once, dict(plans[0].fed_tokens)))
        for name in ("seqstarts", "kvstarts", "cachestarts", "start_pos", "max_seqlen", "max_kvlen",
                     "query_positions", "key_positions"):
            getattr(plans[0], name)[...] = 12345
        for m, plan in zip(twins, plans):
            m.commit(plan)
        assert manager_state(twins[0]) == manager_state(twins[1])
    for plan, read_at_once, fed in kept:  # read now, several steps later
        for name, values in read_at_once.items():
            assert np.array_equal(getattr(plan, name), values), name
        assert plan.fed_tokens == fed


def check_plan_against_public_views(m, plan, fed_counts):
    """Every index array of ``plan`` from the manager's public answers after the step (page tables,
    stored positions), computed here without the manager's arrays."""
    ps = m.page_size
    assert plan.cachestarts.shape == (len(plan.request_ids), m.max_pages)
    for b, rid in enumerate(plan.request_ids):
        pages, end, n = m.page_table(rid), m.computed(rid), fed_counts[rid]
        kvlen = plan.kvstarts[b + 1] - plan.kvstarts[b]
        first_position = end - kvlen
        assert first_position % ps == 0 and -(-end // ps) - first_position // ps == len(pages)
        assert plan.cachestarts[b].tolist() == [p * ps for p in pages] + [-1] * (m.max_pages - len(pages))
        assert plan.seqstarts[b + 1] - plan.seqstarts[b] == n and plan.start_pos[b] == end - n - first_position
        assert plan.query_positions[plan.seqstarts[b]:plan.seqstarts[b + 1]].tolist() == list(range(end - n, end))
        assert plan.key_positions[plan.kvstarts[b]:plan.kvstarts[b + 1]].tolist() == list(range(first_position, end))
    assert int(plan.max_seqlen) == max(fed_counts.values(), default=0)
    assert int(plan.max_kvlen) == int(np.diff(plan.kvstarts).max(initial=0))


def test_a_large_batch_past_the_first_rows_capacity():
    """150 requests (more rows than the first allocation holds), some finished and replaced, decoding
    and prefilling in one batch: every plan agrees with the page tables and positions."""
    rng = np.random.default_rng(7)
    m = KVCacheManager(4000, 4, 12, sliding_window=30)
    for i in range(150):
        m.add_request(i, rng.integers(0, 50, int(rng.integers(1, 9))).tolist())
    next_id = 150
    for step in range(30):
        feeds = {}
        for rid in list(m.requests):
            pending = m.pending_tokens(rid)
            feeds[rid] = pending[:int(rng.integers(1, 4))] if pending else [int(rng.integers(0, 50))]
        plan = m.schedule(feeds)
        check_plan_against_public_views(m, plan, {rid: len(tokens) for rid, tokens in feeds.items()})
        m.commit(plan)
        for rid in rng.choice(sorted(m.requests), 5, replace=False).tolist():
            m.finish(rid)
            m.add_request(next_id, rng.integers(0, 50, int(rng.integers(1, 9))).tolist())
            next_id += 1
        m.check()


def test_feeds_of_any_integer_sequence_plan_as_lists_do():
    """Tuples, numpy arrays and numpy integers in ``feeds`` (checked one request at a time) plan exactly as
    lists of Python ints (checked for the whole batch at once)."""
    plans = []
    for convert in (list, tuple, np.array, lambda tokens: [np.int32(t) for t in tokens]):
        m = KVCacheManager(64, 4, 8, hash_fn=keyed_page_hash(b"same key" * 2))
        for i in range(3):
            m.add_request(i, list(range(10 * i, 10 * i + 6)))
        steps = [{0: list(range(6)), 1: list(range(10, 13)), 2: [20]}, {0: [5], 1: [13, 14, 15], 2: [21, 22]},
                 {0: [6], 1: [16, 17], 2: [23, 24, 25]}]
        for feeds in steps:
            plan = m.schedule({rid: convert(tokens) for rid, tokens in feeds.items()})
            plans.append((convert, [np.copy(getattr(plan, name)) for name in (
                "seqstarts", "kvstarts", "cachestarts", "start_pos", "query_positions", "key_positions")],
                plan.fed_tokens))
            m.commit(plan)
        m.check()
    for step in range(3):
        reference = plans[step]
        for other in plans[step::3][1:]:
            assert all(np.array_equal(a, b) for a, b in zip(reference[1], other[1])), other[0]
            assert reference[2] == other[2]


@pytest.mark.parametrize("arrays", [False, True])
def test_a_batch_fed_again_after_one_of_its_requests_finished(arrays):
    """A decode loop feeds the same request ids step after step. Once one of them finished, feeding the
    same ids again is refused with nothing changed; a request admitted into the finished one's row is fed
    through its own page table."""
    from kvcache_op.manager import UnknownRequest

    def step(rids, tokens):
        return m.schedule_decode(rids, tokens) if arrays else m.schedule({r: [t] for r, t in zip(rids, tokens)})

    m = KVCacheManager(64, 4, 8)
    for rid, prompt in (("a", [1, 2, 3]), ("b", [4, 5, 6, 7, 8])):
        m.add_request(rid, prompt)
        m.commit(m.schedule({rid: prompt}))
    for token in (10, 11):
        m.commit(step(["a", "b"], [token, token]))
    m.finish("b")
    before = manager_state(m)
    with pytest.raises(UnknownRequest):
        step(["a", "b"], [12, 12])
    assert manager_state(m) == before
    m.add_request("c", [20, 21])
    m.commit(m.schedule({"c": [20, 21]}))
    stored = [m.computed("a"), m.computed("c")]
    assert stored == [5, 2]
    plan = step(["a", "c"], [12, 22])
    assert plan.kvstarts.tolist() == [0, stored[0] + 1, stored[0] + stored[1] + 2]
    for b, rid in enumerate(("a", "c")):
        pages = m.page_table(rid)
        assert plan.cachestarts[b, :len(pages)].tolist() == [p * 4 for p in pages]
    m.commit(plan)
    m.check()


@pytest.mark.parametrize("arrays", [False, True])
def test_a_batch_is_matched_again_only_by_ids_that_name_the_same_requests(arrays):
    """Ids that compare equal to the last batch's without being the same dict key (numpy scalars: float64(2**53)
    == 2**53 + 1, yet it hashes as 2**53), ids that fail to compare, and unhashable ids get what a fresh lookup
    gives: their own request's row, the duplicate or unhashable id refused with nothing changed."""
    def step(rids, tokens):
        return m.schedule_decode(rids, tokens) if arrays else m.schedule({r: [t] for r, t in zip(rids, tokens)})

    a, b = 2**53 + 1, 2**53
    m = KVCacheManager(64, 4, 8)
    for rid, prompt, salt in ((a, [1, 2, 3, 4], "tenant a"), (b, [7, 8, 9, 10, 11], "tenant b"), ((1, 2), [5], None),
                              (1, [6], None)):
        m.add_request(rid, prompt, salt=salt)
        m.commit(m.schedule({rid: prompt}))
    m.commit(step([a], [5]))
    m.commit(step([np.float64(b)], [12]))  # equal to a, but b's key
    assert (m.computed(a), m.computed(b)) == (5, 6)
    m.commit(step([(1, 2)], [6]))
    m.commit(step([np.int64(1)], [7]))  # np.int64(1) == (1, 2) does not give a bool
    assert (m.computed((1, 2)), m.computed(1)) == (2, 2)
    m.commit(step([b], [13]))
    if arrays:  # a dict cannot hold one id twice
        before = manager_state(m)
        with pytest.raises(ValueError, match="appears twice"):
            m.schedule_decode([np.float64(b), np.float64(b)], [14, 14])
        assert manager_state(m) == before
        m.commit(m.schedule_decode([a], [6]))
        before = manager_state(m)
        with pytest.raises(TypeError, match="unhashable"):
            m.schedule_decode([np.array(a)], [7])
        assert manager_state(m) == before
    m.check()


@pytest.mark.parametrize("page_size, window", [(2, 3), (2, 4), (4, 5), (4, 6), (1, 2)])
def test_each_decode_step_loads_from_the_page_where_its_window_begins(page_size, window):
    """A one-token decode at position p attends to [p - window + 1, p]: the step loads keys from the first position
    of that position's page on, and the request holds no page before it (each step is a plain append or one that
    releases a page as the window moves on)."""
    m = KVCacheManager(64, page_size, 16, sliding_window=window)
    prompt = [1, 2, 3]
    m.add_request("a", prompt)
    m.commit(m.schedule({"a": prompt}))
    for end in range(len(prompt) + 1, len(prompt) + 13):
        plan = m.schedule({"a": [end]})
        first = max(0, end - window) // page_size * page_size
        assert plan.kvstarts.tolist() == [0, end - first], end
        assert plan.key_positions.tolist() == list(range(first, end)), end
        m.commit(plan)
        held = -(-end // page_size) - first // page_size
        assert len(m.page_table("a")) == m.metrics()["pages_in_use"] == held, end
    m.check()
