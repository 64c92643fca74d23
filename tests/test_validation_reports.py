"""What the kit tells a backend's author: index values in a shrunk call, a read from the wrong slot named as
such, a cache the backend never wrote in place, one finding per kind of call, and honest call counts."""

import pathlib

import pytest

import planted_backends
from kvcache_op.cli import main
from kvcache_op.validation import fuzz, validate, vectors
from kvcache_op.validation.adapters import CallableBackend
from kvcache_op.validation.compare import compare
from kvcache_op.validation.outcome import Outcome, copies, reference_outcome
from kvcache_op.validation.slot_map import SlotMap

TESTS = pathlib.Path(__file__).parent


def _backend(name):
    return CallableBackend({"KeyValueCache": getattr(planted_backends, name)}, name)


def test_a_read_from_another_slot_is_named_as_such(all_vectors):
    report = validate(all_vectors, planted_backends.gqa_tiled, cases=["gqa_repeat2"])
    (result,) = report.results
    key = next(line for line in result.lines if line.startswith("key:"))
    assert "loaded from cache slot" in key
    assert key.endswith("the backend's cache holds the expected contents there: its load is wrong (another slot "
                        "read, or the stored value decoded otherwise)")


def test_a_load_is_not_blamed_when_the_scale_behind_it_differs():
    """The hint that a backend's load is wrong needs both the code and the scale behind the element to be the
    expected ones: scales stored twice as large explain keys twice as large without any wrong load."""
    case = vectors.ALL_CASES["int8_layout0"]()
    expected = reference_outcome(case.op, case.inputs, case.attributes)
    after = copies(expected.after)
    after["scale"] *= 2
    got = Outcome({name: array * 2 for name, array in expected.outputs.items()}, after)
    lines = compare(case.op, case.inputs, case.attributes, expected, got)
    key = next(line for line in lines if line.startswith("key:"))
    assert "loaded from cache slot" in key and "; scale got " in key, key
    assert "holds the expected contents" not in key, key


@pytest.mark.parametrize("output, other", [("key", "value"), ("value", "key")])
def test_a_wrong_load_is_described_from_its_own_half_of_the_cache(output, other):
    """The detail of a ``key`` element reads the key half of the cache (``value``: the value half): a key whose slot
    holds a wrong key is the store's fault, not the load's, although the value half there is right."""
    case = vectors.ALL_CASES["paged_layout0"]()
    expected = reference_outcome(case.op, case.inputs, case.attributes)
    kv = 0 if output == "key" else 1
    flat = int(SlotMap(case.inputs, case.attributes).source(kv)[0, 0, 0])
    after, outputs = copies(expected.after), copies(expected.outputs)
    after["cache"].reshape(-1)[flat] += 1
    outputs[output][0, 0, 0] = after["cache"].reshape(-1)[flat]
    lines = compare(case.op, case.inputs, case.attributes, expected, Outcome(outputs, after))
    assert not any(line.startswith(f"{other}:") for line in lines), lines
    line = next(line for line in lines if line.startswith(f"{output}:"))
    assert "loaded from cache slot" in line and "holds the expected contents" not in line, line


def test_a_cache_the_backend_never_wrote_gets_the_hint(all_vectors):
    report = validate(all_vectors, planted_backends.stores_into_a_copy, cases=["paged_layout0", "int8_layout0"])
    for result in report.results:
        assert result.status == "FAIL"
        assert any(line.startswith("cache: left exactly as it was given: the op writes cache in place") for line in
                   result.lines), result.lines


def test_a_layer_idx_bug_gets_both_findings_each_shrunk():
    result = fuzz(_backend("layer_idx_ignored"), examples=300, seed=0, ops=["KeyValueCache"])
    assert [case.expect_error for case, _ in result.failures] == [False, True]
    (valid, valid_lines), (invalid, invalid_lines) = result.failures
    assert valid.attributes["layer_idx"] != 0 and any(line.startswith("cache:") for line in valid_lines)
    assert invalid_lines[-1].startswith("accepted an invalid call")


def test_counts_are_the_calls_drawn_and_shrinking_is_counted_apart():
    result = fuzz(_backend("gqa_tiled"), examples=5, seed=0, ops=["KeyValueCache"], kinds=("valid",))
    assert result.examples <= 5 and sum(result.by_op.values()) == result.examples
    if result.failure is not None:
        assert result.shrink_calls >= 0


def test_the_shrunk_call_shows_its_index_values(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(TESTS)
    assert main(["fuzz", "--backend", "planted_backends:kvlen_ignored", "--op", "kv", "--examples", "60",
                 "--in-process", "--calls", "valid", "--out", str(tmp_path / "r")]) == 1
    out = capsys.readouterr().out
    call = next(line for line in out.splitlines() if line.strip().startswith("KeyValueCache("))
    assert "seqstarts=int64[" in call and "] [0, " in call  # the values, not only the shape
    assert "kvstarts=int64[" in call and "cache=" in call


def _raises_always(**_):
    raise ValueError("not implemented")


@pytest.mark.parametrize("cases, noted", [(["error_*"], True), (["error_*", "paged_layout0"], False)])
def test_a_run_of_invalid_calls_alone_says_what_it_cannot_show(all_vectors, cases, noted):
    """Any exception refuses an invalid call, so a backend raising on everything passes a run of them alone: the run
    says so (its exit status stays what the cases give)."""
    from kvcache_op.validation import validate_folder

    lines = []
    status = validate_folder(all_vectors, CallableBackend({"KeyValueCache": _raises_always}, "raises"),
                             progress=lines.append, cases=cases)
    assert status == (0 if noted else 1)
    assert any(line.startswith("note: only invalid calls ran") for line in lines) == noted


def test_case_folders_not_written_from_this_kits_definitions_are_noted(all_vectors, tmp_path):
    """A folder left by another version of the kit (a case since changed, one no longer defined, one written before
    folders recorded their definition) is validated as it is, and the run names it."""
    import shutil

    import onnx

    from kvcache_op.validation import validate_folder

    for name in ("offset_layout0", "paged_layout0", "batch0"):
        shutil.copytree(all_vectors / f"test_{name}", tmp_path / f"test_{name}")
    shutil.copytree(all_vectors / "test_paged_layout0", tmp_path / "test_paged_layout_retired")
    model = onnx.load_model(tmp_path / "test_offset_layout0" / "model.onnx")
    (entry,) = [p for p in model.metadata_props if p.key == vectors.FINGERPRINT_KEY]
    entry.value = "0" * 16  # the case as an earlier kit defined it
    onnx.save_model(model, tmp_path / "test_offset_layout0" / "model.onnx")
    model = onnx.load_model(tmp_path / "test_batch0" / "model.onnx")
    del model.metadata_props[:]  # written before folders said what they were written from
    onnx.save_model(model, tmp_path / "test_batch0" / "model.onnx")
    lines = []
    assert validate_folder(tmp_path, "reference", progress=lines.append) == 0
    (note,) = [line for line in lines if line.startswith("note: ")]
    assert note.startswith("note: 3 case folder(s) were not written from this kit's definitions")
    assert "batch0, offset_layout0, paged_layout_retired;" in note


def test_folders_the_kit_writes_are_its_own(all_vectors):
    lines = []
    from kvcache_op.validation import validate_folder

    assert validate_folder(all_vectors, "reference", progress=lines.append, cases=["mha_softcap", "int8_*"]) == 0
    assert not [line for line in lines if line.startswith("note: ")]
