"""The end-to-end GPU serving benchmark (python -m kvcache_op.benchmarks.gpu.serving): a smoke run on the CPU EP
(the same code path as on the GPU but the providers and the device) serves transformers' greedy tokens and writes
its table; without onnxruntime-gpu or a GPU it refuses in one line."""

import json

import pytest

pytest.importorskip("torch")  # kvcache_op.hf imports it
pytest.importorskip("transformers")

from kvcache_op.benchmarks.gpu import serving  # noqa: E402


def test_a_cpu_smoke_run_serves_transformers_tokens_and_writes_its_table(tmp_path, capsys):
    argv = ["--device", "cpu", "--quick", "--requests", "3", "--prompt-tokens", "24", "--new-tokens", "6",
            "--repeats", "1", "--out", str(tmp_path)]
    assert serving.main(argv) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["agreement"] == 1.0  # float32 on the CPU EP: the model's own greedy tokens
    assert all(v > 0 for v in result["tokens_per_s"].values()) and result["vs_transformers"] > 0
    readme = (tmp_path / "README.md").read_text()
    assert "| 3 x 24 + 6 |" in readme and "--device cpu --quick" in readme
    assert "| 3 x 24 + 6 |" in capsys.readouterr().out
    (budget,) = result["budgets"]  # the CPU EP's default alone
    assert budget["max_batch_tokens"] == result["max_batch_tokens"] == 256 and budget["steps"] >= 6
    assert 0 < budget["ort_run_s"] and budget["ort_run_s"] + budget["host_s"] == pytest.approx(6 * 3 / budget[
        "tokens_per_s"], rel=1e-6)


def test_a_wider_vocabulary_is_the_models_and_its_prompts_use_it(tmp_path, monkeypatch):
    """--vocab 2000: the exported model's logits are 2,000 wide (the tokenizer's 360 and ids past it), the prompts draw
    from all of it, and the table says so; the tokens are still transformers' own."""
    from kvcache_op.benchmarks.serving import peers

    prompts, run = [], peers.run_kvcache_op

    def recorded(path, given, *args, **kwargs):
        prompts.extend(given)
        return run(path, given, *args, **kwargs)
    monkeypatch.setattr(serving, "run_kvcache_op", recorded)
    argv = ["--device", "cpu", "--quick", "--vocab", "2000", "--requests", "2", "--prompt-tokens", "16",
            "--new-tokens", "4", "--repeats", "1", "--out", str(tmp_path)]
    assert serving.main(argv) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["vocab_size"] == 2000 and result["agreement"] == 1.0
    assert max(max(p) for p in prompts) >= 360
    assert "vocabulary 2000" in (tmp_path / "README.md").read_text()


def test_a_checkpoint_narrower_than_its_tokenizer_is_refused_before_anything_is_written(tmp_path):
    from kvcache_op.hf import tiny_checkpoint

    with pytest.raises(ValueError, match="vocab_size=100 is narrower than the tokenizer's"):
        tiny_checkpoint(tmp_path / "checkpoint", vocab_size=100)
    assert not (tmp_path / "checkpoint").exists()


def test_budgets_run_side_by_side_with_where_the_engine_spent_its_time(tmp_path):
    """--max-batch-tokens 8 64: the same tokens at both budgets; feeding the 72 prompt tokens alone takes 9 steps of 8
    tokens, and the larger budget fewer steps in all; each row says how many steps it took."""
    argv = ["--device", "cpu", "--quick", "--requests", "3", "--prompt-tokens", "24", "--new-tokens", "6",
            "--repeats", "1", "--max-batch-tokens", "8", "64", "--out", str(tmp_path)]
    assert serving.main(argv) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    small, large = result["budgets"]
    assert (small["max_batch_tokens"], large["max_batch_tokens"], result["max_batch_tokens"]) == (8, 64, 8)
    assert small["agreement"] == large["agreement"] == 1.0
    assert small["steps"] >= 72 // 8 and large["steps"] < small["steps"]
    assert result["tokens_per_s"]["kvcache-op"] == small["tokens_per_s"]
    readme = (tmp_path / "README.md").read_text()
    assert "| max_batch_tokens | tok/s |" in readme and f"| 64 | {large['tokens_per_s']:.0f} |" in readme


def test_without_the_cuda_ep_it_says_what_is_missing_in_one_line(monkeypatch, capsys):
    import onnxruntime as ort

    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    assert serving.main(["--quick"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("GPU serving benchmark: cannot run: ")
    assert "has no CUDAExecutionProvider" in err[0]


def test_a_float16_run_exports_what_transformers_loads_and_records_the_baseline(tmp_path, monkeypatch):
    """--dtype float16: the exported model is the checkpoint as transformers loads it in float16, its rotary
    frequencies still float32 (a model.to(float16) export rounded them, and its tokens parted from transformers' at
    long positions); the table says how often transformers' own float16 tokens agree with its float32 ones."""
    import torch

    import kvcache_op.hf

    exported = []
    real_export = kvcache_op.hf.export_model

    def capture(model, *args, **kwargs):
        exported.append(model)
        return real_export(model, *args, **kwargs)

    monkeypatch.setattr(kvcache_op.hf, "export_model", capture)
    argv = ["--device", "cpu", "--quick", "--dtype", "float16", "--requests", "3", "--prompt-tokens", "40",
            "--new-tokens", "6", "--repeats", "1", "--out", str(tmp_path)]
    assert serving.main(argv) == 0
    (model,) = exported
    assert model.model.embed_tokens.weight.dtype == torch.float16
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["dtype"] == "float16" and 0.0 <= result["baseline_agreement"] <= 1.0
    assert "Baseline: transformers' own float16 tokens" in (tmp_path / "README.md").read_text()
