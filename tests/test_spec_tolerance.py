"""The tolerance table of spec/KeyValueCache.md (``--tolerance spec``): ppl's arithmetic passes it and fails the
exact mode, the table's two ppl-specific bounds are needed (a one-ulp rule would reject ppl), and nothing
outside the table is accepted."""

import numpy as np
import pytest

import planted_backends
from kvcache_op.validation import vectors
from kvcache_op.validation.cases import CASES, MIXED, build
from kvcache_op.validation.mhca_cases import CASES as CACHE_ATTENTION_CASES
from kvcache_op.validation.outcome import Outcome, copies, reference_outcome
from kvcache_op.validation.adapters import CallableBackend
from kvcache_op.validation.compare import compare
from kvcache_op.validation.slot_map import SlotMap
from kvcache_op.validation.tolerance import ulp
from kvcache_op.validation.validate import validate
from kvcache_op.validation import fuzz

PPL = CallableBackend({"KeyValueCache": planted_backends.ppl_style}, "ppl_style")


@pytest.fixture(scope="module")
def kv_vectors(tmp_path_factory):
    out = tmp_path_factory.mktemp("kv")
    vectors.write_conformance(out, [n for n in vectors.ALL_CASES if vectors.ALL_CASES[n]().op == "KeyValueCache"], progress=None)
    return out


def test_ppl_arithmetic_passes_the_spec_tolerance_and_fails_exact(kv_vectors):
    spec = validate(kv_vectors, PPL, tolerance="spec")
    assert [r.name for r in spec.results if r.status != "ok"] == []
    exact = validate(kv_vectors, PPL, tolerance="exact")
    failed = {r.name for r in exact.results if r.status == "FAIL"}
    quantized = {n for n, make in CASES.items() if make().attributes["quant_bit"]}
    assert failed and failed <= quantized, failed - quantized  # unquantized data movement is exact in ppl too
    assert len(failed) >= len(quantized) // 2


def _ppl_and_spec(case):
    got = PPL.run("KeyValueCache", copies(case.inputs), case.attributes)
    want = reference_outcome("KeyValueCache", case.inputs, case.attributes)
    assert compare("KeyValueCache", case.inputs, case.attributes, want, got, "spec") == []
    return got, want


def test_float16_input_float32_scale_differs_by_up_to_half_a_float16_ulp():
    """ppl computes the scale in float16 and stores it into the float32 tensor: thousands of float32 ulps."""
    case = build("ppl-scale", MIXED, heads=4, head_dim=64, quant_bit=8, t1="float16", t3="float32")
    got, want = _ppl_and_spec(case)
    stored = SlotMap(case.inputs, case.attributes).stored(scale=True)
    g, w = got.after["scale"][stored].astype(np.float64), want.after["scale"][stored].astype(np.float64)
    in_float32_ulps = np.abs(g - w) / ulp(w, np.float32)
    assert in_float32_ulps.max() > 1000  # a "1 ulp of T3" rule would reject ppl
    assert np.all(np.abs(g - w) <= ulp(w, np.float16) / 2 + ulp(w, np.float32))


def test_float32_input_float16_scale_exceeds_one_code_step_plus_float32_rounding():
    """ppl dequantizes in float16: with a code off by one, the output differs by more than 1 * scale plus
    T1's rounding (the old bound), and by no more than the table's bound."""
    case = build("ppl-output", MIXED, heads=4, head_dim=64, quant_bit=8, t1="float32", t3="float16")
    got, want = _ppl_and_spec(case)
    slots = SlotMap(case.inputs, case.attributes)
    scales = want.after["scale"].astype(np.float64).reshape(-1)[slots.source(0, scale=True)]
    out, expected = got.outputs["key"].astype(np.float64), want.outputs["key"].astype(np.float64)
    old_bound = scales + ulp(expected, np.float32) / 2
    excess = (np.abs(out - expected) - ulp(expected, np.float32) / 2) / scales
    assert np.any(np.abs(out - expected) > old_bound)
    assert 1.0 < excess.max() < 1.1  # "up to about 5%"


