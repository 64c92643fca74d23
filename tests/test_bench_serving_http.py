"""The HTTP load benchmark runs end to end on a few requests: it starts a server on loopback, streams chat
requests through the openai client and reports what the client saw."""

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")
pytest.importorskip("transformers")

from kvcache_op.benchmarks.serving import http_load  # noqa: E402


def test_a_small_load_run_reports_the_client_side_figures(tmp_path):
    assert http_load.main(["--requests", "8", "--rate", "20", "--max-tokens", "4", "--model", "tiny",
                           "--time-limit", "30", "--num-pages", "64", "--out", str(tmp_path)]) == 0
    load = json.loads((tmp_path / "results.json").read_text())["load"]
    assert load["sent"] == load["completed"] == 8 and load["errors"] == 0 and load["unfinished"] == 0
    assert 0 < load["ttft"]["p50_ms"] <= load["ttft"]["p99_ms"]
    assert load["tokens_per_s"] > 0 and load["requests_per_s"] > 0
    assert "| sent | completed |" in (tmp_path / "README.md").read_text()
