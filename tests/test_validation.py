"""One test per validity condition: a clear KeyValueCacheError, and cache/scale byte-for-byte unchanged; and
the paged bounds at their edges (a page table one page short is refused, untouched pages are never read)."""

import numpy as np
import pytest

from kvcache_op.reference import KeyValueCacheError, key_value_cache
from invalid_calls import INVALID, MORE_INVALID, base, make_invalid


def snapshot(inputs):
    return {k: inputs[k].tobytes() for k in ("cache", "scale") if isinstance(inputs.get(k), np.ndarray)}


@pytest.mark.parametrize("row", INVALID + MORE_INVALID, ids=[r[0] for r in INVALID + MORE_INVALID])
def test_invalid_input_raises_and_writes_nothing(row):
    inputs, attrs = make_invalid(row)
    before = snapshot(inputs)
    with pytest.raises(KeyValueCacheError, match=row[3]):
        key_value_cache(**inputs, **attrs)
    assert snapshot(inputs) == before


@pytest.mark.parametrize("name", ["offset", "paged", "offset_int8", "paged_int4"])
def test_every_base_call_is_valid(name):
    """The rows above fail because of their mutation, not because the base call is already invalid."""
    case = base(name)
    key, _ = key_value_cache(**case.inputs, **case.attributes)
    assert key.shape[0] == case.inputs["kvstarts"][-1]


def test_errors_are_value_errors():
    assert issubclass(KeyValueCacheError, ValueError)


def _paged_call(current, seqlen, kvlen, table, start, cache):
    """One sequence, page_size 4, values the negated keys."""
    return key_value_cache(current, -current, np.array([0, seqlen]), np.array([0, kvlen]), np.array([table]),
                           np.array([start]), np.array(seqlen), np.array(kvlen), cache, cache_mode=1, page_size=4)


def test_a_call_touching_one_position_past_its_page_table_is_refused_by_name():
    """Five positions need two pages of 4: a one-page table is the MaxP error, with nothing written (four
    positions fit it)."""
    cache = np.zeros((8, 1, 2, 1, 2), np.float32)
    current = np.ones((5, 1, 2), np.float32)
    with pytest.raises(KeyValueCacheError, match=r"sequence 0 touches position 4, which is in page 1, but "
                                                 r"cachestarts has MaxP = 1 pages"):
        _paged_call(current, 5, 5, [0], 0, cache)
    assert not cache.any()
    key, _ = _paged_call(current[:4], 4, 4, [0], 0, cache)
    assert key.tolist() == current[:4].tolist() and cache[:4, 0, 0].tolist() == current[:4].tolist()


def test_pages_a_call_does_not_touch_may_hold_minus_one_even_before_a_touched_page():
    """Storing position 4 (page 1) and loading nothing touches page 1 alone: page 0's -1 is never read, and
    the token lands in slot cachestarts[0, 1] + 0 = 0."""
    cache = np.arange(8 * 2 * 2, dtype=np.float32).reshape(8, 1, 2, 1, 2)
    want = cache.copy()
    want[0, 0, 0, 0], want[0, 0, 1, 0] = [5, 6], [-5, -6]
    key, value = _paged_call(np.array([[[5, 6]]], np.float32), 1, 0, [-1, 0], 4, cache)
    assert key.shape == value.shape == (0, 1, 2)
    np.testing.assert_array_equal(cache, want)
