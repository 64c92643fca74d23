"""Stateful tests of the cache manager against a simple model, checked through a real cache tensor.

After every step the op's reference runs on the manager's inputs; every live request must get back
exactly the keys and values it wrote, for the positions it should see, with prefix sharing, LRU
eviction, sliding windows, tenants, out-of-pages steps and aborted steps (the op never ran: its
pages must never be served as a prefix) in play; every step stores only into pages its request holds
alone. The test keeps its own record of each request's tokens. Dedicated long runs:
``HYPOTHESIS_PROFILE=long``.
"""

import copy
import zlib

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from kvcache_op.manager import KVCacheManager, OutOfPages, block_diagonal_causal_mask
from kvcache_op.reference import cache_shape, key_value_cache
from manager_checks import assert_plan_inputs_agree, assert_stores_are_private, manager_state

PAGE, PAGES, MAX_PAGES, HEADS, DH = 4, 20, 8, 1, 2
FAMILIES = [[7, 7, 1, 2, 3, 4, 5, 6, 9, 9], [7, 7, 1, 2, 8, 8, 8, 8], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]]


COVERAGE = {"steps": 0, "gathered": 0, "hit_tokens": 0, "evictions": 0, "out_of_pages": 0, "window_releases": 0,
            "aborts": 0, "hostile_refused": 0, "decode_steps": 0,
            "decode_steps_committed": 0}
HOSTILE_SALTS = [1, True, 1.0, ("tenant-b",), ["x"], {"tenant": "b"}]
HOSTILE_TOKENS = [[1.9], "123", [True], [2**31], [-1], [2**63], [7 + 2**61 - 1], [None]]


def key_of(salt, prefix) -> float:
    """The key a model would compute at the last position of ``prefix``: a function of the salt and the
    whole prefix, so equal cached prefixes (and only those) hold equal keys."""
    return float(zlib.crc32(repr((salt, tuple(prefix))).encode()) % 100003) + 0.25