def _perturbed(case, change):
    """The reference's outcome, and a copy with ``change(outcome, slots)`` applied."""
    want = reference_outcome("KeyValueCache", case.inputs, case.attributes)
    got = Outcome({k: v.copy() for k, v in want.outputs.items()}, {k: v.copy() for k, v in want.after.items()})
    change(got, SlotMap(case.inputs, case.attributes))
    return {mode: compare("KeyValueCache", case.inputs, case.attributes, want, got, mode) for mode in ("exact", "spec")}


def _code_at(stored: bool, delta: int):
    def change(got, slots):
        mask = slots.stored() if stored else ~slots.stored()
        index = np.unravel_index(int(np.flatnonzero(mask)[0]), mask.shape)
        code = int(got.after["cache"][index])
        got.after["cache"][index] = code - delta if code > 0 else code + delta
    return change


@pytest.mark.parametrize("change", [
    _code_at(stored=True, delta=1),  # no rounding to nearest of its value gives it: a bias
    _code_at(stored=True, delta=2),
    _code_at(stored=False, delta=1),  # history: never re-quantized, must be exact
])
def test_a_code_moved_off_its_rounding_fails_spec(change):
    result = _perturbed(CASES["int8_layout0"](), change)
    assert result["exact"] and result["exact"][0].startswith("cache: 1 of ")
    assert result["spec"] and any(line.startswith("cache: ") for line in result["spec"]), result["spec"]


TIES_AWAY = CallableBackend({"KeyValueCache": planted_backends.ties_away}, "ties_away")


def _ties_away_and_spec(name):
    case = CASES[name]()
    got = TIES_AWAY.run("KeyValueCache", copies(case.inputs), case.attributes)
    return case, got, reference_outcome("KeyValueCache", case.inputs, case.attributes)


@pytest.mark.parametrize("name", ["quant_special_values", "quant_ties_int4"])
def test_ties_rounded_away_from_zero_pass_spec_and_fail_exact(name):
    """Half away from zero is a rounding to nearest too: its codes differ by one at exact ties, within the table."""
    case, got, want = _ties_away_and_spec(name)
    assert any(line.startswith("cache: ") for line in compare("KeyValueCache", case.inputs, case.attributes, want,
                                                              got, "exact"))
    assert compare("KeyValueCache", case.inputs, case.attributes, want, got, "spec") == []


@pytest.mark.parametrize("bug", sorted(planted_backends._CODE_BUGS))
def test_codes_their_own_scales_do_not_explain_fail_spec(bug):
    """Codes within the table's +-1 but not their values over the backend's own scales rounded to nearest (biased,
    past qmax, flushed), with outputs decoded from them: each fails some quantized case, at its cache."""
    backend = CallableBackend({"KeyValueCache": planted_backends._backend(bug)}, bug)
    lines = []
    for make in CASES.values():
        case = make()
        if case.attributes["quant_bit"]:
            got = backend.run("KeyValueCache", copies(case.inputs), case.attributes)
            want = reference_outcome("KeyValueCache", case.inputs, case.attributes)
            lines += compare("KeyValueCache", case.inputs, case.attributes, want, got, "spec")
    assert any("stored codes are not their input over the backend's own scale" in line for line in lines), lines


