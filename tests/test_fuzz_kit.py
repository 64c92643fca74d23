"""``kvcache-op fuzz``: the tests' own strategies, run against a backend and the reference, find each planted
bug, shrink it to a small call, and write a reproducer that fails the same way; a correct backend of all
three ops shows no disagreement."""

import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest

import planted_backends
from kvcache_op.cli import main
from kvcache_op.validation.adapters import import_callables
from kvcache_op.validation.fuzz import fuzz
from kvcache_op.validation.validate import validate

TESTS = pathlib.Path(__file__).parent
EXAMPLES = 120  # each bug is found within this many calls (and shrunk) from seed 0
MORE_EXAMPLES = {"layer_ignored_in_layouts_0_and_2": 200,  # a second layer in two of four layouts: found at 200
                 "aliasing_unchecked": 300}  # one rule of 80 named ones, and of 8 kinds of mutation: found at 300


def _kvlens_short(case):
    i = case.inputs
    stored = i["start_pos"] + np.diff(i["seqstarts"])
    return bool(np.any(np.diff(i["kvstarts"]) < stored))


#: bug -> what the minimal call it is shrunk to must show
SIGNS = {
    "no_bounds_checks": lambda case, lines: case.expect_error and (
        lines[0].startswith("accepted an invalid call") or "changed although the call failed" in lines[0]),
    "gqa_tiled": lambda case, lines: case.attributes["num_repeat"] > 1 and case.inputs["current_key"].shape[1] > 1,
    "kvlen_ignored": lambda case, lines: _kvlens_short(case),
    "int4_nibbles_swapped": lambda case, lines: case.attributes["quant_bit"] == 4,
    "scale_not_rounded": lambda case, lines: case.attributes["quant_bit"] and case.inputs["scale"].dtype == np.float16,
    "pages_assumed_aligned": lambda case, lines: case.attributes["cache_mode"] == 1 and bool(
        np.any(case.inputs["cachestarts"][case.inputs["cachestarts"] >= 0] % case.attributes["page_size"])),
    "layer_ignored_in_layouts_0_and_2": lambda case, lines: case.attributes["layer_idx"] > 0 and
    case.attributes["cache_layout"] in (0, 2),
    "page_bounds_of_touched_slots_only": lambda case, lines: case.expect_error and case.attributes["cache_mode"] == 1,
    "aliasing_unchecked": lambda case, lines: case.expect_error and lines[0].startswith("accepted an invalid call"),
}


@pytest.mark.parametrize("bug", planted_backends.BUGS)
def test_fuzz_finds_each_planted_bug_and_shrinks_it(bug):
    result = fuzz(import_callables(f"planted_backends:{bug}"), examples=MORE_EXAMPLES.get(bug, EXAMPLES), seed=0)
    assert result.failure is not None, result.by_op
    case, lines = result.failure
    assert lines and SIGNS[bug](case, lines), (case, lines)
    if not case.expect_error:  # shrunk: a few sequences of a few tokens (a rounding bug may need a few values)
        assert len(case.inputs["start_pos"]) <= 3 and case.inputs["current_key"].shape[0] <= 4, case.inputs


def test_a_correct_backend_of_every_op_shows_no_disagreement():
    result = fuzz(import_callables("planted_backends:ALL_OPS"), examples=200, seed=3)
    assert result.failure is None
    assert set(result.by_op) == {(op, kind) for op in ("KeyValueCache", "KeyCacheRotaryShift", "MultiHeadAttention",
                                                       "MultiHeadCacheAttention") for kind in ("valid", "invalid")}


@pytest.mark.parametrize("backend, op, sign", [
    ("rotary_sin_negated", "KeyCacheRotaryShift", "cache: "),
    ("rotary_flushing_subnormals", "KeyCacheRotaryShift", "cache: "),
    ("attention_window_ignored", "MultiHeadAttention", "attention_output: "),
    ("attention_not_finite_zeroed", "MultiHeadAttention", "attention_output: "),
])
def test_fuzz_covers_the_other_ops(backend, op, sign):
    result = fuzz(import_callables(f"planted_backends:{backend}"), examples=EXAMPLES, seed=0, ops=[op])
    case, lines = result.failure
    assert case.op == op and lines[0].startswith(sign), lines
    if backend == "attention_window_ignored":
        assert case.attributes["sliding_window"] > 0
    if backend == "attention_not_finite_zeroed":  # drawn with an infinity or NaN that reaches a row
        assert not all(np.isfinite(case.inputs[n]).all() for n in ("query", "key", "value"))


def test_ppl_arithmetic_is_a_disagreement_only_in_exact_mode():
    backend = import_callables("planted_backends:ppl_style")
    assert fuzz(backend, examples=80, seed=0, tolerance="spec").failure is None
    assert fuzz(backend, examples=EXAMPLES, seed=0).failure is not None


