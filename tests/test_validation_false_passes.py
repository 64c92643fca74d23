"""A backend cannot pass the validation kit by ending the process, by reshaping what it was given, by writing
its read-only inputs, or by returning NaN everywhere; a backend whose import hangs cannot hang the run."""

import os
import pathlib
import posix
import time

import numpy as np
import pytest

import planted_backends
from kvcache_op.cli import main
from kvcache_op.reference import key_value_cache
from kvcache_op.validation import BackendLoadError, fuzz, load_backend, validate
from kvcache_op.validation.adapters import CallableBackend

TESTS = pathlib.Path(__file__).parent
LAYERS3 = {"layers3_layer_idx2", "layers3_layer_idx1_paged_layout3"}
MOVED_SPECIALS = {"moved_special_values_float16", "moved_special_values_bfloat16", "moved_special_values_float32"}
SOME = ["paged_layout0", "int8_layout0", "offset_layout0", "error_offset_beyond_max_t"]


def _failed(report) -> dict:
    return {r.name: r.lines for r in report.results if r.status == "FAIL"}


def test_sys_exit_in_process_fails_the_case_and_the_run_goes_on(all_vectors):
    report = validate(all_vectors, planted_backends.exits_on_layers3)
    failed = _failed(report)
    assert set(failed) == LAYERS3
    assert failed["layers3_layer_idx2"] == ["the backend called sys.exit(0): a backend must return or raise, never end "
                                            "the process"]
    assert report.count("ok") == len(report.results) - 2 - report.count("skip")


def test_sys_exit_in_process_from_the_command_line_is_a_failure(all_vectors, capsys, monkeypatch):
    monkeypatch.chdir(TESTS)
    status = main(["validate", str(all_vectors), "--backend", "planted_backends:exits_on_layers3", "--in-process",
                   "--case", "layers3_*", "--case", "paged_layout0"])
    assert status == 1
    out = capsys.readouterr().out
    assert "FAIL layers3_layer_idx2" in out and "ok   paged_layout0" in out


@pytest.fixture
def process_exit_trapped(monkeypatch):
    """``os._exit`` and ``posix._exit`` replaced, for the test, by a function that raises: a kit that let a backend
    reach the real one would end the test process with status 0, a run that looks passed. Returns the trap."""
    def trap(code):
        raise AssertionError(f"the process would have ended with status {code}")

    monkeypatch.setattr(os, "_exit", trap)
    monkeypatch.setattr(posix, "_exit", trap)
    return trap


@pytest.mark.parametrize("backend, message", [
    ("os_exits_on_layers3", "the backend called os._exit(0): a backend must return or raise"),
    ("posix_exits_on_layers3", "the backend called os._exit(0): a backend must return or raise"),
    ("base_exception_on_layers3", "the backend raised BackendAbort: unsupported, which is not an Exception"),
])
def test_other_ways_out_of_an_in_process_run_fail_only_their_case(all_vectors, capsys, monkeypatch,
                                                                 process_exit_trapped, backend, message):
    monkeypatch.chdir(TESTS)
    status = main(["validate", str(all_vectors), "--backend", f"planted_backends:{backend}", "--in-process",
                   "--case", "layers3_*", "--case", "paged_layout0"])
    out = capsys.readouterr().out
    assert status == 1 and "FAIL layers3_layer_idx2" in out and "ok   paged_layout0" in out
    assert message in out
    assert any(line.split()[:1] == ["total"] for line in out.splitlines())  # the run ended with its summary
    assert os._exit is process_exit_trapped and posix._exit is process_exit_trapped  # put back after the run


