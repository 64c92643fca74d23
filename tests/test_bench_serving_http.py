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


def test_a_run_whose_requests_all_fail_is_recorded_with_their_reasons_and_fails(tmp_path, capsys):
    """Every request past the model's positions is refused by the server: the run still writes its results (no
    latency: "-"), names the reason and exits 1."""
    assert http_load.main(["--requests", "2", "--rate", "20", "--max-tokens", "5000", "--model", "tiny",
                           "--time-limit", "30", "--num-pages", "64", "--out", str(tmp_path)]) == 1
    load = json.loads((tmp_path / "results.json").read_text())["load"]
    assert load["sent"] == load["errors"] == 2 and load["completed"] == 0 and load["ttft"]["p50_ms"] is None
    text = (tmp_path / "README.md").read_text()
    assert "| 2 | 0 | 2 | 0 | 0.00 | 0 | - | - | - | - |" in text and "BadRequestError" in text
    assert "2 of 2 requests failed" in capsys.readouterr().err


def test_a_load_that_would_send_nothing_is_refused_before_the_server_starts(capsys):
    with pytest.raises(SystemExit) as stop:
        http_load.main(["--requests", "2", "--rate", "0.01", "--time-limit", "1", "--model", "tiny"])
    assert stop.value.code == 2 and "no request would be sent" in capsys.readouterr().err