def test_the_reproducer_fails_the_same_way_on_its_own(tmp_path, monkeypatch):
    monkeypatch.chdir(TESTS)
    out = tmp_path / "repro"
    result = fuzz(import_callables("planted_backends:gqa_tiled"), examples=EXAMPLES, seed=0, out=out,
                  backend_spec="planted_backends:gqa_tiled", backend_options={"isolate": False})
    assert result.reproducer == out and sorted(p.name for p in out.iterdir()) == ["reproduce.py", "test_fuzz_KeyValueCache_valid"]
    assert validate(out, "reference").count("ok") == 1  # the case's expectation is the reference's
    run = subprocess.run([sys.executable, str(out / "reproduce.py")], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 1, run.stderr
    assert run.stdout.splitlines()[:2] == ["FAIL fuzz_KeyValueCache_valid", "    " + result.failure[1][0]]


def test_a_crash_is_found_in_the_worker_and_shrunk(monkeypatch):
    monkeypatch.chdir(TESTS)
    from kvcache_op.validation.backends import load_backend

    backend = load_backend("planted_backends:crashes_on_page_size1")
    try:
        result = fuzz(backend, examples=EXAMPLES, seed=0, kinds=("valid",))
    finally:
        backend.close()
    case, lines = result.failure
    assert lines[0].startswith("the backend crashed") and case.attributes["page_size"] == 1


def test_a_hang_is_reported_as_drawn_without_shrinking(monkeypatch):
    """A hang is not shrunk: each smaller call tried would cost the whole timeout (hours at the default 300 s)."""
    monkeypatch.chdir(TESTS)
    from kvcache_op.validation.backends import load_backend

    backend = load_backend("planted_backends:hangs_on_page_size1", timeout=4)
    start = time.monotonic()
    try:
        result = fuzz(backend, examples=EXAMPLES, seed=0, kinds=("valid",))
    finally:
        backend.close()
    case, lines = result.failure
    assert lines == ["the backend did not return within 4 s (its process was killed)",
                     "(not shrunk: each smaller call tried would wait the whole timeout)"]
    assert case.attributes["page_size"] == 1 and result.shrink_calls == 0
    assert time.monotonic() - start < 120


def test_fuzz_command(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(TESTS)
    argv = ["fuzz", "--backend", "planted_backends:kvlen_ignored", "--op", "kv", "--examples", "60", "--in-process",
            "--out", str(tmp_path / "r")]
    assert main(argv) == 1
    out = capsys.readouterr().out.splitlines()
    drawn = int(out[0].split()[0])
    assert 0 < drawn <= 60 and " calls drawn and run against the reference (seed 0): " in out[0]
    assert out[0].endswith(" more while shrinking")  # shrinking runs calls of its own, counted apart
    assert out[1] == "DISAGREEMENT on a valid call (shrunk to a minimal call):"
    assert out[-1].startswith(f"reproducer: {tmp_path / 'r'}")
    assert main(["fuzz", "--backend", "reference", "--examples", "20", "--out", str(tmp_path / "none")]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "no disagreement found"
    assert not (tmp_path / "none").exists()


def test_an_op_asked_for_that_the_backend_lacks_is_refused_by_name(capsys, monkeypatch):
    """Asking for an op the backend does not provide is an error, not a fuzz of the others that exits 0."""
    monkeypatch.chdir(pathlib.Path(__file__).parent)
    with pytest.raises(ValueError, match="does not provide MultiHeadAttention"):
        fuzz(import_callables("planted_backends:correct"), examples=4, ops=["KeyValueCache", "MultiHeadAttention"])
    assert main(["fuzz", "--backend", "planted_backends:correct", "--op", "kv", "--op", "attention",
                 "--examples", "4"]) == 2
    assert "the backend does not provide MultiHeadAttention" in capsys.readouterr().err


def test_fuzz_takes_every_form_of_backend_validate_takes(monkeypatch):
    """A name, a callable with the reference's KeyValueCache signature and a module path, as validate takes them:
    the reference and a correct callable show no disagreement, a planted bug given by its path is found."""
    monkeypatch.chdir(TESTS)
    monkeypatch.syspath_prepend(str(TESTS))
    from kvcache_op.reference import key_value_cache

    assert fuzz("reference", examples=6, seed=0).failure is None
    assert fuzz(key_value_cache, examples=6, seed=0).failure is None
    found = fuzz("planted_backends:gqa_tiled", examples=EXAMPLES, seed=0, kinds=("valid",))
    assert found.failure is not None and SIGNS["gqa_tiled"](*found.failure)


def test_a_named_backend_is_loaded_with_its_options_and_a_reproducer_needs_a_name(tmp_path):
    """The options reach the backend fuzzed (not only the reproducer): an execution provider ONNX Runtime does not
    have is refused, not fuzzed on the default one; a function given without its name cannot be reproduced."""
    from kvcache_op.validation.backends import BackendLoadError

    with pytest.raises(BackendLoadError):
        fuzz("ort", examples=2, backend_options={"provider": "NoSuchExecutionProvider"})
    with pytest.raises(ValueError, match="give backend_spec"):
        fuzz(planted_backends.gqa_tiled, examples=2, out=tmp_path / "repro")


def test_a_disagreement_of_the_other_kind_is_reported_once_and_only_where_that_kind_found_none():
    """Invalid calls drawn may turn out valid: a valid call the backend gets wrong, met while searching invalid
    calls, is reported (as a valid call) when the valid calls' own search did not run; where it ran and found its
    own, that one alone is reported."""
    backend = import_callables("planted_backends:gqa_tiled")
    aside = fuzz(backend, examples=EXAMPLES, seed=0, ops=["KeyValueCache"], kinds=("invalid",))
    assert [case.expect_error for case, _ in aside.failures] == [False]
    assert SIGNS["gqa_tiled"](*aside.failure)
    both = fuzz(backend, examples=2 * EXAMPLES, seed=0, ops=["KeyValueCache"])
    assert [case.expect_error for case, _ in both.failures] == [False]


def test_a_backend_fuzzed_by_name_is_reproduced_by_that_name_in_a_new_or_reused_folder(tmp_path, monkeypatch):
    """Given by name, a backend needs no ``backend_spec``: reproduce.py loads that name. The folder is made, its
    parents too; a second run there replaces the first run's cases."""
    monkeypatch.chdir(TESTS)
    out = tmp_path / "new" / "repro"
    first = fuzz("planted_backends:kvlen_ignored", examples=EXAMPLES, seed=0, kinds=("valid",), out=out,
                 backend_options={"isolate": False})
    assert first.reproducer == out and "'planted_backends:kvlen_ignored'" in (out / "reproduce.py").read_text()
    second = fuzz("planted_backends:no_bounds_checks", examples=EXAMPLES, seed=0, kinds=("invalid",), out=out,
                  backend_options={"isolate": False})
    assert second.failure is not None and second.failure[0].expect_error
    assert sorted(p.name for p in out.iterdir()) == ["reproduce.py", "test_fuzz_KeyValueCache_invalid"]
    assert "'planted_backends:no_bounds_checks'" in (out / "reproduce.py").read_text()


def test_a_described_call_shows_the_values_of_index_inputs_of_up_to_64_elements():
    """The shrunk call is printed with the values of its small integer inputs (what decides what it stores and
    loads), up to 64 elements; larger ones and the cache by dtype and shape only."""
    from kvcache_op.validation.cases import Case
    from kvcache_op.validation.fuzz import describe

    call = Case("call", {"seqstarts": np.arange(64, dtype=np.int64), "start_pos": np.arange(65, dtype=np.int64),
                         "cache": np.zeros(4, np.int8), "scale": None}, {"num_layer": 1})
    line, attributes = describe(call)
    assert line.startswith("KeyValueCache(seqstarts=int64[64] [ 0,  1,  2, ")
    assert "62, 63], start_pos=int64[65], " in line
    assert line.endswith("cache=int8[4], scale=absent)") and attributes == "attributes: num_layer=1"


@pytest.mark.parametrize("examples", [1, 2, 3])
def test_fuzz_runs_exactly_the_calls_asked_for_shared_between_the_kinds(examples):
    """One call is enough to fuzz (zero is refused), and an odd count shared between the two kinds' searches is run
    whole: no call is lost to the split, none added."""
    result = fuzz("reference", examples=examples, seed=0)
    assert result.failure is None and result.examples == examples
    assert sum(result.by_op.values()) == examples


def test_fuzzing_zero_calls_is_refused():
    with pytest.raises(ValueError, match="examples must be >= 1, got 0"):
        fuzz("reference", examples=0)


@pytest.mark.parametrize("bug", ["zeroes_unquantized_specials", "canonical_nans"])
def test_fuzz_finds_special_values_not_stored_as_they_are(bug):
    """Unquantized data movement is exact, a NaN's sign and payload included: the strategies plant NaN payloads,
    infinities, -0.0 and subnormals, so a backend that stores them as zeros, or its NaNs as the default NaN,
    disagrees."""
    result = fuzz(import_callables(f"planted_backends:{bug}"), examples=EXAMPLES, seed=0,
                  ops=["KeyValueCache"], kinds=("valid",))
    assert result.failure is not None
    case, lines = result.failure
    assert case.attributes["quant_bit"] == 0 and lines
