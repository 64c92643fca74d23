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


def test_the_reference_functions_that_only_read_leave_their_inputs_as_given():
    """apply_rope of float32 keys returns the rotated keys and leaves the given ones (numpy would hand back the same
    memory for a float32 array); the fused op's tolerance stores into copies of the cache and scale."""
    from kvcache_op.reference import apply_rope, cache_attention_tolerance

    keys = np.random.default_rng(3).standard_normal((5, 2, 8)).astype(np.float32)
    given = keys.copy()
    rotated = apply_rope(keys, np.arange(5) + 7)
    assert keys.tobytes() == given.tobytes() and not np.array_equal(rotated, given)

    for name in ("mhca_paged_int8_layout3", "mhca_offset_float16"):
        case = mhca_cases.CASES[name]()
        before = {k: case.inputs[k].tobytes() for k in ("cache", "scale") if case.inputs.get(k) is not None}
        bound = cache_attention_tolerance(**case.inputs, **case.attributes)
        assert bound.shape == case.inputs["query"].shape and (bound > 0).any()
        assert {k: case.inputs[k].tobytes() for k in before} == before, name
