"""``schedule_decode(request_ids, tokens)``: one token per request from arrays, exactly what
``schedule({rid: [token]})`` does — the same plans, the same effect, the same errors with nothing changed.

The stateful machines of test_manager_stateful run again with every one-token-each step (hostile ones
included) sent through ``schedule_decode``; the unit tests compare it with ``schedule`` on twin managers.
"""

import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import initialize

from kvcache_op.manager import KVCacheManager, OutOfPages, UnknownRequest, keyed_page_hash
from manager_checks import manager_state
from test_manager_stateful import ManagerMachine, WindowedManagerMachine

PLAN_ARRAYS = ("seqstarts", "kvstarts", "cachestarts", "start_pos", "max_seqlen", "max_kvlen", "query_positions",
               "key_positions", "shift_slots", "shift_deltas")


class DecodeFirst(KVCacheManager):
    """Sends every step that feeds one token to each request through ``schedule_decode``: an int64 array
    when every token is a Python int, else the tokens as given (so bad ones meet its checks)."""

    def schedule(self, feeds):
        values = list(feeds.values()) if isinstance(feeds, dict) else []
        if not values or not all(isinstance(v, list) and len(v) == 1 for v in values):
            return super().schedule(feeds)
        tokens = [v[0] for v in values]
        if all(type(t) is int and 0 <= t < 2**63 for t in tokens):
            tokens = np.array(tokens, np.int64)
        return self.schedule_decode(list(feeds), tokens)


class DecodeApiMachine(ManagerMachine):
    @initialize()
    def setup(self):
        super().setup()
        self.m.__class__ = DecodeFirst  # the same manager, its steps routed as above


class WindowedDecodeApiMachine(WindowedManagerMachine):
    @initialize()
    def setup(self):
        super().setup()
        self.m.__class__ = DecodeFirst


TestDecodeApi = DecodeApiMachine.TestCase
TestDecodeApi.settings = settings(stateful_step_count=40, deadline=None)
TestWindowedDecodeApi = WindowedDecodeApiMachine.TestCase
TestWindowedDecodeApi.settings = settings(stateful_step_count=40, deadline=None)


def twins(num_pages=40, max_pages=8, **kwargs):
    """Two managers in the same state (one hash key): requests 0..4 prefilled, two prompt tokens of
    request 4 still pending."""
    out = []
    for _ in range(2):
        m = KVCacheManager(num_pages, 4, max_pages, hash_fn=keyed_page_hash(b"twins" * 4), **kwargs)
        for i in range(5):
            prompt = list(range(10 * i, 10 * i + 5 + i))
            m.add_request(i, prompt)
            m.commit(m.schedule({i: prompt if i < 4 else prompt[:-2]}))
        out.append(m)
    return out


def assert_same_plans(a, b):
    for name in PLAN_ARRAYS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype == np.int64 and np.array_equal(x, y), name
    assert a.request_ids == b.request_ids and a.fed_tokens == b.fed_tokens