@pytest.mark.parametrize("backend", ["exits_on_layers3", "os_exits_on_layers3", "base_exception_on_layers3"])
def test_ending_the_process_on_an_invalid_call_is_a_crash_not_the_error_expected(all_vectors, monkeypatch,
                                                                                 process_exit_trapped, backend):
    """An invalid call expects an error, but a backend that ends the process (or raises a BaseException) did not
    refuse it: the case fails with that one line, whatever the cache then holds."""
    monkeypatch.chdir(TESTS)

    def always(*args, **attributes):
        return getattr(planted_backends, backend)(*args, **dict(attributes, num_layer=3))

    report = validate(all_vectors, always, cases=["error_offset_beyond_max_t", "int8_layout0"], isolate=False)
    failed = _failed(report)
    assert set(failed) == {"error_offset_beyond_max_t", "int8_layout0"}
    for lines in failed.values():
        assert len(lines) == 1, lines
        assert lines[0].startswith(("the backend called ", "the backend raised BackendAbort")), lines


def test_a_finding_that_does_not_replay_is_still_reported():
    planted_backends._CALLS[0] = 0
    backend = CallableBackend({"KeyValueCache": planted_backends.wrong_on_third_call}, "flaky")
    result = fuzz(backend, examples=30, seed=0, ops=["KeyValueCache"], kinds=("valid",))
    assert result.failure is not None
    assert result.failure[1][-1].startswith("(did not reproduce when hypothesis replayed it")


def test_sys_exit_is_a_fuzz_finding():
    backend = CallableBackend({"KeyValueCache": planted_backends.exits_on_layers3}, "exits")
    result = fuzz(backend, examples=200, seed=0, ops=["KeyValueCache"], kinds=("valid",))
    assert result.failure is not None
    assert "sys.exit(0)" in result.failure[1][0]


@pytest.mark.parametrize("isolate", [True, False])
def test_a_backend_reshaping_its_cache_fails_each_case_and_the_run_goes_on(all_vectors, monkeypatch, isolate):
    monkeypatch.chdir(TESTS)
    report = validate(all_vectors, "planted_backends:reshapes_cache", cases=SOME, isolate=isolate)
    failed = _failed(report)
    assert set(failed) == {"paged_layout0", "int8_layout0", "offset_layout0"}  # the invalid call writes nothing
    assert any(line.startswith("cache: got float16[") for line in failed["paged_layout0"]), failed["paged_layout0"]


@pytest.mark.parametrize("isolate", [True, False])
@pytest.mark.parametrize("bug, name", [("zeroes_current_key", "current_key"), ("shifts_start_pos", "start_pos")])
def test_a_backend_writing_a_read_only_input_fails(all_vectors, monkeypatch, isolate, bug, name):
    monkeypatch.chdir(TESTS)
    report = validate(all_vectors, f"planted_backends:{bug}", cases=SOME, isolate=isolate)
    failed = _failed(report)
    assert {"paged_layout0", "int8_layout0", "offset_layout0"} <= set(failed)
    assert failed["paged_layout0"][0].startswith(f"{name}: the backend changed this read-only input; first at ")


@pytest.mark.parametrize("isolate", [True, False])
def test_a_backend_returning_none_for_an_invalid_call_fails_every_invalid_case(all_vectors, monkeypatch, isolate):
    """Returning is accepting: None instead of the outputs fails an invalid call (it is not an error the backend
    raised), and the line says what was returned."""
    monkeypatch.chdir(TESTS)
    report = validate(all_vectors, "planted_backends:returns_none_for_an_invalid_call", cases=["error_*"],
                      isolate=isolate)
    failed = _failed(report)
    assert report.results and set(failed) == {r.name for r in report.results}
    line = failed["error_offset_beyond_max_t"][0]
    assert line.startswith("the backend returned None, not key_value_cache's outputs"), line


