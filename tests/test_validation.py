"""One test per validity condition: a clear KeyValueCacheError, and cache/scale byte-for-byte unchanged."""

import numpy as np
import pytest

from kvcache_op.reference import KeyValueCacheError, key_value_cache
from invalid_calls import INVALID, base, make_invalid


def snapshot(inputs):
    return {k: inputs[k].tobytes() for k in ("cache", "scale") if isinstance(inputs.get(k), np.ndarray)}


@pytest.mark.parametrize("row", INVALID, ids=[r[0] for r in INVALID])
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
