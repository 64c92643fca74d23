"""The sampler benchmark (python -m kvcache_op.benchmarks.serving.sampler): a tiny run writes its table, one row per
provider and setting with both medians and their ratio, and the command that made it; a setting whose nucleus the
graph's sort does not hold is refused rather than timed as something else."""

import json

import numpy as np
import pytest

from kvcache_op.benchmarks.serving import sampler


def test_a_tiny_run_writes_a_row_per_setting(tmp_path):
    assert sampler.main(["--rows", "4", "--vocab", "300", "--rounds", "2", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "README.md").read_text()
    assert "python -m kvcache_op.benchmarks.serving.sampler --rows 4 --vocab 300" in text
    rows = [line for line in text.splitlines() if line.startswith("| CPUExecutionProvider |")]
    assert [row.split(" | ")[1] for row in rows] == list(sampler.SETTINGS)
    times = json.loads((tmp_path / "results.json").read_text())["times"]
    for samples in times.values():
        assert len(samples["host"]) == len(samples["graph"]) == 2 and min(samples["host"] + samples["graph"]) > 0


def test_rows_the_host_would_draw_are_not_timed_as_the_graphs():
    """Flat rows (every logit equal) over a wide vocabulary: top_p 0.9's nucleus is far past the 1,024 tokens sorted."""
    with pytest.raises(RuntimeError, match="nuclei lie past the 1024 tokens sorted"):
        sampler.measure(np.zeros((2, 5000), np.float32), 1, ["CPUExecutionProvider"])
