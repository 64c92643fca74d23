"""StreamingLLM in the manager, checked through a real cache: sinks + recent window, both policies.

Every token id is unique, except a shared system prompt that many requests start with (so sink pages
are shared through the prefix cache). A token's value row is its id and its key row is
RoPE(raw(id), position), as a model computes it. The test keeps its own record of every request's
tokens (independent of the manager) and after every step the op's reference gathers each live
request's cache:

* values give the kept token ids — the request's own sink tokens, then one contiguous run of its most
  recent tokens, within the budget;
* keys equal RoPE at each token's current position (shift-RoPE-K: up to float32 rounding of the
  accumulated rotations; re-evaluation: exactly);
* every slot a step stores into lies in a page the request owns alone and that is not published, so
  no store can reach a shared sink page;
* the plan's fed tokens and query positions agree.

Steps feed several tokens at once (chunked prompts, multi-token decode), so discards often happen
while the last page is only partly filled.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from kvcache_op.manager import KVCacheManager, OutOfPages, StreamingPolicy
from kvcache_op.reference import (cache_shape, key_cache_rotary_shift, key_value_cache, rotary_shift_tables)
from manager_checks import assert_plan_inputs_agree, assert_stores_are_private

PAGE, PAGES, MAX_PAGES, DH, SINKS, BUDGET = 4, 40, 6, 4, 3, 5
SYSTEM = [1, 2, 3, 4, 5]  # a shared system prompt: its first page is the sink page
COVERAGE = {"shift": {}, "reevaluate": {}}


def raw_key(token):
    return np.array([np.cos(token), np.sin(token), 0.01 * token, 1.0], np.float64)


def rope(vector, position):
    z = vector[:2] + 1j * vector[2:]  # NeoX halves: pairs (0, 2), (1, 3)
    z = z * np.exp(1j * position * 10000.0 ** (-2.0 * np.arange(2) / DH))
    return np.concatenate([z.real, z.imag])


def count(mode, key, n=1):
    COVERAGE[mode][key] = COVERAGE[mode].get(key, 0) + n


class StreamingMachine(RuleBasedStateMachine):
    mode = "shift"

    @initialize()
    def setup(self):
        self.m = KVCacheManager(PAGES, PAGE, MAX_PAGES, streaming=StreamingPolicy(SINKS, BUDGET, self.mode))
        self.cache = np.zeros(cache_shape(0, 1, PAGES * PAGE, 1, DH), np.float32)
        self.seq = {}  # rid -> every token id of the request: prompt, then generated
        self.stored = {}  # rid -> how many of them are stored (the request's history)
        self.next_token = 100
        self.next_rid = 0

    def fresh(self, n):
        tokens = list(range(self.next_token, self.next_token + n))
        self.next_token += n
        return tokens

    @precondition(lambda self: hasattr(self, "m") and len(self.m.requests) < 4)
    @rule(n=st.integers(1, 18), shared=st.booleans())
    def admit(self, n, shared):
        rid, self.next_rid = self.next_rid, self.next_rid + 1
        prompt = (SYSTEM + self.fresh(n)) if shared else self.fresh(n)
        hit = self.m.add_request(rid, prompt)
        if hit:
            count(self.mode, "sink_hits")
            if COVERAGE[self.mode].get("discards", 0):
                count(self.mode, "sink_hits_after_discards")
        self.seq[rid], self.stored[rid] = prompt, hit

    @precondition(lambda self: hasattr(self, "m") and len(self.m.requests) > 2)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.m.requests)))
        self.m.finish(rid)

    def draw_feeds(self, data):
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.m.requests)), min_size=1, unique=True))
        feeds = {}
        for rid in chosen:
            pending = self.seq[rid][self.stored[rid]:]
            assert pending == self.m.pending_tokens(rid)
            if pending:
                feeds[rid] = pending[:data.draw(st.integers(1, min(len(pending), 6)))]
            else:  # decode, possibly several tokens at once (speculative decoding)
                feeds[rid] = self.fresh(data.draw(st.integers(1, 4)))
        return feeds

    @precondition(lambda self: hasattr(self, "m") and self.m.requests)
    @rule(data=st.data())
    def failed_step(self, data):
        """A step whose op never ran: aborting it leaves the manager as it was."""
        feeds = self.draw_feeds(data)
        before = ({rid: (self.m.page_table(rid), self.m.computed(rid), self.m.pending_tokens(rid))
                   for rid in self.m.requests}, list(self.m.pool.ref_count))
        try:
            plan = self.m.schedule(feeds)
        except (OutOfPages, ValueError):
            return
        self.m.abort(plan)
        after = ({rid: (self.m.page_table(rid), self.m.computed(rid), self.m.pending_tokens(rid))
                  for rid in self.m.requests}, list(self.m.pool.ref_count))
        assert after == before, "abort did not restore the manager"
        count(self.mode, "aborts")

    @precondition(lambda self: hasattr(self, "m") and self.m.requests)
    @rule(data=st.data())
    def step(self, data):
        feeds = self.draw_feeds(data)
        old_computed = {rid: self.m.computed(rid) for rid in feeds}
        try:
            plan = self.m.schedule(feeds)
        except OutOfPages:
            return
        except ValueError as error:  # a chunk that cannot fit the budget even after a full discard
            assert "streaming budget" in str(error)
            return
        assert_stores_are_private(self.m, plan, PAGE)
        assert_plan_inputs_agree(plan)
        for b, rid in enumerate(plan.request_ids):
            fed, n_q = plan.fed_tokens[rid], plan.seqstarts[b + 1] - plan.seqstarts[b]
            assert len(fed) == n_q, "fed tokens and query positions disagree"
            assert fed[len(fed) - len(feeds[rid]):] == feeds[rid]
            assert plan.start_pos[b] >= 0
            if len(fed) > len(feeds[rid]) or self.m.computed(rid) < old_computed[rid] + len(feeds[rid]):
                count(self.mode, "discards")
                if old_computed[rid] % PAGE:
                    count(self.mode, "partial_page_discards")
        if plan.shift_slots.size:  # shift-RoPE-K before the step, as a serving loop does for every layer
            cos, sin = rotary_shift_tables(plan.shift_deltas, DH)
            key_cache_rotary_shift(self.cache, None, plan.shift_slots, cos, sin)
        keys, values = [], []
        for b, rid in enumerate(plan.request_ids):
            positions = plan.query_positions[plan.seqstarts[b]:plan.seqstarts[b + 1]]
            for token, pos in zip(plan.fed_tokens[rid], positions):
                keys.append(rope(raw_key(token), pos))
                values.append(float(token))
            if rid in self.seq and self.stored[rid] + len(feeds[rid]) > len(self.seq[rid]):
                self.seq[rid] += feeds[rid][len(self.seq[rid]) - self.stored[rid]:]
            self.stored[rid] += len(feeds[rid])
        current_k = np.array(keys, np.float32).reshape(-1, 1, DH)
        current_v = np.repeat(np.array(values, np.float32)[:, None, None], DH, axis=2)
        key, value = key_value_cache(current_k, current_v, **plan.op_inputs(), cache=self.cache, cache_mode=1,
                                     page_size=PAGE)
        self.m.commit(plan)
        count(self.mode, "steps")
        for b, rid in enumerate(plan.request_ids):
            rows = slice(plan.kvstarts[b], plan.kvstarts[b + 1])
            kept = value[rows, 0, 0].astype(int).tolist()
            history = self.seq[rid][:self.stored[rid]]
            sinks = min(len(history), -(-SINKS // PAGE) * PAGE)
            assert kept[:sinks] == history[:sinks], "the sink tokens are not the request's own"
            tail = kept[sinks:]
            assert tail == history[len(history) - len(tail):], "kept tokens are not the most recent run"
            assert len(kept) <= BUDGET * PAGE
            want = np.array([rope(raw_key(t), p) for p, t in enumerate(kept)])
            tolerance = 1e-4 if self.mode == "shift" else 1e-6
            np.testing.assert_allclose(key[rows, 0], want, atol=tolerance)

    @invariant()
    def bookkeeping(self):
        if not hasattr(self, "m"):
            return
        self.m.check()
        for rid in self.m.requests:
            assert len(self.m.page_table(rid)) <= BUDGET


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
    with pytest.raises(TypeError, match="sinks must be an integer"):
        KVCacheManager(8, 4, 4, streaming=StreamingPolicy(4.5, 3))


def test_a_long_decode_discards_and_shifts():
    m = KVCacheManager(16, 4, 6, streaming=StreamingPolicy(4, 5, "shift"))
    m.add_request("a", list(range(1, 20)))
    m.commit(m.schedule({"a": list(range(1, 20))}))  # 19 tokens: 5 pages, at the budget
    plan = m.schedule({"a": [99]})  # position 19 is still in page 4
    assert plan.shift_slots.size == 0
    m.commit(plan)
    plan = m.schedule({"a": [100]})  # needs a 6th page: drop 2 of the 4 pages after the sink page
    assert set(plan.shift_deltas.tolist()) == {-8} and plan.shift_slots.size == 8  # positions 12..19 kept
    assert int(plan.query_positions[0]) == 12 and len(m.page_table("a")) == 4


@pytest.mark.parametrize("mode", ["shift", "reevaluate"])
def test_a_partly_filled_page_is_discarded_by_its_positions_not_a_whole_page(mode):
    """Sink page [1..4] shared with request b; a holds 2 tokens in its next page when a 7-token step
    overflows the 3-page budget. Only those 2 positions may be dropped: the step's tokens go to
    positions 4.., never into the shared sink page."""
    m = KVCacheManager(16, 4, 6, streaming=StreamingPolicy(4, 3, mode))
    m.add_request("a", [1, 2, 3, 4, 5, 6])
    m.commit(m.schedule({"a": [1, 2, 3, 4, 5, 6]}))
    assert m.add_request("b", [1, 2, 3, 4, 5, 6]) == 4  # b reads the sink page through the prefix cache
    plan = m.schedule({"a": [7, 8, 9, 10, 11, 12, 13]})
    assert plan.start_pos.tolist() == [4] and plan.query_positions.tolist() == list(range(4, 11))
    assert plan.fed_tokens["a"] == [7, 8, 9, 10, 11, 12, 13] and plan.shift_slots.size == 0
    assert_stores_are_private(m, plan, 4)


def test_the_streaming_machines_reach_partial_discards_and_shared_sinks():
    """Guards the machines above: they really discard (also with a partly filled page), share sink pages
    through the prefix cache after discards, and abort steps."""
    for mode, machine in (("shift", StreamingMachine), ("reevaluate", ReevaluateMachine)):
        COVERAGE[mode] = {}
        run_state_machine_as_test(machine, settings=settings(max_examples=25, stateful_step_count=50,
                                                             deadline=None, derandomize=True))
        seen = COVERAGE[mode]
        for key in ("discards", "partial_page_discards", "sink_hits_after_discards", "aborts"):
            assert seen.get(key, 0) > 3, (mode, seen)


def _feed_in_chunks(mode: str, stream: list, chunk_sizes: list) -> tuple:
    """A request whose prompt is ``stream``, fed in chunks of the given sizes, each cut to ``step_room``;
    returns what its cache holds afterwards: (computed, pages held, token ids at positions [0, computed))."""
    ps = 4
    manager = KVCacheManager(64, ps, 8, streaming=StreamingPolicy(sinks=4, budget_pages=6, mode=mode))
    manager.add_request("r", stream)
    sizes = iter(chunk_sizes)
    while manager.pending_tokens("r"):
        n = min(next(sizes, 1), manager.step_room("r"))
        manager.commit(manager.schedule({"r": manager.pending_tokens("r")[:n]}))
    computed = manager.computed("r")
    return computed, len(manager.page_table("r")), manager.requests["r"].known(0, computed)


@pytest.mark.parametrize("mode", ["shift", "reevaluate"])
@settings(max_examples=40, deadline=None)
@given(length=st.integers(1, 90), chunks=st.lists(st.integers(1, 40), max_size=40))
def test_the_cache_a_stream_leaves_does_not_depend_on_its_chunking(mode, length, chunks):
    """Fed at most step_room tokens a step, a request's discards happen at fixed points of its token stream:
    any chunking leaves the cache that one token per step leaves (what a recomputation after preemption, or
    another step budget, relies on)."""
    stream = list(range(1, length + 1))
    assert _feed_in_chunks(mode, stream, chunks) == _feed_in_chunks(mode, stream, [])


@pytest.mark.parametrize("budget_pages, room_pages", [(6, 3), (5, 2)])
def test_a_full_cache_may_take_as_many_tokens_as_one_discard_frees(budget_pages, room_pages):
    """From a full cache, step_room is what the standard discard frees, (pages after the sinks + 1) // 2 pages (5
    pages after one sink page: 3, rounded up; 4: 2); a step of that many tokens fills the budget again exactly."""
    ps = 4
    m = KVCacheManager(64, ps, 8, streaming=StreamingPolicy(sinks=4, budget_pages=budget_pages, mode="shift"))
    stream = list(range(1, 200))
    m.add_request("r", stream)
    m.commit(m.schedule({"r": stream[:budget_pages * ps]}))
    assert m.step_room("r") == room_pages * ps
    m.commit(m.schedule({"r": m.pending_tokens("r")[:room_pages * ps]}))
    assert m.computed("r") == budget_pages * ps and len(m.page_table("r")) == budget_pages
    m.check()
