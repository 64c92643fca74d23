"""The attention benchmark runs end to end (tiny shapes), writes its table and data, and its baseline — the
dense-mask attention from standard ONNX ops — computes the op's semantics."""

import json

import numpy as np

from kvcache_op.cli import main
from kvcache_op.reference import attention_tolerance
from kvcache_op.benchmarks.attention import bench as bench_attention


def test_quick_run_writes_results_with_measured_memory(tmp_path, capsys):
    assert bench_attention.main(["--quick", "--repeats", "1", "--warmup", "0", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert len(data["rows"]) == len(bench_attention.QUICK_SHAPES)
    for row in data["rows"]:
        assert row["op_ms"] > 0 and row["dense_ms"] > 0 and row["batched_ms"] > 0 and row["speedup"] > 0
        assert all(row[f"{m}_peak_bytes"] is not None for m in bench_attention.METHODS)
        assert row["mask_bytes"] == row["batch"] ** 2 * row["seqlen"] * row["kvlen"] * (
            4 if row["dtype"] == "float32" else 2)
    text = (tmp_path / "results.md").read_text()
    assert "| vs dense |" in text and "| vs batched |" in text and "Summary: decode: the op is" in text
    assert "batched" in capsys.readouterr().out


def test_both_baselines_compute_the_ops_semantics():
    """Each baseline's output is within twice the spec's bound of the op's on the same inputs (decode and causal
    prefill), so the speed-ups compare equal work."""
    for shape in bench_attention.QUICK_SHAPES:
        inputs = bench_attention.make_inputs(shape)
        outputs = {}
        for method in bench_attention.METHODS:
            run, out = bench_attention.runner(method, shape, bench_attention.method_feeds(method, shape, inputs), 1)
            run()
            outputs[method] = out.astype(np.float64)
        tolerance = 2 * attention_tolerance(**inputs, num_heads=shape.heads, head_dim=shape.head_dim)
        for method in bench_attention.METHODS[1:]:
            assert np.all(np.abs(outputs["op"] - outputs[method]) <= tolerance), (shape, method)
        assert np.any(outputs["op"] != 0)


def test_dense_mask_is_block_diagonal_and_causal():
    shape = bench_attention.Shape("t", batch=2, seqlen=2, kvlen=3, heads=1, head_dim=4)
    mask = bench_attention.dense_mask(shape, bench_attention.make_inputs(shape))
    visible = (mask == 0).astype(int).tolist()
    # query rows: seq 0 at positions 1, 2; seq 1 at positions 1, 2; key columns: seq 0 keys 0-2, seq 1 keys 0-2
    assert visible == [[1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1]]


def test_cli_dispatches_bench_attention(capsys):
    assert main(["bench", "attention", "--quick", "--repeats", "1", "--warmup", "0", "--no-memory"]) == 0
    assert "batched" in capsys.readouterr().out
