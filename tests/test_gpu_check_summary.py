"""tools/gpu_check.sh's summary: counts from the junit reports, every step's verdict and reason."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_summary_lists_counts_verdicts_and_skip_reasons(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "device.txt").write_text("NVIDIA H100 80GB HBM3\n")
    (tmp_path / "steps.tsv").write_text("host-runner\tpass\t3 passed\nsanitizer-memcheck\tfail\texit 86\n"
                                        "benchmark\tskip\tno CUDA device is visible\n")
    (tmp_path / "logs" / "host-runner.xml").write_text(
        '<testsuites><testsuite tests="5" failures="1" errors="0" skipped="1"/></testsuites>')
    out = subprocess.run([sys.executable, str(ROOT / "tools/gpu_check_summary.py"), str(tmp_path)], check=True,
                         capture_output=True, text=True).stdout
    summary = (tmp_path / "summary.md").read_text()
    assert out.strip() == summary.strip()
    assert "Device: NVIDIA H100 80GB HBM3" in summary
    assert "| host-runner | pass | 3 passed, 1 failed, 1 skipped | 3 passed |" in summary
    assert "| sanitizer-memcheck | fail |  | exit 86 |" in summary
    assert "| benchmark | skip |  | no CUDA device is visible |" in summary


def test_gpu_check_needs_an_output_folder():
    done = subprocess.run(["bash", str(ROOT / "tools/gpu_check.sh")], capture_output=True, text=True)
    assert done.returncode != 0 and "usage: tools/gpu_check.sh OUTDIR" in done.stderr
