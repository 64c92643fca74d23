"""The serving benchmark runs end to end on a small scenario, both graph forms side by side, with a shared system
prompt or with every prompt its own, and reports the fused export's tokens/s against the split pair's; each step
measured holds its own host work."""

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


def test_each_measured_step_holds_its_own_host_work(tmp_path):
    """Every decode step measured records the scheduling and feeds it took (planned many at once, the steps
    recorded none and the table read zero host work)."""
    row = bench.measure("tiny", 3, 40, 6, 0, str(tmp_path))
    assert row["steps"] >= 3 and row["scheduling_ms"] > 0 and row["after_ms"] > 0

