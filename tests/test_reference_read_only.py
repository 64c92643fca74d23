"""The reference ops write the cache and scale in place: a read-only one is refused with KeyValueCacheError naming it,
before any write, so the other is left byte-for-byte as it was (a read-only scale used to be refused by numpy's own
error after the cache was already written)."""

import numpy as np
import pytest

from kvcache_op.reference import (KeyValueCacheError, key_cache_rotary_shift, key_value_cache,
                                  multi_head_cache_attention)
from kvcache_op.validation import cases, mhca_cases, rotary_cases

CALLS = [(key_value_cache, cases.CASES, "int8_layout0"),
         (multi_head_cache_attention, mhca_cases.CASES, "mhca_paged_int8_layout3"),
         (key_cache_rotary_shift, rotary_cases.CASES, "rotary_int8_layout1")]


@pytest.mark.parametrize("read_only", ["scale", "cache"])
@pytest.mark.parametrize("op, registry, name", CALLS, ids=[name for _, _, name in CALLS])
def test_a_read_only_cache_or_scale_is_refused_before_any_write(op, registry, name, read_only):
    case = registry[name]()
    inputs = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in case.inputs.items()}
    op(**{k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in inputs.items()}, **case.attributes)  # valid
    before = {k: inputs[k].tobytes() for k in ("cache", "scale")}
    inputs[read_only].setflags(write=False)
    with pytest.raises(KeyValueCacheError, match=f"{read_only} is read-only"):
        op(**inputs, **case.attributes)
    assert {k: inputs[k].tobytes() for k in ("cache", "scale")} == before
