"""Conformance vectors: the committed set is reproducible and every case round-trips through files."""

import pathlib

import numpy as np
import pytest

from kvcache_op.spec import vectors
from kvcache_op.spec.cases import CASES
from kvcache_op.spec.mha_cases import ATTENTION_CASES
from kvcache_op.tools.validate_backend import compare_case, validate_folder


def test_there_are_at_least_40_named_cases():
    assert len(CASES) >= 40
    assert len(ATTENTION_CASES) >= 20
    assert vectors.ALL_CASES.keys() == CASES.keys() | ATTENTION_CASES.keys()


def _same_within(committed: pathlib.Path, fresh: pathlib.Path, tolerance) -> bool:
    """An attention result regenerated elsewhere: BLAS may sum in another order (the spec allows any), so
    the reference's output must agree within the case's tolerance and the tolerance itself to 1e-9."""
    want, got = vectors._load(committed), vectors._load(fresh)
    if want.dtype != got.dtype or want.shape != got.shape:
        return False
    if committed.name == "output_0_tolerance.pb":
        return bool(np.allclose(got, want, rtol=1e-9, atol=0))
    return bool(np.all(np.abs(got.astype(np.float64) - want.astype(np.float64)) <= tolerance))


def test_committed_vectors_are_regenerated_unchanged(tmp_path):
    vectors.write_all(tmp_path, vectors.COMMITTED, progress=None)
    committed = sorted(p.relative_to(vectors.COMMITTED_DIR) for p in vectors.COMMITTED_DIR.rglob("*") if p.is_file())
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert committed == fresh
    for rel in committed:
        old, new = vectors.COMMITTED_DIR / rel, tmp_path / rel
        if old.read_bytes() == new.read_bytes():
            continue
        case, data = rel.parts[0], vectors.COMMITTED_DIR / rel.parts[0] / vectors.DATA_SET
        assert case in ATTENTION_CASES and rel.name.startswith("output_0"), f"{rel} differs"
        assert _same_within(old, new, vectors._load(data / "output_0_tolerance.pb")), f"{rel} differs"


@pytest.fixture(scope="module")
def all_vectors(tmp_path_factory):
    out = tmp_path_factory.mktemp("conformance")
    vectors.write_all(out, progress=None)
    return out


@pytest.mark.parametrize("name", list(vectors.ALL_CASES))
def test_case_round_trips_through_reference_evaluator(all_vectors, name):
    assert compare_case(pathlib.Path(all_vectors) / name, "reference") == []


def test_attention_validator_fails_an_output_outside_the_tolerance(all_vectors, tmp_path):
    """One element moved by just over its recorded tolerance fails the case; by just under, passes."""
    import shutil

    from onnx import numpy_helper

    name = "mha_mixed_decode_chunk_prefill"
    for factor, verdict in ((1.5, 1), (0.5, 0)):
        folder = tmp_path / f"{factor}" / name
        shutil.copytree(pathlib.Path(all_vectors) / name, folder)
        data = folder / vectors.DATA_SET
        output = vectors._load(data / "output_0.pb").astype(np.float64)
        tolerance = vectors._load(data / "output_0_tolerance.pb")
        index = np.unravel_index(np.argmax(tolerance), tolerance.shape)
        output[index] += factor * tolerance[index]
        moved = output.astype(np.float16)
        assert abs(float(moved[index]) - float(vectors._load(data / "output_0.pb")[index])) > 0  # it did move
        (data / "output_0.pb").write_bytes(numpy_helper.from_array(moved, "attention_output").SerializeToString())
        lines = []
        assert validate_folder(folder.parent, "reference", progress=lines.append) == verdict, lines


def test_validate_reports_a_corrupted_expectation(all_vectors, tmp_path):
    """The validator is able to fail: a flipped byte in an expected cache is reported."""
    import shutil

    folder = tmp_path / "paged_layout0"
    shutil.copytree(pathlib.Path(all_vectors) / "paged_layout0", folder)
    path = folder / vectors.DATA_SET / "cache_after.pb"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    lines = []
    assert validate_folder(tmp_path, "reference", progress=lines.append) == 1
    assert lines[0].startswith("FAIL paged_layout0") and "cache" in lines[0]