def assert_same_decode_plans(plan, twin):
    """A decode step planned ahead (``plan``) against the twin's one-step plan: the same arrays of the same kinds
    (ONNX Runtime binds a 0-d array, not a numpy scalar), except that the page tables may hold pages of later steps:
    every column a step reads holds a page in both, and the twin's others are empty."""
    for name in PLAN_ARRAYS + ("input_ids",):
        mine, theirs = getattr(plan, name), getattr(twin, name)
        assert type(mine) is type(theirs) is np.ndarray and mine.dtype == theirs.dtype == np.int64, name
        assert mine.ndim == theirs.ndim, name
        if name != "cachestarts":
            assert np.array_equal(mine, theirs), name
    for row, (mine, theirs) in enumerate(zip(plan.cachestarts, twin.cachestarts)):
        used = -(-(plan.kvstarts[row + 1] - plan.kvstarts[row]) // 4)
        assert (mine[:used] >= 0).all() and (theirs[:used] >= 0).all() and (theirs[used:] == -1).all()
    assert plan.fed_tokens == twin.fed_tokens


@pytest.mark.parametrize("window", [None, 5])
def test_decode_steps_plan_exactly_as_schedule(window):
    a, b = twins(sliding_window=window)
    pending = [47, 48]  # request 4's last prompt tokens, fed one per step
    for step in range(14):
        rids = [3, 0, 4, 1] if step % 3 else [2, 4]
        tokens = [pending.pop(0) if rid == 4 and pending else step * 10 + rid for rid in rids]
        plan_a = a.schedule({rid: [t] for rid, t in zip(rids, tokens)})
        plan_b = b.schedule_decode(rids, np.array(tokens, np.int32))
        assert_same_plans(plan_a, plan_b)
        a.commit(plan_a)
        b.commit(plan_b)
        assert manager_state(a) == manager_state(b)
        a.check()
        b.check()


@pytest.mark.parametrize("request_ids, tokens, error", [
    ([0, 9], [1, 2], UnknownRequest),
    ([0, 1, 0], [1, 2, 3], ValueError),
    ((0, 1), [1, 2, 3], ValueError),
    ({0: 1}, [1], TypeError),
    ([0, 1], np.array([1.0, 2.0]), TypeError),
    ([0, 1], np.array([[1, 2]]), ValueError),
    ([0, 1], np.array([1, -1]), ValueError),
    ([0, 1], np.array([1, 2**63], np.uint64), ValueError),
    ([0, 1], np.array([1, 2**31]), ValueError),
    ([0, 1], [1, True], TypeError),
    ([0, 1], [1, 2.0], TypeError),
    ([0, 1], "12", TypeError),
    ([0, 4], [1, 99], ValueError),  # request 4's next token is a prompt token, and it is not 99
])
def test_bad_decode_steps_are_refused_before_any_change(request_ids, tokens, error):
    m = twins()[0]
    before = manager_state(m)
    with pytest.raises(error):
        m.schedule_decode(request_ids, tokens)
    assert manager_state(m) == before
    m.check()


def test_decode_steps_run_out_of_pages_and_wait_for_the_outstanding_step():
    m = KVCacheManager(2, 2, 4)
    m.add_request("a", [1, 2])
    m.commit(m.schedule({"a": [1, 2]}))
    m.add_request("b", [1, 2, 3])
    m.commit(m.schedule({"b": [3]}))  # b's third token starts the pool's second page
    before = manager_state(m)
    with pytest.raises(OutOfPages):
        m.schedule_decode(["a", "b"], [5, 6])  # a needs a new page; none is left
    assert manager_state(m) == before
    plan = m.schedule_decode(["b"], [6])
    with pytest.raises(RuntimeError, match="outstanding"):
        m.schedule_decode(["b"], [7])
    m.abort(plan)
    assert manager_state(m) == before
    assert m.schedule_decode([], np.zeros(0, np.int64)).cachestarts.shape == (0, 4)


@pytest.mark.parametrize("longest", [4, 13])
@pytest.mark.parametrize("seed", range(6))
def test_decode_steps_planned_at_once_leave_what_one_step_at_a_time_leaves(seed, longest):
    """``schedule_decode(..., steps)`` + ``advance`` + ``commit`` after any number of them, against the same
    tokens fed one step at a time on a twin: every step's plan is the same (the page tables up to which pages:
    the twin takes a page when a step reaches it), and after each commit both publish the same pages (equal
    prefix hashes: same chains, same tokens), hold the same positions and count the same pages in use. Runs of up
    to a page (``longest`` 4) and of up to three pages (13: several pages taken at once, and given back when the
    run stops early). The steps are advanced one at a time or, on odd seeds, all at once after they ran."""
    rng = np.random.default_rng(seed)
    a, b = twins() if longest <= 4 else twins(num_pages=80, max_pages=16)
    rids = [0, 1, 2, 3]  # request 4 still has prompt tokens: refused below
    with pytest.raises(ValueError, match="prompt tokens to feed"):
        a.schedule_decode([0, 4], [1, 47], steps=2)  # 47: its next prompt token, fine for one step
    for _ in range(6 if longest <= 4 else 3):
        steps = int(rng.integers(2, longest + 1))
        ran = int(rng.integers(1, steps + 1))
        tokens = rng.integers(0, 50, (ran, len(rids)))
        plan = first = a.schedule_decode(rids, tokens[0], steps=steps)
        if seed % 2 and ran > 1:  # the caller ran every step itself: one advance over all the rows
            last = a.advance(plan, tokens[1:])
        for j in range(ran):
            if j:
                plan = first.next_decode(tokens[j], steps - 1, later=j) if seed % 2 else a.advance(plan, tokens[j])
            twin = b.schedule_decode(rids, tokens[j])
            assert_same_decode_plans(plan, twin)
            b.commit(twin)
        if seed % 2 and ran > 1:
            plan = last
        if ran < steps:
            with pytest.raises(ValueError, match="not the outstanding step"):
                a.advance(twin, tokens[0])
        a.commit(plan)
        assert set(a.index.by_hash) == set(b.index.by_hash)
        for rid in rids:
            assert a.computed(rid) == b.computed(rid) and len(a.page_table(rid)) == len(b.page_table(rid))
            assert a.requests[rid].registered == b.requests[rid].registered
        assert a.metrics()["pages_in_use"] == b.metrics()["pages_in_use"]
        a.check()
    assert a.metrics()["pages_cached"] + a.metrics()["pages_in_use"] > 5  # pages were filled and published


def test_decode_steps_planned_at_once_are_refused_where_they_cannot_be_exact():
    """More steps than the page tables hold, a sliding window, advancing past the planned steps and bad rows of
    tokens are refused with nothing changed; an abort after some steps (of a run within a page, and of one past a
    page) rolls all of them back."""
    a, b = twins()
    before = manager_state(a)
    with pytest.raises(ValueError, match="steps must be in"):
        a.schedule_decode([0], [1], steps=4 * 8 + 1)  # past page_size * max_pages
    with pytest.raises(ValueError, match="steps must be in"):
        a.schedule_decode([0], [1], steps=0)
    assert manager_state(a) == before
    windowed, _ = twins(sliding_window=5)
    with pytest.raises(ValueError, match="sliding window"):
        windowed.schedule_decode([0], [1], steps=2)
    plan = a.schedule_decode([0, 1], [1, 2], steps=2)
    plan = a.advance(plan, [3, 4])
    with pytest.raises(ValueError, match="all 2 planned steps have run"):
        a.advance(plan, [5, 6])
    with pytest.raises(ValueError):
        a.advance(plan, [5])  # one token per request
    a.abort(plan)
    assert manager_state(a) == before
    plan = first = a.schedule_decode([0, 1], [1, 2], steps=9)  # past a page: several pages taken at once
    for bad, error, match in ((np.zeros((9, 2), np.int64), ValueError, "only 8 planned steps are left"),
                              ([[1, 2, 3]], ValueError, "rows of 2 token ids"), ([[1, 2], [3]], ValueError, "rows of 2"),
                              ([[1, -2]], ValueError, "outside"), (np.zeros((2, 2)), TypeError, "integer")):
        with pytest.raises(error, match=match):
            a.advance(plan, bad)  # refused with nothing changed: the rows below still advance it
    for later in (0, 9):  # not a planned step that follows
        with pytest.raises(ValueError, match="outside the planned steps"):
            first.next_decode(np.array([3, 4]), 8, later=later)
    plan = a.advance(plan, [[3, 4], [5, 6]])  # the third step: fed the second row
    assert (plan.start_pos == first.start_pos + 2).all() and plan.input_ids.tolist() == [5, 6]
    with pytest.raises(ValueError, match="outside the planned steps"):
        plan.next_decode(np.array([3, 4]), 6, later=7)  # 6 planned steps follow the third
    a.abort(plan)
    assert manager_state(a) == before
    empty = a.schedule_decode([], np.zeros(0, np.int64), steps=3)
    a.abort(a.advance(empty, [[], []]))  # an empty batch's rows: empty lists
    assert manager_state(a) == before


def test_a_failed_advance_changes_nothing():
    """An ``advance`` that raises (here: the caller edited its plan) leaves the planned steps as they were: the commit
    that follows commits the one step that ran, and no page holding an unwritten slot is ever served."""
    m = KVCacheManager(16, 4, 8)
    m.add_request("a", [1, 2])
    m.commit(m.schedule({"a": [1, 2]}))
    plan = m.schedule_decode(["a"], [5], steps=4)  # stores position 2
    plan.kvstarts = None  # next_decode cannot build the next steps from it
    with pytest.raises(TypeError):
        m.advance(plan, [6])
    m.commit(plan)
    assert m.computed("a") == 3
    assert m.add_request("b", [1, 2, 5, 6, 7]) == 0  # position 3 was never written: page 0 is not offered
    m.check()


def test_planned_steps_past_max_pages_name_the_request():
    m = KVCacheManager(16, 4, 2)
    m.add_request("a", [1, 2, 3, 4, 5, 6])
    m.commit(m.schedule({"a": [1, 2, 3, 4, 5, 6]}))  # 2 pages: positions up to 7 fit
    before = manager_state(m)
    with pytest.raises(ValueError, match="request 'a': 3 decode steps need more than max_pages=2"):
        m.schedule_decode(["a"], [7], steps=3)  # positions 6, 7, 8
    assert manager_state(m) == before
    m.commit(m.advance(m.schedule_decode(["a"], [7], steps=2), [8]))  # positions 6, 7
    assert m.computed("a") == 8


def prefill_twins(seed: int):
    """Two managers in the same state: requests 0..3 decoding, and three new requests (one sharing a
    published prefix with request 0, one with a chunk of its prompt already computed) whose prompts
    are still to be fed; returns (a, b, the feeds of a step giving every request its last tokens)."""
    rng = np.random.default_rng(seed)
    shared = list(range(0, 8))  # request 0's first two full pages: published once computed
    prompts = {i: (shared if i == 0 else list(range(10 * i, 10 * i + 5 + i))) + [99 - i] for i in range(4)}
    prompts.update({5: shared + rng.integers(0, 50, int(rng.integers(1, 7))).tolist(),
                    6: rng.integers(0, 50, int(rng.integers(1, 11))).tolist(),
                    7: rng.integers(0, 50, 10).tolist()})
    out = []
    for _ in range(2):
        m = KVCacheManager(80, 4, 16, hash_fn=keyed_page_hash(b"twins" * 4))
        for i in range(4):
            m.add_request(i, prompts[i])
            m.commit(m.schedule({i: prompts[i]}))
        fed = {i: [int(t)] for i, t in enumerate(rng.integers(0, 50, 4))}
        for i in (5, 6, 7):
            fed[i] = prompts[i][m.add_request(i, prompts[i]):]
        m.commit(m.schedule({7: fed[7][:3]}))  # request 7: its first chunk computed already
        fed[7] = fed[7][3:]
        out.append(m)
        rng = np.random.default_rng(seed)  # the twin draws the same
        rng.integers(0, 50, int(rng.integers(1, 7))), rng.integers(0, 50, int(rng.integers(1, 11)))
        rng.integers(0, 50, 10)
    return out[0], out[1], fed, prompts


@pytest.mark.parametrize("longest", [4, 13])
@pytest.mark.parametrize("seed", range(6))
def test_a_prompts_last_chunk_and_decode_steps_planned_at_once_leave_what_one_step_at_a_time_leaves(seed, longest):
    """``schedule(feeds, steps)`` (decodes and prompts' last chunks, one with a prefix hit, then decode steps) +
    ``advance`` + ``commit`` after any number of steps, against a twin that schedules the same first step alone
    and then each decode step: the first step's plan is the twin's (the page tables up to which pages), each
    later step's too, and after the commit both publish the same pages (equal prefix hashes: same chains, same
    tokens), hold the same positions and pages, and count the same pages in use. The steps are advanced one at a
    time, all at once after they ran, or fed to ``commit`` itself (``seed % 3``)."""
    a, b, feeds, prompts = prefill_twins(seed)
    assert a.requests[5].token_base == 0 and a.computed(5) == 8  # request 5 matched request 0's published pages
    rng = np.random.default_rng(100 + seed)
    steps = int(rng.integers(2, longest + 1))
    ran = int(rng.integers(1, steps + 1))
    rids = list(feeds)
    tokens = rng.integers(0, 50, (ran, len(rids)))  # row j: fed to step j + 1
    plan = first = a.schedule(feeds, steps=steps)
    twin = b.schedule(feeds)
    for name in PLAN_ARRAYS + ("input_ids",):
        if name != "cachestarts":
            assert np.array_equal(getattr(plan, name), getattr(twin, name)), name
    assert plan.fed_tokens == twin.fed_tokens
    b.commit(twin)
    mode = seed % 3  # 0: advance each step; 1: one advance over all the rows after they ran; 2: commit them
    if mode == 1 and ran > 1:
        last = a.advance(plan, tokens[1:])
    for j in range(1, ran):
        plan = a.advance(plan, tokens[j]) if mode == 0 else first.next_decode(tokens[j], steps - 1, later=j)
        twin = b.schedule_decode(rids, tokens[j])
        assert_same_decode_plans(plan, twin)
        b.commit(twin)
    if mode == 1 and ran > 1:
        plan = last
    if mode == 2:
        a.commit(first, tokens[1:] if ran > 1 else None)
    else:
        a.commit(plan)
    assert set(a.index.by_hash) == set(b.index.by_hash)
    for rid in rids:
        assert a.computed(rid) == b.computed(rid) and len(a.page_table(rid)) == len(b.page_table(rid))
        assert a.requests[rid].registered == b.requests[rid].registered
        assert a.pending_tokens(rid) == b.pending_tokens(rid) == []
    assert a.metrics()["pages_in_use"] == b.metrics()["pages_in_use"]
    a.check()
    context = prompts[6] + tokens[1:, rids.index(6)].tolist()  # request 6's, up to the last stored position
    hits = [m.add_request("late", context + [1]) for m in (a, b)]
    assert hits[0] == hits[1] == len(context) // 4 * 4  # every full page of it published, on both


def test_a_step_with_prompt_tokens_left_plans_no_decode_steps_and_an_abort_restores_all():
    """``schedule(feeds, steps)`` is refused with nothing changed where a request would still have prompt tokens
    after the step, or a chunk would pass max_pages with the steps; an abort of the steps planned after prompts'
    last chunks leaves the manager as it was."""
    a, _, feeds, _ = prefill_twins(0)
    before = manager_state(a)
    short = {**feeds, 7: feeds[7][:-1]}  # request 7's last prompt token not fed
    with pytest.raises(ValueError, match="request 7 has prompt tokens to feed after this step"):
        a.schedule(short, steps=2)
    with pytest.raises(ValueError, match="steps must be in"):
        a.schedule(feeds, steps=4 * 16 + 1)
    with pytest.raises(ValueError, match="max_pages"):
        a.schedule(feeds, steps=4 * 16)  # request 7's prompt and 64 more positions pass 16 pages
    assert manager_state(a) == before
    plan = a.schedule(feeds, steps=9)
    with pytest.raises(ValueError, match="commit: 9 rows of tokens, but only 8 planned steps are left"):
        a.commit(plan, np.ones((9, len(feeds)), np.int64))
    with pytest.raises(ValueError, match="commit: tokens"):
        a.commit(plan, [[1] * (len(feeds) + 1)])
    plan = a.advance(plan, [[1] * len(feeds), [2] * len(feeds)])  # the refused commits left the steps outstanding
    a.abort(plan)
    assert manager_state(a) == before
    a.commit(a.schedule(short))  # as one step it is fine


def test_advancing_by_one_row_then_several_then_one_goes_on_from_the_right_step():
    """Five decode steps planned at once, advanced by one row, then by two (the caller ran two steps itself), then by
    one: each plan is the twin's plan of that step (the plans' positions also stay as they were given once later
    steps are planned and committed)."""
    a, b = twins()
    rids = [0, 1, 2, 3]
    tokens = np.random.default_rng(7).integers(0, 50, (5, len(rids)))
    twin_plans = []
    for j in range(5):
        twin_plans.append(b.schedule_decode(rids, tokens[j]))
        b.commit(twin_plans[-1])
    plan = first = a.schedule_decode(rids, tokens[0], steps=5)
    assert_same_decode_plans(plan, twin_plans[0])
    positions = first.query_positions.copy()
    plan = a.advance(plan, tokens[1])
    assert_same_decode_plans(plan, twin_plans[1])
    plan = a.advance(plan, tokens[2:4])
    assert_same_decode_plans(plan, twin_plans[3])
    plan = a.advance(plan, tokens[4])
    assert_same_decode_plans(plan, twin_plans[4])
    a.commit(plan)
    a.commit(a.schedule_decode(rids, tokens[0]))
    assert a.computed(0) == b.computed(0) + 1
    a.check()
    assert a.schedule_decode(rids, tokens[1]).query_positions.tolist() == (positions + 6).tolist()
    assert first.query_positions.tolist() == positions.tolist()  # the first plan's, as given
