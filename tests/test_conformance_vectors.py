"""Conformance vectors: the committed set is reproducible, every case round-trips through files, and the
layout is what ONNX's backend-test loader reads."""

import json
import pathlib
import shutil

import numpy as np
import pytest

from kvcache_op.reference.dtypes import SCALE_EPS
from kvcache_op.validation import fingerprints, vectors
from kvcache_op.validation.cases import CASES
from kvcache_op.validation.error_cases import INVALID, MORE_INVALID
from kvcache_op.validation.mha_cases import ATTENTION_CASES
from kvcache_op.validation.mha_error_cases import INVALID as ATTENTION_INVALID
from kvcache_op.validation.mhca_cases import ATTENTION_INVALID as CACHE_ATTENTION_INVALID
from kvcache_op.validation.mhca_cases import CASES as CACHE_ATTENTION_CASES
from kvcache_op.validation.outcome import copies, reference_outcome
from kvcache_op.validation.rotary_cases import CASES as ROTARY_CASES
from kvcache_op.validation.rotary_cases import ERROR_CASES as ROTARY_ERROR_CASES
from kvcache_op.validation.validate import compare_case, validate_folder


def test_every_validity_row_is_a_named_invalid_case():
    assert len(CASES) >= 40 and len(ATTENTION_CASES) >= 20
    cache_attention = {f"mhca_error_{r[0]}" for r in INVALID + MORE_INVALID if not r[0].startswith("num_repeat")} | \
        {f"mhca_error_{r[0]}" for r in CACHE_ATTENTION_INVALID}
    invalid = {f"error_{r[0]}" for r in INVALID + MORE_INVALID} | {f"mha_error_{r[0]}" for r in ATTENTION_INVALID} | \
        {f"rotary_error_{k}" for k in ROTARY_ERROR_CASES} | cache_attention
    assert vectors.ALL_CASES.keys() == (CASES.keys() | ATTENTION_CASES.keys() | ROTARY_CASES.keys() |
                                        CACHE_ATTENTION_CASES.keys() | invalid)
    assert all(vectors.ALL_CASES[name]().expect_error for name in invalid)


def _same_within(committed: pathlib.Path, fresh: pathlib.Path, tolerance) -> bool:
    """An attention result regenerated elsewhere: BLAS may sum in another order (the spec allows any), so
    the reference's output must agree within the case's tolerance and the tolerance itself to 1e-9."""
    want, got = vectors.load_tensor(committed), vectors.load_tensor(fresh)
    if want.dtype != got.dtype or want.shape != got.shape:
        return False
    if committed.name == "tolerance_0.pb":
        return bool(np.allclose(got, want, rtol=1e-9, atol=0))
    return bool(np.all(np.abs(got.astype(np.float64) - want.astype(np.float64)) <= tolerance))


def test_committed_vectors_are_regenerated_unchanged(tmp_path):
    vectors.write_conformance(tmp_path, vectors.COMMITTED, progress=None)
    committed = sorted(p.relative_to(vectors.COMMITTED_DIR) for p in vectors.COMMITTED_DIR.rglob("*") if p.is_file())
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert committed == fresh
    for rel in committed:
        old, new = vectors.COMMITTED_DIR / rel, tmp_path / rel
        if old.read_bytes() == new.read_bytes():
            continue
        name, data = vectors.case_name(rel.parts[0]), vectors.COMMITTED_DIR / rel.parts[0] / vectors.DATA_SET
        # Only an attention result (and so its atol in data.json) may differ in its last bits.
        assert name in ATTENTION_CASES and rel.name in ("output_0.pb", "tolerance_0.pb", "data.json"), f"{rel} differs"
        if rel.name == "data.json":
            assert json.loads(old.read_text()) == pytest.approx(json.loads(new.read_text()), rel=1e-9), f"{rel} differs"
            continue
        assert _same_within(old, new, vectors.load_tensor(data / "tolerance_0.pb")), f"{rel} differs"


def test_every_case_is_defined_as_committed():
    """Beyond the committed sample, a case changes only on purpose: its op, attributes, input dtypes and shapes, index
    values and non-finite counts match spec/conformance_cases.json (rewrite it with
    ``python -m kvcache_op.validation.fingerprints spec/conformance_cases.json`` after a deliberate change)."""
    changed = fingerprints.differences(fingerprints.committed(), fingerprints.fingerprints())
    assert not changed, "conformance cases differ from spec/conformance_cases.json:\n" + "\n".join(changed)