def test_an_output_that_is_not_its_own_cache_decoded_fails_spec():
    """A tie stored rounded away (code 1 where the spec holds 0) but output one step the other way (-scale): one
    step from the spec's output, which (O) alone allows, and two from what the backend itself holds."""
    case, got, want = _ties_away_and_spec("quant_special_values")
    slots = SlotMap(case.inputs, case.attributes)
    codes, spec_codes = (o.after["cache"].astype(np.int8).reshape(-1) for o in (got, want))
    element = tuple(np.argwhere(np.isin(slots.source(0), np.flatnonzero(codes != spec_codes)))[0])
    at, scale = slots.source(0)[element], got.after["scale"].astype(np.float64).reshape(-1)[slots.source(0, True)[element]]
    got.outputs["key"][element] = (2 * int(spec_codes[at]) - int(codes[at])) * scale
    lines = compare("KeyValueCache", case.inputs, case.attributes, want, got, "spec")
    assert lines and lines[0].startswith("key: 1 of "), lines


@pytest.mark.parametrize("factor, spec_accepts", [(0.5, True), (3.0, False)])
def test_a_stored_scale_within_half_a_float16_ulp_plus_one_float32_ulp(factor, spec_accepts):
    """T1 float16, T3 float32: a stored scale may move by up to ulp_fp16/2 + ulp_fp32, not more."""
    def change(got, slots):
        index = np.unravel_index(int(np.flatnonzero(slots.stored(scale=True))[0]), got.after["scale"].shape)
        value = np.float64(got.after["scale"][index])
        got.after["scale"][index] = np.float32(value + factor * ulp(value, np.float16))
        planted_backends.decode_outputs(case, got)  # its outputs decoded with the scale it holds

    case = CASES["int8_layout0"]()
    result = _perturbed(case, change)
    assert result["exact"] and (result["spec"] == []) == spec_accepts, result["spec"]


@pytest.mark.parametrize("past, spec_accepts", [(0, True), (1, False)])
def test_a_stored_scale_exactly_at_the_bound_passes_and_one_float32_step_past_it_fails(past, spec_accepts):
    """The bound is inclusive: a stored scale exactly ulp_fp16/2 + ulp_fp32 above the expected one passes (both
    terms are powers of two, so the sum is a float32), the next float32 up does not."""
    def change(got, slots):
        index = np.unravel_index(int(np.flatnonzero(slots.stored(scale=True))[0]), got.after["scale"].shape)
        value = np.float64(got.after["scale"][index])
        bound = 0.5 * ulp(value, np.float16) + ulp(value, np.float32)
        moved = np.float32(value + bound)
        assert np.float64(moved) == value + bound and ulp(moved, np.float16) == ulp(value, np.float16)
        for _ in range(past):
            moved = np.nextafter(moved, np.float32(np.inf))
        got.after["scale"][index] = moved
        planted_backends.decode_outputs(case, got)

    case = CASES["int8_layout0"]()
    result = _perturbed(case, change)
    assert result["exact"] and (result["spec"] == []) == spec_accepts, result["spec"]
    assert spec_accepts or result["spec"][0].startswith("scale: 1 of "), result["spec"]


def test_a_history_scale_moved_by_one_float32_step_fails_spec():
    """Scales the call does not store are history: the table allows them no difference at all."""
    def change(got, slots):
        index = np.unravel_index(int(np.flatnonzero(~slots.stored(scale=True))[-1]), got.after["scale"].shape)
        got.after["scale"][index] = np.nextafter(got.after["scale"][index], np.float32(np.inf))

    result = _perturbed(CASES["int8_layout0"](), change)
    assert result["exact"] and len(result["spec"]) == 1 and result["spec"][0].startswith("scale: 1 of "), result


def test_a_code_stored_below_minus_qmax_fails_spec_in_every_quantized_case_that_stores_minus_qmax():
    """-qmax - 1 is never a rounding to nearest of a clipped quotient, whatever T1: a bfloat16 quotient's coarse
    rounding puts it near enough to -qmax, yet it is outside."""
    bug = "minus_qmax_stored_one_below"
    backend = CallableBackend({"KeyValueCache": planted_backends._backend(bug)}, bug)
    passed, moved = [], set()
    for name, make in CASES.items():
        case = make()
        if not case.attributes["quant_bit"]:
            continue
        got = backend.run("KeyValueCache", copies(case.inputs), case.attributes)
        want = reference_outcome("KeyValueCache", case.inputs, case.attributes)
        if np.array_equal(got.after["cache"].astype(np.int8), want.after["cache"].astype(np.int8)):
            continue
        moved.add(str(case.inputs["current_key"].dtype))
        lines = compare("KeyValueCache", case.inputs, case.attributes, want, got, "spec")
        if not any("stored codes are not their input over the backend's own scale" in line for line in lines):
            passed.append(name)
    assert moved == {"float16", "float32", "bfloat16"} and passed == []