@pytest.mark.parametrize("bug, cases", [
    ("refuses_a_sequence_ending_at_max_t", {"offset_sequence_ends_at_max_t"}),
    ("scale_floor_missing", {"quant_special_values", "quant_special_values_scale_float16"}),
    ("rotary_slots_sorted", {"rotary_unsorted_slots"}),
    ("cache_attention_nan_when_all_masked", {"mhca_mask_minus_inf"}),
    ("cache_attention_kv_heads_required", {"mhca_num_kv_heads0"}),
    ("empty_scale_refused", {"empty_scale_placeholder", "mhca_empty_scale_mask", "rotary_empty_scale_placeholder"}),
    ("loads_flush_subnormals", MOVED_SPECIALS),
    ("zeroes_unquantized_specials", MOVED_SPECIALS),
    ("canonical_nans", MOVED_SPECIALS),
    ("attention_not_finite_zeroed", {"mha_live_values_not_finite", "mha_masked_key_value_infinite",
                                     "mha_masked_key_range_value_not_finite", "mha_query_infinite"}),
    ("attention_not_saturating", {"mha_saturating_float16"}),
    ("attention_non_finite_moved", {"mha_live_values_not_finite", "mha_masked_key_value_infinite",
                                    "mha_masked_key_range_value_not_finite", "mha_query_infinite"}),
])
def test_bugs_at_the_bounds_and_at_special_values_fail_their_cases(all_vectors, monkeypatch, bug, cases):
    """Each bug shows only at a bound (the last slot of the cache), at a special value (a group of zeros, whose
    scale is the floor; a query row masked whole) or in an order (slots not sorted): the cases built for them fail,
    and only those."""
    monkeypatch.chdir(TESTS)
    report = validate(all_vectors, f"planted_backends:{bug}", isolate=False)
    assert set(_failed(report)) == cases


@pytest.mark.parametrize("backend", ["attention_saturating", "attention_non_finite_rows_all_nan",
                                     "attention_nan_as_infinity"])
def test_what_the_attention_spec_leaves_open_passes(all_vectors, monkeypatch, backend):
    """Weights that sum past 1 with the output saturated, a row an infinity reaches NaN whole, an infinity where the
    reference has NaN: each is the spec's (its rounding freedoms; "which elements are non-finite, and whether NaN or
    an infinity, is not specified"), so no attention case fails."""
    monkeypatch.chdir(TESTS)
    report = validate(all_vectors, f"planted_backends:{backend}", cases=["mha_*"], isolate=False)
    assert report.count("ok") >= 30 and _failed(report) == {}


def test_a_function_named_as_an_op_is_that_ops_backend(all_vectors, monkeypatch):
    """``module:multi_head_attention`` is MultiHeadAttention's backend, not KeyValueCache's (whose invalid calls
    it would "refuse" by a TypeError)."""
    monkeypatch.chdir(TESTS)
    report = validate(all_vectors, "planted_backends:multi_head_attention", isolate=False)
    ran = {r.op for r in report.results if r.status != "skip"}
    assert ran == {"MultiHeadAttention"} and _failed(report) == {}


@pytest.mark.parametrize("isolate", [False, True])
@pytest.mark.parametrize("how", ["sys", "os"])
def test_a_module_that_ends_the_process_when_imported_is_refused(monkeypatch, isolate, how, process_exit_trapped):
    """In process, ``sys.exit(0)`` at import would end the run with status 0 and no output, a pass: it is a load
    error (``os._exit`` is trapped here, so a kit that let it through fails the test rather than ending it)."""
    monkeypatch.chdir(TESTS)
    monkeypatch.setenv("KVCACHE_TEST_IMPORT_EXIT", how)
    with pytest.raises(BackendLoadError, match="planted_import_exits" if isolate else
                       r"importing 'planted_import_exits' ended the process \(exit status 0\)"):
        load_backend("planted_import_exits:key_value_cache", isolate=isolate)


def test_a_module_that_ends_the_process_when_imported_fails_the_command(all_vectors, monkeypatch, capsys):
    monkeypatch.chdir(TESTS)
    monkeypatch.setenv("KVCACHE_TEST_IMPORT_EXIT", "sys")
    assert main(["validate", str(all_vectors), "--backend", "planted_import_exits:key_value_cache",
                 "--in-process"]) == 2
    assert "ended the process" in capsys.readouterr().err