def test_the_fingerprint_command_rewrites_the_file_it_is_given_and_names_what_changed(tmp_path, capsys):
    path = tmp_path / "conformance_cases.json"
    stale = dict(fingerprints.committed(), batch0="0" * 16, no_such_case="1" * 16)
    del stale["int8_layout0"]
    path.write_text(json.dumps(stale))
    assert fingerprints.main([str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:-1] == ["added: int8_layout0", "removed: no_such_case", "changed: batch0"]
    assert out[-1] == f"wrote {len(vectors.ALL_CASES)} fingerprints to {path}"
    assert json.loads(path.read_text()) == fingerprints.committed()
    assert fingerprints.main([str(path)]) == 0 and capsys.readouterr().out.splitlines()[0] == "no case changed"
    assert fingerprints.main(["a", "b"]) == 2
    assert capsys.readouterr().err.startswith("usage: python -m kvcache_op.validation.fingerprints ")


@pytest.mark.parametrize("name, change", [
    ("max_len_shape1", lambda c: c.inputs.update(max_seqlen=c.inputs["max_seqlen"].reshape(()))),
    ("quant_special_values", lambda c: c.inputs["current_key"].__setitem__((1, 0, 0), 0)),  # its NaN gone
    ("paged_layout0", lambda c: c.inputs["cachestarts"].__setitem__((0, 0), c.inputs["cachestarts"][0, 0] + 4)),
    ("paged_layout0", lambda c: c.attributes.update(page_size=8)),
    ("error_paged_sentinel_minus_one", lambda c: setattr(c, "expect_error", False)),
])
def test_a_fingerprint_changes_with_what_it_covers(name, change):
    case = vectors.ALL_CASES[name]()
    before = fingerprints.case_fingerprint(case)
    assert before == fingerprints.committed()[name]
    change(case)
    assert fingerprints.case_fingerprint(case) != before


@pytest.mark.parametrize("name", ["quant_special_values", "quant_special_values_scale_float16", "quant_ties_int4"])
def test_the_special_value_cases_hold_their_special_values(name):
    """What these cases exist for lies in floating values, which fingerprints leave out: groups whose quotients are
    exact ties (amax / qmax = 2, rounded to even), and for the special-value cases an all-zero group and a group
    whose scale is below the floor (both quantized with the floor)."""
    case = vectors.ALL_CASES[name]()
    qmax = {8: 127, 4: 7}[case.attributes["quant_bit"]]
    key = case.inputs["current_key"].astype(np.float64)
    groups = key.reshape(key.shape[:-1] + (-1, case.attributes["quant_group"]))
    with np.errstate(invalid="ignore"):
        amax = np.abs(groups).max(axis=-1)
        ties = (amax == 2 * qmax)[..., None] & (np.abs(groups / 2) % 1 == 0.5)
    assert ties.any(axis=-1).sum() >= 2, "two groups of exact ties"
    if name.startswith("quant_special_values"):
        assert (amax == 0).any(), "an all-zero group"
        assert ((amax > 0) & (amax / qmax < SCALE_EPS)).any(), "a group whose scale is below the floor"


def test_the_rotary_ties_case_rounds_its_two_ties_to_even():
    """rotary_ties_int8 rotates codes [127, 125, 0, 0] at scale 1 by cos 1, sin 0.5 (half split): 127, 125, 63.5,
    62.5 at the new scale 1, worked by hand; round half to even stores 64 and 62 (half away from zero: 64, 63)."""
    from kvcache_op.reference import key_cache_rotary_shift

    case = vectors.ALL_CASES["rotary_ties_int8"]()
    inputs = copies(case.inputs)
    key_cache_rotary_shift(**inputs, **case.attributes)
    assert inputs["cache"][2, 0, 0, 0].tolist() == [127, 125, 64, 62]
    assert inputs["scale"][2, 0, 0, 0] == 1.0


def test_every_case_passes_through_reference_evaluator(all_vectors):
    lines = []
    assert validate_folder(all_vectors, "reference", progress=lines.append) == 0, "\n".join(lines)
    assert lines[-1].split() == ["total", str(len(vectors.ALL_CASES)), "0", "0"]


@pytest.mark.parametrize("name", ["int4_layout2", "t1_bfloat16", "error_paged_sentinel_minus_one", "mha_mixed_bfloat16",
                                  "rotary_int4_layout3_scale_float16", "rotary_error_scale_missing"])
def test_a_case_reads_back_as_written(all_vectors, name):
    written = vectors.ALL_CASES[name]()
    read = vectors.read_case(all_vectors / vectors.folder_name(name))
    assert (read.name, read.op) == (name, written.op)
    # a node may leave an attribute at its default out (attention's extensions) or write it (the defaults)
    assert all(read.attributes[k] == v for k, v in written.attributes.items() if k in read.attributes)
    assert read.inputs.keys() == written.inputs.keys()
    for key, array in written.inputs.items():
        assert (array is None and read.inputs[key] is None) or read.inputs[key].tobytes() == array.tobytes(), key
    expected = vectors.expected(written)
    assert reference_outcome(read.op, read.inputs, read.attributes).error == expected.error
    assert read.expected.error == expected.error
    for got, want in ((read.expected.outputs or {}, expected.outputs or {}), (read.expected.after, expected.after)):
        assert got.keys() == want.keys() and all(got[k].tobytes() == want[k].tobytes() for k in want)


def test_layout_is_what_onnx_backend_test_loads(all_vectors):
    """Names start with test_, only the expected graph outputs are output_<i>.pb, and the model lists the
    in-place inputs as graph outputs after the node's (for an invalid call: only them)."""
    from onnx.backend.test.loader import load_model_tests

    loaded = load_model_tests(data_dir=str(all_vectors.parent), kind=all_vectors.name)
    assert sorted(c.name for c in loaded) == sorted(vectors.folder_name(n) for n in vectors.ALL_CASES)
    for name, outputs in (("int8_layout1", ["key", "value", "cache", "scale"]), ("offset_layout0", ["key", "value", "cache"]),
                          ("rotary_int8_layout1", ["slots_out", "cache", "scale"]), ("mha_prefill_causal", ["attention_output"]),
                          ("error_int8_offset_beyond_max_t", ["cache", "scale"]), ("mha_error_key_dtype", [])):
        import onnx

        folder = all_vectors / vectors.folder_name(name)
        model = onnx.load(folder / "model.onnx")
        assert [o.name for o in model.graph.output] == outputs
        assert len(list((folder / vectors.DATA_SET).glob("output_*.pb"))) == len(outputs)
        assert json.loads((folder / "data.json").read_text())["rtol"] == 0.0


def test_validator_fails_an_attention_output_outside_the_tolerance(all_vectors, tmp_path):
    """One element moved by just over its recorded tolerance fails the case, the line naming it and its tolerance; by
    just under, passes."""
    from onnx import numpy_helper

    folder_name = vectors.folder_name("mha_mixed_decode_chunk_prefill")
    for factor, verdict in ((1.5, 1), (0.5, 0)):
        folder = tmp_path / f"{factor}" / folder_name
        shutil.copytree(all_vectors / folder_name, folder)
        data = folder / vectors.DATA_SET
        original = vectors.load_tensor(data / "output_0.pb")
        tolerance = vectors.load_tensor(data / "tolerance_0.pb")
        index = np.unravel_index(np.argmax(tolerance), tolerance.shape)
        output = original.astype(np.float64)
        output[index] += factor * tolerance[index]
        moved = output.astype(np.float16)
        assert abs(float(moved[index]) - float(original[index])) > 0  # it did move
        (data / "output_0.pb").write_bytes(numpy_helper.from_array(moved, "attention_output").SerializeToString())
        lines = []
        assert validate_folder(folder.parent, "reference", progress=lines.append) == verdict, lines
        if verdict:  # the line says which element, by how much it may differ, and nothing else differs
            detail = [line.strip() for line in "\n".join(lines).splitlines()
                      if line.strip().startswith("attention_output:")]
            assert len(detail) == 1 and detail[0].startswith(
                f"attention_output: 1 of {original.size} elements outside the tolerance; first at "
                f"[{', '.join(map(str, index))}]: got "), lines
            assert detail[0].endswith(f"(tolerance {float(tolerance[index]):.3g})"), detail


def test_validator_reports_a_corrupted_expected_cache(all_vectors, tmp_path):
    """The validator is able to fail: a changed element of an expected cache is reported with its index."""
    folder = tmp_path / vectors.folder_name("paged_layout0")
    shutil.copytree(all_vectors / folder.name, folder)
    path = folder / vectors.DATA_SET / "output_2.pb"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    lines = []
    assert validate_folder(tmp_path, "reference", progress=lines.append) == 1
    head, detail = lines[0].splitlines()
    assert head == "FAIL paged_layout0" and detail.startswith("    cache: 1 of ") and "first at [" in detail
    assert compare_case(folder, "reference") == [detail.strip()]


def test_vectors_written_again_into_the_same_folder_overwrite_it_and_say_where_they_are(tmp_path):
    """Writing the vectors again (after a change, say) reuses the folder; each case written is one progress line."""
    names = ["paged_layout0", "mha_batch0"]
    lines = []
    vectors.write_conformance(tmp_path, names, progress=lines.append)
    first = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    vectors.write_conformance(tmp_path, names, progress=lines.append)
    assert {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == first
    assert lines == ["[1/2] paged_layout0", "[2/2] mha_batch0"] * 2
