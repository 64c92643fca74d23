"""The reference agrees exactly with an independent per-token transliteration of the spec."""

import pytest
from hypothesis import given

from kvcache_op.reference import key_value_cache
from naive_reference import naive_key_value_cache
from strategies import COMBINATIONS, calls_for


def run_both(case):
    inputs = {k: (None if v is None else v.copy()) for k, v in case.inputs.items()}
    key, value = key_value_cache(**inputs, **case.attributes)
    i = case.inputs
    nk, nv, ncache, nscale = naive_key_value_cache(
        i["current_key"], i["current_value"], i["seqstarts"], i["kvstarts"], i["cachestarts"], i["start_pos"],
        i["cache"], i["scale"], **case.attributes)
    return (key, value, inputs["cache"], inputs["scale"]), (nk, nv, ncache, nscale)


@pytest.mark.parametrize("combo", COMBINATIONS, ids=lambda c: f"q{c[0]}-mode{c[1]}-layout{c[2]}")
def test_reference_matches_naive_transliteration(combo):
    @given(calls_for(combo))
    def check(case):
        got, want = run_both(case)
        for name, g, w in zip(("key", "value", "cache", "scale"), got, want):
            if w is None:
                assert g is None, name
                continue
            assert g.dtype == w.dtype and g.shape == w.shape, name
            assert g.tobytes() == w.tobytes(), name

    check()
