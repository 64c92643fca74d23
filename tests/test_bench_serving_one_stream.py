"""The one-stream host-work benchmark: its figures from an engine's counters worked by hand, and a run end to end on a
tiny decoder in which every setting is measured in every round, each round prefilling its whole prompt."""

import json

import pytest

pytest.importorskip("transformers")

from kvcache_op.benchmarks.serving import one_stream  # noqa: E402


class CountedEngine:
    """An engine whose counters move by set amounts in one generate."""

    def __init__(self):
        self.counters = {"time_ort_run_s": 1.0, "wall_s": 2.0, "steps": 10, "fed_tokens": 100, "prefix_hit_tokens": 0}

    def metrics(self):
        return dict(self.counters)

    def generate(self, prompts, max_new_tokens, params):
        moves = {"time_ort_run_s": 2.0, "wall_s": 5.0, "steps": 4, "fed_tokens": 7, "prefix_hit_tokens": 3}
        for key, step in moves.items():
            self.counters[key] += step


def test_the_figures_are_the_counters_moves():
    r = one_stream.measure(CountedEngine(), [1, 2, 3], tokens=10)
    # 5 s of wall time over 4 steps, 2 of them in ONNX Runtime runs: 0.5 s a step run, 0.75 s a step elsewhere.
    assert r["tokens_per_s"] == pytest.approx(2.0)
    assert r["run_us"] == pytest.approx(0.5e6) and r["host_us"] == pytest.approx(0.75e6)
    assert r["host_share"] == pytest.approx(1.5)
    assert (r["steps"], r["fed_tokens"], r["prefix_hit_tokens"]) == (4, 7, 3)


def test_a_small_run_measures_every_setting_in_every_round(tmp_path):
    tokens = 12
    assert one_stream.main(["--model", "tiny", "--tokens", str(tokens), "--rounds", "2", "--decode-steps", "1",
                            "--decode-steps", "5", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert set(data["rounds"]) == {"1", "5"}
    for rounds in data["rounds"].values():
        assert len(rounds) == 2
        for r in rounds:
            assert r["tokens_per_s"] > 0 and r["run_us"] > 0 and r["host_us"] > 0
            # Every round prefills its whole prompt (no prefix cache hit from the warm-up or an earlier round) and
            # feeds back every generated token but the last.
            assert r["prefix_hit_tokens"] == 0
            assert r["fed_tokens"] == one_stream.PROMPT_TOKENS + tokens - 1
    text = (tmp_path / "README.md").read_text()
    assert "| 1 |" in text and "| 5 |" in text
    assert f"one request: {one_stream.PROMPT_TOKENS} prompt tokens (a fresh prompt each round" in text
