"""The repeated-shift error measurement: shifting error grows with the number of shifts, re-evaluation
does not, and one shift costs little more than re-evaluation."""

from kvcache_op.benchmarks.shift_error import measure as shift_error


def test_shift_error_grows_and_reevaluation_stays_flat(tmp_path):
    rows = shift_error.measure([1, 4, 16], delta=64, tokens=16, heads=2, head_dim=64)
    for kind in ("float16", "int8", "int4"):
        mine = [r for r in rows if r["cache"] == kind]
        assert mine[0]["shift_error"] < mine[1]["shift_error"] < mine[2]["shift_error"], kind
        flat = [r["reevaluate_error"] for r in mine]
        assert max(flat) < 1.2 * min(flat), kind
        assert mine[0]["shift_error"] < 2 * mine[0]["reevaluate_error"], kind
    assert shift_error.main(["--shifts", "1", "2", "--tokens", "8", "--out", str(tmp_path)]) == 0
    assert "| int8 | 2 |" in (tmp_path / "results.md").read_text()