def test_an_unquantized_output_one_ulp_off_fails_both_modes():
    def change(got, slots):
        key = got.outputs["key"]
        key.reshape(-1).view(np.uint16)[0] += 1

    result = _perturbed(CASES["offset_layout0"](), change)
    assert result["exact"] == result["spec"] and result["spec"][0].startswith("key: 1 of ")


def test_a_quantized_output_not_explained_by_its_codes_fails_spec():
    """An output two code steps away while the caches agree is outside (O)."""
    def change(got, slots):
        scale = got.after["scale"].astype(np.float64).reshape(-1)[slots.source(0, scale=True)]
        got.outputs["key"][0, 0, 0] += np.float16(2 * scale[0, 0, 0])

    result = _perturbed(CASES["int8_layout0"](), change)
    assert result["spec"] and result["spec"][0].startswith("key: 1 of ") and "code got" in result["spec"][0]


def _quantized_cache_attention_cases():
    cases = (make() for make in CACHE_ATTENTION_CASES.values())
    return [case for case in cases if case.attributes.get("quant_bit")]


def _cache_attention_lines(backend, case, mode):
    got = backend.run("MultiHeadCacheAttention", copies(case.inputs), case.attributes)
    want = reference_outcome("MultiHeadCacheAttention", case.inputs, case.attributes)
    return compare("MultiHeadCacheAttention", case.inputs, case.attributes, want, got, mode)


def test_ppl_arithmetic_cache_attention_passes_the_spec_tolerance_over_its_own_cache():
    """A fused op whose stores follow ppl's arithmetic (within the table) attends over its own codes and scales:
    its output is held to the bound over the keys in its cache, not the reference's (over the reference's keys,
    three quantized cases failed)."""
    ppl = CallableBackend({"MultiHeadCacheAttention": planted_backends.ppl_style_cache_attention}, "ppl_style")
    cases = _quantized_cache_attention_cases()
    assert cases
    assert {c.name: _cache_attention_lines(ppl, c, "spec") for c in cases} == {c.name: [] for c in cases}
    assert any(_cache_attention_lines(ppl, c, "exact") for c in cases)  # its cache is not the reference's


def test_a_wrong_output_over_a_cache_that_passes_still_fails_the_spec_tolerance():
    """The output expected over the backend's own cache still holds it to the bound: 2% off fails."""
    def off(*args, **attributes):
        return planted_backends.ppl_style_cache_attention(*args, output_factor=1.02, **attributes)

    backend = CallableBackend({"MultiHeadCacheAttention": off}, "ppl_style_2pc_off")
    lines = [line for c in _quantized_cache_attention_cases() for line in _cache_attention_lines(backend, c, "spec")]
    assert lines and all(line.startswith("output:") for line in lines), lines
    assert any("over the keys and values in the backend's cache" in line for line in lines), lines


@pytest.mark.parametrize("bug", sorted(planted_backends._CODE_BUGS))
def test_codes_their_own_scales_do_not_explain_fail_the_fused_op_too(bug):
    """Codes within the table's +-1 but not the backend's values over its own scales (biased, past qmax, flushed):
    the fused op fails at its cache (its output held to the keys in its own biased cache passed every case)."""
    backend = CallableBackend({"MultiHeadCacheAttention": planted_backends.cache_attention_over(
        planted_backends._backend(bug))}, bug)
    lines = [line for c in _quantized_cache_attention_cases() for line in _cache_attention_lines(backend, c, "spec")]
    assert any("stored codes are not their input over the backend's own scale" in line for line in lines), lines


