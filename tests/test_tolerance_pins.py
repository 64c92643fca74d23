"""Every tolerance the validation kit applies, pinned just inside and just outside its bound: loosening or
tightening any of them by a few percent (or by one float32 step) fails here."""

import numpy as np
import pytest

import planted_backends

from kvcache_op.reference import attention_tolerance
from kvcache_op.validation.cases import CASES, MIXED, build
from kvcache_op.validation.compare import compare
from kvcache_op.validation.mha_cases import ATTENTION_CASES
from kvcache_op.validation.outcome import Outcome, reference_outcome
from kvcache_op.validation.slot_map import SlotMap
from kvcache_op.validation.tolerance import codes_outside, ulp

ATTENTION = ["mha_sliding_window1_float32", "mha_alibi_heads6_gqa", "mha_sliding_window3"]


def _attention(name):
    case = ATTENTION_CASES[name]()
    return case, reference_outcome("MultiHeadAttention", case.inputs, case.attributes)


@pytest.mark.parametrize("name", ATTENTION)
def test_the_kit_holds_attention_to_twice_the_specs_bound(name):
    case, want = _attention(name)
    np.testing.assert_array_equal(want.tolerance, 2 * attention_tolerance(**case.inputs, **case.attributes))


@pytest.mark.parametrize("name", ATTENTION)
@pytest.mark.parametrize("factor, passes", [(0.98, True), (1.02, False)])
def test_attention_just_inside_passes_and_just_outside_fails(name, factor, passes):
    """Each element moved by ``factor`` times its recorded bound (where the output's rounding keeps it on that
    side of the bound), one element at a time set to the largest such move."""
    case, want = _attention(name)
    output, bound = want.outputs["attention_output"], want.tolerance
    moved = (output.astype(np.float64) + factor * bound).astype(output.dtype)
    distance = np.abs(moved.astype(np.float64) - output.astype(np.float64))
    on_its_side = (distance <= bound) if passes else (distance > bound)
    assert on_its_side.any(), "no element where the output's precision can show this factor"
    got_output = np.where(on_its_side, moved, output)
    got = Outcome({"attention_output": got_output}, {})
    for mode in ("exact", "spec"):
        lines = compare("MultiHeadAttention", case.inputs, case.attributes, want, got, mode)
        assert (lines == []) == passes, lines


def _scale_moved(steps_of_float32: int):
    """int8, float16 values, float32 scale: a stored scale moved by half a float16 ulp plus ``steps`` float32
    ulps (the spec's bound is half a float16 ulp plus one float32 ulp)."""
    case = CASES["int8_layout0"]()
    want = reference_outcome("KeyValueCache", case.inputs, case.attributes)
    assert want.after["scale"].dtype == np.float32 and case.inputs["current_key"].dtype == np.float16
    got = Outcome({k: v.copy() for k, v in want.outputs.items()}, {k: v.copy() for k, v in want.after.items()})
    stored = SlotMap(case.inputs, case.attributes).stored(scale=True)
    index = np.unravel_index(int(np.flatnonzero(stored & (want.after["scale"] > 0))[0]), stored.shape)
    value = np.float64(want.after["scale"][index])
    moved = value + 0.5 * float(ulp(value, np.float16)) + steps_of_float32 * float(ulp(value, np.float32))
    got.after["scale"][index] = np.float32(moved)
    assert np.float64(got.after["scale"][index]) == moved  # exactly on the float32 grid
    planted_backends.decode_outputs(case, got)  # its outputs decoded with the scale it holds
    return compare("KeyValueCache", case.inputs, case.attributes, want, got, "spec")


def test_a_scale_at_the_bound_passes_and_one_float32_step_past_it_fails():
    assert _scale_moved(1) == []
    assert _scale_moved(2) and _scale_moved(2)[0].startswith("scale: 1 of ")


def _one_code_moved_to(value: float, code: int):
    """int8, float32 values and scales, one group [127, value, 0, 0] (scale 1.0, so value is its own quotient) whose
    second code the backend stores as ``code``, its outputs decoded from what it holds: the spec-mode lines."""
    case = build("pin-code", MIXED, quant_bit=8, quant_group=4, t1="float32", t3="float32")
    case.inputs["current_key"][0, 0, 0:4] = [127.0, value, 0.0, 0.0]
    want = reference_outcome("KeyValueCache", case.inputs, case.attributes)
    assert want.after["scale"].reshape(-1)[SlotMap(case.inputs, case.attributes).source(0, True)[0, 0, 1]] == 1.0
    got = Outcome({k: v.copy() for k, v in want.outputs.items()}, {k: v.copy() for k, v in want.after.items()})
    got.after["cache"].reshape(-1)[SlotMap(case.inputs, case.attributes).source(0)[0, 0, 1]] = code
    planted_backends.decode_outputs(case, got)
    return compare("KeyValueCache", case.inputs, case.attributes, want, got, "spec")


def test_a_code_half_a_step_plus_the_float16_quotient_rounding_off_passes_and_past_it_fails():
    """The rule: |code' - q| <= 1/2 + ulp_fp16(q) + |q| ulp_T3(scale') / scale' + 2^-10; at q = 10.5..., ulp_fp16 is
    2^-7 (0.0078), so code 10 is inside up to q = 10.5088 (float32 scale 1: the scale term is 2^-20)."""
    assert _one_code_moved_to(10.5078, 11) == [] and _one_code_moved_to(10.5078, 10) == []
    lines = _one_code_moved_to(10.5098, 10)
    assert len(lines) == 1 and lines[0].startswith("cache: 1 of "), lines


def test_a_stored_code_one_from_the_spec_passes_the_code_rule_and_two_fail_it_and_history_codes_allow_none():
    """The table's code rule alone (the own-scale rule aside): within +-1 in the slots the call stores, equal
    elsewhere."""
    want = np.array([-74, -74, -74, 5, 5, 5], np.int8)
    got = np.array([-75, -76, -72, 5, 6, 4], np.int8)
    stored = np.array([True, True, True, False, False, False])
    assert codes_outside(got, want, stored).tolist() == [False, True, True, False, True, True]
