"""Offset-mode (cache_mode 0) allocation, checked through the op's reference on a real cache."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcache_op.manager import OffsetCacheManager, OutOfSlots
from kvcache_op.reference import cache_shape, key_value_cache


@given(st.lists(st.tuples(st.sampled_from(["admit", "step", "finish"]), st.integers(1, 12), st.integers(0, 10)),
                max_size=60))
def test_random_admit_step_finish_keeps_every_request_its_own_tokens(actions):
    max_t = 48
    m = OffsetCacheManager(max_t)
    cache = np.zeros(cache_shape(0, 1, max_t, 1, 2), np.float32)
    written = {}  # rid -> values written in order
    next_id = 0
    for kind, size, pick in actions:
        live = sorted(m.regions)
        if kind == "admit":
            try:
                m.add_request(next_id, size)
                written[next_id] = []
            except OutOfSlots:
                pass
            next_id += 1
        elif kind == "finish" and live:
            rid = live[pick % len(live)]
            m.finish(rid)
            del written[rid]
        elif kind == "step" and live:
            counts = {}
            for rid in live[pick % len(live):]:
                room = m.regions[rid].length - m.regions[rid].computed
                if room:
                    counts[rid] = min(room, 1 + pick % 3)
            if not counts:
                continue
            plan = m.schedule(counts)
            values = []
            for rid, n in counts.items():
                new = [1000.0 * rid + len(written[rid]) + i for i in range(n)]
                written[rid] += new
                values += new
            current = np.repeat(np.array(values, np.float32)[:, None, None], 2, axis=2)
            key, _ = key_value_cache(current, current, **plan.op_inputs(), cache=cache)
            for b, rid in enumerate(plan.request_ids):
                assert key[plan.kvstarts[b]:plan.kvstarts[b + 1], 0, 0].tolist() == written[rid]
        m.check()


def test_out_of_slots_is_typed_and_merging_restores_room():
    m = OffsetCacheManager(10)
    assert [m.add_request(i, 3) for i in range(3)] == [0, 3, 6]
    with pytest.raises(OutOfSlots) as error:
        m.add_request("big", 5)
    assert error.value.largest == 1
    m.finish(0)
    m.finish(1)  # merged with the freed run before it
    assert m.add_request("big", 6) == 0
    m.check()


def test_sizes_must_be_integers_and_nothing_is_truncated():
    with pytest.raises(TypeError, match="max_t must be an integer"):
        OffsetCacheManager(10.5)
    m = OffsetCacheManager(10)
    for bad in (2.9, "3", True):
        with pytest.raises(TypeError):
            m.add_request("a", bad)
    assert not m.regions
    m.add_request("a", 4)
    m.add_request("b", 4)
    with pytest.raises(TypeError):
        m.schedule({"a": 2, "b": 1.5})
    assert [r.computed for r in m.regions.values()] == [0, 0]
    plan = m.schedule({"a": np.int64(2)})
    assert plan.seqstarts.tolist() == [0, 2]


def test_a_full_cache_frees_its_last_region_and_out_of_slots_names_the_largest_run():
    """Regions filling every slot (no free run after the last one to merge); then two free runs of 2 and 3 slots:
    a request for 4 is refused naming 3, the largest, and its plan's positions start where each request stands."""
    m = OffsetCacheManager(10)
    starts = [m.add_request(rid, n) for rid, n in (("a", 2), ("b", 3), ("c", 2), ("d", 3))]
    assert starts == [0, 2, 5, 7]
    m.finish("d")  # the last region, nothing free after it
    m.check()
    assert m.add_request("d", 3) == 7
    m.finish("a")
    m.finish("d")
    m.check()
    with pytest.raises(OutOfSlots, match="need 4 contiguous slots, the largest free run has 3") as error:
        m.add_request("e", 4)
    assert (error.value.needed, error.value.largest) == (4, 3)
    m.schedule({"b": 2})
    plan = m.schedule({"b": 1, "c": 2})
    assert plan.query_positions.tolist() == [2, 0, 1] and plan.key_positions.tolist() == [0, 1, 2, 0, 1]
    assert plan.cachestarts.tolist() == [2, 5] and plan.start_pos.tolist() == [2, 0]


@pytest.mark.parametrize("count", [0, -1, 3])
def test_a_step_past_the_reservation_or_of_no_tokens_is_refused_and_changes_nothing(count):
    """Request "a" owns slots 0..3 and has computed 2: three more would write slot 4, "b"'s first."""
    m = OffsetCacheManager(8)
    m.add_request("a", 4)
    m.add_request("b", 4)
    m.schedule({"a": 2})
    with pytest.raises(ValueError, match=rf"request 'a': {count} tokens at position 2 overflow its reservation of 4"):
        m.schedule({"b": 1, "a": count})
    assert [r.computed for r in m.regions.values()] == [2, 0]
    assert m.schedule({"a": 2}).start_pos.tolist() == [2]  # exactly up to the end is allowed
