"""The peer benchmark runs end to end on one small row: GenAI's model builder, the three systems on the same
weights, and the same greedy tokens from all three."""

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("onnxruntime_genai", reason="the peer benchmark needs onnxruntime-genai (the 'test' extra)")

from kvcache_op.benchmarks.serving import peers  # noqa: E402


def test_one_row_beside_genai_and_transformers(tmp_path):
    assert peers.main(["--models", "256x4", "--rows", "1 x 128", "--repeats", "1", "--new-tokens", "4",
                       "--out", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert all(v > 0 for v in row["tokens_per_s"].values())
    assert row["agreement"] == {"genai": 1.0, "transformers": 1.0, "genai_vs_transformers": 1.0}


def test_agreement_stops_at_the_first_end_of_sequence():
    assert peers.agreement([[1, 2, 9, 4]], [[1, 3, 5, 5]], eos={9}) == 0.5
    assert peers.agreement([[1, 2]], [[1, 2]]) == 1.0


def test_a_failing_model_builder_says_why(tmp_path):
    """The builder on a folder with no checkpoint fails: the error carries the builder's own last lines."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(RuntimeError, match=r"GenAI's model builder failed \(exit \d+\): .+"):
        peers.build_genai_model(str(tmp_path / "empty"), str(tmp_path / "out"), str(tmp_path / "cache"))