class ManagerMachine(RuleBasedStateMachine):
    window = None

    @initialize()
    def setup(self):
        self.m = KVCacheManager(PAGES, PAGE, MAX_PAGES, sliding_window=self.window, cache_key=("float32",))
        self.cache = np.zeros(cache_shape(0, 1, PAGES * PAGE, HEADS, DH), np.float32)
        self.live = {}  # rid -> (salt, every token id of the request: prompt, then generated)
        self.next_id = 0
        self.steps = 0

    def capacity(self, rid):
        return MAX_PAGES * PAGE if self.window is None else 10_000

    @rule(family=st.integers(0, 2), cut=st.integers(1, 12), suffix=st.lists(st.integers(0, 3), max_size=6),
          salt=st.sampled_from([None, "tenant-b"]))
    def admit(self, family, cut, suffix, salt):
        prompt = FAMILIES[family][:cut] + suffix
        rid = self.next_id
        self.next_id += 1
        hit = self.m.add_request(rid, prompt, salt=salt)
        assert hit % PAGE == 0 and hit < len(prompt)
        self.live[rid] = (salt, list(prompt))

    @rule(data=st.data(), bad_salt=st.booleans())
    def hostile_request(self, data, bad_salt):
        """A hostile admission or feed (wrong salt type, non-integer or out-of-range token, late in a
        batch) is a TypeError/ValueError and changes nothing."""
        before = self.state()
        with pytest.raises((TypeError, ValueError)):
            if bad_salt or not self.live:
                self.m.add_request(self.next_id, [7, 7, 1], salt=data.draw(st.sampled_from(HOSTILE_SALTS)))
            else:
                feeds = self.draw_feeds(data)
                victim = data.draw(st.sampled_from(sorted(self.live)))
                feeds.pop(victim, None)
                feeds[victim] = data.draw(st.sampled_from(HOSTILE_TOKENS))  # the last of the batch
                self.m.schedule(feeds)
        assert self.state() == before, "a refused call changed the manager"
        COVERAGE["hostile_refused"] += 1

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.m.finish(rid)
        del self.live[rid]

    def draw_feeds(self, data):
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.live)), min_size=1, unique=True))
        feeds = {}
        for rid in chosen:
            remaining = self.m.pending_tokens(rid)
            assert self.m.has_pending_tokens(rid) == bool(remaining)
            if remaining:
                feeds[rid] = remaining[:data.draw(st.integers(1, len(remaining)))]
            elif self.m.computed(rid) < self.capacity(rid):
                feeds[rid] = [data.draw(st.integers(0, 3))]
        return feeds

    def state(self):
        return manager_state(self.m)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def failed_step(self, data):
        """The op of a planned step never runs (or fails): abort restores the manager exactly, and
        nothing the step would have written is ever served as a prefix (later steps check the keys)."""
        feeds = self.draw_feeds(data)
        if not feeds:
            return
        before, evictions = self.state(), self.m.pool.evictions
        try:
            plan = self.m.schedule(feeds)
        except OutOfPages:
            return
        self.m.abort(plan)
        if self.m.pool.evictions == evictions:  # an evicted page stays evicted (it may have been written)
            assert self.state() == before, "abort did not restore the manager"
        COVERAGE["aborts"] += 1

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def step(self, data):
        feeds = self.draw_feeds(data)
        if not feeds:
            return
        before = self.state()
        try:
            plan = self.m.schedule(feeds)
        except OutOfPages:
            assert self.state() == before, "OutOfPages changed the manager's state"
            COVERAGE["out_of_pages"] += 1
            return
        key, value = self.run_step(plan, feeds)
        self.m.commit(plan)
        self.check_gathered(plan, key, value)

    @precondition(lambda self: self.live and self.window is None)
    @rule(data=st.data())
    def decode_steps(self, data):
        """Decode steps planned at once (``schedule_decode(..., steps)``, then ``advance``): every step stores only
        into pages its request holds alone and gathers exactly the keys its request wrote; committed after any
        number of them, the requests end where that many steps end them, and prefix sharing stays exact (later
        steps check the keys); aborted, the manager is as before."""
        decoding = [rid for rid in sorted(self.live) if not self.m.has_pending_tokens(rid)]
        if not decoding:
            return
        rids = data.draw(st.lists(st.sampled_from(decoding), min_size=1, unique=True))
        steps = data.draw(st.integers(2, PAGE))
        if any(self.m.computed(rid) + steps > self.capacity(rid) for rid in rids):
            return
        before, evictions, live = self.state(), self.m.pool.evictions, copy.deepcopy(self.live)
        ends = [self.m.computed(rid) for rid in rids]
        draw_tokens = lambda: data.draw(st.lists(st.integers(0, 3), min_size=len(rids), max_size=len(rids)))
        tokens = draw_tokens()
        try:
            plan = self.m.schedule_decode(rids, tokens, steps=steps)
        except OutOfPages:
            assert self.state() == before, "OutOfPages changed the manager's state"
            return
        ran = data.draw(st.integers(1, steps))
        for j in range(ran):
            if j:
                tokens = draw_tokens()
                plan = self.m.advance(plan, tokens)
            key, value = self.run_step(plan, {rid: [t] for rid, t in zip(rids, tokens)})
            self.check_gathered(plan, key, value)
            COVERAGE["decode_steps"] += 1
        if data.draw(st.booleans()):
            self.m.abort(plan)
            self.live = live
            if self.m.pool.evictions == evictions:
                assert self.state() == before, "abort did not restore the manager"
            return
        self.m.commit(plan)
        assert [self.m.computed(rid) for rid in rids] == [end + ran for end in ends]
        COVERAGE["decode_steps_committed"] += 1

    def run_step(self, plan, feeds):
        """Stores the plan's keys (each a function of its request's whole prefix, from the test's own record of
        its tokens) with the op's reference and returns what it gathers."""
        assert_stores_are_private(self.m, plan, PAGE)
        assert_plan_inputs_agree(plan)
        self.steps += 1
        current = []
        for b, rid in enumerate(plan.request_ids):
            salt, tokens = self.live[rid]
            positions = plan.query_positions[plan.seqstarts[b]:plan.seqstarts[b + 1]].tolist()
            tokens[positions[0]:positions[-1] + 1] = feeds[rid]
            for pos in positions:
                current.append(np.full((HEADS, DH), key_of(salt, tokens[:pos + 1]), np.float32))
        current = np.stack(current)
        return key_value_cache(current, -current, **plan.op_inputs(), cache=self.cache, cache_mode=1, page_size=PAGE)

    def check_gathered(self, plan, key, value):
        """Every request got back exactly the keys of its own prefix, for the positions it should see."""
        for b, rid in enumerate(plan.request_ids):
            salt, tokens = self.live[rid]
            rows = slice(plan.kvstarts[b], plan.kvstarts[b + 1])
            positions = plan.key_positions[rows]
            want = [key_of(salt, tokens[:p + 1]) for p in positions]
            assert key[rows, 0, 0].tolist() == want, f"request {rid} got another prompt's keys"
            assert np.array_equal(value[rows], -key[rows])
            if self.window is not None:
                first_query = plan.query_positions[plan.seqstarts[b]]
                assert positions[0] <= max(0, first_query - self.window + 1), "a needed key was released"
        COVERAGE["steps"] += 1
        COVERAGE["gathered"] += key.shape[0]
        COVERAGE["window_releases"] += int((plan.key_positions[plan.kvstarts[:-1]] >= PAGE).sum())
        mask = block_diagonal_causal_mask(plan.seqstarts, plan.kvstarts, plan.query_positions,
                                          plan.key_positions, self.window)
        assert mask.any(axis=1).all(), "every query sees at least its own key"

    def teardown(self):
        if hasattr(self, "m"):
            COVERAGE["hit_tokens"] += self.m.metrics()["hit_tokens"]
            COVERAGE["evictions"] += self.m.metrics()["evictions"]

    @invariant()
    def bookkeeping(self):
        if hasattr(self, "m"):
            self.m.check()
            if self.window is not None:
                for rid in self.m.requests:  # memory per sequence bounded by the window (+ one chunk)
                    assert len(self.m.page_table(rid)) <= -(-(self.window + 12) // PAGE) + 1


class WindowedManagerMachine(ManagerMachine):
    window = 6


TestManager = ManagerMachine.TestCase
TestManager.settings = settings(stateful_step_count=40, deadline=None)
TestWindowedManager = WindowedManagerMachine.TestCase
TestWindowedManager.settings = settings(stateful_step_count=40, deadline=None)


def test_the_machines_exercise_sharing_eviction_windows_and_out_of_pages():
    """Guards the tests above: the random runs really reach every mechanism they claim to check."""
    for key in COVERAGE:
        COVERAGE[key] = 0
    run_state_machine_as_test(ManagerMachine, settings=settings(max_examples=40, stateful_step_count=40,
                                                                deadline=None, derandomize=True))
    run_state_machine_as_test(WindowedManagerMachine, settings=settings(max_examples=40, stateful_step_count=40,
                                                                        deadline=None, derandomize=True))
    assert COVERAGE["steps"] > 100 and COVERAGE["gathered"] > 1000, COVERAGE
    assert COVERAGE["hit_tokens"] > 0 and COVERAGE["evictions"] > 0, COVERAGE
    assert COVERAGE["out_of_pages"] > 0 and COVERAGE["window_releases"] > 0, COVERAGE
    assert COVERAGE["aborts"] > 0 and COVERAGE["hostile_refused"] > 0, COVERAGE
    assert COVERAGE["decode_steps"] > 20 and COVERAGE["decode_steps_committed"] > 3, COVERAGE
