"""The benchmark tool runs end to end (tiny shapes) and writes its table, data and chart."""

import json

from kvcache_op.tools import bench_kvcache


def test_bench_quick_run_writes_results(tmp_path, capsys):
    assert bench_kvcache.main(["--quick", "--repeats", "1", "--warmup", "0", "--reference-repeats", "1",
                               "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert len(data["rows"]) == 2 * 2 * 2 * 2  # shapes x quant x layouts x threads
    assert all(r["op_GBps"] > 0 and r["vs_copy"] > 0 for r in data["rows"])
    assert "| op / copy |" in (tmp_path / "results.md").read_text()
    assert "op/copy" in capsys.readouterr().out


def test_bytes_moved_counts_reads_and_writes():
    shape = bench_kvcache.Shape("t", batch=1, seqlen=1, start_pos=0, heads=1, head_dim=8, page_size=4)
    # fp16: store reads 2 x 16 B and writes 2 x 16 B; gather reads 2 x 16 B and writes 2 x 16 B
    assert bench_kvcache.bytes_moved(shape, 0) == 128