@pytest.mark.parametrize("path", ["planted_backends.py", "./planted_backends", "tests/planted_backends"])
def test_a_file_path_for_a_backend_says_to_give_the_module_name(monkeypatch, path):
    monkeypatch.chdir(TESTS)
    with pytest.raises(BackendLoadError, match="give the module's name"):
        load_backend(f"{path}:correct", isolate=False)


def test_an_attention_case_without_its_bounds_fails_alone(all_vectors, tmp_path):
    """A case folder that lost tolerance_0.pb (or holds one of another shape) fails with what is missing; the run
    goes on."""
    import shutil

    for name in ("mha_softcap", "mha_prefill_causal", "paged_layout0"):
        shutil.copytree(all_vectors / f"test_{name}", tmp_path / f"test_{name}")
    (tmp_path / "test_mha_softcap" / "test_data_set_0" / "tolerance_0.pb").unlink()
    shutil.copy(all_vectors / "test_mha_fully_masked_rows" / "test_data_set_0" / "tolerance_0.pb",
                tmp_path / "test_mha_prefill_causal" / "test_data_set_0" / "tolerance_0.pb")
    failed = _failed(validate(tmp_path, "reference"))
    assert set(failed) == {"mha_softcap", "mha_prefill_causal"}
    assert "an attention case needs the bound of every element of its attention_output" in failed["mha_softcap"][0]
    assert "found none" in failed["mha_softcap"][0] and "found one of shape" in failed["mha_prefill_causal"][0]


def _nan_everywhere(current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen, max_kvlen,
                    cache, scale=None, **attributes):
    """The reference's call, then NaN in every float element it returns or holds (outputs, cache, scale)."""
    outputs = key_value_cache(current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen,
                              max_kvlen, cache, scale, **attributes)
    for array in (*outputs, cache, scale):
        if array is not None and array.dtype.kind in "fV" and array.dtype.itemsize > 1:
            array.fill(np.nan)
    return outputs


@pytest.mark.parametrize("tolerance", ["exact", "spec"])
def test_a_backend_whose_outputs_and_cache_are_all_nan_fails_every_mode(all_vectors, tolerance):
    """NaN matches NaN only where the spec's own result is NaN: a backend answering NaN for finite keys, values,
    cache and scales fails, plain and quantized."""
    backend = CallableBackend({"KeyValueCache": _nan_everywhere}, "nan_everywhere")
    names = ["offset_layout0", "paged_layout3", "int8_layout0"]
    report = validate(all_vectors, backend, tolerance=tolerance, cases=names)
    assert set(_failed(report)) == set(names), [(r.name, r.status) for r in report.results]


def test_attention_writing_its_query_fails(all_vectors, monkeypatch):
    monkeypatch.chdir(TESTS)
    report = validate(all_vectors, "planted_backends:attention_query_nan", cases=["mha_*"])
    failed = _failed(report)
    valid = [r for r in report.results if not r.name.startswith("mha_error")]
    assert valid and {r.name for r in valid} - {"mha_batch0"} <= set(failed)  # batch0: no query to write
    assert "mha_batch0" not in failed
    assert failed[valid[0].name][0].startswith("query: the backend changed this read-only input")


def test_a_backend_whose_import_hangs_is_refused_within_the_timeout(monkeypatch):
    monkeypatch.chdir(TESTS)
    monkeypatch.setenv("KVCACHE_TEST_SLOW_IMPORT", "1")
    start = time.monotonic()
    with pytest.raises(BackendLoadError, match=r"did not load within 1\.5 s"):
        load_backend("planted_slow_import:key_value_cache", timeout=1.5)
    assert time.monotonic() - start < 30


