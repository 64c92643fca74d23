"""Conformance vectors: the committed set is reproducible and every case round-trips through files."""

import pathlib

import pytest

from kvcache_op.spec import vectors
from kvcache_op.spec.cases import CASES
from kvcache_op.tools.validate_backend import compare_case, validate_folder


def test_there_are_at_least_40_named_cases():
    assert len(CASES) >= 40


def test_committed_vectors_are_regenerated_unchanged(tmp_path):
    vectors.write_all(tmp_path, vectors.COMMITTED, progress=None)
    committed = sorted(p.relative_to(vectors.COMMITTED_DIR) for p in vectors.COMMITTED_DIR.rglob("*") if p.is_file())
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert committed == fresh
    for rel in committed:
        assert (vectors.COMMITTED_DIR / rel).read_bytes() == (tmp_path / rel).read_bytes(), str(rel)


@pytest.fixture(scope="module")
def all_vectors(tmp_path_factory):
    out = tmp_path_factory.mktemp("conformance")
    vectors.write_all(out, progress=None)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_case_round_trips_through_reference_evaluator(all_vectors, name):
    assert compare_case(pathlib.Path(all_vectors) / name, "reference") == []


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
