"""The CUDA benchmark on a GPU: its smoke run prints and writes a table of sane figures, and its torch
baseline writes the op's bytes (the comparison is like for like)."""

import json
import math

import pytest

from kvcache_op.cli import main as cli_main
from kvcache_op.benchmarks.gpu.bench import DeviceCall, cases

pytestmark = pytest.mark.gpu

TIMES = ("op_ms", "host_ms", "host_queued_ms", "copy_ms", "torch_ms", "op_GBps", "copy_GBps", "torch_GBps",
         "vs_copy", "torch_vs_copy", "vs_torch")


def test_quick_run_prints_and_writes_positive_figures(tmp_path, capsys):
    import torch

    argv = ["--device", "cuda", "--quick", "--repeats", "3", "--warmup", "1", "--out", str(tmp_path)]
    assert cli_main(["bench", "op", *argv]) == 0
    lines = capsys.readouterr().out.splitlines()
    device = torch.cuda.get_device_name()
    assert device in lines[0]
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert len(rows) == len(cases(quick=True))
    assert len(lines) == 2 + len(rows) + 1  # title, header, one line per case, "wrote ..."
    for row in rows:
        assert row["bytes_moved"] == row["bytes_store"] + row["bytes_gather"] > 0
        for key in TIMES:
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)
    md = (tmp_path / "results.md").read_text()
    # the command that reproduces the table: the benchmark's own module (the command line's --device cuda picks it)
    assert device in md and "python -m kvcache_op.benchmarks.gpu.bench --quick" in md
    assert sum(line.startswith(("| decode", "| prefill")) for line in md.splitlines()) == len(rows)


def _bytes(t):
    return t.contiguous().view(-1).view(__import__("torch").uint8)


@pytest.mark.parametrize("case", cases(quick=True), ids=lambda c: c.label().replace(" ", "-"))
def test_torch_baseline_writes_the_ops_bytes(case):
    """Both follow the spec's arithmetic (quant 8 included), so outputs and cache agree bit for bit."""
    import torch

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        op, baseline = DeviceCall(case, seed=5), DeviceCall(case, seed=5)
        assert torch.equal(_bytes(op.cache), _bytes(baseline.cache))  # same seed, same starting bytes
        before = op.cache.clone()
        op.run_op()
        baseline.run_torch()
    stream.synchronize()
    assert not torch.equal(_bytes(op.cache), _bytes(before)), "the op stored nothing"
    names = ("key", "value", "cache") + (("scale",) if case.quant_bit else ())
    for name in names:
        assert torch.equal(_bytes(getattr(op, name)), _bytes(getattr(baseline, name))), name