def test_the_fused_op_dequantizing_in_float16_scales_passes_spec():
    """The table's ppl torch row dequantizes in T3: over float16 scales the fused op's keys and values then differ
    from the spec's float32 products by T3's rounding, and its output is held to the attention over those."""
    backend = CallableBackend({"MultiHeadCacheAttention": planted_backends.cache_attention_over(
        planted_backends.dequantize_in_t3)}, "dequantize_in_t3")
    case = CACHE_ATTENTION_CASES["mhca_float32_int4_scale_float16"]()
    assert _cache_attention_lines(backend, case, "exact")  # its output is not the spec's
    assert _cache_attention_lines(backend, case, "spec") == []
    found = fuzz(backend, examples=200, seed=0, ops=["MultiHeadCacheAttention"], kinds=("valid",), tolerance="spec")
    assert found.failure is None, found.failure



@pytest.mark.parametrize("t1", ["float32", "float16", "bfloat16"])
def test_ppl_arithmetic_with_float16_scales_in_the_subnormal_range_passes_spec(t1):
    """ppl's torch reference divides by the scale before its rounding to T3: a float16 scale in the subnormal range
    (groups below 127 * 2^-14) moves that quotient by up to a third of a step at 127, which the rounding-to-nearest
    rule allows for (it failed float32 values before)."""
    case = build("ppl-subnormal", MIXED, quant_bit=8, t1=t1, t3="float16", cache_mode=1, page_size=4)
    for name in ("current_key", "current_value"):
        case.inputs[name] = (case.inputs[name].astype(np.float32) * 1e-3).astype(case.inputs[name].dtype)
    _ppl_and_spec(case)


def test_a_scale_of_the_wrong_dtype_is_the_only_line():
    """A backend whose scale has another dtype has no (code, scale) pairs to decode: its outputs, bit for bit the
    expected ones, are not reported outside a bound over pairs it does not have."""
    case = CASES["int8_scale_float16"]()
    want = reference_outcome("KeyValueCache", case.inputs, case.attributes)
    got = Outcome({k: v.copy() for k, v in want.outputs.items()},
                  {"cache": want.after["cache"].copy(), "scale": want.after["scale"].astype(np.float32)})
    lines = compare("KeyValueCache", case.inputs, case.attributes, want, got, "spec")
    assert lines == ["scale: got float32" + lines[0][len("scale: got float32"):]] and len(lines) == 1, lines


@pytest.mark.parametrize("steps, passes", [(2, True), (3, False)])
def test_an_output_within_its_own_pairs_rounding_passes_and_one_step_past_it_fails(steps, passes):
    """The own-pair rule pinned: a tie stored rounded away (code 1, scale 2: the backend holds 2.0, the spec 0.0)
    output ``steps`` float16 steps below 2.0 (2^-10 each), which (O) allows (within one code step of 0.0); the rule
    allows ulp_T3 + ulp_T1 at 2.0 (2^-22 + 2^-9): two steps, not three."""
    case, got, want = _ties_away_and_spec("quant_special_values")
    slots = SlotMap(case.inputs, case.attributes)
    codes, spec_codes = (o.after["cache"].astype(np.int8).reshape(-1) for o in (got, want))
    element = tuple(np.argwhere(np.isin(slots.source(0), np.flatnonzero(codes != spec_codes)))[0])
    assert got.outputs["key"][element] == 2.0 and want.outputs["key"][element] == 0.0
    got.outputs["key"][element] = np.float16(2.0 - steps * 2.0 ** -10)
    lines = compare("KeyValueCache", case.inputs, case.attributes, want, got, "spec")
    assert (lines == []) == passes, lines