def test_a_slow_import_on_the_command_line_is_one_line(all_vectors, monkeypatch, capsys):
    monkeypatch.chdir(TESTS)
    monkeypatch.setenv("KVCACHE_TEST_SLOW_IMPORT", "1")
    assert main(["validate", str(all_vectors), "--backend", "planted_slow_import:key_value_cache",
                 "--timeout", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "did not load within 1 s" in err[0]


def test_a_read_only_input_removed_added_retyped_or_reshaped_is_named_as_such():
    """A worker's or a binding's outcome can lose an input, gain one the call did not have, or give it another
    dtype or shape with the same bytes: the line says which, and an input absent on both sides is no change."""
    from kvcache_op.validation.outcome import read_only_changes

    start_pos = np.zeros(2, np.int64)
    assert read_only_changes("KeyValueCache", {"start_pos": start_pos}, {"start_pos": start_pos.view(np.uint64)}) == (
        "start_pos: the backend changed this read-only input to uint64[2] (was int64[2])",)
    assert read_only_changes("KeyValueCache", {"start_pos": start_pos}, {"start_pos": start_pos.reshape(2, 1)}) == (
        "start_pos: the backend changed this read-only input to int64[2, 1] (was int64[2])",)
    assert read_only_changes("KeyValueCache", {"start_pos": start_pos}, {"start_pos": None}) == (
        "start_pos: the backend changed this read-only input (removed)",)
    assert read_only_changes("KeyValueCache", {"start_pos": None}, {"start_pos": start_pos}) == (
        "start_pos: the backend changed this read-only input (added)",)
    assert read_only_changes("KeyValueCache", {"start_pos": None}, {}) == ()


def _payload(bits: int) -> np.float32:
    return np.array(bits, np.uint32).view(np.float32)


@pytest.mark.parametrize("tolerance", ["exact", "spec"])
def test_a_nan_payload_changed_where_the_call_writes_nothing_fails(tolerance):
    """Every slot a call does not store or rotate keeps every bit, a NaN's payload too (only a NaN the call computes
    may come back with another payload): a rotary cache's untouched slot and a quantized cache's unstored scale."""
    from kvcache_op.reference import rotary_shift_tables
    from kvcache_op.validation.compare import compare
    from kvcache_op.validation.outcome import Outcome, reference_outcome

    cos, sin = rotary_shift_tables(np.array([1.0]), 4)
    cache = np.zeros((4, 1, 2, 1, 4), np.float32)
    cache[1, 0, 0, 0, 1] = cache[3, 0, 0, 0, 0] = _payload(0x7FC00123)  # slot 1 is rotated, slot 3 is not
    rotary = dict(cache=cache, scale=None, slots=np.array([1]), cos=cos, sin=sin)
    want = reference_outcome("KeyCacheRotaryShift", rotary, {})
    for slot, fails in ((1, False), (3, True)):
        changed = want.after["cache"].copy()
        changed[slot, 0, 0, 0, int(slot == 1)] = _payload(0x7FC00000)
        got = Outcome(dict(want.outputs), {"cache": changed})
        assert bool(compare("KeyCacheRotaryShift", rotary, {}, want, got, tolerance)) == fails, slot

    scale = np.ones((4, 1, 2, 1, 1), np.float32)
    scale[3, 0, 0, 0, 0] = _payload(0x7FC00123)  # slot 3: not stored
    one = np.ones((1, 1, 4), np.float32)
    call = dict(current_key=one, current_value=one, seqstarts=np.array([0, 1]), kvstarts=np.array([0, 1]),
                cachestarts=np.array([0]), start_pos=np.array([0]), max_seqlen=np.array(1), max_kvlen=np.array(1),
                cache=np.zeros((4, 1, 2, 1, 4), np.int8), scale=scale)
    attributes = dict(quant_bit=8, quant_group=4)
    want = reference_outcome("KeyValueCache", call, attributes)
    changed = want.after["scale"].copy()
    changed[3, 0, 0, 0, 0] = _payload(0x7FC00000)
    got = Outcome(dict(want.outputs), {"cache": want.after["cache"], "scale": changed})
    assert compare("KeyValueCache", call, attributes, want, got, tolerance)
