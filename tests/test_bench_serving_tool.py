"""The serving benchmark runs end to end on a small scenario, both graph forms side by side, with a shared system
prompt or with every prompt its own, and reports the fused export's tokens/s against the split pair's; each step
measured holds its own host work."""

import json

import pytest

pytest.importorskip("transformers")

from kvcache_op.benchmarks.serving import bench  # noqa: E402


@pytest.mark.parametrize("distinct", [False, True])
def test_a_small_run_measures_both_forms(tmp_path, distinct):
    argv = ["--model", "tiny", "--requests", "3", "--context", "40", "--decode-steps", "6", "--out", str(tmp_path)]
    assert bench.main(argv + (["--distinct"] if distinct else [])) == 0
    text = (tmp_path / "README.md").read_text()
    assert "| tiny | split |" in text and "| tiny | fused |" in text
    assert "tiny: the fused export decodes" in text
    data = json.loads((tmp_path / "results.json").read_text())
    assert [r["attention"] for r in data["rows"]] == ["split", "fused"] and data["requests"] == 3


def test_a_sampled_run_samples_every_request_and_says_so(tmp_path, monkeypatch):
    """--temperature / --top-p: every request is seeded and sampled to the end (end-of-sequence ignored)."""
    from kvcache_op.serving import Engine

    seen, generate = [], Engine.generate

    def recorded(self, prompts, count, **kwargs):
        seen.append(kwargs.get("params"))
        return generate(self, prompts, count, **kwargs)
    monkeypatch.setattr(Engine, "generate", recorded)
    argv = ["--model", "tiny", "--requests", "3", "--context", "40", "--decode-steps", "6", "--attention", "fused",
            "--temperature", "0.8", "--top-p", "0.9", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    (params,) = seen
    assert [(p.temperature, p.top_p, p.seed, p.ignore_eos, p.max_tokens) for p in params] == [
        (0.8, 0.9, i, True, 6) for i in range(3)]
    assert "sampled at temperature 0.8, top_p 0.9" in (tmp_path / "README.md").read_text()
    assert json.loads((tmp_path / "results.json").read_text())["sampling"] == "sampled at temperature 0.8, top_p 0.9"


def test_each_measured_step_holds_its_own_host_work(tmp_path):
    """Every decode step measured records the scheduling and feeds it took (planned many at once, the steps
    recorded none and the table read zero host work)."""
    row = bench.measure("tiny", 3, 40, 6, 0, str(tmp_path))
    assert row["steps"] >= 3 and row["scheduling_ms"] > 0 and row["after_ms"] > 0



def test_tokens_per_s_is_over_the_median_step():
    """Three full steps whose parts' medians come from different steps: their sum (6 ms) is no step's time; the
    median step takes 10 ms. Steps that are not full (a request missing) are left out."""
    def step(scheduling, run, after, sequences=4, decodes=4):
        return dict(sequences=sequences, decodes=decodes, kv_tokens=100, scheduling_s=scheduling / 1e3,
                    ort_run_s=run / 1e3, after_run_s=after / 1e3)

    trace = [step(1, 1, 8), step(8, 1, 1), step(1, 4, 1), step(50, 50, 50, decodes=3)]
    figures = bench.full_step_figures(trace, 4)
    assert figures["steps"] == 3
    assert (figures["scheduling_ms"], figures["ort_ms"], figures["after_ms"]) == pytest.approx((1, 1, 1))
    assert figures["tokens_per_s"] == pytest.approx(4 / 10e-3)
    with pytest.raises(RuntimeError, match="no step decoded the whole batch"):
        bench.full_step_figures(trace[3:], 4)


@pytest.mark.parametrize("argv, message", [
    (["--context", "8"], "--context must be at least 16"),
    (["--decode-steps", "2"], "--decode-steps must be at least 3"),
    (["--context", "4090", "--decode-steps", "24"], "exceed the model's 4096 positions"),
    (["--temperature", "-1"], "temperature must be in [0.0, inf], got -1.0"),
    (["--temperature", "1", "--top-p", "1.5"], "top_p must be in [0.0, 1.0], got 1.5"),
    (["--top-p", "0.9"], "--top-p samples: give a --temperature above 0 with it"),
    (["--temperature", "1e-6"], "--temperature 1e-06 is greedy (the engine samples from 1e-05 up)"),
])
def test_arguments_no_run_can_use_are_refused_before_the_export(capsys, argv, message):
    with pytest.raises(SystemExit) as stop:
        bench.main(["--model", "tiny"] + argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_results_record_a_command_that_runs_again(tmp_path):
    """The command is recorded shell-quoted: a word with a space stays one word."""
    import shlex

    from kvcache_op.benchmarks.environment import recorded_command

    words = shlex.split(recorded_command("kvcache_op.benchmarks.serving.peers", ["--rows", "1 x 128", "--out", "a b"]))
    assert words[words.index("--rows") + 1] == "1 x 128" and words[-1] == "a b"
