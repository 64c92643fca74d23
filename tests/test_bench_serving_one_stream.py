"""The one-stream host-work benchmark runs end to end on a tiny decoder: every setting measured in every round,
its share computed from the engine's own counters."""

import json

import pytest

pytest.importorskip("transformers")

from kvcache_op.benchmarks.serving import one_stream  # noqa: E402


def test_a_small_run_measures_every_setting_in_every_round(tmp_path):
    assert one_stream.main(["--model", "tiny", "--tokens", "12", "--rounds", "2", "--decode-steps", "1",
                            "--decode-steps", "5", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert set(data["rounds"]) == {"1", "5"}
    for rounds in data["rounds"].values():
        assert len(rounds) == 2
        for r in rounds:
            assert r["tokens_per_s"] > 0 and r["run_us"] > 0 and r["host_us"] > 0
            assert r["host_share"] == pytest.approx(r["host_us"] / r["run_us"])
    text = (tmp_path / "README.md").read_text()
    assert "| 1 |" in text and "| 5 |" in text and "one request: 128 prompt tokens + 12 greedy tokens" in text
