"""The online serving benchmark runs end to end on a few requests: Poisson submissions, then the same requests
through generate; its latencies are measured from the handles' own token times."""

import json

import pytest

pytest.importorskip("transformers")

from kvcache_op.benchmarks.serving import online  # noqa: E402


def test_a_small_run_writes_latencies_for_both_modes(tmp_path):
    assert online.main(["--requests", "6", "--rate", "40", "--max-tokens", "4", "--num-pages", "48", "--model", "tiny",
                        "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    for mode in ("online", "batch"):
        r = data[mode]
        assert 0 < r["ttft"]["p50_ms"] <= r["ttft"]["p99_ms"] and 0 < r["itl"]["p50_ms"] <= r["itl"]["p99_ms"]
        assert r["tokens_per_s"] > 0 and r["wall_s"] > 0
    assert data["online_host_share"] > 0
    assert "| online |" in (tmp_path / "README.md").read_text()


def test_percentiles_and_the_workload():
    assert online.percentiles([]) == {"p50_ms": None, "p99_ms": None}
    assert online.percentiles([0.001, 0.003])["p50_ms"] == pytest.approx(2.0)
    prompts = online.workload(8, 100)
    assert len(prompts) == 8 and all(len(p) == 80 for p in prompts)
    assert prompts[0][:64] == prompts[4][:64] != prompts[1][:64]  # four shared system prompts
