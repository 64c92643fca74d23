"""StreamingLLM in the manager, checked through a real cache: sinks + recent window, both policies.

Every token id is unique, its value row is the id itself and its key row is RoPE(raw(id), position), as a
model computes it. After every step the op's reference gathers each live request's cache, and:
values give the kept token ids — the sink tokens, then one contiguous run of the most recent tokens,
within the budget; keys equal RoPE at each token's current position (shift-RoPE-K: up to float32
rounding of the accumulated rotations; re-evaluation: exactly).
"""

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from kvcache_op.manager import KVCacheManager, OutOfPages, StreamingPolicy
from kvcache_op.reference import (cache_shape, key_cache_rotary_shift, key_value_cache, rotary_shift_tables)

PAGE, PAGES, MAX_PAGES, DH, SINKS, BUDGET = 4, 40, 6, 4, 3, 5
DISCARDS = {"shift": 0, "reevaluate": 0}


def raw_key(token):
    return np.array([np.cos(token), np.sin(token), 0.01 * token, 1.0], np.float64)


def rope(vector, position):
    z = vector[:2] + 1j * vector[2:]  # NeoX halves: pairs (0, 2), (1, 3)
    z = z * np.exp(1j * position * 10000.0 ** (-2.0 * np.arange(2) / DH))
    return np.concatenate([z.real, z.imag])


class StreamingMachine(RuleBasedStateMachine):
    mode = "shift"

    @initialize()
    def setup(self):
        self.m = KVCacheManager(PAGES, PAGE, MAX_PAGES, streaming=StreamingPolicy(SINKS, BUDGET, self.mode))
        self.cache = np.zeros(cache_shape(0, 1, PAGES * PAGE, 1, DH), np.float32)
        self.history = {}  # rid -> every token id fed so far, in order
        self.next_token = 1
        self.steps = 0

    def fresh(self, n):
        tokens = list(range(self.next_token, self.next_token + n))
        self.next_token += n
        return tokens

    @precondition(lambda self: len(self.m.requests) < 4 if hasattr(self, "m") else False)
    @rule(n=st.integers(1, 18))
    def admit(self, n):
        rid = len(self.history) + 1000 * self.steps
        self.m.add_request(rid, self.fresh(n))
        self.history[rid] = []

    @precondition(lambda self: len(self.m.requests) > 2 if hasattr(self, "m") else False)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.m.requests)))
        self.m.finish(rid)

    @precondition(lambda self: self.m.requests if hasattr(self, "m") else False)
    @rule(data=st.data())
    def step(self, data):
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.m.requests)), min_size=1, unique=True))
        feeds = {}
        for rid in chosen:
            r = self.m.requests[rid]
            pending = len(r.tokens) - r.computed
            feeds[rid] = (r.tokens[r.computed:r.computed + data.draw(st.integers(1, min(pending, 4)))]
                          if pending > 0 else self.fresh(1))
        try:
            plan = self.m.schedule(feeds)
        except OutOfPages:
            return
        self.steps += 1
        DISCARDS[self.mode] += sum(len(plan.fed_tokens[rid]) > len(feeds[rid]) for rid in plan.request_ids)
        DISCARDS[self.mode] += int(plan.shift_slots.size > 0)
        if plan.shift_slots.size:  # shift-RoPE-K before the step, as a serving loop does for every layer
            cos, sin = rotary_shift_tables(plan.shift_deltas, DH)
            key_cache_rotary_shift(self.cache, None, plan.shift_slots, cos, sin)
        keys, values = [], []
        for b, rid in enumerate(plan.request_ids):
            positions = plan.query_positions[plan.seqstarts[b]:plan.seqstarts[b + 1]]
            for token, pos in zip(plan.fed_tokens[rid], positions):
                keys.append(rope(raw_key(token), pos))
                values.append(float(token))
            self.history[rid] += [t for t in feeds[rid]]
        current_k = np.array(keys, np.float32).reshape(-1, 1, DH)
        current_v = np.repeat(np.array(values, np.float32)[:, None, None], DH, axis=2)
        key, value = key_value_cache(current_k, current_v, **plan.op_inputs(), cache=self.cache, cache_mode=1,
                                     page_size=PAGE)
        for b, rid in enumerate(plan.request_ids):
            rows = slice(plan.kvstarts[b], plan.kvstarts[b + 1])
            kept = value[rows, 0, 0].astype(int).tolist()
            history = self.history[rid]
            sinks = min(len(history), -(-SINKS // PAGE) * PAGE)
            assert kept[:sinks] == history[:sinks], "the sink tokens were not kept"
            tail = kept[sinks:]
            assert tail == history[len(history) - len(tail):], "kept tokens are not the most recent run"
            assert len(kept) <= BUDGET * PAGE
            want = np.array([rope(raw_key(t), p) for p, t in enumerate(kept)])
            tolerance = 1e-4 if self.mode == "shift" else 1e-6
            np.testing.assert_allclose(key[rows, 0], want, atol=tolerance)

    @invariant()
    def bookkeeping(self):
        if hasattr(self, "m"):
            self.m.check()
            for r in self.m.requests.values():
                assert len(r.pages) <= BUDGET


class ReevaluateMachine(StreamingMachine):
    mode = "reevaluate"


TestStreamingShift = StreamingMachine.TestCase
TestStreamingShift.settings = settings(stateful_step_count=50, deadline=None)
TestStreamingReevaluate = ReevaluateMachine.TestCase
TestStreamingReevaluate.settings = settings(stateful_step_count=50, deadline=None)


def test_streaming_policy_is_validated():
    with pytest.raises(ValueError, match="alternatives"):
        KVCacheManager(8, 4, 4, sliding_window=8, streaming=StreamingPolicy(4, 3))
    with pytest.raises(ValueError, match="budget_pages"):
        KVCacheManager(8, 4, 4, streaming=StreamingPolicy(4, 2))
    with pytest.raises(ValueError, match="'shift' or 'reevaluate'"):
        KVCacheManager(8, 4, 4, streaming=StreamingPolicy(4, 3, "drop"))


def test_a_long_decode_discards_and_shifts():
    m = KVCacheManager(16, 4, 6, streaming=StreamingPolicy(4, 5, "shift"))
    m.add_request("a", list(range(1, 20)))
    m.schedule({"a": list(range(1, 20))})  # 19 tokens: 5 pages, at the budget
    plan = m.schedule({"a": [99]})  # position 19 is still in page 4
    assert plan.shift_slots.size == 0
    plan = m.schedule({"a": [100]})  # needs a 6th page: drop 2 of the 4 pages after the sink page
    assert set(plan.shift_deltas.tolist()) == {-8} and plan.shift_slots.size == 8  # positions 12..19 kept
    assert m.requests["a"].tokens[:4] == [1, 2, 3, 4] and m.requests["a"].tokens[4] == 13
    assert int(plan.query_positions[0]) == 12 and len(m.page_table("a")) == 4


def test_the_streaming_machines_really_discard():
    for mode, machine in (("shift", StreamingMachine), ("reevaluate", ReevaluateMachine)):
        DISCARDS[mode] = 0
        run_state_machine_as_test(machine, settings=settings(max_examples=20, stateful_step_count=50,
                                                             deadline=None, derandomize=True))
        assert DISCARDS[mode] > 5, (mode, DISCARDS)
