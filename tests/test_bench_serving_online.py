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


class SlowSubmitEngine:
    """An engine whose submit waits (as for a running step) before it stamps the request, then answers one token
    right away; or, with ``refuse``, refuses the request."""

    def __init__(self, wait_s=0.05, refuse=False):
        self.wait_s, self.refuse = wait_s, refuse

    def submit(self, prompt, params):
        import time
        from types import SimpleNamespace

        if self.refuse:
            raise ValueError("refused by the engine")
        time.sleep(self.wait_s)
        now = time.perf_counter()
        return SimpleNamespace(submitted_at=now, token_times=[now + 0.001], tokens=[1], result=lambda timeout: [1])


def test_time_to_first_token_counts_the_submit_calls_own_wait():
    result = online.run_online(SlowSubmitEngine(wait_s=0.05), [[1]] * 3, rate=1000.0, max_tokens=1)
    assert result["ttft"]["p50_ms"] >= 50


def test_a_client_that_fails_fails_the_run():
    with pytest.raises(ValueError, match="refused by the engine"):
        online.run_online(SlowSubmitEngine(refuse=True), [[1]] * 2, rate=1000.0, max_tokens=1)


@pytest.mark.parametrize("argv, message", [
    (["--num-pages", "2", "--max-tokens", "4"], "need 6 pages of 16, more than --num-pages 2"),
    (["--max-tokens", "4017"], "exceed the model's 4096 positions"),
])
def test_requests_the_engine_cannot_hold_are_refused_before_the_export(capsys, argv, message):
    with pytest.raises(SystemExit) as stop:
        online.main(["--model", "tiny"] + argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err
